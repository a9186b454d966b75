"""Quantizing at conversion (`convert-checkpoint --quantize fp8|int8`): a source whose sharded Linear weights are
stored quantized, each with a per-output-channel float32 scale `<module>.weight_scale` of shape [out].

Which weights: the plan's sharded Linear weights (colwise, rowwise, packed; 2-D, floating), not those of modules
the model class keeps in float32 (`_keep_in_fp32_modules`, matched on whole dotted components). Everything else
(norms, embeddings, biases, what the plan keeps whole, and the tp_rms_norm weights) is kept as it is. The layout
written is one `format/quant.py` recognises ("channel" granularity), so loading needs nothing new.

The arithmetic is `format.quant.quantize_rows`: each row by its own scale, so the weight is quantized where a band
is cut (`slicing.cast_band`, the same place as a `--dtype` cast), band after band: memory stays the band's. The
scale is a tensor no source file holds: `QuantizedRows` serves its rows from the scales computed when the weight's
rows went through (`finish_band`), or, where they did not (a resumed run that kept the weight), by reading the
weight's rows again. Either way it is a function of the weight's bytes alone, so the weight's source proof is the
scale's too (`take_proofs`, `prove`): a resume keeps a scale only where the source still holds its weight's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from preshard.errors import PlanError, SourceError
from preshard.format.dtypes import FLOAT32, DType, as_dtype
from preshard.format.layout import TensorLayout
from preshard.format.manifest import Source
from preshard.format.plan import Plan, resolve_plan
from preshard.format.quant import QUANTIZE_SCALE, check_finite_scale, recognise, row_scales
from preshard.sources import ConversionSource, SourceRows
from preshard.sources.wrapped import Wrapped, WrappedRows

QUANTIZE_VERSION = 1  # part of a conversion's identity: another arithmetic is another conversion


def keep_fp32_modules(config: Mapping[str, Any] | None) -> list[str]:
    """The model class's `_keep_in_fp32_modules` (empty where the class cannot be imported: diffusers absent)."""
    name = (config or {}).get("_class_name")
    if not isinstance(name, str):
        return []
    try:
        from preshard.plans.model_class import import_model_class

        return list(getattr(import_model_class(name), "_keep_in_fp32_modules", None) or [])
    except Exception:  # noqa: BLE001 - no diffusers or an unknown class: nothing is known to be kept in float32
        return []


def _kept_fp32(module: str, keep: list[str]) -> bool:
    parts = module.split(".")
    return any(k in parts or module.startswith(f"{k}.") or module == k for k in keep)


def weights_to_quantize(
    plan: Plan, shapes: Mapping[str, tuple[tuple[int, ...], DType]], config: Mapping[str, Any] | None
) -> list[str]:
    """The plan's sharded Linear weights that `--quantize` stores quantized, in the source's order.

    Raises:
        PlanError: the source is already quantized, or holds a tensor named like the scale a weight would get.
    """
    found = recognise(shapes, config)
    if found:
        first = next(iter(found.values()))
        raise PlanError(
            f"the source is already quantized ({first.weight} is {first.format}); --quantize converts a "
            "bf16/fp16/fp32 checkpoint: drop --quantize to shard it as it is"
        )
    layouts = resolve_plan(plan, shapes, 1, config=config, check_divisible=False)
    keep = keep_fp32_modules(config)
    chosen = []
    for name, layout in layouts.items():
        module, _, leaf = name.rpartition(".")
        dtype = as_dtype(shapes[name][1])
        if (
            leaf == "weight"
            and len(layout.shape) == 2
            and layout.style.module_kind == "linear"
            and layout.sharded
            and dtype.is_floating_point
            and dtype.itemsize > 1
            and not _kept_fp32(module, keep)
        ):
            if f"{module}.{QUANTIZE_SCALE}" in shapes:
                raise PlanError(f"the source already holds {module}.{QUANTIZE_SCALE}; --quantize would write it")
            chosen.append(name)
    return chosen


def scale_name(weight: str) -> str:
    return f"{weight.rpartition('.')[0]}.{QUANTIZE_SCALE}"


