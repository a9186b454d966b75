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
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from preshard.errors import OutputError, PlanError, UsageError
from preshard.format.dtypes import dtype_name, parse_cast
from preshard.format.layout import FileLayout, TensorLayout, place_records
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan, resolve_plan, valid_tp_degrees
from preshard.plans.from_model import check_cp_plan
from preshard.plans.registry import choose_plan
from preshard.sources import CheckpointSource, HeaderSource, open_source_headers
from preshard.units import human_bytes

GIB = 1 << 30
# The recommended mesh leaves at least this share of each device's memory to what comes on top of the weights.
HEADROOM = 0.2
PROBE_BYTES = 64 << 20
PROBE_BLOCK = 8 << 20


@dataclass(frozen=True)
class RankBytes:
    """What one TP rank holds and reads under one TP degree (every TP rank holds the same)."""

    tp: int
    own: int  # bytes of this rank's slices of the sharded tensors
    replicated: int  # bytes of the tensors every rank holds whole
    read: int  # bytes of the records the rank reads at load (framing included)
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
                    reads[r] += c.framing.length
            else:
                reads[c.owner] += c.framing.length
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
    dtype: str | torch.dtype | None = None,
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


def plan_json(report: PlanReport) -> list[dict[str, Any]]:
    """What `preshard plan --json` prints: one object per mesh."""
    return [m.to_dict() for m in report.meshes]


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
    fits_title = f"fits {memory / GIB:g} GiB" if memory else "fits"
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


@dataclass(frozen=True)
class Probe:
    """A short measurement of this machine: read the source, write+fsync next to the output, hash."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    hash_bytes: int = 0
    hash_seconds: float = 0.0

    @staticmethod
    def _rate(n: int, s: float) -> float | None:
        return n / s if n and s > 0 else None

    @property
    def read_rate(self) -> float | None:
        return self._rate(self.read_bytes, self.read_seconds)

    @property
    def write_rate(self) -> float | None:
        return self._rate(self.write_bytes, self.write_seconds)

    @property
    def hash_rate(self) -> float | None:
        return self._rate(self.hash_bytes, self.hash_seconds)


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
    probe: Probe
    estimate_seconds: float | None
    notes: list[str] = field(default_factory=list)
    loras: list[dict[str, Any]] = field(default_factory=list)  # --lora: one entry per LoRA (`LoraSet.summary`)


def probe_io(source_files: list[Path], data_start: int, folder: Path, nbytes: int = PROBE_BYTES) -> Probe:
    """Time a read of up to `nbytes` of the largest source file, an xxh3 pass over it, and a write+fsync of as
    much into a temporary file in `folder` (removed again). Nothing is left behind.

    `data_start` is where that file's tensor data begin (its header is skipped)."""
    buffer = bytearray()
    read_s = 0.0
    if source_files:
        path = max(source_files, key=lambda p: p.stat().st_size)
        fd = os.open(path, os.O_RDONLY)
        try:
            want = max(0, min(nbytes, os.fstat(fd).st_size - data_start))
            start = time.perf_counter()
            offset = data_start
            while len(buffer) < want:
                block = os.pread(fd, min(PROBE_BLOCK, want - len(buffer)), offset)
                if not block:
                    break
                buffer += block
                offset += len(block)
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    data = bytes(buffer) if 2 * len(buffer) >= nbytes else os.urandom(nbytes)  # a tiny source: random bytes
    start = time.perf_counter()
    xxhash.xxh3_128(data).hexdigest()
    hash_s = time.perf_counter() - start
    write_bytes, write_s = 0, 0.0
    if shutil.disk_usage(folder).free > 4 * len(data):
        fd, name = tempfile.mkstemp(prefix=".preshard-probe-", dir=folder)
        try:
            start = time.perf_counter()
            view = memoryview(data)
            for i in range(0, len(view), PROBE_BLOCK):
                os.write(fd, view[i : i + PROBE_BLOCK])
            os.fsync(fd)
            write_s = time.perf_counter() - start
            write_bytes = len(data)
        finally:
            os.close(fd)
            os.unlink(name)
    return Probe(len(buffer), read_s, write_bytes, write_s, len(data), hash_s)


def estimate_seconds(source_bytes: int, output_bytes: int, probe: Probe, hub: bool) -> float | None:
    """Read the source once, write the output once, hash both (the converter records xxh3 of each)."""
    if probe.write_rate is None or probe.hash_rate is None:
        return None
    seconds = output_bytes / probe.write_rate + (source_bytes + output_bytes) / probe.hash_rate
    if not hub:
        if probe.read_rate is None:
            return None
        seconds += source_bytes / probe.read_rate
    return seconds


