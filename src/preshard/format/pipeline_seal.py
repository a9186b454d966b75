"""Sealing a converted pipeline's record: every file no manifest covers hashed, each manifest's digest recorded.

The conversion calls `seal_pipeline_record` on its partial folder just before the commit, when every component is
in place: a sharded component's checkpoint is covered by its manifest (data files, `.metadata`, `config.json`; the
manifest itself by its digest, recorded here); every other file of the folder is listed with its size and
xxh3_128 (`format/pipeline_files.py`), and the record is sealed (`PipelineRecord.sealed`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from preshard.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from preshard.format.pipeline_files import folder_files, record_files
from preshard.format.pipeline_record import PIPELINE_RECORD_NAME, PipelineRecord


def covered_names(manifest: Manifest) -> set[str]:
    """The files of a converted checkpoint its manifest covers (by the manifest's digest, or a recorded hash)."""
    names = {MANIFEST_NAME, *(f.name for f in manifest.files)}
    for record in (manifest.config, manifest.metadata):
        if record is not None:
            names.add(record.name)
    return names


def seal_pipeline_record(folder: Path, record: PipelineRecord) -> PipelineRecord:
    """`record` with each sharded component's manifest digest, every other file of `folder` listed, sealed.

    Raises:
        CorruptCheckpointError: a sharded component's manifest that cannot be read.
        OSError: a file that cannot be read.
    """
    covered: set[str] = {PIPELINE_RECORD_NAME}
    components = dict(record.components)
    for c in record.sharded():
        manifest = read_manifest(folder / c.name)
        components[c.name] = replace(c, manifest_digest=manifest.digest)
        covered |= {f"{c.name}/{name}" for name in covered_names(manifest)}
    files = record_files(folder, [name for name in folder_files(folder) if name not in covered])
    return replace(record, components=components, files=files).sealed()


__all__ = ["covered_names", "seal_pipeline_record"]
