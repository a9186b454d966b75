"""Quantized Linear weights in a source checkpoint: which layout a checkpoint uses, and how each scale is sharded.

Recognised from the tensors alone (names, dtypes, shapes), so every reader of a converted checkpoint (the manifest
validator, the runtime, reshard) derives the same facts from what the manifest already records, and a quantized
checkpoint needs no manifest field of its own:

- a quantized weight is a Linear `weight` of dtype float8_e4m3fn, float8_e5m2 or int8;
- its weight scale sits beside it as `weight_scale` (ModelOpt, ComfyUI, LightX2V) or `scale_weight` (ComfyUI's
  older spelling), float32/bf16/fp16: per tensor (a scalar or `[1]`), per output channel (`[out]` or `[out, 1]`);
  or `weight_scale_inv` over a block grid `[ceil(out/b0), ceil(in/b1)]` (DeepSeek-style block FP8, block size in
  config.json's `quantization_config.weight_block_size`, else derived from the shapes);
- an activation scale `input_scale` / `scale_input` (one value) is kept whole and not applied: weight-only
  dequantization computes the weight's function at the compute dtype;
- ComfyUI's `scaled_fp8` marker (an empty tensor at the root) and any other tensor the plan does not name are
  replicated like any unplanned tensor.

A weight scale follows its weight: replicated where it covers the whole tensor or an axis the style keeps whole
(a per-output-channel scale of a row-split weight), sliced with the rows where it is per output channel of a
column-split weight (packed blocks included), and a block grid is split with its weight, one scale row (column)
per block, which is only exact when every shard is whole blocks: the grid's split sizes then enter the TP degree
check, whose message names the degrees that work. Layouts this module does not handle (NVFP4, bitsandbytes,
GPTQ/AWQ, SVDQuant) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preshard.errors import PlanError, UsageError
from preshard.format.dtypes import as_dtype
from preshard.format.styles import REPLICATE, Style

QUANTIZED_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
WEIGHT_SCALES = ("weight_scale", "scale_weight")
INPUT_SCALES = ("input_scale", "scale_input")
BLOCK_SCALE = "weight_scale_inv"
COMPANIONS = (*WEIGHT_SCALES, *INPUT_SCALES, BLOCK_SCALE)
SCALE_DTYPES = ("float32", "bfloat16", "float16")

# Tensor leaves that mark a layout preshard does not handle, and what to call it.
_REFUSED = {
    "weight_scale_2": "NVFP4 (two-level block scales)",
    "SCB": "bitsandbytes int8",
    "weight_format": "bitsandbytes",
    "absmax": "bitsandbytes 4-bit",
    "quant_map": "bitsandbytes 4-bit",
    "qweight": "GPTQ/AWQ",
    "qzeros": "GPTQ/AWQ",
    "g_idx": "GPTQ",
    "wscales": "SVDQuant (nunchaku)",
    "smooth_factor": "SVDQuant (nunchaku)",
    "proj_down": "SVDQuant (nunchaku)",
}


@dataclass(frozen=True)
class QuantSpec:
    """How one Linear weight is quantized.

    `granularity` is "none" (a plain cast, no scale), "tensor", "channel" or "block" (then `block` is
    `(rows, cols)`); `scale` names the weight-scale tensor (None for "none"), `input_scale` the activation scale
    kept beside it, if any.
    """

    weight: str
    format: str
    granularity: str
    scale: str | None = None
    scale_dtype: str | None = None
    block: tuple[int, int] | None = None
    input_scale: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format, "granularity": self.granularity, "scale": self.scale,
            "scale_dtype": self.scale_dtype, "block": list(self.block) if self.block else None,
            "input_scale": self.input_scale,
        }  # fmt: skip


Shapes = Mapping[str, tuple[tuple[int, ...], Any]]


def refuse_unsupported(tensors: Shapes) -> None:
    """Raises PlanError naming the first layout preshard does not handle (NVFP4, bitsandbytes, GPTQ, SVDQuant)."""
    for name in tensors:
        leaf = name.rpartition(".")[2]
        if leaf in _REFUSED:
            raise PlanError(
                f"{name} belongs to a {_REFUSED[leaf]} checkpoint, which preshard does not shard; convert the "
                "bf16/fp32 release (optionally with --quantize fp8) or an fp8/int8-scaled one"
            )


def _block_size(
    weight: tuple[int, ...], grid: tuple[int, ...], config: Mapping[str, Any] | None, name: str, derive: bool = False
):
    configured = ((config or {}).get("quantization_config") or {}).get("weight_block_size")
    if configured is not None:
        sizes_ok = isinstance(configured, list) and len(configured) == 2
        if not sizes_ok or not all(isinstance(b, int) and b > 0 for b in configured):
            raise PlanError(f"config.json's quantization_config.weight_block_size {configured!r} is not [rows, cols]")
        block = (configured[0], configured[1])
    elif derive:  # (a sealed manifest's own check: the conversion refused a block the shapes did not determine)
        block = (-(-weight[0] // grid[0]), -(-weight[1] // grid[1]))
    else:
        block = _derived_block(weight, grid, name)
    expected = (-(-weight[0] // block[0]), -(-weight[1] // block[1]))
    if tuple(grid) != expected:
        raise PlanError(
            f"{name} has shape {list(grid)}, not the [{expected[0]}, {expected[1]}] grid of "
            f"{block[0]}x{block[1]} blocks of its weight {list(weight)}; fix quantization_config.weight_block_size "
            "in config.json"
        )
    return block


def _derived_block(weight: tuple[int, ...], grid: tuple[int, ...], name: str) -> tuple[int, int]:
    """The block size the shapes alone determine: a grid of `g` blocks over `n` rows fits every block size `b`
    with `ceil(n / b) == g`, i.e. `n/g <= b < n/(g-1)`; one grid block (`g == 1`) is the whole dimension whatever `b`.
    Where more than one size fits, they dequantize differently: refused, never guessed."""
    block = []
    for n, g in zip(weight, grid, strict=True):
        if g < 1 or g > max(n, 1):
            block.append(-(-n // max(g, 1)))  # no size fits: the caller's grid check names the shape
            continue
        low = -(-n // g)
        high = low if g == 1 else -(-n // (g - 1)) - 1
        if high != low:
            raise PlanError(
                f"{name}: its {list(grid)} grid over the weight {list(weight)} fits blocks of {low} to {high} along "
                f"one dimension, and config.json states no quantization_config.weight_block_size; add it (e.g. "
                '"weight_block_size": [128, 128], as the release states it)'
            )
        block.append(max(low, 1))
    return block[0], block[1]


def check_finite_scale(name: str, values: Any, error: type[Exception], fix: str) -> None:
    """Raises `error` naming the weight scale `name` where its torch tensor `values` holds NaN or Inf: a
    dequantized weight would be NaN/Inf in every row the scale covers."""
    import torch

    if values.is_floating_point() and values.numel() and not bool(torch.isfinite(values).all()):
        raise error(f"the weight scale {name} holds NaN or Inf; {fix}")


def companion_style(
    name: str,
    shape: tuple[int, ...],
    style: Style,
    tensors: Shapes,
    config: Mapping[str, Any] | None,
    derive_blocks: bool = False,
) -> Style:
    """The style of a scale tensor `name` whose module the plan gives `style` (cut as `layout_role` says).

    Raises:
        PlanError: a scale with no quantized weight beside it, a scale whose shape fits no granularity, or a
            block grid the plan would cut inside a block.
    """
    module, _, leaf = name.rpartition(".")
    numel = math.prod(shape)
    if leaf in INPUT_SCALES:
        if numel != 1:
            raise PlanError(f"{name} has shape {list(shape)}; an input scale is one value (per tensor)")
        return REPLICATE
    weight = tensors.get(f"{module}.weight")
    if weight is None or len(weight[0]) != 2 or as_dtype(weight[1]).name not in QUANTIZED_DTYPES:
        got = "no weight" if weight is None else f"a {as_dtype(weight[1]).name} weight of shape {list(weight[0])}"
        raise PlanError(f"{name} is a weight scale, but its module has {got}, not an fp8/int8 Linear weight")
    out, inp = weight[0]
    if leaf in WEIGHT_SCALES and numel == 1:
        return REPLICATE
    if leaf in WEIGHT_SCALES and tuple(shape) in ((out,), (out, 1)):
        if style.shard_dim("weight") == 0:
            return style
        return REPLICATE
    if len(shape) == 2:  # a block grid (weight_scale_inv, or a block-shaped weight_scale)
        block = _block_size(weight[0], shape, config, name, derive_blocks)
        dim = style.shard_dim("weight")
        if dim is None:
            return REPLICATE
        if weight[0][dim] % block[dim]:
            raise PlanError(
                f"the plan splits {module}.weight along dim {dim} of {weight[0][dim]}, which is not whole "
                f"{block[dim]}-wide scale blocks; only tp=1 keeps its blocks whole: keep it whole in the plan"
            )
        if style.packed:
            sizes = style.block_sizes(weight[0][dim], f"{module}.weight dim {dim}")
            cut = [s for s in sizes if s % block[dim]]
            if cut:
                raise PlanError(
                    f"a packed block of {cut[0]} in {module}.weight is not whole {block[dim]}-wide scale blocks; "
                    "its scales cannot be split with it"
                )
            return type(style)(blocks=tuple(s // block[dim] for s in sizes))
        return style
    raise PlanError(
        f"{name} has shape {list(shape)}, which fits no scale granularity of its weight [{out}, {inp}] "
        f"(per tensor: [] or [1]; per output channel: [{out}] or [{out}, 1]; block grid: 2-D)"
    )


def layout_role(name: str, shape: tuple[int, ...]) -> str:
    """The Linear parameter a tensor is cut like: its own leaf, or for a scale, a bias (1-D) or weight (2-D)."""
    leaf = name.rpartition(".")[2]
    if leaf in COMPANIONS:
        return "bias" if len(shape) == 1 else "weight"
    return leaf


def is_companion(name: str) -> bool:
    """Whether `name` is a weight or input scale beside a Linear weight."""
    return name.rpartition(".")[2] in COMPANIONS


def recognise(
    tensors: Shapes, config: Mapping[str, Any] | None = None, derive_blocks: bool = False
) -> dict[str, QuantSpec]:
    """Every quantized Linear weight of a checkpoint, by weight name.

    A block size comes from config.json's `quantization_config.weight_block_size`, else from the shapes where they
    determine it (else refused); `derive_blocks` takes the smallest size that fits instead (a sealed manifest's
    check, which has no config.json: the conversion and the load refuse what the shapes leave open).

    Raises:
        PlanError: a layout preshard does not handle, or a scale of a dtype no scale is stored in.
    """
    refuse_unsupported(tensors)
    for name in tensors:  # a weight scale beside a weight that is not fp8/int8 would be silently left unapplied
        module, _, leaf = name.rpartition(".")
        if leaf in (*WEIGHT_SCALES, BLOCK_SCALE):
            weight = tensors.get(f"{module}.weight" if module else "weight")
            if weight is None or len(weight[0]) != 2 or as_dtype(weight[1]).name not in QUANTIZED_DTYPES:
                got = "no weight" if weight is None else f"a {as_dtype(weight[1]).name} weight"
                raise PlanError(
                    f"{name} is a weight scale, but its module has {got}, not an fp8/int8 Linear weight; preshard "
                    "does not apply a scale to a floating weight: remove the scale or store the weight quantized"
                )
    specs: dict[str, QuantSpec] = {}
    for name, (shape, dtype) in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or as_dtype(dtype).name not in QUANTIZED_DTYPES:
            continue
        prefix = f"{module}." if module else ""
        scales = [f"{prefix}{s}" for s in (*WEIGHT_SCALES, BLOCK_SCALE) if f"{prefix}{s}" in tensors]
        inputs = [f"{prefix}{s}" for s in INPUT_SCALES if f"{prefix}{s}" in tensors]
        if len(scales) > 1:
            raise PlanError(f"{module} has two weight scales ({', '.join(scales)}); a checkpoint keeps one")
        fmt = as_dtype(dtype).name
        if not scales:
            specs[name] = QuantSpec(name, fmt, "none", input_scale=inputs[0] if inputs else None)
            continue
        scale_shape, scale_dtype = tensors[scales[0]]
        scale_dtype_name = as_dtype(scale_dtype).name
        if scale_dtype_name not in SCALE_DTYPES:
            raise PlanError(f"{scales[0]} is {scale_dtype_name}; a weight scale is stored in {', '.join(SCALE_DTYPES)}")
        numel = math.prod(scale_shape)
        block = None
        if numel == 1:
            granularity = "tensor"
        elif tuple(scale_shape) in ((shape[0],), (shape[0], 1)) and not scales[0].endswith(BLOCK_SCALE):
            granularity = "channel"
        else:
            granularity = "block"
            if len(scale_shape) != 2:
                raise PlanError(f"{scales[0]} has shape {list(scale_shape)}, which fits no scale granularity")
            block = _block_size(tuple(shape), tuple(scale_shape), config, scales[0], derive_blocks)
        specs[name] = QuantSpec(
            name, fmt, granularity, scales[0], scale_dtype_name, block, inputs[0] if inputs else None
        )
    return specs


# ---------------------------------------------------------------------------------------------------------
# Quantizing at conversion (`convert-checkpoint --quantize fp8|int8`)

# --quantize value -> the stored dtype and the largest magnitude it holds.
QUANTIZE_FORMATS = {"fp8": ("float8_e4m3fn", 448.0), "int8": ("int8", 127.0)}
QUANTIZE_SCALE = "weight_scale"  # per output channel, [out] float32: a layout `recognise` reads back as "channel"


def parse_quantize(value: str | None) -> str | None:
    """The stored dtype name for a `--quantize` value (None for None).

    Raises:
        UsageError: a format preshard does not quantize to.
    """
    if value is None:
        return None
    found = QUANTIZE_FORMATS.get(value) or next((f for f in QUANTIZE_FORMATS.values() if f[0] == value), None)
    if found is None:
        raise UsageError(f"--quantize {value!r} is not a format preshard quantizes to; use one of: fp8, int8")
    return found[0]


def quantized_max(dtype_name: str) -> float:
    """The largest magnitude a quantized dtype (or `--quantize` value) stores: 448 for float8_e4m3fn, 127 for int8."""
    return QUANTIZE_FORMATS[_format_key(dtype_name)][1]


def _format_key(value: str) -> str:
    return next((key for key, (name, _) in QUANTIZE_FORMATS.items() if value in (key, name)), value)


def row_scales(rows: Any, dtype_name: str) -> Any:
    """The float32 scale of each row of a 2-D floating torch tensor: `amax(|row|) / max` (1 for an all-zero row)."""
    import torch

    limit = quantized_max(dtype_name)
    if not rows.shape[1]:
        return torch.ones(rows.shape[0])
    low, high = torch.aminmax(rows, dim=1)  # no |rows| copy: amax(|row|) = max(-min, max)
    amax = torch.maximum(low.neg(), high).to(torch.float32)
    return torch.where(amax == 0, torch.ones_like(amax), amax / limit)  # (NaN and Inf stay: the caller refuses)


def quantize_rows(rows: Any, dtype_name: str) -> tuple[Any, Any]:
    """(quantized rows, float32 scale per row) of a 2-D floating torch tensor: `scale = row_scales(rows)`,
    `q = row / scale` (in float32) rounded into the dtype, so `q * scale` approximates the row.

    Each row is computed from itself alone, in float32, so the result does not depend on how rows are grouped in
    bands or which rank reads them: every TP degree stores the same model.
    """
    import torch

    limit = quantized_max(dtype_name)
    dtype_name = QUANTIZE_FORMATS[_format_key(dtype_name)][0]
    work = rows.to(torch.float32, copy=True)
    scale = row_scales(work, dtype_name)  # (the same as of `rows`: a maximum is exact in any dtype)
    work.div_(scale[:, None]).clamp_(-limit, limit)
    if dtype_name == "int8":
        return work.round_().to(torch.int8), scale
    return work.to(getattr(torch, dtype_name)), scale
