"""Tensor-parallel forward for styles that rewire their Linear (rowwise and its variants).

A row-parallel layer's partial products are summed with an all-reduce over the TP group and the bias is
added once, after the reduce. That ordering cannot be expressed with forward hooks around
`nn.Linear.forward` (its bias is already added on every rank), so the module's class is switched to a
subclass whose forward is the style's own `parallel_forward`: names, parameters and
`isinstance(m, nn.Linear)` are unchanged. Styles whose local output is already this rank's slice of the
features (colwise, packed colwise) need nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from preshard.format.styles import Style
from preshard.runtime import collectives


class ParallelLinear(nn.Linear):
    """nn.Linear whose forward is its sharding style's, with the TP group's all-reduce."""

    preshard_style: Style
    preshard_forward: Callable[..., torch.Tensor]
    tp_group: ProcessGroup | None
    tp_rank: int
    tp_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.preshard_forward(self, x, self.tp_rank, self.tp_size, self._all_reduce)

    def _all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce_sum(out, self.tp_group) if self.tp_group is not None else out


def parallelize_linear(
    module: nn.Linear, style: Style, group: ProcessGroup | None, tp_rank: int, tp: int
) -> str | None:
    """Switch `module` to `style`'s forward; returns the description for the model's report (None: unchanged)."""
    forward = style.parallel_forward()
    if forward is None:
        return None
    module.__class__ = ParallelLinear
    module.preshard_style, module.preshard_forward = style, forward
    module.tp_group, module.tp_rank, module.tp_size = group, tp_rank, tp
    what = "slice replicated input, " if style.name == "replicated_input_rowwise" else ""
    return f"tp: {style.name}: {what}all-reduce(sum) over tp group, bias after reduce"


def unparallelize_linear(module: nn.Linear) -> None:
    """Back to a plain nn.Linear (for negative controls: the output must then be wrong)."""
    module.__class__ = nn.Linear
