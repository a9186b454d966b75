"""Every collective the runtime issues goes through this module.

TP hooks and CP attention both call these functions instead of `torch.distributed` directly, so one
switch (`NeuronRuleChecker`) can validate and record all of them. The checker enforces, on any backend
(gloo in tests), the rules that Neuron and XLA impose: all-to-all only over contiguous ascending ranks,
all-gather only with equal sizes on every rank. Without it a strided group or a ragged all-gather would
only fail (or hang) on the device.

On the xla backend (torch_xla, and torch-neuronx built on it) the collectives do not go through
`torch.distributed`: torch_xla's ProcessGroupXla ignores the group in all-to-all, gives a subgroup only its
own replica group, and turns batch_isend_irecv into one collective_permute per pair, issued in a
rank-dependent order. Instead each collective calls torch_xla's own primitive with the replica groups of
the whole mesh axis, identical on every rank: `xm.all_reduce(groups=)`, `xm.all_gather(groups=)`,
`xm.all_to_all(groups=)`, and for a ring pass one `xm.collective_permute` whose pairs cover every ring of
the axis in one global order. Those replica groups follow from the collective's own group and the world size
(`axis_partition`: on a mesh, the groups of an axis are translates of one another), so no state is kept between
calls. `check_backend_supports`, which the runtime calls once after building the mesh's groups, refuses in one
line a mesh the backend cannot run (PJRT CPU across processes, torch_xla seeing another world size, Neuron's
all-to-all over strided ranks, groups that are not such a partition); a collective over a group that is not one
of a mesh axis raises rather than guess. Untested on TPU/GPU/Neuron.

Elsewhere (gloo, nccl) every collective is one of torch's functional collectives (`torch.ops._c10d_functional`):
an op that returns a new tensor and a `wait_tensor` that completes it. torch.compile traces them into the graph
(no graph break), and eager mode runs the same ops, so both paths share one implementation. The ring pass is
an all-to-all whose only non-empty chunk goes to the next rank: the functional point-to-point ops exist in
recent torch, but inductor deadlocked on them here, and an all-to-all traces on every supported torch version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from preshard.errors import CollectiveRuleViolation, DeviceError

__all__ = [
    "CollectiveCall",
    "CollectiveRuleViolation",
    "NeuronRuleChecker",
    "all_gather_bytes",
    "all_gather_cat",
    "all_gather_equal",
    "all_reduce_sum",
    "all_to_all_equal",
    "axis_partition",
    "check_backend_supports",
    "group_ranks",
    "PendingRingPass",
    "ring_pass",
    "ring_pass_async",
]

_MAX_SHAPE_DIMS = 15


def _functional():
    """torch's functional collective ops (registered when torch.distributed's functional module is imported)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops and their fake kernels)

    return torch.ops._c10d_functional


def _group_name(group: ProcessGroup | None) -> str:
    from torch.distributed._functional_collectives import _resolve_group_name

    return _resolve_group_name(group if group is not None else dist.group.WORLD)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return _functional().wait_tensor(tensor)


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

# xla: group ranks (in group order) -> every group of that mesh axis, as torch_xla's replica groups.
# The mesh axis whose groups carry all-to-all (Ulysses): Neuron needs them contiguous and ascending.
_ALL_TO_ALL_AXIS = "ulysses"


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """Global ranks of `group` in group-rank order (the default group when None)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _violation(rule: str, op: str, ranks: list[int], detail: str) -> CollectiveRuleViolation:
    message = f"{op} over ranks {ranks} breaks the Neuron rule '{rule}': {detail}"
    if _ACTIVE is not None:
        _ACTIVE.violations.append(message)
    return CollectiveRuleViolation(message)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of `tensor` over the group (use the return value: `tensor` itself may or may not be updated)."""
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _ACTIVE._record("all_reduce_sum", ranks, tensor)
    if len(ranks) > 1:
        if _is_xla(tensor):
            xm = _xla_model()
            # The list form reduces in place.
            xm.all_reduce(xm.REDUCE_SUM, [tensor], groups=_replica_groups(ranks, "all_reduce_sum"), pin_layout=False)
        else:
            tensor = _wait(_functional().all_reduce(tensor, "sum", _group_name(group)))
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
    return _gather_dim0(moved, group, ranks, "all_gather_cat").movedim(0, dim)


