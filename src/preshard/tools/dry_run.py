"""What a command would write, decided and measured without writing it: `convert-checkpoint --dry-run` here, and
what every dry run shares (the output's disk space, the rates probed for the time estimate, how a reshard's or
unshard's dry run is shown). Those two sit beside their tools (`tools/reshard.reshard_dry_run`,
`tools/unshard.unshard_dry_run`); which meshes fit is `tools/planner.py`'s.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preshard.errors import OutputError
from preshard.format.dtypes import DType, dtype_name
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan
from preshard.sources import HeaderSource, open_source_headers
from preshard.tools.estimate import Estimate, Probe, Work, estimate, input_cached, probe, timed_check
from preshard.tools.planner import RankBytes, rank_bytes, source_label
from preshard.units import human_bytes, plural


@dataclass
class DryRun:
    """What a conversion would do, decided and measured without writing it."""

    source: str
    hub: bool
    plan: str
    mesh: MeshSpec
    dtype: str | None
    tensors: int
    source_bytes: int  # tensor bytes of the source
    per_rank: RankBytes
    output: Path
    needed_bytes: int  # data files + config.json + allowance for manifest and .metadata
    free_bytes: int
    space_error: str | None
    estimate: Estimate | None
    notes: list[str] = field(default_factory=list)
    loras: list[dict[str, Any]] = field(default_factory=list)  # --lora: one entry per LoRA (`LoraSet.summary`)
    quantize: str | None = None  # --quantize: the stored dtype of the weights quantized at conversion
    quantized_weights: int = 0


def dry_run(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec,
    plan: str | Path | Plan | None = None,
    dtype: str | DType | Any | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    probe: bool = True,
    loras: Any = None,
    quantize: str | None = None,
    start_seconds: float = 0.0,
    model_class: str | type | None = None,
) -> DryRun:
    """Everything a conversion decides before writing, the space it needs and a time estimate; writes nothing.

    A Hub source is read by its headers (no weights downloaded); the estimate then excludes the download.
    `start_seconds`: what the conversion's own process pays before planning (the CLI passes its own age).

    Raises:
        SourceError, PlanError, UsageError: as the conversion would. OutputError: an output the conversion would
            refuse (exists without `overwrite`, overlaps the source, parent missing). Too little free space is
            not raised: it is in `space_error`, so the report can still be shown.
    """
    from preshard.converter.convert import plan_conversion, space_needed
    from preshard.converter.workdir import check_output

    src = open_source_headers(source, subfolder=subfolder, revision=revision, token=token)
    job, check_s = timed_check(
        plan_conversion, src, mesh=mesh, plan=plan, dtype=dtype, loras=loras, token=token, quantize=quantize,
        model_class=model_class,
    )  # fmt: skip
    output = Path(output)
    check_output(output, job.source.input_paths(), overwrite)
    per_rank = rank_bytes(job.layouts, job.write_order, mesh.tp)
    needed = space_needed(job)
    free, space_error = disk_space(output, needed)
    hub = isinstance(src, HeaderSource)
    source_bytes = sum(layout.shape_bytes(source=True) for layout in job.layouts.values())
    notes = []
    measured = None
    if probe:
        paths = [] if isinstance(src, HeaderSource) else [h.path for h in src.files]
        work = Work.conversion(source_bytes, input_cached(paths), job.output_bytes)
        rates = probe_rates(paths, output, space_error)
        measured = estimate(work, rates, start_seconds=start_seconds, check_seconds=check_s)
    if hub:
        from huggingface_hub import constants

        cache = Path(constants.HF_HUB_CACHE)
        cache_free = shutil.disk_usage(existing_parent(cache)).free
        notes.append(
            f"the source is downloaded first: {human_bytes(source_bytes)} into the HF cache {cache} "
            f"({human_bytes(cache_free)} free), not counted in the estimate"
        )
    return DryRun(
        source=source_label(src),
        hub=hub,
        plan=job.plan.name,
        mesh=mesh,
        dtype=dtype_name(job.cast) if job.cast is not None else None,
        tensors=len(job.layouts),
        source_bytes=source_bytes,
        per_rank=per_rank,
        output=output,
        needed_bytes=needed,
        free_bytes=free,
        space_error=space_error,
        estimate=measured,
        notes=notes,
        loras=job.source.loras.summary() if hasattr(job.source, "loras") else [],
        quantize=job.quantize,
        quantized_weights=sum(layout.quantizes for layout in job.layouts.values()),
    )


def disk_space(output: Path, needed: int) -> tuple[int, str | None]:
    from preshard.converter.workdir import check_space, partial_dir

    free = shutil.disk_usage(existing_parent(output.parent)).free  # a missing parent is made when writing begins
    try:
        check_space(output, partial_dir(output), needed)
    except OutputError as exc:
        return free, str(exc)
    return free, None


def probe_rates(inputs: list[Path], output: Path, space_error: str | None) -> Probe:
    """The rates, probing the largest input file; the write probe is skipped on a file system without the space."""
    largest = max(inputs, key=lambda p: p.stat().st_size) if inputs else None
    return probe(largest, None if space_error else existing_parent(output.parent))


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def output_fields(run: DryRun | WriteDryRun) -> dict[str, Any]:
    """What every dry run says of its output: disk space, the time estimate, notes."""
    return {
        "needed_bytes": run.needed_bytes,
        "free_bytes": run.free_bytes,
        "fits_disk": run.space_error is None,
        "space_error": run.space_error,
        "estimate_seconds": None if run.estimate is None else round(run.estimate.seconds, 3),
        "estimate": None if run.estimate is None else run.estimate.to_dict(),
        "notes": list(run.notes),
    }


def dry_run_json(run: DryRun) -> dict[str, Any]:
    """What `convert-checkpoint --dry-run --json` prints: the same figures as the text, in bytes and seconds."""
    r = run.per_rank
    return {
        "command": "convert",
        "status": "dry run",
        "source": run.source,
        "hub": run.hub,
        "plan": run.plan,
        "dtype": run.dtype,
        "mesh": run.mesh.to_dict(),
        "world_size": run.mesh.world_size,
        "tensors": run.tensors,
        "source_bytes": run.source_bytes,
        "weight_bytes_per_rank": r.weights,
        "own_bytes_per_rank": r.own,
        "replicated_bytes_per_rank": r.replicated,
        "read_bytes_per_rank": r.read,
        "data_file_bytes": list(r.file_sizes),
        "output": str(run.output),
        **output_fields(run),
        "loras": [dict(lora) for lora in run.loras],
        "quantize": run.quantize,
        "quantized_weights": run.quantized_weights,
    }


def dry_run_text(run: DryRun) -> str:
    """The human view of a dry run."""
    r, mesh = run.per_rank, run.mesh
    lines = [
        "dry run: nothing was written",
        f"source:    {run.source}, {plural(run.tensors, 'tensor')}, {human_bytes(run.source_bytes)}"
        + (" (headers only; nothing downloaded)" if run.hub else ""),
        f"plan:      {run.plan}" + (f", cast to {run.dtype}" if run.dtype else ""),
        f"mesh:      {mesh.describe()}, world size {mesh.world_size}",
        f"per rank:  {human_bytes(r.weights)} of weights ({human_bytes(r.own)} own slices + "
        f"{human_bytes(r.replicated)} replicated); reads {human_bytes(r.read)} at load",
        f"output:    {plural(mesh.tp, 'data file')}, {human_bytes(r.disk)} "
        f"(largest {human_bytes(max(r.file_sizes))}) + manifest.json, .metadata, config.json",
        space_line(run.needed_bytes, run.output, run.free_bytes, run.space_error),
        time_line(run.estimate, run.hub),
    ]
    lines[3:3] = [
        f"lora:      {lora['path']} x {lora['scale']:g}, fused into {lora['modules']} Linear layers (rank "
        f"{'/'.join(map(str, lora['ranks']))}, {human_bytes(lora['bytes'])}), read by {lora['loader']}"
        + (" (keys converted)" if lora["converted"] else "")
        for lora in run.loras
    ]
    if run.quantize:
        lines.insert(
            3,
            f"quantize:  {plural(run.quantized_weights, 'Linear weight')} stored as {run.quantize}, each with a "
            "float32 per-output-channel weight_scale (counted in the bytes below)",
        )
    lines += [f"note:      {note}" for note in run.notes]
    return "\n".join(lines)


def space_line(needed: int, output: Path, free: int, error: str | None) -> str:
    return (
        f"space:     needs {human_bytes(needed)} on the file system of {existing_parent(output.parent)}, "
        f"{human_bytes(free)} free -> " + ("NOT ENOUGH" if error else "ok")
    )


def time_line(measured: Estimate | None, hub: bool = False) -> str:
    if measured is None:
        return "time:      not estimated"
    return f"time:      {measured.describe()}" + ("; the download comes on top" if hub else "")


# What a reshard or unshard would write (their dry runs: tools/reshard.py, tools/unshard.py)


@dataclass
class WriteDryRun:
    """What a reshard or unshard would write, decided and measured without writing it."""

    command: str  # "reshard" | "unshard"
    input: str
    output: Path
    mesh: MeshSpec | None  # reshard: the new mesh
    files: list[tuple[str, int]]  # every file it writes (name, exact size); links are not listed
    linked: bool  # reshard with the same TP degree: the data files are hard-linked, not written
    needed_bytes: int
    free_bytes: int
    space_error: str | None
    estimate: Estimate | None
    notes: list[str] = field(default_factory=list)


def file_names(tp: int) -> list[str]:
    from preshard.format.layout import data_file_name

    return [data_file_name(r) for r in range(tp)]


def write_dry_run_json(run: WriteDryRun) -> dict[str, Any]:
    """What `reshard/unshard --dry-run --json` prints."""
    return {
        "command": run.command,
        "status": "dry run",
        "input": run.input,
        "output": str(run.output),
        "mesh": None if run.mesh is None else run.mesh.to_dict() | {"world_size": run.mesh.world_size},
        "linked": run.linked,
        "files": [{"name": n, "size": s} for n, s in run.files],
        "output_bytes": sum(s for _, s in run.files),
        **output_fields(run),
    }


def write_dry_run_text(run: WriteDryRun) -> str:
    written = sum(s for _, s in run.files)
    lines = [f"dry run: nothing was written ({run.command} {run.input} -> {run.output})"]
    if run.mesh is not None:
        lines.append(f"mesh:      {run.mesh.describe()}, world size {run.mesh.world_size}")
    lines.append(
        f"output:    {plural(len(run.files), 'file')}, {human_bytes(written)}"
        + (" + manifest.json (the data files linked)" if run.linked else "")
    )
    lines += [space_line(run.needed_bytes, run.output, run.free_bytes, run.space_error), time_line(run.estimate)]
    lines += [f"note:      {note}" for note in run.notes]
    return "\n".join(lines)


__all__ = [
    "DryRun",
    "WriteDryRun",
    "dry_run",
    "dry_run_json",
    "dry_run_text",
    "write_dry_run_json",
    "write_dry_run_text",
]
