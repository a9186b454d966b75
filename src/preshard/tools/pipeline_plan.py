"""`preshard plan PIPELINE`: every component of a pipeline folder per rank, added up, and one mesh for the job.

Each component is treated as `convert-checkpoint PIPELINE OUT` would (`converter.pipeline_folder.plan_pipeline`,
the same `--component` choices): a sharded one is sized by `plan_meshes` at each mesh (its slices plus what every
rank holds whole), a whole one counts its stored bytes on every rank. A sharded text encoder (TP only, replicated
across the CP groups at load) counts its slices at each mesh's TP degree, without the layers `--keep-layers` (or
the pipeline's documented default) leaves out. Headers only (a pipeline of headers over
holes costs nothing). Weights only, as `plan` says for one model: activations and workspace come on top.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from preshard.converter.convert import as_loaded_names, resolve_mesh
from preshard.converter.left_out import is_left_out
from preshard.converter.pipeline_folder import (
    ComponentChoice,
    is_text_encoder,
    layers_to_keep,
    parse_component_choices,
    plan_pipeline,
)
from preshard.errors import SourceError, UsageError
from preshard.format.dtypes import parse_cast
from preshard.format.pipeline_record import read_pipeline_index
from preshard.sources.safetensors_file import read_header
from preshard.tools.planner import GIB, HEADROOM, plan_meshes
from preshard.units import human_bytes


@dataclass(frozen=True)
class PipelineMesh:
    """One mesh of the job: each component's bytes per rank and their sum."""

    tp: int
    ring: int
    ulysses: int
    world_size: int
    per_component: dict[str, int]  # bytes per rank
    total: int
    fits: bool | None  # None without a device memory
    recommended: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp, "ring": self.ring, "ulysses": self.ulysses, "world_size": self.world_size,
            "bytes_per_rank": dict(self.per_component), "total_bytes_per_rank": self.total, "fits": self.fits,
            "recommended": self.recommended,
        }  # fmt: skip


@dataclass
class PipelinePlan:
    source: str
    pipeline_class: str
    devices: int
    device_memory: int | None
    treatments: dict[str, str]
    meshes: list[PipelineMesh] = field(default_factory=list)
    recommended: PipelineMesh | None = None
    reason: str = ""


def _stored_bytes(folder: Path, itemsize: int | None, keep: int | None = None) -> int:
    """A whole component's tensors as stored (or as cast to `itemsize`, floating ones), from the headers; with
    `keep`, only those a `--keep-layers` conversion keeps."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        for entry in read_header(path).tensors.values():
            if keep is not None and is_left_out(entry.name, keep):
                continue
            if itemsize is not None and entry.dtype.is_floating_point and entry.dtype.itemsize > 1:
                total += entry.nbytes // entry.dtype.itemsize * itemsize
            else:
                total += entry.nbytes
    return total


def _text_encoder_per_rank(folder: Path, degrees: Iterable[int], dtype: Any, keep: int | None) -> dict[int, int]:
    """A sharded text encoder's weight bytes per rank at each TP degree its inferred plan allows (the others are
    left out of the result), without the tensors `keep` leaves out."""
    import math

    from preshard.errors import PlanError
    from preshard.format.plan import resolve_plan
    from preshard.plans.registry import choose_plan
    from preshard.sources import open_source_headers

    src = as_loaded_names(open_source_headers(folder))  # the names the model's modules have, as converted
    cast = parse_cast(dtype)
    config = src.config or {}
    shapes = {n: s for n, s in src.shapes().items() if keep is None or not is_left_out(n, keep)}
    sizes = {}
    for tp in degrees:
        try:
            layouts = resolve_plan(choose_plan(None, config, tp), shapes, tp, cast=cast, config=config)
        except PlanError:
            continue
        sizes[tp] = sum(math.prod(x.local_shape(tp)) * x.dtype.itemsize for x in layouts.values())
    return sizes


def plan_pipeline_job(
    source: str | Path,
    *,
    devices: int,
    device_memory_gib: float | None = None,
    dtype: Any = None,
    components: Iterable[str] | dict[str, ComponentChoice] | None = None,
    keep_layers: Iterable[str] | dict[str, int | None] | None = None,
) -> PipelinePlan:
    """Every mesh of `devices` ranks for a local pipeline folder, with each component's bytes per rank.

    Args:
        source: a local pipeline folder (`model_index.json` or `modular_model_index.json`).
        devices: ranks in the job: every TP degree of the sharded components that divides it, every CP split.
        device_memory_gib: memory of one device, to say which meshes fit and recommend one.
        dtype: as for a conversion (the whole components are counted in it too: `load_pipeline(dtype=)`).
        components: `NAME:tp=N|whole|skip` choices, as for the conversion.
        keep_layers: `NAME:K|all`, as for the conversion (default: what the pipeline documents it reads).

    Returns:
        A `PipelinePlan`; the recommended mesh is the smallest TP degree whose total leaves HEADROOM of the device
        free on a mesh of every device, Ulysses as wide as the sharded components' plans allow.

    Raises:
        SourceError: not a pipeline folder. UsageError: bad arguments or choices. PlanError: as for a conversion.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UsageError(f"--devices must be a whole number >= 1, got {devices!r}")
    folder = Path(source)
    index = read_pipeline_index(folder) if folder.is_dir() else None
    if index is None:
        raise SourceError(f"{source} is not a local pipeline folder (no model_index.json or modular_model_index.json)")
    choices = dict(components) if isinstance(components, dict) else parse_component_choices(components or [])
    planned = plan_pipeline(folder, index, resolve_mesh(None, 1, None, None, None, None), choices)
    cast = parse_cast(dtype)
    itemsize = None if cast is None else cast.itemsize
    memory = int(device_memory_gib * GIB) if device_memory_gib is not None else None
    keeps = layers_to_keep(index, planned, keep_layers)
    whole = {
        p.record.name: _stored_bytes(p.folder, itemsize, keeps.get(p.record.name))
        for p in planned
        if p.record.treatment == "whole" and p.folder is not None
    }
    sharded = [p for p in planned if p.record.treatment == "sharded"]
    encoders = [p for p in sharded if p.folder is not None and is_text_encoder(p.record.library, p.folder)]
    per_mesh: dict[tuple[int, int, int], dict[str, int]] = {}
    for p in sharded:
        if p in encoders:
            continue
        report = plan_meshes(folder, devices=devices, plan=None, dtype=dtype, subfolder=p.record.name)
        for m in report.meshes:
            chosen = choices.get(p.record.name)
            if m.world_size == devices and (chosen is None or chosen.tp is None or chosen.tp == m.tp):
                per_mesh.setdefault((m.tp, m.ring, m.ulysses), {})[p.record.name] = m.weight_bytes_per_rank
    for p in encoders:
        assert p.folder is not None
        chosen = choices.get(p.record.name)
        sizes = _text_encoder_per_rank(p.folder, {tp for tp, _, _ in per_mesh}, dtype, keeps.get(p.record.name))
        for (tp, _ring, _ulysses), by_component in per_mesh.items():
            if tp in sizes and (chosen is None or chosen.tp is None or chosen.tp == tp):
                by_component[p.record.name] = sizes[tp]
    meshes = []
    for (tp, ring, ulysses), by_component in sorted(per_mesh.items()):
        if len(by_component) != len(sharded):
            continue  # a TP degree one sharded component does not allow
        parts = {**by_component, **whole}
        total = sum(parts.values())
        meshes.append(
            PipelineMesh(tp, ring, ulysses, devices, parts, total, None if memory is None else total <= memory)
        )
    plan = PipelinePlan(
        str(source), index.pipeline_class, devices, memory, {p.record.name: p.record.treatment for p in planned}
    )
    plan.meshes = meshes
    _recommend(plan)
    return plan


