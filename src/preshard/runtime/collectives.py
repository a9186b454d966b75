"""Every collective the runtime issues goes through this module.

TP hooks and CP attention both call these functions instead of `torch.distributed` directly, so one
switch (`NeuronRuleChecker`) can validate and record all of them. The checker enforces, on any backend
(gloo in tests), the rules that Neuron and XLA impose: all-to-all only over contiguous ascending ranks,
all-gather only with equal sizes on every rank. Without it a strided group or a ragged all-gather would
only fail (or hang) on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "CollectiveCall",
    "CollectiveRuleViolation",
    "NeuronRuleChecker",
    "all_gather_cat",
    "all_reduce_sum",
    "all_to_all_equal",
    "group_ranks",
    "PendingRingPass",
    "ring_pass",
    "ring_pass_async",
]

_MAX_SHAPE_DIMS = 15
# torch >= 2.10 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveRuleViolation(RuntimeError):
    """A collective that Neuron/XLA would reject (or hang on), caught before it is issued."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as issued: what the checker records."""

    op: str
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class NeuronRuleChecker:
    """While active (as a context manager), validate and record every collective of this module."""

    calls: list[CollectiveCall] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    _previous: NeuronRuleChecker | None = field(default=None, repr=False)

    def __enter__(self) -> NeuronRuleChecker:
        global _ACTIVE
        self._previous = _ACTIVE
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self._previous
        self._previous = None

    def ops(self) -> list[str]:
        """Op names in call order, for short assertions."""
        return [c.op for c in self.calls]

    def _record(self, op: str, ranks: list[int], tensor: torch.Tensor) -> None:
        self.calls.append(CollectiveCall(op, tuple(ranks), tuple(tensor.shape), tensor.dtype))


_ACTIVE: NeuronRuleChecker | None = None


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """Global ranks of `group` in group-rank order (the default group when None)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _violation(rule: str, op: str, ranks: list[int], detail: str) -> CollectiveRuleViolation:
    message = f"{op} over ranks {ranks} breaks the Neuron rule '{rule}': {detail}"
    if _ACTIVE is not None:
        _ACTIVE.violations.append(message)
    return CollectiveRuleViolation(message)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over the group, in place; returns it."""
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _ACTIVE._record("all_reduce_sum", ranks, tensor)
    if len(ranks) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_cat(tensor: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """Gather equal-sized tensors from every rank and concatenate them along `dim` in group-rank order."""
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _check_equal_shapes(tensor, group, ranks, "all_gather_cat")
        _ACTIVE._record("all_gather_cat", ranks, tensor)
    if len(ranks) == 1:
        return tensor
    dim = dim % tensor.dim()
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((len(ranks) * moved.shape[0], *moved.shape[1:]))
    _ALL_GATHER_SINGLE(out, moved, group=group)
    return out.movedim(0, dim)


def all_to_all_equal(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-to-all with equal splits along dim 0: chunk j goes to group rank j, chunk i comes from i."""
    ranks = group_ranks(group)
    if tensor.shape[0] % len(ranks):
        raise ValueError(f"all_to_all_equal: dim 0 ({tensor.shape[0]}) not divisible by group size {len(ranks)}")
    if _ACTIVE is not None:
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise _violation(
                "all-to-all replica groups must be contiguous ascending ranks",
                "all_to_all_equal",
                ranks,
                f"shape {tuple(tensor.shape)}",
            )
        _ACTIVE._record("all_to_all_equal", ranks, tensor)
    if len(ranks) == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


class PendingRingPass:
    """A ring pass in flight: `wait()` returns the tensor received from the previous rank."""

    def __init__(self, out: torch.Tensor, requests: list, keep_alive: torch.Tensor) -> None:
        self._out = out
        self._requests = requests
        self._keep_alive = keep_alive  # the send buffer must outlive the send

    def wait(self) -> torch.Tensor:
        for req in self._requests:
            req.wait()
        self._requests = []
        return self._out


def ring_pass_async(tensor: torch.Tensor, group: ProcessGroup | None) -> PendingRingPass:
    """Start sending `tensor` to the next group rank (wrapping) and receiving the previous rank's.

    Async so ring attention can compute on the current block while the next one is in flight.
    """
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _ACTIVE._record("ring_pass", ranks, tensor)
    n = len(ranks)
    if n == 1:
        return PendingRingPass(tensor, [], tensor)
    me = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (me + 1) % n)
    recv_from = dist.get_global_rank(group, (me - 1) % n)
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, send_to, group=group),
        dist.P2POp(dist.irecv, out, recv_from, group=group),
    ]
    return PendingRingPass(out, dist.batch_isend_irecv(ops), tensor)


def ring_pass(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Send `tensor` to the next group rank (wrapping) and return the previous group rank's tensor."""
    return ring_pass_async(tensor, group).wait()


def _check_equal_shapes(tensor: torch.Tensor, group: ProcessGroup | None, ranks: list[int], op: str) -> None:
    """Exchange (shape, itemsize) with a fixed-size all-gather so every rank sees a ragged call and raises."""
    if len(ranks) == 1:
        return
    if tensor.dim() > _MAX_SHAPE_DIMS:
        raise ValueError(f"{op}: tensors with more than {_MAX_SHAPE_DIMS} dims are not supported")
    desc = [tensor.dim(), tensor.element_size(), *tensor.shape]
    desc += [-1] * (_MAX_SHAPE_DIMS + 2 - len(desc))
    mine = torch.tensor(desc, dtype=torch.int64, device=tensor.device)
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    seen = [tuple(t.tolist()) for t in everyone]
    if any(s != seen[0] for s in seen):
        shapes = [tuple(v for v in s[2 : 2 + s[0]]) for s in seen]
        raise _violation(
            "all-gather needs equal sizes on every rank",
            op,
            ranks,
            f"shapes by rank {shapes}, itemsizes {[s[1] for s in seen]}",
        )
