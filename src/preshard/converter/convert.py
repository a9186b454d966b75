"""convert_checkpoint: a source checkpoint -> per-TP-rank DCP shards + manifest, atomically and resumably.

The whole output layout (every record's file and offset) is derived from the plan and the source headers
before anything is written (`preshard.format.layout`). Then the source is read once, front to back, in
bands; each band is cut into the pieces of its chunks (`slicer`) and appended to the rank files
(`writer`), which hash what they write. The working folder, lock, journal and commit are `workdir`'s.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from preshard.converter.signals import StopFlag, deferred_signals
from preshard.converter.workdir import (
    Journal,
    OutputLock,
    check_output,
    check_space,
    commit,
    open_workdir,
    open_writers,
    partial_dir,
    resume,
)
from preshard.converter.writer import RecordFileWriter
from preshard.errors import UsageError
from preshard.format.dcp_metadata import write_dcp_metadata
from preshard.format.dtypes import dtype_name, parse_cast
from preshard.format.fileio import byte_view
from preshard.format.jsonio import fsync_file, write_json_atomic
from preshard.format.layout import ChunkRecord, FileLayout, TensorLayout, data_file_name, place_records
from preshard.format.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    TensorRecord,
    file_digest,
)
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan, resolve_plan
from preshard.format.slicing import BufferPool, tensor_pieces
from preshard.format.torch_record import RECORD_FRAMING_VERSION
from preshard.plans.from_model import check_plan_against_model
from preshard.plans.registry import choose_plan
from preshard.progress import Progress
from preshard.sources import ConversionSource, SourceRows, open_source

# Journal (so fsync) about 64 times per conversion, at least every 16 MiB: a crash loses at most that much.
SYNC_MIN_BYTES, SYNC_ROUNDS = 16 << 20, 64
# Tests replace this to act between tensors (e.g. to crash there); never used otherwise.
_after_tensor_hook = None


def resolve_mesh(
    mesh: MeshSpec | None,
    tp: int | None,
    cp: int | None,
    ring: int | None,
    ulysses: int | None,
    order: str | tuple[str, ...] | None,
    default: MeshSpec | None = None,
) -> MeshSpec:
    """A `MeshSpec` or the keywords, not both; with neither, `default` (or tp is required)."""
    keywords = (tp, cp, ring, ulysses, order)
    if mesh is not None:
        if any(k is not None for k in keywords):
            raise UsageError("pass either mesh=MeshSpec(...) or tp/cp/ring/ulysses/order, not both")
        if not isinstance(mesh, MeshSpec):
            raise UsageError(f"mesh must be a preshard.MeshSpec, not {type(mesh).__name__}")
        return mesh
    if tp is None and default is None:
        raise UsageError("the TP degree is required: pass --tp N (or tp=N / mesh=MeshSpec(tp=N, ...))")
    return MeshSpec.build(tp, cp, ring, ulysses, order, default=default)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything decided before writing: source, plan, mesh, cast, every tensor's layout and every record's place."""

    source: ConversionSource
    plan: Plan
    mesh: MeshSpec
    cast: torch.dtype | None
    layouts: dict[str, TensorLayout]
    files: FileLayout
    write_order: list[str]

    @property
    def output_bytes(self) -> int:
        return sum(self.files.file_sizes)


