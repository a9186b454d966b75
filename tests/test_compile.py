"""torch.compile(fullgraph=True) of the sharded MiniMax-H3 on every mesh: one graph, no break, the CP collectives
inside it, the same output as eager and as the unsharded model.

One spawn of 2 gloo ranks compiles tp=2, ulysses=2 and ring=2 with aot_eager, and ring=2 once more with inductor
(the slow one: the ring pass, the ring kernels and the Ulysses exchange are all in it); one spawn of 4 ranks
compiles tp=2 x ulysses=2. The sequence length (37) is odd, so the padding paths are the ones compiled.

Graph breaks are counted two ways: `fullgraph=True` raises on the first one, and a recording backend sees
every graph dynamo hands over (exactly one per mesh, also after a second call: no recompile; plus the cross-rank
input check's, as torch.compile(module) compiles a module's hooks as frames of their own) and lists the ops
in it, so the tests can see the collectives in the graph (a graph without them would be a model computing the
whole sequence on every rank, which returns the right values too).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch
from multiproc import init_gloo, run_ranks

from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config

SEQ_LEN = 37
TOL = 1e-5
WORLD2 = [((2, 1, 1), "aot_eager"), ((1, 1, 2), "aot_eager"), ((1, 2, 1), "aot_eager"), ((1, 2, 1), "inductor")]
WORLD4 = [((2, 1, 2), "aot_eager")]
CHECK_OP = "preshard.check_inputs"  # the cross-rank input check's custom op
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "wait_tensor")
# Compiling is slow on 2 busy cores (inductor ~90 s per rank when quiet, several minutes under load).
pytestmark = [pytest.mark.timeout(1800), pytest.mark.xla_api]


class _RecordingBackend:
    """A torch.compile backend that keeps the ops of every graph dynamo hands it, then compiles with `inner`."""

    def __init__(self, inner: str) -> None:
        from torch._dynamo import lookup_backend

        self.inner = lookup_backend(inner)
        self.graphs: list[Counter] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        ops = Counter(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        self.graphs.append(ops)
        return self.inner(gm, example_inputs)


def _collective_counts(ops: Counter) -> dict[str, int]:
    return {name: sum(n for op, n in ops.items() if f"_c10d_functional.{name}" in op) for name in COLLECTIVES}


def _compile_runs(rank: int, world: int, checkpoints: dict[int, str], reference, cases) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.errors import InconsistentInputsError
    from preshard.runtime.load import load_sharded

    init_gloo()
    inputs = make_inputs(tiny_config(), SEQ_LEN)
    results = {}
    for (tp, ring, ulysses), backend in cases:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        net = load_sharded(H3, checkpoints[tp], ring=ring, ulysses=ulysses)
        with torch.no_grad():
            eager = net(**inputs, return_dict=False)
            recorder = _RecordingBackend(backend)
            compiled = torch.compile(net, backend=recorder, fullgraph=True)
            start = time.perf_counter()
            first = compiled(**inputs, return_dict=False)
            seconds = time.perf_counter() - start
            net.preshard_report.attention_rows.clear()
            second = compiled(**inputs, return_dict=False)
            try:  # each rank its own inputs: the compiled check still refuses them, on every rank
                compiled(**make_inputs(tiny_config(), SEQ_LEN, seed=rank), return_dict=False)
                refused = None
            except InconsistentInputsError as exc:
                refused = str(exc)
        # torch.compile(module) runs a module's hooks as frames of their own: the input check (runtime/consistency.py,
        # the model's first pre-hook) is a graph of its one op, and the forward is the other graph.
        checks = [ops for ops in recorder.graphs if set(ops) == {CHECK_OP}]
        forward = [ops for ops in recorder.graphs if set(ops) != {CHECK_OP}]
        results[((tp, ring, ulysses), backend)] = {
            "graphs": len(forward),
            "check_graphs": len(checks),
            "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "collectives": _collective_counts(forward[0]) if forward else {},
            "vs_eager": max((a - b).abs().max().item() for a, b in zip((*first, *second), (*eager, *eager))),
            "vs_unsharded": max((a - b).abs().max().item() for a, b in zip(second, reference)),
            "rows": dict(net.preshard_report.attention_rows),  # replayed by the compiled graph's side effects
            "compile_s": seconds,
            "refused": refused,
        }
    return results


@pytest.fixture(scope="module")
def checkpoints(converted) -> dict[int, str]:
    return {tp: str(converted("float32", tp)) for tp in (1, 2)}


@pytest.fixture(scope="module")
def reference(tiny_models):
    return reference_forward(tiny_models("float32"), make_inputs(tiny_config(), SEQ_LEN))


def _spawn(world: int, cases, checkpoints, reference) -> dict:
    per_rank = run_ranks(_compile_runs, world, checkpoints, reference, cases, timeout=1500)
    return {case: [rank[case] for rank in per_rank] for case in cases}


@pytest.fixture(scope="module")
def world2(checkpoints, reference) -> dict:
    return _spawn(2, WORLD2, checkpoints, reference)


@pytest.fixture(scope="module")
def world4(checkpoints, reference) -> dict:
    return _spawn(4, WORLD4, checkpoints, reference)


@pytest.fixture()
def runs(request, case) -> dict:
    return request.getfixturevalue("world2" if case in WORLD2 else "world4")


def _id(case) -> str:
    (tp, ring, ulysses), backend = case
    return f"tp{tp}-ring{ring}-uly{ulysses}-{backend}"


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=_id)
def test_fullgraph_compile_is_one_graph_equal_to_eager_and_unsharded(runs, case):
    for rank, run in enumerate(runs[case]):
        assert run["graphs"] == 1, f"rank {rank}: {run['graphs']} graphs (a recompile or a break)"
        assert run["check_graphs"] == 1, run["check_graphs"]  # the input check is compiled, and kept:
        assert run["refused"] is not None and "holds other values on ranks" in run["refused"], run["refused"]
        assert run["breaks"] == 0
        assert run["vs_eager"] <= TOL, (rank, run["vs_eager"])
        assert run["vs_unsharded"] <= TOL, (rank, run["vs_unsharded"])


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=_id)
def test_the_collectives_are_in_the_graph(runs, case):
    (tp, ring, ulysses), _ = case
    blocks = tiny_config()["num_layers"]
    cp = ring * ulysses
    for run in runs[case]:
        got = run["collectives"]
        assert (got["all_reduce"] > 0) == (tp > 1), got  # TP's row-parallel sums
        # Ulysses: q/k/v in one exchange and the output back, per block; ring: one pass per extra ring rank.
        assert got["all_to_all_single"] == blocks * (2 * (ulysses > 1) + (ring - 1)), got
        assert got["all_gather_into_tensor"] == (2 if cp > 1 else 0), got  # the video and audio outputs
        assert got["wait_tensor"] == got["all_reduce"] + got["all_to_all_single"] + got["all_gather_into_tensor"]
        if cp > 1:  # the compiled graph still runs attention on this rank's rows only
            assert run["rows"] and set(run["rows"].values()) == {-(-SEQ_LEN // cp)}, run["rows"]


def test_graph_break_counter_sees_a_break():
    """Negative control for the counting: a function with a break gives two graphs and a counted break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorder = _RecordingBackend("aot_eager")

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    assert torch.equal(torch.compile(broken, backend=recorder)(torch.ones(2)), torch.full((2,), 4.0))
    assert len(recorder.graphs) == 2
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 1
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(broken, backend="aot_eager", fullgraph=True)(torch.ones(2))
