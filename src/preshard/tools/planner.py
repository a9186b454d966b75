"""Which meshes fit, and what a conversion will cost, from safetensors headers alone (`preshard plan`; the dry runs
that use these figures sit beside their tools: `tools/dry_run.py`, `tools/reshard.py`, `tools/unshard.py`).

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from preshard.errors import PlanError, UsageError
from preshard.format.dtypes import DType, dtype_name, parse_cast
from preshard.format.layout import FileLayout, TensorLayout, place_records
from preshard.format.mesh import MAX_WORLD_SIZE
from preshard.format.plan import Plan, resolve_plan, valid_tp_degrees
from preshard.plans.model_class import check_cp_plan, is_transformers_config
from preshard.plans.registry import AUTO, choose_plan
from preshard.sources import CheckpointSource, HeaderSource, open_source_headers
from preshard.units import human_bytes

GIB = 1 << 30
MAX_DEVICE_MEMORY_GIB = 1 << 20  # a PiB per device: past any accelerator, and finite
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
    vocabulary: str | None = None  # whether the plan splits the vocabulary (embedding, lm_head) by rows, and why


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


def source_label(src: CheckpointSource | HeaderSource) -> str:
    """The source as a report names it: its path, or the Hub repo (and subfolder, revision)."""
    hub = src.hub
    if hub is not None:
        where = hub.repo_id + (f"/{hub.subfolder}" if hub.subfolder else "")
        return f"Hub repo {where} @ {hub.revision or 'default branch'} (commit {hub.commit[:12]})"
    return str(src.path)


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


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
    if devices is not None and (
        isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_WORLD_SIZE
    ):
        raise UsageError(f"--devices must be a whole number in 1..{MAX_WORLD_SIZE}, got {devices!r}")
    if device_memory_gib is not None and not (
        isinstance(device_memory_gib, (int, float))
        and not isinstance(device_memory_gib, bool)
        and 0 < device_memory_gib <= MAX_DEVICE_MEMORY_GIB
    ):
        raise UsageError(
            f"--device-memory must be a number of GiB in (0, {MAX_DEVICE_MEMORY_GIB}], got {device_memory_gib!r}"
        )
    cast = parse_cast(dtype)
    src = open_source_headers(source, subfolder=subfolder, revision=revision, token=token)
    chosen = choose_plan(plan, src.config)
    shapes, order, config = src.shapes(), src.read_order(), src.config or {}
    # An inferred transformers plan depends on the degree (KV heads, a vocabulary the degree does not divide stays
    # whole): each degree is sized under the plan inferred at it.
    inferred = is_transformers_config(config) and (plan is None or plan == AUTO)
    if is_transformers_config(config):  # under the names the model's modules have, as the converter reads them
        from preshard.plans.hf_transformers import checkpoint_renames, workable_degrees

        renames = checkpoint_renames(config, list(shapes))
        shapes = {renames.get(n, n): v for n, v in shapes.items()}
        order = [renames.get(n, n) for n in order]
    whole = resolve_plan(chosen, shapes, 1, cast=cast, config=config, check_divisible=False)
    base = _without_vocabulary(chosen) if inferred else chosen
    degrees = valid_tp_degrees(base, resolve_plan(base, shapes, 1, config=config, check_divisible=False), config)
    if is_transformers_config(config):  # the heads decide, at each degree (KV heads split or computed whole)
        degrees = workable_degrees(config, degrees)
    at_degree: dict[int, Plan] = {}  # the plan inferred at each degree (one meta build), as a conversion infers it
    if inferred:  # and every degree whose own inferred plan resolves (a block kept whole where it does not divide)
        from preshard.plans.hf_transformers import plans_by_degree

        for tp, at_tp in plans_by_degree(config).items():
            try:
                resolve_plan(at_tp, shapes, tp, cast=cast, config=config)
            except PlanError:
                continue
            at_degree[tp] = at_tp
        degrees = sorted({*degrees, *at_degree})
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
        at = chosen if not inferred or tp == 1 else at_degree.get(tp) or choose_plan(plan, src.config, tp)
        per_rank = rank_bytes(resolve_plan(at, shapes, tp, cast=cast, config=config), order, tp)
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
        source=source_label(src),
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
        vocabulary=_vocabulary(chosen),
    )


_VOCABULARY_STYLES = ("vocab_parallel", "colwise_gather")


def _without_vocabulary(plan: Plan) -> Plan:
    """`plan` with the vocabulary kept whole: what limits the degrees of an inferred plan, which keeps a vocabulary
    whole at a degree that does not divide it."""
    return replace(plan, linear=tuple(r for r in plan.linear if r.style.name not in _VOCABULARY_STYLES))


def _vocabulary(plan: Plan) -> str | None:
    """Whether the plan splits the vocabulary, in words: its rules say; an inferred plan's description says why."""
    said = next((part for part in plan.description.split("; ") if part.startswith("vocabulary ")), None)
    split = [rule.match for rule in plan.linear if rule.style.name in _VOCABULARY_STYLES]
    if split:
        return (
            said if said and said.startswith("vocabulary split") else f"vocabulary split by rows ({', '.join(split)})"
        )
    return said if said and said.startswith("vocabulary whole") else None


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
        "vocabulary": report.vocabulary,
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
    if report.vocabulary:
        lines.append(f"{report.vocabulary}.")
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