def plan_conversion(
    source: str | Path | ConversionSource,
    *,
    mesh: MeshSpec,
    plan: str | Path | Plan | None = None,
    dtype: str | torch.dtype | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> ConversionPlan:
    """Resolve source, plan, mesh and layout without writing anything (what a dry run shows)."""
    cast = parse_cast(dtype)
    if isinstance(source, (str, Path)):
        src = open_source(source, subfolder=subfolder, revision=revision, token=token)
    else:
        src = source
    chosen = choose_plan(plan, src.config)
    layouts = resolve_plan(chosen, src.shapes(), mesh.tp, cast=cast, config=src.config or {})
    check_plan_against_model(chosen, src.config, mesh.tp)
    order = src.read_order()
    files = place_records([layouts[name] for name in order], mesh.tp)
    return ConversionPlan(src, chosen, mesh, cast, layouts, files, order)


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    plan: str | Path | Plan | None = None,
    dtype: str | torch.dtype | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
) -> Manifest:
    """Convert a safetensors checkpoint into per-TP-rank DCP shards and a manifest, in `output`.

    Args:
        source: a `.safetensors` file, a diffusers weights folder (with or without `*.safetensors.index.json`),
            or a Hugging Face Hub repo id (a local path of the same spelling wins).
        output: the folder to create. Written atomically: it appears complete or not at all.
        mesh: the TP x CP mesh; or give `tp` (required) and `cp` (= Ulysses degree) or `ring`/`ulysses`, `order`.
        plan: a built-in plan name, a plan JSON file, or a `Plan`; default: from config.json's `_class_name`
            (a built-in plan, else the diffusers class's own `_tp_plan`).
        dtype: cast 16/32/64-bit floating tensors to bf16/fp16/fp32 (a string or torch dtype); default: keep each.
        subfolder, revision, token: for Hub repos (`subfolder` also for a local folder).
        overwrite: replace an existing `output`.
        wait: wait for another conversion into the same `output` to finish instead of failing at once.
        progress: show progress (default: when stderr is a terminal).

    Returns:
        The manifest written to `output/manifest.json`.

    Raises:
        UsageError: a bad mesh or dtype. SourceError: a missing, malformed or changing source.
        PlanError: a plan that does not fit the checkpoint or the TP degree. OutputError: an output that
        cannot be written (exists, locked, too little disk space). Interrupted: SIGINT/SIGTERM (the finished
        part is kept for a resume).
    """
    mesh = resolve_mesh(mesh, tp, cp, ring, ulysses, order)
    job = plan_conversion(
        source, mesh=mesh, plan=plan, dtype=dtype, subfolder=subfolder, revision=revision, token=token
    )
    return write_conversion(job, Path(output), overwrite=overwrite, wait=wait, progress=progress)


def space_needed(job: ConversionPlan) -> int:
    """Bytes the output's file system must have free: the data files, config.json, 1 MiB for manifest and .metadata."""
    return job.output_bytes + len(job.source.config_bytes() or b"") + (1 << 20)


def write_conversion(
    job: ConversionPlan, output: Path, *, overwrite: bool = False, wait: bool = False, progress: bool | None = None
) -> Manifest:
    """Write a planned conversion into `output`, under the output's lock, atomically and resumably."""
    check_output(output, job.source.input_paths(), overwrite)
    check_space(output, partial_dir(output), space_needed(job))  # before the lock file: refused before any write
    with OutputLock(output, wait=wait), deferred_signals() as stop:
        check_output(output, job.source.input_paths(), overwrite)  # again, now that we hold the lock
        return _convert_locked(job, output, stop, progress)


def _job_key(job: ConversionPlan) -> str:
    """What must match for a partial conversion to be resumed (cheap: the source's identity, plan, mesh, cast)."""
    h = hashlib.sha256(job.source.identity().encode())
    h.update(json.dumps(job.plan.to_dict(), sort_keys=True).encode())
    h.update(f"tp={job.mesh.tp}:cast={job.cast}:records={RECORD_FRAMING_VERSION}".encode())
    return h.hexdigest()


