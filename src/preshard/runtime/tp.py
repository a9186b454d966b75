"""Tensor-parallel forward for input-sharded Linear layers (rowwise, replicated_input_rowwise).

A rowwise layer's partial products are summed with an all-reduce over the TP group and the bias is
added once, after the reduce. That ordering cannot be expressed with forward hooks around
`nn.Linear.forward` (its bias is already added on every rank), so the module's class is switched to
a subclass with the parallel forward: names, parameters and `isinstance(m, nn.Linear)` are unchanged.
Colwise and packed_colwise layers need nothing: their local output is the rank's slice of features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from preshard.runtime import collectives


class RowParallelLinear(nn.Linear):
    """nn.Linear whose weight holds this rank's input columns; output is all-reduced over the TP group."""

    tp_group: ProcessGroup | None
    tp_rank: int
    tp_size: int
    slice_input: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slice_input:
            width = self.in_features
            x = x[..., self.tp_rank * width : (self.tp_rank + 1) * width]
        out = F.linear(x, self.weight)
        if self.tp_group is not None:
            out = collectives.all_reduce_sum(out, self.tp_group)
        if self.bias is not None:
            out = out + self.bias
        return out


def make_row_parallel(
    module: nn.Linear, group: ProcessGroup | None, tp_rank: int, tp_size: int, slice_input: bool
) -> str:
    """Switch `module` to the row-parallel forward; returns the description for the model's report."""
    module.__class__ = RowParallelLinear
    module.tp_group, module.tp_rank, module.tp_size, module.slice_input = group, tp_rank, tp_size, slice_input
    what = "slice replicated input, " if slice_input else ""
    return f"tp: {what}all-reduce(sum) over tp group, bias after reduce"


def remove_row_parallel(module: nn.Linear) -> None:
    """Back to a plain nn.Linear (for negative controls: the output must then be wrong)."""
    module.__class__ = nn.Linear
