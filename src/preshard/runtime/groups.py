"""This rank's process groups on a mesh, built collectively by every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preshard.format.mesh import MeshSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class MeshGroups:
    spec: MeshSpec
    rank: int
    tp: ProcessGroup | None
    ring: ProcessGroup | None
    ulysses: ProcessGroup | None
    cp: ProcessGroup | None
    ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        return self.spec.coords(self.rank)


def build_groups(spec: MeshSpec, rank: int) -> MeshGroups:
    """Create every group of every axis (new_group is collective: all ranks create all groups, same order)."""
    import torch.distributed as dist

    made: dict[str, ProcessGroup | None] = {}
    ranks: dict[str, list[int]] = {}
    for axis in ("tp", "ring", "ulysses", "cp"):
        made[axis] = None
        for members in spec.groups(axis):
            group = dist.new_group(members) if len(members) > 1 else None
            if rank in members:
                made[axis], ranks[axis] = group, members
    return MeshGroups(spec=spec, rank=rank, ranks=ranks, **made)
