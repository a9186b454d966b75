"""The forwards the runtime gives modules rewired by a style (`Style.parallel_forward` hands them out).

Apart from `styles` because they compute with torch, which the styles' other facts (dims, blocks, chunks) do
not need: the converter and the tools that only move bytes never import this module, hence never torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def dequantized_weight(linear: Any) -> torch.Tensor:
    """The weight a Linear computes with: its own, or a quantized one (`format/quant.py`) dequantized to the
    compute dtype with its scale, as `runtime/quant.py` set up (the scale applies to this rank's rows/columns).

    Weight-only: the activation is never quantized, so the layer computes the dequantized model's function.
    """
    weight: torch.Tensor = linear.weight
    dtype: torch.dtype | None = getattr(linear, "preshard_compute_dtype", None)
    if dtype is None:
        return weight
    stored: torch.dtype | None = getattr(linear, "preshard_weight_format", None)
    if stored is not None:  # a float8 weight held as its bytes (runtime/quant.py says why)
        weight = weight.view(stored)
    scale_name: str | None = linear.preshard_scale_name
    if scale_name is None:
        return weight.to(dtype)
    scale: torch.Tensor = getattr(linear, scale_name).to(dtype)
    block: tuple[int, int] | None = linear.preshard_block
    if block is None:  # per tensor ([] or [1]) or per output channel ([out] or [out, 1])
        return weight.to(dtype) * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    rows, cols = weight.shape
    scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.to(dtype) * scale


TILE_BYTES = 1 << 21  # a quantized weight is dequantized this many bytes of rows at a time (stays in cache)


def _tile_rows(rows: int, cols: int, itemsize: int, block_rows: int, input_bytes: int) -> int:
    # at least the input's size: each tile's matmul reads the whole input again, which many small tiles would
    # make cost more than the decoding (a 2000-row input measured 1.85x dense with 2 MiB tiles)
    rows_per_tile = max(1, max(TILE_BYTES, input_bytes) // max(1, cols * itemsize))
    if block_rows > 1:  # whole scale blocks per tile
        rows_per_tile = max(block_rows, rows_per_tile // block_rows * block_rows)
    return min(rows, rows_per_tile)


def linear_forward(linear: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, dequantized_weight(linear), bias)` without a full-precision copy of the weight: a quantized
    weight is dequantized a tile of output rows at a time (`TILE_BYTES`, or the input's size if larger) into one
    buffer reused across the tiles of the call, each tile multiplied as it is made; a per-channel or per-tensor
    scale is applied to the output (one pass over the output rather than over the weight), a block grid to each
    tile. Nothing outlives the call.

    On CPU a float8 tile is decoded with integer ops rather than torch's float8 cast (6 ns per element here, against
    under 2): an e4m3fn byte shifted into a float16's bits is its value / 256 exactly (subnormals included; the
    factor goes into the scale), an e5m2 byte is the top byte of its float16. The two NaN patterns of e4m3fn decode
    as +-480, not NaN (a checkpoint whose weights hold NaN is not a model either way).

    Plain tensor ops over static shapes: `torch.compile(fullgraph=True)` traces it (the tile loop unrolls). A float
    weight is `F.linear` itself.
    """
    dtype: torch.dtype | None = getattr(linear, "preshard_compute_dtype", None)
    if dtype is None:
        return F.linear(x, linear.weight, bias)
    held: torch.Tensor = linear.weight
    stored: torch.dtype | None = getattr(linear, "preshard_weight_format", None)
    weight = held if stored is None else held.view(stored)  # a float8 weight is held as its bytes (runtime/quant.py)
    decode = held.device.type == "cpu" and stored in (torch.float8_e4m3fn, torch.float8_e5m2)
    factor = 256.0 if decode and stored == torch.float8_e4m3fn else 1.0
    scale_name: str | None = linear.preshard_scale_name
    scale = None if scale_name is None else getattr(linear, scale_name).to(dtype)
    block: tuple[int, int] | None = linear.preshard_block
    rows, cols = weight.shape
    x = x.to(dtype)
    step = _tile_rows(rows, cols, dtype.itemsize, block[0] if block is not None else 1, x.numel() * dtype.itemsize)
    buffer = torch.empty((step, cols), dtype=dtype, device=weight.device)
    bits = torch.empty((step, cols), dtype=torch.int16, device=weight.device) if decode else None
    pieces = []
    for start in range(0, rows, step):
        count = min(step, rows - start)
        tile = buffer[:count]
        if bits is not None:
            code = bits[:count]
            code.copy_(held[start : start + count])  # the int8 bytes, sign-extended
            if stored == torch.float8_e4m3fn:  # s.eeee.mmm -> s.0eeee.mmm0000000 (bit 14 cleared of the sign's copy)
                code.bitwise_left_shift_(7).bitwise_and_(~0x4000)
            else:  # e5m2: s.eeeee.mm is the top byte of a float16
                code.bitwise_left_shift_(8)
            tile.copy_(code.view(torch.float16))
        else:
            tile.copy_(weight[start : start + count])
        if block is not None and scale is not None:
            grid = scale[start // block[0] : -(-(start + count) // block[0])]
            grid = grid.repeat_interleave(block[0], 0)[:count].repeat_interleave(block[1], 1)[:, :cols]
            tile.mul_(grid * factor if factor != 1.0 else grid)
        pieces.append(F.linear(x, tile))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    if block is None and scale is not None:  # per tensor ([] or [1]) or per output channel ([out] or [out, 1])
        out = out * ((scale.reshape(-1) if scale.numel() > 1 else scale.reshape(())) * factor)
    elif scale is None and factor != 1.0:
        out = out * factor
    return out if bias is None else out + bias.to(out.dtype)


def _row_parallel(linear: torch.nn.Linear, x: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
    out = all_reduce(linear_forward(linear, x, None))
    return out if linear.bias is None else out + linear.bias


def rowwise_forward(linear, x, tp_rank, tp, all_reduce) -> torch.Tensor:
    """Input features split, the input already this rank's slice: all-reduce, then the bias once."""
    return _row_parallel(linear, x, all_reduce)


def replicated_input_rowwise_forward(linear, x, tp_rank, tp, all_reduce) -> torch.Tensor:
    """Rowwise on a replicated input: this rank's `in/T` features first."""
    width = linear.weight.shape[1]
    return _row_parallel(linear, x[..., tp_rank * width : (tp_rank + 1) * width], all_reduce)


def kv_head_select_forward(linear, x, tp_rank, tp, all_reduce) -> torch.Tensor:
    """A whole KV projection computing only this rank's KV head (`kv_head_select`): rows of head `r * heads // T`."""
    heads = linear.preshard_style.blocks
    width = linear.weight.shape[0] // heads
    start = (tp_rank * heads // tp) * width
    bias = None if linear.bias is None else linear.bias[start : start + width]
    return F.linear(x, linear.weight[start : start + width], bias)


def colwise_gather_forward(linear, x, tp_rank, tp, all_gather) -> torch.Tensor:
    """This rank's output features (its vocabulary rows, for an lm_head), all-gathered along the last dim."""
    return all_gather(linear_forward(linear, x, linear.bias))


def vocab_parallel_forward(embedding, ids: torch.Tensor, tp_rank: int, tp: int, all_reduce) -> torch.Tensor:
    """Look up the ids in this rank's vocabulary rows `[r*V/T, (r+1)*V/T)`, zeros for the others, summed over the
    TP group: every id's row comes from the one rank holding it."""
    rows = embedding.weight.shape[0]
    local = ids - tp_rank * rows
    outside = (local < 0) | (local >= rows)
    found = F.embedding(local.masked_fill(outside, 0), embedding.weight)
    return all_reduce(found.masked_fill(outside.unsqueeze(-1), 0))


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit floats (as torch's own rms_norm upcasts), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def tp_rms_norm_forward(norm, x: torch.Tensor, tp_rank: int, tp: int, all_reduce) -> torch.Tensor:
    """RMSNorm of rows split over the TP group: this rank holds `x`'s local features and the matching weight slice.

    Casts as the module it replaces: `torch.nn.RMSNorm` computes in the upcast dtype, multiplies by the weight
    there and casts back to the input dtype; diffusers' RMSNorm casts to a 16-bit weight's dtype before the
    weight, and back to the input dtype only without a weight.
    """
    up = x.to(_computation_dtype(x.dtype))
    square_sum = all_reduce(up.pow(2).sum(-1, keepdim=True))
    eps = norm.eps if norm.eps is not None else torch.finfo(up.dtype).eps
    inverse_rms = torch.rsqrt(square_sum / norm.preshard_full_width + eps)
    weight = norm.weight
    if isinstance(norm, torch.nn.RMSNorm):
        out = up * inverse_rms
        return (out if weight is None else out * weight).to(x.dtype)
    out = x * inverse_rms
    if weight is None:
        return out.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        out = out.to(weight.dtype)
    out = out * weight
    bias = getattr(norm, "bias", None)
    return out if bias is None else out + bias


def tp_layer_norm_forward(norm, x: torch.Tensor, tp_rank: int, tp: int, all_reduce) -> torch.Tensor:
    """LayerNorm of rows split over the TP group: this rank holds `x`'s local features and the matching weight and
    bias slices. The mean from the all-reduced sum, then the variance from the all-reduced sum of squared deviations
    (two passes, as exact as the unsharded norm's; one pass of sum and sum of squares would cancel for rows far
    from zero mean). Computed in float32 for 16-bit inputs and cast back, as torch's LayerNorm kernels and
    diffusers' FP32LayerNorm do.
    """
    up = x.to(_computation_dtype(x.dtype))
    width = norm.preshard_full_width
    centred = up - all_reduce(up.sum(-1, keepdim=True)) / width
    variance = all_reduce(centred.pow(2).sum(-1, keepdim=True)) / width
    out = centred * torch.rsqrt(variance + norm.eps)
    if norm.weight is not None:
        out = out * norm.weight.to(out.dtype)
    if norm.bias is not None:
        out = out + norm.bias.to(out.dtype)
    return out.to(x.dtype)


def split_experts_forward(
    experts,
    local_forward: Callable[..., torch.Tensor],
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tp_rank: int,
    tp: int,
    all_reduce,
) -> torch.Tensor:
    """The experts this rank holds (`split_experts`: `[r*E/T, (r+1)*E/T)`) on their own rows of `x` (sorted by expert,
    `tokens_per_expert` rows each, any padding after them), through the module's own forward (`local_forward`) with
    this rank's parameters; zeros in every other row, all-reduced: each row comes from the one rank holding its
    expert. The row counts are read on the host (one sync, as the module's own per-expert loop does).
    """
    local = tokens_per_expert.shape[0] // tp
    counts = tokens_per_expert.tolist()
    start = sum(counts[: tp_rank * local])
    stop = start + sum(counts[tp_rank * local : (tp_rank + 1) * local])
    mine = local_forward(x[start:stop], tokens_per_expert[tp_rank * local : (tp_rank + 1) * local])
    out = mine.new_zeros((x.shape[0], *mine.shape[1:]))
    out[start:stop] = mine
    return all_reduce(out)