def _convert_locked(job: ConversionPlan, output: Path, stop: StopFlag, progress: bool | None) -> Manifest:
    src = job.source
    work = partial_dir(output)
    config_bytes = src.config_bytes()
    check_space(output, work, space_needed(job))
    identity = src.identity()
    resuming = open_workdir(work, _job_key(job))
    done, writers = resume(work, job.write_order, job.files, job.mesh.tp) if resuming else ({}, {})
    writers = writers or open_writers(work, job.mesh.tp, {})
    reader = src.open_reader()
    bar = Progress(job.output_bytes, "converting", progress, initial=sum(_bytes_of(done)))
    try:
        records = _write_tensors(job, work, reader, writers, done, stop, bar)
        checksums = [writers[r].close() for r in range(job.mesh.tp)]
        source_hashes = reader.file_hashes()
    finally:
        bar.close()
        reader.close()
        for w in writers.values():
            w.abandon()
    stop.check()
    src.check_unchanged(identity)
    manifest = _manifest(job, records, checksums, source_hashes, config_bytes)
    if config_bytes is not None:
        (work / CONFIG_NAME).write_bytes(config_bytes)
        fsync_file(work / CONFIG_NAME)
    write_dcp_metadata(work, manifest)
    for name in ("journal.jsonl", "job.json"):
        (work / name).unlink(missing_ok=True)
    write_json_atomic(work / MANIFEST_NAME, manifest.to_dict())
    stop.check()
    commit(work, output)
    return manifest


def _bytes_of(done: dict[str, list[ChunkRecord]]):
    for chunks in done.values():
        for c in chunks:
            yield c.framing.length


def _write_tensors(
    job: ConversionPlan,
    work: Path,
    reader: SourceRows,
    writers: dict[int, RecordFileWriter],
    done: dict[str, list[ChunkRecord]],
    stop: StopFlag,
    bar: Progress,
) -> dict[str, list[ChunkRecord]]:
    records = dict(done)
    journal = Journal(work, keep_lines=len(done))
    by_file = {data_file_name(r): writers[r] for r in writers}
    pool = BufferPool()
    pending: list[dict] = []
    unsynced = 0
    try:
        for name in job.write_order:
            if name in records:
                continue
            layout = job.layouts[name]
            planned = job.files.chunks[name]
            written: dict[int, ChunkRecord] = {}

            def read_rows(start: int, count: int, out: torch.Tensor, name=name) -> None:
                reader.read_rows(name, start, count, out)

            for pieces in tensor_pieces(layout, planned, read_rows, pool):
                for piece in pieces:
                    writer = by_file[piece.chunk.file]
                    if piece.first:
                        writer.begin(piece.chunk)
                    writer.write(byte_view(piece.data))
                    if piece.last:
                        written[id(piece.chunk)] = writer.end()
                        bar.update(piece.chunk.framing.length)
                stop.check()
            records[name] = [written[id(c)] for c in planned]
            pending.append({"tensor": name, "chunks": [c.xxh3_64 for c in records[name]]})
            unsynced += layout.nbytes
            if unsynced >= max(SYNC_MIN_BYTES, job.output_bytes // SYNC_ROUNDS):
                _sync(writers, journal, pending)
                unsynced = 0
            if _after_tensor_hook is not None:
                _after_tensor_hook(name)
        _sync(writers, journal, pending)
    finally:
        journal.close()
    return records


def _sync(writers: dict[int, RecordFileWriter], journal: Journal, pending: list[dict]) -> None:
    """Make the written records durable, then claim them in the journal."""
    for writer in writers.values():
        writer.sync()
    journal.append(pending)
    pending.clear()


def _manifest(
    job: ConversionPlan,
    records: dict[str, list[ChunkRecord]],
    checksums: list[str],
    source_hashes: dict[str, str],
    config_bytes: bytes | None,
) -> Manifest:
    from preshard import __version__

    config = None
    if config_bytes is not None:
        digest = file_digest()
        digest.update(config_bytes)
        config = FileRecord(CONFIG_NAME, len(config_bytes), digest.hexdigest())
    tensors = {name: TensorRecord(job.layouts[name], tuple(records[name])) for name in sorted(records)}
    files = tuple(FileRecord(data_file_name(r), job.files.file_sizes[r], checksums[r]) for r in range(job.mesh.tp))
    return Manifest(
        source=job.source.source_record(source_hashes),
        mesh=job.mesh,
        plan=job.plan,
        tensors=tensors,
        files=files,
        config=config,
        dtype=job.cast,
        derived_from=getattr(job.source, "derived_from", None),
        preshard_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    ).sealed()


__all__ = ["ConversionPlan", "convert_checkpoint", "dtype_name", "plan_conversion", "resolve_mesh", "space_needed"]
