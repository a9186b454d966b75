"""Which meshes fit, and what a conversion will cost, from safetensors headers alone (`preshard plan`,
`convert-checkpoint --dry-run`).

Why: before converting 66 GB a user wants to know which TP x CP meshes fit their devices (the seed's trn2 run found
out by running out of memory: TP=2 needs about 31 GiB per rank, and a 24 GiB core does not have it) and how long
and how much disk the conversion takes. Everything here follows from tensor names, shapes and dtypes: the plan
resolved for each TP degree (`preshard.format.plan.resolve_plan`) gives each tensor's per-rank shape, and the
record layout (`preshard.format.layout.place_records`) gives every data file's exact size. A local source is
opened by its headers (no tensor data read); a Hub source's headers come with ranged requests (no weights
downloaded).

The figures are the weights only, as stored after any `--dtype` cast: parameters and persistent buffers, each
replicated tensor counted on every rank. Activations, the attention workspace, communication buffers and a
compiler's workspace (Neuron, XLA) come on top.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from preshard.errors import OutputError, PlanError, UsageError
from preshard.format.dtypes import DType, dtype_name, parse_cast
from preshard.format.layout import FileLayout, TensorLayout, place_records
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan, resolve_plan, valid_tp_degrees
from preshard.plans.model_class import check_cp_plan
from preshard.plans.registry import choose_plan
from preshard.sources import CheckpointSource, HeaderSource, open_source_headers
from preshard.tools.estimate import Estimate, Probe, Work, estimate, input_cached, probe, timed_check
from preshard.units import human_bytes, plural

GIB = 1 << 30
# The recommended mesh leaves at least this share of each device's memory to what comes on top of the weights.
HEADROOM = 0.2


@dataclass(frozen=True)
class RankBytes:
    """What one TP rank holds and reads under one TP degree (every TP rank holds the same)."""

    tp: int
    own: int  # bytes of this rank's slices of the sharded tensors
    replicated: int  # bytes of the tensors every rank holds whole
    read: int  # bytes the rank reads at load (`ChunkRecord.load_bytes`: each record's framing header and data)
    file_sizes: tuple[int, ...]  # every data file, exact

    @property
    def weights(self) -> int:
        return self.own + self.replicated

    @property
    def disk(self) -> int:
        return sum(self.file_sizes)


@dataclass(frozen=True)
class MeshEstimate:
    """One mesh's figures, as `preshard plan --json` prints them."""

    tp: int
    ring: int
    ulysses: int
    world_size: int
    weight_bytes_per_rank: int
    own_bytes_per_rank: int
    replicated_bytes_per_rank: int
    read_bytes_per_rank: int
    disk_bytes: int
    largest_file_bytes: int
    fills_devices: bool
    fits: bool | None  # None without --device-memory
    recommended: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlanReport:
    """`plan_meshes`' answer: the source, every mesh's figures, and the recommended one (with why)."""

    source: str
    plan: str
    tensors: int
    stored_bytes: int  # all tensors as stored after the cast
    dtype: str | None
    devices: int | None
    device_memory: int | None  # bytes
    tp_degrees: list[int]  # every TP degree the plan allows for this checkpoint
    meshes: list[MeshEstimate]
    recommended: MeshEstimate | None
    reason: str
    no_cp: str | None = None  # why no mesh has CP (no CP plan anywhere), else None


def rank_bytes(layouts: dict[str, TensorLayout], order: list[str], tp: int) -> RankBytes:
    """Per-rank weights, reads and exact file sizes under TP degree `tp` (the plan already resolved for it)."""
    own = replicated = 0
    for layout in layouts.values():
        size = math.prod(layout.local_shape(tp)) * layout.dtype.itemsize
        if layout.sharded:
            own += size
        else:
            replicated += size
    files: FileLayout = place_records([layouts[name] for name in order], tp)
    reads = [0] * tp
    for chunks in files.chunks.values():
        for c in chunks:
            if c.owner is None:
                for r in range(tp):
                    reads[r] += c.load_bytes
            else:
                reads[c.owner] += c.load_bytes
    return RankBytes(tp, own, replicated, max(reads), tuple(files.file_sizes))