def all_gather_equal(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Stack every group rank's equal-sized `tensor` along a new dim 0, in group-rank order (small exchanges:
    the input-consistency check, the gathers of a sharded model's state)."""
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _check_equal_shapes(tensor, group, ranks, "all_gather_equal")
        _ACTIVE._record("all_gather_equal", ranks, tensor)
    moved = tensor.contiguous().unsqueeze(0)
    if len(ranks) == 1:
        return moved
    if moved.dtype.is_floating_point and moved.dtype.itemsize == 1:  # float8: gloo has none; its bytes gather alike
        return _gather_dim0(moved.view(torch.int8), group, ranks, "all_gather_equal").view(moved.dtype)
    return _gather_dim0(moved, group, ranks, "all_gather_equal")


def _gather_dim0(moved: torch.Tensor, group: ProcessGroup | None, ranks: list[int], op: str) -> torch.Tensor:
    """Concatenate every group rank's `moved` along dim 0, in group-rank order."""
    if _is_xla(moved):
        # XLA concatenates in the order the replica group lists its members, which is group-rank order.
        groups = _replica_groups(ranks, op)
        return _xla_model().all_gather(moved, dim=0, groups=groups, pin_layout=False)
    return _wait(_functional().all_gather_into_tensor(moved, len(ranks), _group_name(group)))


def all_gather_bytes(data: bytes, size: int, device: torch.device, group: ProcessGroup | None = None) -> list[bytes]:
    """Every group rank's `data` (at most `size` bytes), in group-rank order.

    One fixed-size all-gather of a uint8 tensor on `device` (NCCL and XLA need device tensors, Neuron and XLA equal
    sizes), so it runs wherever the model's collectives run.
    """
    if len(data) > size:
        raise ValueError(f"all_gather_bytes: {len(data)} bytes do not fit in {size}")
    ranks = group_ranks(group)
    if len(ranks) == 1:
        return [bytes(data)]
    buffer = torch.zeros(8 + size, dtype=torch.uint8)
    buffer[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if data:
        buffer[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = all_gather_cat(buffer.to(device).unsqueeze(0), group, 0).cpu()
    out = []
    for row in gathered:
        raw = row.numpy().tobytes()
        length = min(int.from_bytes(raw[:8], "little"), size)
        out.append(raw[8 : 8 + length])
    return out


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
    if _is_xla(tensor):
        # torch_xla's all_to_all_single ignores the group (it splits over the whole world): call XLA directly.
        groups = _replica_groups(ranks, "all_to_all_equal")
        return _xla_model().all_to_all(tensor, 0, 0, len(ranks), groups=groups, pin_layout=False)
    splits = [tensor.shape[0] // len(ranks)] * len(ranks)
    return _wait(_functional().all_to_all_single(tensor, splits, splits, _group_name(group)))


class PendingRingPass:
    """A ring pass in flight: `wait()` returns the tensor received from the previous rank.

    The wait is a separate op (`wait_tensor`), so work issued between the pass and `wait()` overlaps it, in
    eager mode and in a compiled graph alike.
    """

    def __init__(self, out: torch.Tensor, pending: bool, shape: torch.Size | None = None) -> None:
        self._out = out
        self._pending = pending
        self._shape = shape

    def wait(self) -> torch.Tensor:
        if self._pending:
            self._out, self._pending = _wait(self._out), False
            if self._shape is not None:
                self._out = self._out.view(self._shape)
        return self._out


def ring_pass_async(tensor: torch.Tensor, group: ProcessGroup | None) -> PendingRingPass:
    """Start sending `tensor` to the next group rank (wrapping) and receiving the previous rank's.

    Async so ring attention can compute on the current block while the next one is in flight. Every rank
    sends the same shape.
    """
    ranks = group_ranks(group)
    if _ACTIVE is not None:
        _ACTIVE._record("ring_pass", ranks, tensor)
    n = len(ranks)
    if n == 1:
        return PendingRingPass(tensor, False)
    if _is_xla(tensor):
        # One collective_permute for every ring of the axis, pairs in one global order, the same on every
        # rank (torch_xla's batch_isend_irecv would issue a permute per pair, in a rank-dependent order).
        rings = _replica_groups(ranks, "ring_pass")
        pairs = [[ring[i], ring[(i + 1) % len(ring)]] for ring in rings for i in range(len(ring))]
        return PendingRingPass(_xla_model().collective_permute(tensor.contiguous(), pairs=pairs), False)
    me = ranks.index(dist.get_rank())
    flat = tensor.reshape(-1)
    send, recv = [0] * n, [0] * n
    send[(me + 1) % n] = recv[(me - 1) % n] = flat.numel()
    out = _functional().all_to_all_single(flat.contiguous(), recv, send, _group_name(group))
    return PendingRingPass(out, True, tensor.shape)


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
    if _is_xla(mine):
        everyone = list(_gather_dim0(mine.unsqueeze(0), group, ranks, op).cpu())
    else:
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


# ---------------------------------------------------------------- backends


def check_backend_supports(
    backend: str,
    axis_groups: Mapping[str, Sequence[Sequence[int]]],
    world_size: int,
    *,
    neuron: bool = False,
) -> None:
    """Call once per rank after building the mesh's groups: refuse, in one line, a mesh the backend cannot run.

    `axis_groups` maps each mesh axis ("tp", "ring", "ulysses", "cp") to every group of that axis, each in
    group-rank order (`MeshSpec.groups(axis)`). On xla every axis's groups must be what each collective will
    derive as torch_xla's replica groups (`axis_partition`), which it needs whole, identical on every rank.
    `neuron`: apply Neuron's rule that all-to-all groups are contiguous ascending ranks (the default axis order
    keeps to it).
    """
    partitions = {axis: [list(g) for g in groups] for axis, groups in axis_groups.items()}
    multi = {axis: groups for axis, groups in partitions.items() if any(len(g) > 1 for g in groups)}
    strided = [g for g in multi.get(_ALL_TO_ALL_AXIS, []) if g != list(range(g[0], g[0] + len(g)))]
    if neuron and strided:
        raise DeviceError(
            f"Neuron's all-to-all needs contiguous ascending rank groups but the {_ALL_TO_ALL_AXIS} groups "
            f"include {strided[0]}; load with the default order tp,ring,ulysses (ulysses last)"
        )
    if backend != "xla" or not multi:
        return
    import torch_xla.runtime as xr

    platform = xr.device_type() or "unset"
    if platform == "CPU":
        raise DeviceError(
            f"PJRT_DEVICE=CPU cannot run collectives between processes, and this mesh needs them over "
            f"{', '.join(multi)}; use device='cpu' (gloo) for multi-rank CPU runs, or XLA on TPU/GPU/Neuron"
        )
    if xr.world_size() != world_size:
        raise DeviceError(
            f"torch_xla sees {xr.world_size()} devices (xr.world_size()) but the job has {world_size} ranks; "
            "initialise the process group with init_method='xla://' (preshard does when it initialises it)"
        )
    for axis, groups in multi.items():
        members = sorted(r for g in groups for r in g)
        if members != list(range(world_size)) or len({len(g) for g in groups}) != 1:
            raise DeviceError(
                f"XLA replica groups must split ranks 0..{world_size - 1} into equal groups, but the {axis} "
                f"groups are {groups}; use a mesh whose axes multiply to the world size"
            )
    for axis, groups in multi.items():
        # A process group's ranks are in ascending order (`dist.new_group` sorts them), and so is what its
        # collectives gather: the replica groups are too, whatever the axis order.
        ordered = sorted(sorted(g) for g in groups)
        if axis_partition(ordered[0], world_size) != ordered:
            raise DeviceError(
                f"XLA replica groups must be translates of one another, as a mesh axis's are, but the {axis} "
                f"groups are {groups}; use a mesh built by MeshSpec"
            )


def axis_partition(ranks: Sequence[int], world_size: int) -> list[list[int]] | None:
    """Every group of the mesh axis that `ranks` is a group of, each sorted, in order; None if `ranks` is not a
    group of any mesh axis over `world_size` ranks.

    On a mesh (rank = the sum of each axis's coordinate times its stride) the groups of one axis are the
    translates of any one of them by the other axes' offsets; taking the smallest rank not yet covered as the
    next group's start finds them all, and fails (a rank past the world, or covered twice) for anything else.
    """
    base = sorted(ranks)
    offsets = [r - base[0] for r in base]
    groups: list[list[int]] = []
    covered: set[int] = set()
    for start in range(world_size):
        if start in covered:
            continue
        group = [start + o for o in offsets]
        if group[-1] >= world_size or covered.intersection(group):
            return None
        covered.update(group)
        groups.append(group)
    return groups if base in groups else None


def _is_xla(tensor: torch.Tensor) -> bool:
    """Whether the collective runs on torch_xla: read from the tensor, not the group, because a traced
    `dist.get_backend` breaks torch.compile(fullgraph=True) on torch 2.9 (its backend map is keyed by the group).
    load_sharded has checked that the process group's backend fits the device."""
    return tensor.device.type == "xla"


def _xla_model():
    import torch_xla.core.xla_model as xm

    return xm


def _replica_groups(ranks: list[int], op: str) -> list[list[int]]:
    """torch_xla's replica groups for a collective over `ranks`: every group of its mesh axis."""
    import torch_xla.runtime as xr

    # xm.all_reduce returns its input unchanged when torch_xla sees one device: never let that pass.
    if xr.world_size() != dist.get_world_size():
        raise DeviceError(
            f"{op}: torch_xla sees {xr.world_size()} devices (xr.world_size()) but the process group has "
            f"{dist.get_world_size()} ranks; initialise it with init_method='xla://'"
        )
    groups = axis_partition(ranks, dist.get_world_size())
    if groups is None:
        raise CollectiveRuleViolation(
            f"{op} over ranks {ranks} on xla: XLA needs every group of the mesh axis, and these ranks are no group "
            "of a mesh axis; build the groups with MeshSpec.groups"
        )
    return groups
