"""The TP x ring x Ulysses device mesh: rank <-> coordinates, and the rank groups of each axis.

Ranks are laid out row-major over `order`, the last axis varying fastest. With the default
`("tp", "ring", "ulysses")` Ulysses groups are contiguous ranks, which Neuron's all-to-all requires;
TP's all-reduce accepts strided groups. The CP rank (position in the sequence) is always
`ring * ulysses_size + ulysses`, whatever the physical order, so the sequence layout never depends
on how ranks are placed. Pure arithmetic: process groups are built by `preshard.runtime.groups`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from preshard.errors import UsageError

AXES = ("tp", "ring", "ulysses")
DEFAULT_ORDER = AXES
# The most ranks a mesh may have: its rank table (one entry per rank, in every manifest) must stay small enough to
# build and to read in moments; 2**20 is far beyond any job, yet a 2**40-rank table is never attempted.
MAX_WORLD_SIZE = 1 << 20


def _whole(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def parse_order(order: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...] | None:
    """`"tp,ring,ulysses"` or a sequence of axis names; None means "not given" (an empty string is an error)."""
    if order is None:
        return None
    parts = order.split(",") if isinstance(order, str) else list(order)
    names = tuple(p.strip() if isinstance(p, str) else p for p in parts)
    if sorted(map(str, names)) != sorted(AXES) or not all(isinstance(n, str) for n in names):
        raise UsageError(
            f"mesh order {order!r} must name each of tp, ring, ulysses exactly once "
            "(for example --order tp,ring,ulysses)"
        )
    return names


@dataclass(frozen=True)
class MeshSpec:
    """A TP x ring x Ulysses mesh. `cp = ring * ulysses`; world size = tp * cp."""

    tp: int = 1
    ring: int = 1
    ulysses: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXES:
            _whole(getattr(self, axis), f"--{axis}")
        object.__setattr__(self, "order", parse_order(self.order))
        if self.world_size > MAX_WORLD_SIZE:
            raise UsageError(
                f"the mesh tp={self.tp} x ring={self.ring} x ulysses={self.ulysses} has {self.world_size} ranks, more "
                f"than the {MAX_WORLD_SIZE} preshard supports; use smaller degrees"
            )

    @classmethod
    def build(
        cls,
        tp: int | None = None,
        cp: int | None = None,
        ring: int | None = None,
        ulysses: int | None = None,
        order: str | tuple[str, ...] | None = None,
        *,
        default: MeshSpec | None = None,
    ) -> MeshSpec:
        """A mesh from the keywords users pass (CLI flags or Python), each validated.

        `cp=N` alone means Ulysses N; `ring`/`ulysses` set the split explicitly and must agree with `cp` if
        both are given. Keywords left as None take their value from `default` (else 1 / the default order).

        Raises:
            UsageError: a size that is not a whole number >= 1, `cp` disagreeing with ring x ulysses, or an
                order that does not name each axis once.
        """
        for value, name in ((tp, "--tp"), (cp, "--cp"), (ring, "--ring"), (ulysses, "--ulysses")):
            if value is not None:
                _whole(value, name)
        base = default or cls()
        if cp is not None and (ring is not None or ulysses is not None):
            if (ring or 1) * (ulysses or 1) != cp:
                raise UsageError(
                    f"--cp {cp} disagrees with --ring {ring or 1} x --ulysses {ulysses or 1}; "
                    "give either --cp or --ring/--ulysses"
                )
        if ring is None and ulysses is None:
            if cp is not None:
                ring, ulysses = 1, cp
            else:
                ring, ulysses = base.ring, base.ulysses
        return cls(
            tp=tp if tp is not None else base.tp,
            ring=ring if ring is not None else 1,
            ulysses=ulysses if ulysses is not None else 1,
            order=parse_order(order) or base.order,
        )

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
            raise UsageError(f"rank {rank} is outside a mesh of world size {self.world_size}")
        coords: dict[str, int] = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {axis: coords[axis] for axis in AXES}

    def rank(self, tp: int = 0, ring: int = 0, ulysses: int = 0) -> int:
        coords = {"tp": tp, "ring": ring, "ulysses": ulysses}
        rank = 0
        for axis in self.order:
            if not 0 <= coords[axis] < self.size(axis):
                raise UsageError(f"{axis} coordinate {coords[axis]} is outside 0..{self.size(axis) - 1}")
            rank = rank * self.size(axis) + coords[axis]
        return rank

    def cp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["ring"] * self.ulysses + c["ulysses"]

    def groups(self, axis: str) -> list[list[int]]:
        """Rank groups along `axis` ("tp", "ring", "ulysses" or "cp" = ring x ulysses), each in axis order."""
        varying = ("ring", "ulysses") if axis == "cp" else (axis,)
        if any(a not in AXES for a in varying):
            raise UsageError(f"unknown mesh axis {axis!r}; use one of tp, ring, ulysses, cp")
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

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "ring": self.ring, "ulysses": self.ulysses, "order": list(self.order)}

    @classmethod
    def from_dict(cls, data: Any) -> MeshSpec:
        """Parse the manifest's `mesh` object (every key required)."""
        if not isinstance(data, dict) or set(data) != {"tp", "ring", "ulysses", "order"}:
            raise UsageError("mesh must be an object with exactly tp, ring, ulysses and order")
        if not isinstance(data["order"], list):
            raise UsageError("mesh order must be a list of axis names")
        return cls(tp=data["tp"], ring=data["ring"], ulysses=data["ulysses"], order=tuple(data["order"]))

    def describe(self) -> str:
        return f"tp={self.tp} x ring={self.ring} x ulysses={self.ulysses} (order {','.join(self.order)})"


def resolve_mesh(
    mesh: MeshSpec | None,
    tp: int | None,
    cp: int | None,
    ring: int | None,
    ulysses: int | None,
    order: str | tuple[str, ...] | None,
    default: MeshSpec | None = None,
) -> MeshSpec:
    """The one resolution of a mesh from what a caller passes (convert, reshard, their dry runs, load_sharded): a
    `MeshSpec` or the keywords, not both; with neither, `default` (or tp is required).

    Raises:
        UsageError: both given, a mesh that is no MeshSpec, no TP degree and no default, or a bad keyword.
    """
    keywords = (tp, cp, ring, ulysses, order)
    if mesh is not None:
        if any(k is not None for k in keywords):
            raise UsageError("pass either mesh=MeshSpec(...) or tp/cp/ring/ulysses/order, not both")
        if not isinstance(mesh, MeshSpec):
            raise UsageError(f"mesh must be a preshard.MeshSpec, not {type(mesh).__name__}")
        return mesh
    if tp is None and default is None:
        raise UsageError("the TP degree is required: pass --tp N (or tp=N / mesh=MeshSpec(tp=N, ...))")
    return MeshSpec.build(tp, cp, ring, ulysses, order, default=default)