def _source_label(src: CheckpointSource | HeaderSource) -> str:
    hub = src.hub
    if hub is not None:
        where = hub.repo_id + (f"/{hub.subfolder}" if hub.subfolder else "")
        return f"Hub repo {where} @ {hub.revision or 'default branch'} (commit {hub.commit[:12]})"
    return str(src.path)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _preferred_split(cp: int, local_heads: int | None) -> tuple[int, int]:
    """(ring, ulysses) for `cp` ranks: Ulysses as wide as the rank's heads divide evenly (an all-to-all over
    contiguous ranks, the device's own attention kernel; uneven heads are zero-padded), ring for the rest."""
    for ulysses in sorted(_divisors(cp), reverse=True):
        if local_heads is None or local_heads % ulysses == 0:
            return cp // ulysses, ulysses
    return cp, 1


def plan_meshes(
    source: str | Path,
    *,
    devices: int | None = None,
    device_memory_gib: float | None = None,
    plan: str | Path | Plan | None = None,
    dtype: str | DType | Any | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> PlanReport:
    """Per-rank weights, load reads, disk and fit of every mesh a checkpoint allows, from its headers alone.

    Args:
        source: a local safetensors checkpoint (file or folder) or a Hub repo id (headers read with ranged
            requests; no weights downloaded).
        devices: how many devices the job has: every TP degree up to it, and for each TP degree dividing it
            every ring x ulysses split of the rest. Without it: every TP degree alone (no CP).
        device_memory_gib: memory of one device in GiB, to say which meshes fit and recommend one.
        plan, dtype: as for `convert_checkpoint`.
        subfolder, revision, token: for a Hub repo (`subfolder` also for a local folder).

    Returns:
        A `PlanReport`.

    Raises:
        UsageError: a bad --devices, --device-memory or --dtype. SourceError, PlanError: as for a conversion.
    """
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise UsageError(f"--devices must be a whole number >= 1, got {devices!r}")
    if device_memory_gib is not None and not (isinstance(device_memory_gib, (int, float)) and device_memory_gib > 0):
        raise UsageError(f"--device-memory must be a positive number of GiB, got {device_memory_gib!r}")
    cast = parse_cast(dtype)
    src = open_source_headers(source, subfolder=subfolder, revision=revision, token=token)
    chosen = choose_plan(plan, src.config)
    shapes, order, config = src.shapes(), src.read_order(), src.config or {}
    whole = resolve_plan(chosen, shapes, 1, cast=cast, config=config, check_divisible=False)
    degrees = valid_tp_degrees(chosen, whole, config)
    memory = int(device_memory_gib * GIB) if device_memory_gib is not None else None
    heads = config.get("num_attention_heads")
    heads = heads if isinstance(heads, int) and not isinstance(heads, bool) else None

    no_cp = None
    if devices is not None and devices > 1:  # a CP split needs a CP plan, the plan's or the model class's
        try:
            check_cp_plan(chosen, config, 2)
        except PlanError as exc:  # only TP meshes can load: list no CP split
            no_cp = str(exc).split(", so ")[0]

    meshes: list[MeshEstimate] = []
    for tp in [d for d in degrees if devices is None or d <= devices]:
        per_rank = rank_bytes(resolve_plan(chosen, shapes, tp, cast=cast, config=config), order, tp)
        if devices is not None and devices % tp == 0 and (no_cp is None or tp == devices):
            splits = [(ring, devices // tp // ring) for ring in _divisors(devices // tp)]
        else:
            splits = [(1, 1)]
        for ring, ulysses in splits:
            world = tp * ring * ulysses
            meshes.append(
                MeshEstimate(
                    tp=tp,
                    ring=ring,
                    ulysses=ulysses,
                    world_size=world,
                    weight_bytes_per_rank=per_rank.weights,
                    own_bytes_per_rank=per_rank.own,
                    replicated_bytes_per_rank=per_rank.replicated,
                    read_bytes_per_rank=per_rank.read,
                    disk_bytes=per_rank.disk,
                    largest_file_bytes=max(per_rank.file_sizes),
                    fills_devices=devices is None or world == devices,
                    fits=None if memory is None else per_rank.weights <= memory,
                )
            )
    recommended, reason = _recommend(meshes, memory, heads)
    if recommended is not None:
        meshes = [replace(m, recommended=True) if m == recommended else m for m in meshes]
        recommended = replace(recommended, recommended=True)
    return PlanReport(
        source=_source_label(src),
        plan=chosen.name,
        tensors=len(shapes),
        stored_bytes=sum(layout.nbytes for layout in whole.values()),
        dtype=dtype_name(cast) if cast is not None else None,
        devices=devices,
        device_memory=memory,
        tp_degrees=degrees,
        meshes=meshes,
        recommended=recommended,
        reason=reason,
        no_cp=no_cp,
    )


def _recommend(meshes: list[MeshEstimate], memory: int | None, heads: int | None) -> tuple[MeshEstimate | None, str]:
    """The smallest TP degree whose weights leave HEADROOM of the device free (fewer TP ranks: fewer all-reduces,
    larger matmuls), on a mesh that uses every device if one does; CP split as `_preferred_split` says."""
    if memory is None:
        return None, "pass --device-memory GIB to see which meshes fit and which one is recommended"
    fitting = [m for m in meshes if m.fits]
    if not fitting:
        return None, (
            "no mesh fits: the weights alone exceed device memory at every TP degree the plan allows; use more "
            "devices, a plan that shards more, or --dtype bf16"
        )
    filling = [m for m in fitting if m.fills_devices] or fitting
    roomy = [m for m in filling if m.weight_bytes_per_rank <= (1 - HEADROOM) * memory]
    pool = roomy or filling
    tp = min(m.tp for m in pool)
    same_tp = [m for m in pool if m.tp == tp]
    ring, ulysses = _preferred_split(same_tp[0].world_size // tp, heads // tp if heads else None)
    best = next((m for m in same_tp if (m.ring, m.ulysses) == (ring, ulysses)), same_tp[0])
    why = (
        f"the smallest TP degree whose weights leave at least {HEADROOM:.0%} of device memory free"
        if roomy
        else f"the smallest TP degree that fits, but it leaves under {HEADROOM:.0%} of device memory free"
    )
    why += " (fewer TP ranks: fewer all-reduces, larger matmuls)"
    if best.ring * best.ulysses > 1:
        why += "; the other devices run CP, Ulysses as wide as the heads divide, ring for the rest"
    return best, why


def smallest_fitting(report: PlanReport, device_memory_gib: float, headroom: float = HEADROOM) -> MeshEstimate | None:
    """The mesh with the fewest TP ranks (CP 1) whose weights leave `headroom` of a `device_memory_gib` device free,
    the bar the recommendation uses; None if no TP degree the plan allows gets there. CP ranks can be added to it:
    they hold the same weights.

    Raises:
        UsageError: a device memory that is not a positive number, or a headroom outside [0, 1).
    """
    if not (isinstance(device_memory_gib, (int, float)) and device_memory_gib > 0):
        raise UsageError(f"device memory must be a positive number of GiB, got {device_memory_gib!r}")
    if not 0 <= headroom < 1:
        raise UsageError(f"headroom must be a share in [0, 1), got {headroom!r}")
    limit = (1 - headroom) * device_memory_gib * GIB
    fitting = [m for m in report.meshes if m.ring * m.ulysses == 1 and m.weight_bytes_per_rank <= limit]
    return min(fitting, key=lambda m: m.tp, default=None)


def plan_json(report: PlanReport) -> dict[str, Any]:
    """What `preshard plan --json` prints: the source and plan, every mesh's figures, the recommended one."""
    return {
        "source": report.source,
        "plan": report.plan,
        "tensors": report.tensors,
        "stored_bytes": report.stored_bytes,
        "dtype": report.dtype,
        "devices": report.devices,
        "device_memory_bytes": report.device_memory,
        "tp_degrees": list(report.tp_degrees),
        "meshes": [m.to_dict() for m in report.meshes],
        "recommended": None if report.recommended is None else report.recommended.to_dict(),
        "reason": report.reason,
        "no_cp": report.no_cp,
    }


def _memory(n: int) -> str:
    """Device memory as given: '24 GiB', '0.5 GiB'; under 0.01 GiB in MiB/KiB (no 0.000999999 GiB)."""
    return f"{n / GIB:.2f}".rstrip("0").rstrip(".") + " GiB" if n >= GIB // 100 else human_bytes(n)


def plan_table(report: PlanReport) -> str:
    """The human view: one row per TP degree, its CP splits, the figures, the recommended mesh marked."""
    memory = report.device_memory
    header = (
        f"source: {report.source}\n"
        f"plan:   {report.plan}; {report.tensors} tensors, {human_bytes(report.stored_bytes)} as stored"
        + (f" (cast to {report.dtype})" if report.dtype else "")
        + "\n"
        + f"TP degrees the plan allows: {', '.join(map(str, report.tp_degrees))}"
        + (f"; devices: {report.devices}" if report.devices else "")
        + (f" x {memory / GIB:g} GiB" if memory else "")
    )
    fits_title = f"fits {_memory(memory)}" if memory else "fits"
    rows = [
        ("", "tp", "ring x ulysses", "weights/rank", "replicated", "reads/rank", "disk", fits_title),
    ]
    by_tp: dict[int, list[MeshEstimate]] = {}
    for m in report.meshes:
        by_tp.setdefault(m.tp, []).append(m)
    for tp, group in by_tp.items():
        first = group[0]
        if report.devices is None:
            splits = "-"
        elif not first.fills_devices:
            splits = f"- ({tp} of {report.devices} devices)"
        else:
            splits = " ".join(f"{m.ring}x{m.ulysses}" for m in group)
        if first.fits is None:
            fits = "?"
        elif first.fits:
            fits = f"yes, {human_bytes(memory - first.weight_bytes_per_rank)} left"
        else:
            fits = f"no, {human_bytes(first.weight_bytes_per_rank - memory)} over"
        mark = "*" if any(m.recommended for m in group) else ""
        rows.append(
            (
                mark,
                str(tp),
                splits,
                human_bytes(first.weight_bytes_per_rank),
                human_bytes(first.replicated_bytes_per_rank),
                human_bytes(first.read_bytes_per_rank),
                human_bytes(first.disk_bytes),
                fits,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {1, 3, 4, 5, 6}
    lines = [header, ""]
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    if report.no_cp:
        lines.append(f"no CP splits: {report.no_cp}; every rank must be a TP rank.")
    best = report.recommended
    if best is not None:
        lines.append(
            f"* recommended: tp={best.tp} x ring={best.ring} x ulysses={best.ulysses} (world size {best.world_size}): "
            f"{report.reason}."
        )
    else:
        lines.append(f"no recommendation: {report.reason}.")
    lines.append(
        "weights/rank: parameters and persistent buffers as stored, replicated tensors on every rank. Activations, "
        "attention and communication buffers and the compiler's workspace come on top."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# convert-checkpoint --dry-run


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
        plan_conversion, src, mesh=mesh, plan=plan, dtype=dtype, loras=loras, token=token, quantize=quantize
    )
    output = Path(output)
    check_output(output, job.source.input_paths(), overwrite)
    per_rank = rank_bytes(job.layouts, job.write_order, mesh.tp)
    needed = space_needed(job)
    free, space_error = _space(output, needed)
    hub = isinstance(src, HeaderSource)
    source_bytes = sum(layout.shape_bytes(source=True) for layout in job.layouts.values())
    notes = []
    measured = None
    if probe:
        paths = [] if hub else [h.path for h in src.files]
        work = Work.conversion(source_bytes, input_cached(paths), job.output_bytes)
        rates = _probe(paths, output, space_error)
        measured = estimate(work, rates, start_seconds=start_seconds, check_seconds=check_s)
    if hub:
        from huggingface_hub import constants

        cache = Path(constants.HF_HUB_CACHE)
        cache_free = shutil.disk_usage(_existing(cache)).free
        notes.append(
            f"the source is downloaded first: {human_bytes(source_bytes)} into the HF cache {cache} "
            f"({human_bytes(cache_free)} free), not counted in the estimate"
        )
    return DryRun(
        source=_source_label(src),
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


def _space(output: Path, needed: int) -> tuple[int, str | None]:
    from preshard.converter.workdir import check_space, partial_dir

    free = shutil.disk_usage(_existing(output.parent)).free  # a missing parent is made when writing begins
    try:
        check_space(output, partial_dir(output), needed)
    except OutputError as exc:
        return free, str(exc)
    return free, None


def _probe(inputs: list[Path], output: Path, space_error: str | None) -> Probe:
    """The rates, probing the largest input file; the write probe is skipped on a file system without the space."""
    largest = max(inputs, key=lambda p: p.stat().st_size) if inputs else None
    return probe(largest, None if space_error else _existing(output.parent))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _output_fields(run: DryRun | WriteDryRun) -> dict[str, Any]:
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
        **_output_fields(run),
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
        _space_line(run.needed_bytes, run.output, run.free_bytes, run.space_error),
        _time_line(run.estimate, run.hub),
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
            "float32 "
            "per-output-channel weight_scale (counted in the bytes below)",
        )
    lines += [f"note:      {note}" for note in run.notes]
    return "\n".join(lines)


def _space_line(needed: int, output: Path, free: int, error: str | None) -> str:
    return (
        f"space:     needs {human_bytes(needed)} on the file system of {_existing(output.parent)}, {human_bytes(free)} "
        "free -> " + ("NOT ENOUGH" if error else "ok")
    )


def _time_line(measured: Estimate | None, hub: bool = False) -> str:
    if measured is None:
        return "time:      not estimated"
    return f"time:      {measured.describe()}" + ("; the download comes on top" if hub else "")


# ---------------------------------------------------------------------------------------------------------
# reshard --dry-run, unshard --dry-run


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


def reshard_dry_run(
    checkpoint: str | Path,
    output: str | Path,
    *,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    start_seconds: float = 0.0,
) -> WriteDryRun:
    """What `reshard_checkpoint` would do: the new mesh checked against the plan (the degrees that work are named
    otherwise), the output checked, the files it writes, the space and a time estimate; nothing is written.

    Raises:
        As `reshard_checkpoint`, before writing (too little space is in `space_error`).
    """
    from preshard.converter.convert import plan_conversion, resolve_mesh, space_needed
    from preshard.converter.workdir import check_output
    from preshard.sources.presharded import open_presharded

    source = open_presharded(checkpoint, subfolder=subfolder, revision=revision, token=token)
    manifest = source.manifest
    mesh = resolve_mesh(None, tp, cp, ring, ulysses, order, default=manifest.mesh)
    output = Path(output)
    inputs = [source.folder / f.name for f in manifest.files]
    input_bytes = sum(f.size for f in manifest.files)
    if mesh.tp == manifest.tp:
        if manifest.mesh.cp == 1:
            check_cp_plan(manifest.plan, source.config, mesh.cp)
        check_output(output, source.input_paths(), overwrite)
        needed = 1 << 20  # a manifest; the data files are linked (copied where the file system cannot link)
        free, space_error = _space(output, needed)
        measured = estimate(Work(0, 0, 0, 0, 0), probe(None, None), start_seconds=start_seconds)
        notes = [f"the same TP degree: the data files ({human_bytes(input_bytes)}) are hard-linked, not written"]
        return WriteDryRun(
            "reshard", str(checkpoint), output, mesh, [], True, needed, free, space_error, measured, notes
        )
    job, check_s = timed_check(plan_conversion, source, mesh=mesh, plan=manifest.plan, dtype=manifest.dtype)
    check_output(output, source.input_paths(), overwrite)
    needed = space_needed(job)
    free, space_error = _space(output, needed)
    files = [(name, size) for name, size in zip(_file_names(mesh.tp), job.files.file_sizes)]
    work = Work.conversion(input_bytes, input_cached(inputs), job.output_bytes)
    measured = estimate(work, _probe(inputs, output, space_error), start_seconds=start_seconds, check_seconds=check_s)
    return WriteDryRun("reshard", str(checkpoint), output, mesh, files, False, needed, free, space_error, measured)


def unshard_dry_run(
    checkpoint: str | Path,
    output: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    start_seconds: float = 0.0,
) -> WriteDryRun:
    """What `unshard_checkpoint` would write (the source's files, exact sizes), the space and a time estimate.

    Raises:
        As `unshard_checkpoint`, before writing (a lossy cast is refused; too little space is in `space_error`).
    """
    from preshard.converter.workdir import SAFETENSORS_FOLDER, check_output
    from preshard.sources.presharded import open_presharded
    from preshard.tools.unshard import (
        refuse_fused_loras,
        refuse_lossy_cast,
        refuse_quantized_at_conversion,
        small_files,
    )

    source = open_presharded(checkpoint, subfolder=subfolder, revision=revision, token=token)
    refuse_quantized_at_conversion(source)  # first: it is why the cast check would also refuse
    refuse_lossy_cast(source)
    refuse_fused_loras(source)
    manifest = source.manifest
    extra = [(name, len(data)) for name, data in small_files(source, source.source_headers()).items()]
    output = Path(output)
    check_output(output, source.input_paths(), overwrite, kind=SAFETENSORS_FOLDER)
    files = [(f.name, f.size) for f in manifest.source.files]
    out_bytes = sum(size for _, size in files)
    needed = out_bytes + sum(size for _, size in extra) + (1 << 20)
    free, space_error = _space(output, needed)
    inputs = [source.folder / f.name for f in manifest.files]
    work = Work.unshard(sum(f.size for f in manifest.files), input_cached(inputs), out_bytes)
    measured = estimate(work, _probe(inputs, output, space_error), start_seconds=start_seconds)
    return WriteDryRun(
        "unshard", str(checkpoint), output, None, files + extra, False, needed, free, space_error, measured
    )


def _file_names(tp: int) -> list[str]:
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
        **_output_fields(run),
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
    lines += [_space_line(run.needed_bytes, run.output, run.free_bytes, run.space_error), _time_line(run.estimate)]
    lines += [f"note:      {note}" for note in run.notes]
    return "\n".join(lines)
