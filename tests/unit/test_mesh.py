"""MeshSpec: ranks <-> coordinates row-major over the axis order, groups per axis, and every way to get the
sizes or the order wrong refused with one line."""

from __future__ import annotations

import itertools

import pytest

from preshard.errors import UsageError
from preshard.format.mesh import MeshSpec

MESHES = [(tp, ring, ulysses) for tp in (1, 2) for ring in (1, 2) for ulysses in (1, 2, 4) if tp * ring * ulysses <= 8]


def _row_major(tp: int, ring: int, ulysses: int, order: tuple[str, ...]) -> list[dict[str, int]]:
    """Rank i's coordinates: row-major over `order`, the last axis varying fastest."""
    sizes = {"tp": tp, "ring": ring, "ulysses": ulysses}
    return [dict(zip(order, values)) for values in itertools.product(*(range(sizes[a]) for a in order))]


@pytest.mark.parametrize(
    "tp, ring, ulysses, order",
    [
        (2, 1, 2, ("tp", "ring", "ulysses")),
        (2, 2, 2, ("ulysses", "ring", "tp")),
        (4, 2, 1, ("ring", "tp", "ulysses")),
        (3, 2, 2, ("tp", "ulysses", "ring")),
        (1, 1, 1, ("tp", "ring", "ulysses")),
    ],
)
def test_rank_and_coords_both_ways(tp, ring, ulysses, order):
    spec = MeshSpec(tp=tp, ring=ring, ulysses=ulysses, order=order)
    expected = _row_major(tp, ring, ulysses, order)
    assert spec.world_size == len(expected) == tp * ring * ulysses
    for rank, coords in enumerate(expected):
        assert spec.coords(rank) == {a: coords[a] for a in ("tp", "ring", "ulysses")}
        assert spec.rank(**coords) == rank
    with pytest.raises(UsageError):
        spec.coords(spec.world_size)


def test_build_from_keywords():
    assert MeshSpec.build(tp=2, cp=4) == MeshSpec(tp=2, ring=1, ulysses=4)
    assert MeshSpec.build(tp=2, ring=2, ulysses=2, cp=4) == MeshSpec(tp=2, ring=2, ulysses=2)
    assert MeshSpec.build(tp=2, order="ulysses,ring,tp").order == ("ulysses", "ring", "tp")
    saved = MeshSpec(tp=4, ring=2, ulysses=1, order=("ring", "tp", "ulysses"))
    assert MeshSpec.build(default=saved) == saved  # nothing given: the default as it is
    assert MeshSpec.build(ulysses=2, default=saved) == MeshSpec(tp=4, ring=1, ulysses=2, order=saved.order)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tp": 0}, "--tp must be a whole number >= 1, got 0"),
        ({"tp": 2, "ring": 0}, "--ring must be a whole number >= 1, got 0"),
        ({"tp": 2, "ulysses": 0}, "--ulysses must be a whole number >= 1, got 0"),
        ({"tp": 2, "cp": 0}, "--cp must be a whole number >= 1, got 0"),
        ({"tp": True}, "--tp must be a whole number"),
        ({"tp": 2.0}, "--tp must be a whole number"),
        ({"tp": 2, "order": ""}, "must name each of tp, ring, ulysses exactly once"),
        ({"tp": 2, "order": "tp,ring"}, "must name each of tp, ring, ulysses exactly once"),
        ({"tp": 2, "order": "tp,tp,ring"}, "must name each of tp, ring, ulysses exactly once"),
        ({"tp": 2, "cp": 4, "ring": 2}, "--cp 4 disagrees with --ring 2 x --ulysses 1"),
    ],
)
def test_bad_sizes_and_orders_are_refused_not_defaulted(kwargs, needle):
    with pytest.raises(UsageError) as info:
        MeshSpec.build(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_manifest_mesh_needs_every_key():
    spec = MeshSpec(tp=2, ring=2, ulysses=1)
    assert MeshSpec.from_dict(spec.to_dict()) == spec
    for key in ("tp", "ring", "ulysses", "order"):
        data = spec.to_dict()
        del data[key]
        with pytest.raises(UsageError):
            MeshSpec.from_dict(data)


def test_default_order_groups():
    spec = MeshSpec(tp=2, ring=1, ulysses=2)
    assert spec.groups("tp") == [[0, 2], [1, 3]]
    assert spec.groups("ulysses") == [[0, 1], [2, 3]]
    assert spec.groups("ring") == [[0], [1], [2], [3]]
    assert spec.groups("cp") == [[0, 1], [2, 3]]


def test_other_order_groups():
    spec = MeshSpec(tp=2, ring=1, ulysses=2, order=("ulysses", "ring", "tp"))
    assert spec.groups("tp") == [[0, 1], [2, 3]]
    assert spec.groups("ulysses") == [[0, 2], [1, 3]]
    assert spec.groups("cp") == [[0, 2], [1, 3]]


def test_tp2_ring2_ulysses2_groups():
    spec = MeshSpec(tp=2, ring=2, ulysses=2)
    assert spec.groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert spec.groups("ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert spec.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec.groups("cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [spec.cp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]

    swapped = MeshSpec(tp=2, ring=2, ulysses=2, order=("tp", "ulysses", "ring"))
    assert swapped.groups("ulysses") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert swapped.groups("ring") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # cp groups list members in cp-rank order (ring major), whatever the physical order
    assert swapped.groups("cp") == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert [swapped.cp_rank(r) for r in range(8)] == [0, 2, 1, 3, 0, 2, 1, 3]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "tp{}-ring{}-uly{}".format(*m))
@pytest.mark.parametrize("order", ["tp,ring,ulysses", "ulysses,ring,tp", "tp,ulysses,ring", "ring,tp,ulysses"])
def test_groups_partition_the_world(mesh, order):
    spec = MeshSpec.build(tp=mesh[0], ring=mesh[1], ulysses=mesh[2], order=order)
    for axis in ("tp", "ring", "ulysses", "cp"):
        groups = spec.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(spec.world_size))
        size = spec.cp if axis == "cp" else spec.size(axis)
        assert all(len(g) == size for g in groups)
    for rank in range(spec.world_size):
        assert spec.rank(**spec.coords(rank)) == rank
        assert spec.group_of("cp", rank)[spec.cp_rank(rank)] == rank
    if order == "tp,ring,ulysses":
        for g in spec.groups("ulysses"):  # the default keeps Ulysses groups contiguous
            assert g == list(range(g[0], g[0] + len(g)))
