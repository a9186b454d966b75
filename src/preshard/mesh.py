"""The TP x ring x Ulysses device mesh: rank <-> coordinates, and the rank groups of each axis.

Ranks are laid out row-major over `order`, the last axis varying fastest. With the default
`("tp", "ring", "ulysses")` Ulysses groups are contiguous ranks, which Neuron's all-to-all requires;
TP's all-reduce accepts strided groups. The CP rank (position in the sequence) is always
`ring * ulysses_size + ulysses`, whatever the physical order, so the sequence layout never depends
on how ranks are placed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preshard.errors import PreshardError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

AXES = ("tp", "ring", "ulysses")
DEFAULT_ORDER = AXES


@dataclass(frozen=True)
class MeshSpec:
    tp: int = 1
    ring: int = 1
    ulysses: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise PreshardError(f"--{axis} must be a whole number >= 1, got {size!r}")
        order = tuple(self.order)
        if sorted(order) != sorted(AXES):
            raise PreshardError(
                f"mesh order {','.join(order)} must name each of tp, ring, ulysses exactly once "
                "(for example --order tp,ring,ulysses)"
            )
        object.__setattr__(self, "order", order)

    @classmethod
    def from_cli(
        cls,
        tp: int,
        cp: int | None = None,
        ring: int | None = None,
        ulysses: int | None = None,
        order: str | tuple[str, ...] | None = None,
    ) -> MeshSpec:
        """`--cp N` means ulysses=N, ring=1; `--ring`/`--ulysses` set the split explicitly."""
        if cp is not None and (ring is not None or ulysses is not None):
            if (ring or 1) * (ulysses or 1) != cp:
                raise PreshardError(
                    f"--cp {cp} disagrees with --ring {ring or 1} x --ulysses {ulysses or 1}; "
                    "give either --cp or --ring/--ulysses"
                )
        if ring is None and ulysses is None:
            ring, ulysses = 1, (cp if cp is not None else 1)
        if isinstance(order, str):
            order = tuple(part.strip() for part in order.split(",") if part.strip())
        return cls(tp=tp, ring=ring or 1, ulysses=ulysses or 1, order=order or DEFAULT_ORDER)

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def world_size(self) -> int:
        return self.tp * self.ring * self.ulysses

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise PreshardError(f"rank {rank} is outside a mesh of world size {self.world_size}")
        coords: dict[str, int] = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {axis: coords[axis] for axis in AXES}

    def rank(self, tp: int = 0, ring: int = 0, ulysses: int = 0) -> int:
        coords = {"tp": tp, "ring": ring, "ulysses": ulysses}
        rank = 0
        for axis in self.order:
            if not 0 <= coords[axis] < self.size(axis):
                raise PreshardError(f"{axis} coordinate {coords[axis]} is outside 0..{self.size(axis) - 1}")
            rank = rank * self.size(axis) + coords[axis]
        return rank

    def cp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["ring"] * self.ulysses + c["ulysses"]

    def groups(self, axis: str) -> list[list[int]]:
        """Rank groups along `axis` ("tp", "ring", "ulysses" or "cp" = ring x ulysses), each in axis order."""
        varying = ("ring", "ulysses") if axis == "cp" else (axis,)
        if any(a not in AXES for a in varying):
            raise PreshardError(f"unknown mesh axis {axis!r}; use one of tp, ring, ulysses, cp")
        fixed = [a for a in AXES if a not in varying]
        result = []
        for fixed_values in itertools.product(*(range(self.size(a)) for a in fixed)):
            base = dict(zip(fixed, fixed_values))
            members = [
                self.rank(**base, **dict(zip(varying, values)))
                for values in itertools.product(*(range(self.size(a)) for a in varying))
            ]
            result.append(members)
        return result

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "ring": self.ring, "ulysses": self.ulysses, "order": list(self.order)}

    @classmethod
    def from_dict(cls, data: dict) -> MeshSpec:
        return cls(
            tp=data["tp"],
            ring=data.get("ring", 1),
            ulysses=data.get("ulysses", 1),
            order=tuple(data.get("order", DEFAULT_ORDER)),
        )

    def describe(self) -> str:
        return f"tp={self.tp} x ring={self.ring} x ulysses={self.ulysses} (order {','.join(self.order)})"


@dataclass
class MeshGroups:
    """This rank's process groups on a mesh, built collectively by every rank."""

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
