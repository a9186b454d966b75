"""The collective layer and its Neuron rule checker, on real gloo process groups (4 CPU ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiproc import init_gloo, run_ranks

from preshard.runtime import collectives as C

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it


def _gloo_entry(rank: int, world: int, fn: Callable[[int, int], Any]) -> Any:
    init_gloo()
    return fn(rank, world)


def launch(fn: Callable[[int, int], Any], world: int, timeout: float = 120.0) -> list[Any]:
    """Run `fn(rank, world)` on `world` gloo ranks (the shared launcher: free port, timeout, teardown)."""
    return run_ranks(_gloo_entry, world, fn, timeout=timeout)


# --- the checks, all run in one spawn of 4 ranks -------------------------------------------------


def _expect_violation(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except C.CollectiveRuleViolation as e:
        return str(e)
    return "NO VIOLATION"


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    world_group = dist.group.WORLD
    # every rank creates every group, in the same order
    pairs = {tuple(r): dist.new_group(list(r)) for r in ([0, 1], [2, 3], [0, 2], [1, 3])}
    contiguous = pairs[(0, 1)] if rank < 2 else pairs[(2, 3)]
    strided = pairs[(0, 2)] if rank % 2 == 0 else pairs[(1, 3)]

    with C.NeuronRuleChecker() as checker:
        t = torch.full((2, 3), float(rank + 1))
        out["all_reduce"] = C.all_reduce_sum(t, world_group).tolist()

        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank
        out["all_gather_dim1"] = C.all_gather_cat(x, world_group, dim=1).tolist()
        out["all_gather_dim0_pair"] = C.all_gather_cat(x, contiguous, dim=0).tolist()

        y = torch.arange(4, dtype=torch.float32).repeat_interleave(2).view(4, 2) + 10 * rank
        out["all_to_all_world"] = C.all_to_all_equal(y, world_group).tolist()
        z = torch.tensor([[rank * 10.0], [rank * 10.0 + 1]])
        out["all_to_all_pair"] = C.all_to_all_equal(z, contiguous).tolist()

        out["ring_world"] = C.ring_pass(torch.tensor([float(rank)]), world_group).tolist()
        out["ring_strided"] = C.ring_pass(torch.tensor([float(rank)]), strided).tolist()

        out["strided_a2a"] = _expect_violation(lambda: C.all_to_all_equal(z, strided))
        rows = 3 if rank == 0 else 2
        out["ragged_gather"] = _expect_violation(lambda: C.all_gather_cat(torch.ones(rows, 4), world_group, 0))
        # the group is still usable after the (consistently raised) violations
        out["after_violation"] = C.all_reduce_sum(torch.ones(1), world_group).item()
        out["calls"] = [(c.op, c.ranks, c.shape, c.dtype) for c in checker.calls]
        out["violations"] = list(checker.violations)

    # without the checker the strided all-to-all runs on gloo: the checker is what catches it
    out["strided_a2a_unchecked"] = C.all_to_all_equal(z, strided).tolist()
    out["calls_after_exit"] = len(checker.calls)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_worker, 4)


def test_all_reduce_sum(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["all_reduce"] == [[10.0] * 3] * 2
        assert r["after_violation"] == 4.0


def test_all_gather_cat(results: list[dict[str, Any]]) -> None:
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    want = torch.cat([base + 100 * i for i in range(4)], dim=1).tolist()
    for rank, r in enumerate(results):
        assert r["all_gather_dim1"] == want
        lo = 0 if rank < 2 else 2
        assert r["all_gather_dim0_pair"] == torch.cat([base + 100 * lo, base + 100 * (lo + 1)]).tolist()


def test_all_to_all_equal(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        # row j of rank i's input is [j, j] + 10 i; rank `rank` receives row `rank` from each i
        assert r["all_to_all_world"] == [[rank + 10.0 * i] * 2 for i in range(4)]
        lo = 0 if rank < 2 else 2
        assert r["all_to_all_pair"] == [[lo * 10.0 + rank - lo], [(lo + 1) * 10.0 + rank - lo]]


def test_ring_pass(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["ring_world"] == [float((rank - 1) % 4)]
        assert r["ring_strided"] == [float((rank + 2) % 4)]  # strided groups are fine for P2P


def test_strided_all_to_all_rejected_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        msg = r["strided_a2a"]
        assert "contiguous" in msg and "all_to_all_equal" in msg
        assert str([0, 2] if rank % 2 == 0 else [1, 3]) in msg
        assert "\n" not in msg
        # gloo itself accepts it; only the checker stops it
        assert len(r["strided_a2a_unchecked"]) == 2


def test_ragged_all_gather_rejected_on_every_rank(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["ragged_gather"]
        assert "equal sizes" in msg and "all_gather_cat" in msg and "[0, 1, 2, 3]" in msg
        assert "(3, 4)" in msg and "(2, 4)" in msg
        assert len(r["violations"]) == 2


def test_checker_records_calls(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        ops = [c[0] for c in r["calls"]]
        assert ops == [
            "all_reduce_sum",
            "all_gather_cat",
            "all_gather_cat",
            "all_to_all_equal",
            "all_to_all_equal",
            "ring_pass",
            "ring_pass",
            "all_reduce_sum",
        ]
        assert r["calls"][0] == ("all_reduce_sum", (0, 1, 2, 3), (2, 3), torch.float32)
        assert r["calls"][4][1] == ((0, 1) if rank < 2 else (2, 3))
        assert r["calls_after_exit"] == len(r["calls"])  # nothing recorded once the checker exits


def test_checker_is_a_context_manager_that_restores() -> None:
    assert issubclass(C.CollectiveRuleViolation, RuntimeError)
    assert C._ACTIVE is None
    with C.NeuronRuleChecker() as outer:
        with C.NeuronRuleChecker() as inner:
            assert C._ACTIVE is inner
        assert C._ACTIVE is outer
    assert C._ACTIVE is None