class QuantizedRows(WrappedRows):
    """A source's rows, with the rows of the scales the quantized weights get (the weights' rows are quantized
    where bands are cut; the base reader reads and hashes the raw bytes)."""

    def __init__(self, base: SourceRows, weights: dict[str, str], fmt: str, shapes: Mapping[str, Any]) -> None:
        self.base, self.fmt, self.shapes = base, fmt, shapes
        self.weight_of = {scale_name(w): w for w in weights}
        self.quantized = set(weights)
        self.scales: dict[str, np.ndarray] = {}  # weight -> float32 scales of the rows seen (NaN: not yet)
        self.rereads = 0  # rows read a second time to compute a scale (counted for the tests)

    def _scales_of(self, weight: str, start: int, rows: np.ndarray) -> None:
        import torch

        shape, dtype = self.shapes[weight]
        count = rows.size // (math.prod(shape[1:]) * dtype.itemsize) if shape[1] else 0
        data = rows if rows.ctypes.data % dtype.itemsize == 0 else rows.copy()
        tensor = torch.from_numpy(data[: count * shape[1] * dtype.itemsize]).view(dtype.torch).view(count, shape[1])
        seen = self.scales.setdefault(weight, np.full(shape[0], np.nan, dtype=np.float32))
        scales = row_scales(tensor, self.fmt).numpy()
        bad = np.flatnonzero(~np.isfinite(scales))  # a NaN or Inf in the row: its scale would be one too
        if bad.size:
            raise SourceError(
                f"row {start + int(bad[0])} of {weight} holds NaN or Inf; --quantize cannot scale it (nothing is "
                "committed): fix the source's weights or drop --quantize"
            )
        seen[start : start + count] = scales

    def _serve(self, scale: str, start: int, count: int, out: np.ndarray) -> np.ndarray:
        weight = self.weight_of[scale]
        seen = self.scales.get(weight)
        if seen is None or np.isnan(seen[start : start + count]).any():
            shape, dtype = self.shapes[weight]
            rows = np.empty(count * shape[1] * dtype.itemsize, dtype=np.uint8)
            self.base.read_rows(weight, start, count, rows)
            self.rereads += count
            self._scales_of(weight, start, rows)
            seen = self.scales[weight]
        view = out[: count * 4]
        view.view(np.float32)[:] = seen[start : start + count]
        return view

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None:
        if name in self.weight_of:
            self._serve(name, start, count, out)
            return
        self.base.read_rows(name, start, count, out)

    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> Any:
        if name in self.weight_of:
            return ("scale", name, start, count, buffer)
        return ("rows", name, start, count, self.base.start_band(name, start, count, buffer))

    def finish_band(self, band: Any) -> np.ndarray:
        kind, name, start, count, inner = band
        if kind == "scale":
            return self._serve(name, start, count, inner)
        view = self.base.finish_band(inner)
        if name in self.quantized and count:
            self._scales_of(name, start, view)
        return view

    def file_of(self, name: str) -> str:
        return self.base.file_of(self.weight_of.get(name, name))

    def take_proofs(self) -> dict[str, str]:
        proofs = self.base.take_proofs()
        for weight in self.quantized & set(proofs):
            proofs[scale_name(weight)] = proofs[weight]
        return proofs

    def prove(self, kept: list[tuple[str, str | None]], check_stop: Any = None) -> int:
        """As the base's, a scale proved by its weight's proof (the weight comes first in the read order)."""
        real = [(n, p) for n, p in kept if n not in self.weight_of]
        proved = {n for n, _ in real[: self.base.prove(real, check_stop)]}
        recorded = dict(kept)
        for index, (name, proof) in enumerate(kept):
            weight = self.weight_of.get(name)
            if weight is None and name not in proved:
                return index
            if weight is not None and (weight not in proved or proof is None or recorded[weight] != proof):
                return index
        return len(kept)


def _as_values(data: np.ndarray, count: int, shape: tuple[int, ...], dtype: DType) -> Any:
    """The values of `count` rows (a 0-dim tensor: its one value) held in the flat uint8 `data`, as torch's."""
    import torch

    nbytes = (count * math.prod(shape[1:]) if shape else 1) * dtype.itemsize
    raw = data[:nbytes]
    if raw.ctypes.data % dtype.itemsize:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype.torch)


