"""Views of a converted checkpoint for people (`preshard inspect`) and programs (`inspect --json`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from preshard.format.locate import local_path
from preshard.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from preshard.units import human_bytes, plural


def read_checkpoint_manifest(
    checkpoint: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Manifest:
    """The manifest of a converted checkpoint: a local folder, or a Hub repo id holding one (only its manifest.json
    is downloaded, into the HF cache). A local path wins over a repo id of the same spelling.

    Raises:
        CheckpointNotFoundError: neither a local checkpoint nor a repo id. UsageError: --revision on a local path.
        SourceError: the Hub repo, revision or manifest cannot be fetched. CorruptCheckpointError: a bad manifest.
    """
    path = local_path(checkpoint, subfolder, revision)
    if path is not None:
        return read_manifest(path)
    from preshard.sources import hub

    if isinstance(checkpoint, str) and hub.is_repo_id(checkpoint):
        head = hub.download_files(checkpoint, [MANIFEST_NAME], revision=revision, token=token, subfolder=subfolder)
        return read_manifest(head.folder)
    missing = Path(checkpoint)
    if subfolder and missing.is_dir():
        missing = missing / subfolder
    return read_manifest(missing)  # names the missing path


def rank_read_bytes(manifest: Manifest, tp_rank: int) -> tuple[int, int]:
    """(data bytes of this TP rank's own slices, data bytes of the replicated tensors it also reads); what it reads
    at load, framing included, is `manifest.read_bytes(tp_rank)`."""
    own = shared = 0
    for chunks in manifest.chunks_for_tp_rank(tp_rank).values():
        for c in chunks:
            if c.owner is None:
                shared += c.data_length
            else:
                own += c.data_length
    return own, shared


def total_tensor_bytes(manifest: Manifest) -> int:
    return sum(c.data_length for t in manifest.tensors.values() for c in t.chunks)


def summary_line(manifest: Manifest, output: str | Path, verb: str = "wrote") -> str:
    size = sum(f.size for f in manifest.files)
    return (
        f"{verb} {output}: {plural(len(manifest.tensors), 'tensor')}, {plural(len(manifest.files), 'data file')}, "
        f"{human_bytes(size)}, mesh {manifest.mesh.describe()}, plan {manifest.plan.name}"
    )


def outcome_line(manifest: Manifest, output: str | Path, outcome: Any) -> str:
    """The line a conversion ends with: what it wrote, what a resume kept, or that it was already done."""
    if outcome.status == "already converted":
        return (
            "already converted: " + summary_line(manifest, output, "nothing to do,")
            + " (same source bytes, plan, mesh and dtype; --overwrite converts again)"
        )  # fmt: skip
    line = summary_line(manifest, output)
    if outcome.status == "resumed":
        line += (
            f"; resumed: kept {plural(outcome.kept_tensors, 'tensor')} ({human_bytes(outcome.kept_bytes)}) "
            "from the interrupted run, every record re-checked"
        )
    return line


def provenance_line(manifest: Manifest) -> str:
    s = manifest.source
    if s.kind == "hub":
        where = f"hub {s.repo_id}" + (f"/{s.subfolder}" if s.subfolder else "")
        where += f" @ {s.revision or 'default branch'} (commit {s.commit})"
    else:
        where = f"{s.kind} {s.path}"
    line = f"{where} ({plural(len(s.files), 'file')})"
    if manifest.derived_from is not None:
        d = manifest.derived_from
        line += f"; {d.kind} of {d.checkpoint} (tp={d.mesh.get('tp')}, manifest digest {d.digest[:12]}...)"
    return line


def lora_lines(manifest: Manifest) -> list[str]:
    """One line per LoRA fused at conversion: the file, its scale and hash, and what it changed."""
    lines = []
    for lora in manifest.source.loras:
        ranks = "/".join(str(r) for r in sorted({m.rank for m in lora.modules.values()}))
        lines.append(
            f"{lora.name} x {lora.scale:g} fused into {len(lora.modules)} Linear layers (rank {ranks}; xxh3_128 "
            f"{lora.xxh3_128}; read by {lora.loader}{', keys converted' if lora.converted else ''})"
        )
    return lines


def inspect_data(manifest: Manifest) -> dict[str, Any]:
    """What `inspect --json` prints: provenance, mesh, plan, files and the bytes each TP rank reads."""
    total = total_tensor_bytes(manifest)
    ranks = []
    for r in range(manifest.tp):
        own, shared = rank_read_bytes(manifest, r)
        ranks.append(
            {
                "tp_rank": r,
                "own_bytes": own,
                "replicated_bytes": shared,
                "read_bytes_per_rank": manifest.read_bytes(r),
                "ranks": [row["rank"] for row in manifest.rank_table() if row["coords"]["tp"] == r],
            }
        )
    body = manifest.body()
    source_files = body["source"]["files"]
    return {
        "manifest_version": body["version"],
        "preshard_version": manifest.preshard_version,
        "created": manifest.created,
        "digest": manifest.digest,
        "source": body["source"] | {"files": [{k: v for k, v in f.items() if k != "header"} for f in source_files]},
        "derived_from": body["derived_from"],
        "mesh": manifest.mesh.to_dict() | {"world_size": manifest.mesh.world_size},
        "plan": manifest.plan.name,
        "dtype": body["dtype"],
        "tensors": len(manifest.tensors),
        "tensor_bytes": total,
        "read_bytes_per_rank": max(manifest.read_bytes(r) for r in range(manifest.tp)),
        "styles": dict(Counter(t.layout.style.name for t in manifest.tensors.values())),
        "files": [
            {"name": f.name, "tp_rank": i, "size": f.size, "xxh3_128": f.xxh3_128} for i, f in enumerate(manifest.files)
        ],
        "tp_ranks": ranks,
    }


def inspect_table(manifest: Manifest) -> str:
    mesh = manifest.mesh
    total = total_tensor_bytes(manifest)
    styles = Counter(t.layout.style.name for t in manifest.tensors.values())
    lines = [
        f"preshard checkpoint (manifest v2, preshard {manifest.preshard_version}, {manifest.created})",
        f"source:  {provenance_line(manifest)}",
        *(f"lora:    {line}" for line in lora_lines(manifest)),
        f"plan:    {manifest.plan.name}  " + ", ".join(f"{n} {s}" for s, n in sorted(styles.items())),
        f"mesh:    {mesh.describe()}, world size {mesh.world_size}",
        f"tensors: {len(manifest.tensors)}, {human_bytes(total)}"
        + (f", cast to {str(manifest.dtype).removeprefix('torch.')}" if manifest.dtype else ""),
        "",
        f"{'file':<16} {'tp rank':>7} {'size':>12}  xxh3_128",
    ]
    for r, f in enumerate(manifest.files):
        lines.append(f"{f.name:<16} {r:>7} {human_bytes(f.size):>12}  {f.xxh3_128}")
    lines += ["", f"{'tp rank':>7} {'own slices':>12} {'replicated':>12} {'reads':>12} {'of total':>9}  ranks"]
    for r in range(mesh.tp):
        own, shared = rank_read_bytes(manifest, r)
        reads = manifest.read_bytes(r)
        ranks = [row["rank"] for row in manifest.rank_table() if row["coords"]["tp"] == r]
        share = reads / total if total else 0.0
        lines.append(
            f"{r:>7} {human_bytes(own):>12} {human_bytes(shared):>12} {human_bytes(reads):>12} "
            f"{share:>8.1%}  {_ranges(ranks)}"
        )
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{','.join(map(str, ranks[:8]))},... ({len(ranks)})"


def read_pipeline(checkpoint: str | Path) -> Any:
    """The sealed record of a local converted pipeline folder, or None where `checkpoint` is not one (no
    `preshard_pipeline.json` beside no manifest).

    Raises:
        CorruptCheckpointError: a record that is edited, damaged or of another version.
    """
    from preshard.format.folder import CheckpointFolder
    from preshard.format.pipeline_record import PIPELINE_RECORD_NAME, parse_pipeline_record

    path = Path(checkpoint)
    if not path.is_dir() or not (path / PIPELINE_RECORD_NAME).exists() or (path / MANIFEST_NAME).exists():
        return None
    folder = CheckpointFolder(path)
    return parse_pipeline_record(folder.read_bytes(PIPELINE_RECORD_NAME), folder.where(PIPELINE_RECORD_NAME))


def inspect_pipeline(checkpoint: str | Path, record: Any) -> tuple[dict[str, Any], str]:
    """What `inspect` says of a converted pipeline: each component (library, class, treatment, TP degree, and how it
    is checked: a sharded one by its manifest, whose digest the record holds; a whole one by its files' sizes and
    xxh3_128 in the record), as JSON data and as a table.

    Example:
        >>> data, text = inspect_pipeline("wan-tp4", read_pipeline("wan-tp4"))  # doctest: +SKIP
    """
    path = Path(checkpoint)
    by_component: dict[str, list[Any]] = {}
    for f in record.files:
        by_component.setdefault(f.name.split("/")[0] if "/" in f.name else "", []).append(f)
    components = []
    for c in record.components.values():
        files = by_component.get(c.name, [])
        entry: dict[str, Any] = {
            "name": c.name, "library": c.library, "class": c.class_name, "treatment": c.treatment, "tp": c.tp,
            "files": [f.to_dict() for f in files], "bytes": sum(f.size for f in files),
        }  # fmt: skip
        if c.treatment == "sharded":
            manifest = read_manifest(path / c.name)
            entry.update(
                manifest_digest=c.manifest_digest, mesh=manifest.mesh.to_dict(), tensors=len(manifest.tensors),
                bytes=entry["bytes"] + sum(f.size for f in manifest.files),
                checks=f"manifest {c.manifest_digest[:12]}... (its data files, .metadata and config.json by checksum)",
            )  # fmt: skip
        elif c.treatment == "whole":
            entry["checks"] = f"{plural(len(files), 'file')} by size and xxh3_128"
        else:
            entry["checks"] = "left out (the index names it [null, null])"
        if c.left_out is not None:
            entry["left_out"] = c.left_out.to_dict()
        components.append(entry)
    top = by_component.get("", [])
    data = {
        "kind": "pipeline", "format_version": record.to_dict()["format_version"], "digest": record.digest,
        "index": record.index_name, "pipeline_class": record.pipeline_class, "mesh": record.mesh,
        "source": record.source, "created": record.created, "components": components,
        "top_level_files": [f.to_dict() for f in top],
    }  # fmt: skip
    lines = [
        f"preshard converted pipeline (record v{data['format_version']}, digest {record.digest}, {record.created})",
        f"pipeline: {record.pipeline_class} ({record.index_name}), converted for tp={record.mesh.get('tp')}",
        f"source:   {record.source}",
        "",
        f"{'component':<18} {'treatment':<10} {'tp':>3} {'size':>10}  {'class':<44} checks",
    ]
    for e in components:
        lines.append(
            f"{e['name']:<18} {e['treatment']:<10} {e['tp'] or '-':>3} {human_bytes(e['bytes']):>10}  "
            f"{e['library'] + '.' + e['class']:<44} {e['checks']}"
        )
    lines.append(f"{'(top level)':<18} {'':<10} {'':>3} {human_bytes(sum(f.size for f in top)):>10}  "
                 f"{'':<44} {plural(len(top), 'file')} by size and xxh3_128")  # fmt: skip
    return data, "\n".join(lines)