def dry_run(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec,
    plan: str | Path | Plan | None = None,
    dtype: str | torch.dtype | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    probe: bool = True,
    loras: Any = None,
) -> DryRun:
    """Everything a conversion decides before writing, the space it needs and a time estimate; writes nothing.

    A Hub source is read by its headers (no weights downloaded); the estimate then excludes the download.

    Raises:
        SourceError, PlanError, UsageError: as the conversion would. OutputError: an output the conversion would
            refuse (exists without `overwrite`, overlaps the source, parent missing). Too little free space is
            not raised: it is in `space_error`, so the report can still be shown.
    """
    from preshard.converter.convert import plan_conversion, space_needed
    from preshard.converter.workdir import check_output, check_space, partial_dir

    src = open_source_headers(source, subfolder=subfolder, revision=revision, token=token)
    job = plan_conversion(src, mesh=mesh, plan=plan, dtype=dtype, loras=loras, token=token)
    output = Path(output)
    check_output(output, job.source.input_paths(), overwrite)
    per_rank = rank_bytes(job.layouts, job.write_order, mesh.tp)
    needed = space_needed(job)
    free = shutil.disk_usage(output.parent).free
    space_error = None
    try:
        check_space(output, partial_dir(output), needed)
    except OutputError as exc:
        space_error = str(exc)
    hub = isinstance(src, HeaderSource)
    source_bytes = sum(layout.shape_bytes(source=True) for layout in job.layouts.values())
    notes = []
    measured = Probe()
    if probe:
        files = [] if hub else [h.path for h in src.files]
        start = 0 if hub else max(src.files, key=lambda h: h.path.stat().st_size).header_bytes
        size = min(PROBE_BYTES, max(PROBE_BLOCK, job.output_bytes))  # a small conversion needs no 64 MiB probe
        measured = probe_io(files, start, output.parent, size)
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
        probe=measured,
        estimate_seconds=estimate_seconds(source_bytes, job.output_bytes, measured, hub),
        notes=notes,
        loras=job.source.loras.summary() if hasattr(job.source, "loras") else [],
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _rate(rate: float | None) -> str:
    return f"{human_bytes(rate)}/s" if rate else "not measured"


def dry_run_json(run: DryRun) -> dict[str, Any]:
    """What `convert-checkpoint --dry-run --json` prints: the same figures as the text, in bytes and seconds."""
    r, p = run.per_rank, run.probe
    return {
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
        "needed_bytes": run.needed_bytes,
        "free_bytes": run.free_bytes,
        "fits_disk": run.space_error is None,
        "space_error": run.space_error,
        "probe_bytes_per_second": {"read": p.read_rate, "write_fsync": p.write_rate, "xxh3": p.hash_rate},
        "estimate_seconds_at_least": run.estimate_seconds,
        "notes": list(run.notes),
        "loras": [dict(lora) for lora in run.loras],
    }


def dry_run_text(run: DryRun) -> str:
    """The human view of a dry run."""
    r, mesh = run.per_rank, run.mesh
    p = run.probe
    lines = [
        "dry run: nothing was written",
        f"source:    {run.source}, {run.tensors} tensors, {human_bytes(run.source_bytes)}"
        + (" (headers only; nothing downloaded)" if run.hub else ""),
        f"plan:      {run.plan}" + (f", cast to {run.dtype}" if run.dtype else ""),
        f"mesh:      {mesh.describe()}, world size {mesh.world_size}",
        f"per rank:  {human_bytes(r.weights)} of weights ({human_bytes(r.own)} own slices + "
        f"{human_bytes(r.replicated)} replicated); reads {human_bytes(r.read)} at load",
        f"output:    {mesh.tp} data files, {human_bytes(r.disk)} (largest {human_bytes(max(r.file_sizes))}) + "
        "manifest.json, .metadata, config.json",
        f"space:     needs {human_bytes(run.needed_bytes)} on the file system of {run.output.parent}, "
        f"{human_bytes(run.free_bytes)} free -> " + ("NOT ENOUGH" if run.space_error else "ok"),
    ]
    probe = (
        f"read {_rate(p.read_rate)}" + ("" if not run.hub else " (Hub: not probed)")
        + f", write+fsync {_rate(p.write_rate)}, xxh3 {_rate(p.hash_rate)}"
    )  # fmt: skip
    if run.estimate_seconds is not None:
        lines.append(
            f"time:      at least {human_seconds(run.estimate_seconds)}: the source read once, the output written "
            f"once, both hashed, at the rates of {human_bytes(p.hash_bytes)} probes just now ({probe}); a sustained "
            "write is often slower than a short burst" + ("; the download comes on top" if run.hub else "")
        )
    else:
        lines.append(f"time:      no estimate ({probe})")
    lines[3:3] = [
        f"lora:      {lora['path']} x {lora['scale']:g}, fused into {lora['modules']} Linear layers (rank "
        f"{'/'.join(map(str, lora['ranks']))}, {human_bytes(lora['bytes'])}), read by {lora['loader']}"
        + (" (keys converted)" if lora["converted"] else "")
        for lora in run.loras
    ]
    lines += [f"note:      {note}" for note in run.notes]
    return "\n".join(lines)