class ScaleCheckedRows(WrappedRows):
    """A source's rows, each weight scale's values checked finite as they are read (a pre-quantized source)."""

    def __init__(self, base: SourceRows, scales: set[str], shapes: Mapping[str, tuple[tuple[int, ...], DType]]):
        self.base, self.checked, self.shapes = base, scales, shapes

    def _check(self, name: str, count: int, data: np.ndarray) -> None:
        shape, dtype = self.shapes[name]
        fix = "nothing is committed: fix the source's scales"
        check_finite_scale(name, _as_values(data, count, shape, dtype), SourceError, fix)

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None:
        self.base.read_rows(name, start, count, out)
        if name in self.checked:
            self._check(name, count, out)

    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> Any:
        return (name, count, self.base.start_band(name, start, count, buffer))

    def finish_band(self, band: Any) -> np.ndarray:
        name, count, inner = band
        view = self.base.finish_band(inner)
        if name in self.checked:
            self._check(name, count, view)
        return view


class ScaleCheckedSource(Wrapped):
    """A conversion source whose weight scales are checked finite as they are read; all else is the base's."""

    def __init__(self, base: ConversionSource, scales: set[str]) -> None:
        self.base, self.scales = base, scales

    def open_reader(self) -> ScaleCheckedRows:
        shapes = {name: (shape, as_dtype(dtype)) for name, (shape, dtype) in self.base.shapes().items()}
        return ScaleCheckedRows(self.base.open_reader(), self.scales, shapes)


def with_scale_checks(source: ConversionSource) -> ConversionSource:
    """`source`, its weight scales (if it is quantized) checked finite as they are read: a NaN/Inf scale is
    refused naming it (`SourceError`) before the conversion commits."""
    scales = {spec.scale for spec in recognise(source.shapes(), source.config).values() if spec.scale is not None}
    return ScaleCheckedSource(source, scales) if scales else source


class QuantizedSource(Wrapped):
    """A conversion source whose chosen weights are stored quantized, each followed by its scale: the tensors the
    checkpoint holds (`shapes`, `read_order`); the files, hashes and provenance are the base's, and the identity
    (what a resume must match) adds the format."""

    def __init__(self, base: ConversionSource, weights: list[str], fmt: str) -> None:
        self.base, self.weights, self.fmt = base, weights, fmt
        self.config: dict[str, Any] | None = base.config
        self.base_shapes = base.shapes()

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        out: dict[str, tuple[tuple[int, ...], DType]] = {}
        chosen = set(self.weights)
        for name, (shape, dtype) in self.base_shapes.items():
            if name in chosen:
                out[name] = (shape, as_dtype(self.fmt))
                out[scale_name(name)] = ((shape[0],), FLOAT32)
            else:
                out[name] = (shape, dtype)
        return out

    def read_order(self) -> list[str]:
        chosen = set(self.weights)
        order = []
        for name in self.base.read_order():
            order.append(name)
            if name in chosen:
                order.append(scale_name(name))  # right after its weight: its scales are computed by then
        return order

    def layouts(self, layouts: dict[str, TensorLayout]) -> dict[str, TensorLayout]:
        """The resolved layouts of `shapes()`, each quantized weight read from its floating source rows and each
        scale kept float32 (a `--dtype` cast does not touch them)."""
        out = dict(layouts)
        for name in self.weights:
            out[name] = replace(layouts[name], source_dtype=as_dtype(self.base_shapes[name][1]))
            scale = scale_name(name)
            out[scale] = replace(layouts[scale], dtype=FLOAT32, source_dtype=FLOAT32)
        return out

    def input_paths(self) -> list[Path]:
        return self.base.input_paths()

    def config_bytes(self) -> bytes | None:
        return self.base.config_bytes()

    def identity(self) -> str:
        return f"{self.base.identity()}+quantize:{self.fmt}:v{QUANTIZE_VERSION}"

    def check_unchanged(self, identity: str) -> None:
        self.base.check_unchanged(identity.rpartition("+quantize:")[0])

    def open_reader(self) -> QuantizedRows:
        weights = {w: scale_name(w) for w in self.weights}
        return QuantizedRows(self.base.open_reader(), weights, self.fmt, self.base_shapes)

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        return self.base.source_record(file_hashes)


def with_quantize(source: ConversionSource, plan: Plan, fmt: str) -> QuantizedSource:
    """`source` with the plan's sharded Linear weights quantized to `fmt` (a stored dtype name).

    Raises:
        PlanError: as `weights_to_quantize`.
    """
    return QuantizedSource(source, weights_to_quantize(plan, source.shapes(), source.config), fmt)


__all__ = [
    "QuantizedRows", "QuantizedSource", "ScaleCheckedSource", "keep_fp32_modules", "weights_to_quantize",
    "with_quantize", "with_scale_checks",
]  # fmt: skip
