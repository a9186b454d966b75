"""The forwards the runtime gives modules rewired by a style (`Style.parallel_forward` hands them out).

Apart from `styles` because they compute with torch, which the styles' other facts (dims, blocks, chunks) do
not need: the converter and the tools that only move bytes never import this module, hence never torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _row_parallel(linear: torch.nn.Linear, x: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
    out = all_reduce(F.linear(x, linear.weight))
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