def _recommend(plan: PipelinePlan) -> None:
    if plan.device_memory is None:
        plan.reason = "pass --device-memory GIB to see which meshes fit and which one is recommended"
        return
    roomy = [m for m in plan.meshes if m.total <= (1 - HEADROOM) * plan.device_memory]
    pool = roomy or [m for m in plan.meshes if m.fits]
    if not pool:
        plan.reason = (
            "no mesh fits: the components per rank exceed device memory at every TP degree; use more devices, "
            "bf16, or leave the largest whole component out of the job (--component NAME:skip)"
        )
        return
    tp = min(m.tp for m in pool)
    best = max((m for m in pool if m.tp == tp), key=lambda m: (m.ulysses, -m.ring))
    plan.meshes = [replace_recommended(m) if m is best else m for m in plan.meshes]
    plan.recommended = replace_recommended(best)
    plan.reason = (
        f"the smallest TP degree whose components leave at least {HEADROOM:.0%} of device memory free"
        if roomy
        else f"the smallest TP degree that fits, leaving under {HEADROOM:.0%} of device memory free"
    )
    if best.ring * best.ulysses > 1:
        plan.reason += "; the other devices run CP, Ulysses as wide as it goes"


def replace_recommended(mesh: PipelineMesh) -> PipelineMesh:
    return replace(mesh, recommended=True)


def pipeline_plan_json(plan: PipelinePlan) -> dict[str, Any]:
    """What `preshard plan PIPELINE --json` prints."""
    return {
        "source": plan.source,
        "pipeline": plan.pipeline_class,
        "devices": plan.devices,
        "device_memory_bytes": plan.device_memory,
        "components": plan.treatments,
        "meshes": [m.to_dict() for m in plan.meshes],
        "recommended": None if plan.recommended is None else plan.recommended.to_dict(),
        "reason": plan.reason,
    }


def pipeline_plan_table(plan: PipelinePlan) -> str:
    """The per-rank table: one row per mesh, one column per component, the total."""
    names = [n for n in plan.treatments if any(m.per_component.get(n) for m in plan.meshes)]  # those holding weights
    head = ["mesh", *names, "total/rank", "fits"]
    rows = [head]
    for m in plan.meshes:
        mesh = f"tp{m.tp} ring{m.ring} uly{m.ulysses}" + (" *" if m.recommended else "")
        fits = "-" if m.fits is None else ("yes" if m.fits else "no")
        rows.append([mesh, *(human_bytes(m.per_component.get(n, 0)) for n in names), human_bytes(m.total), fits])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"pipeline {plan.pipeline_class} at {plan.source}, {plan.devices} devices"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    kinds = ", ".join(f"{n}: {t}" for n, t in plan.treatments.items())
    lines.append(f"components: {kinds}")
    if plan.recommended is not None:
        m = plan.recommended
        lines.append(
            f"recommended: tp={m.tp} ring={m.ring} ulysses={m.ulysses} ({human_bytes(m.total)} per rank): {plan.reason}"
        )
    else:
        lines.append(plan.reason)
    return "\n".join(lines)
