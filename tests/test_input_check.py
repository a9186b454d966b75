"""Consistent inputs across ranks, checked on every forward: per-rank inputs are refused with the same one line on
every rank of every mesh (tp=2, ulysses=2, ring=2, tp2 x ulysses2), naming the argument and the fix; the opt-out
really skips it (and then the outputs are silently wrong); "broadcast" uses rank 0's inputs; and the check
compiles with torch.compile(fullgraph=True) at tp=2, staying in the graph and still refusing there.

The fingerprint itself is tested in this process: exact for every dtype, position-sensitive, blind to memory
layout. The ranks run in one spawn per world size, every case in turn."""

from __future__ import annotations

import pytest
import torch
from multiproc import init_gloo, run_ranks

from preshard.errors import PreshardError, UsageError
from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config
from preshard.runtime.consistency import _word_sums, parse_mode

# the spawned ranks of each world size run every case first
pytestmark = [pytest.mark.timeout(1200), pytest.mark.xla_api]

TOL = 1e-5
SEQ = 37
MESHES = {2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2)]}  # (tp, ring, ulysses)
FIX = "seed every rank's generator identically"


# ---------------------------------------------------------------- the fingerprint, in this process


def _fp(t: torch.Tensor) -> tuple[int, int]:
    plain, weighted = _word_sums(t, torch.device("cpu")).tolist()
    return plain, weighted


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
              torch.bool, torch.complex64, torch.float8_e4m3fn],
)  # fmt: skip
def test_fingerprint_is_exact_and_sees_values_and_order(dtype):
    g = torch.Generator().manual_seed(0)

    def draw():
        if dtype == torch.bool:
            return torch.randn(3, 2050, generator=g) > 0
        if dtype == torch.complex64:
            return torch.view_as_complex(torch.randn(3, 2050, 2, generator=g))
        return (torch.randn(3, 2050, generator=g) * 50).to(dtype)

    x = draw()
    assert _fp(x) == _fp(x.clone())
    assert _fp(draw()) != _fp(x)
    swapped = x.clone().reshape(-1)
    i = int((swapped != swapped[0]).nonzero()[0])  # two different elements, swapped
    first = swapped[0].clone()  # element copies, not advanced indexing: torch 2.9 has no float8 index kernel
    swapped[0] = swapped[i]
    swapped[i] = first
    assert _fp(swapped.reshape(x.shape))[1] != _fp(x)[1]  # the position-weighted sum sees the reordering


def test_fingerprint_reads_bits_not_layout():
    x = torch.randn(64, 33)
    assert _fp(x.t()) == _fp(x.t().contiguous())  # a view fingerprints as its values
    assert _fp(torch.tensor([0.0])) != _fp(torch.tensor([-0.0]))  # bits, not numeric equality
    assert _fp(torch.empty(0, 5)) == (0, 0)
    # Word i weighs i % 1021 + 1; the sums are exact (modulo 2**64), whatever the order of the reduction.
    n = 5_000_000
    weighted = sum(range(1, 1022)) * (n // 1021) + sum(range(1, n % 1021 + 1))
    assert _fp(torch.full((n,), -1, dtype=torch.int64)) == (-n, -weighted)
    huge = torch.full((n,), 2**62, dtype=torch.int64)  # wraps modulo 2**64: still equal for equal bytes
    assert _fp(huge) == _fp(huge.clone()) != _fp(huge.roll(1) + 1)
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: one partial word, little-endian
    assert _fp(odd) == (sum(i << (8 * i) for i in range(7)),) * 2
    assert _fp(torch.arange(10, dtype=torch.bfloat16)[1:]) == _fp(torch.arange(1, 10, dtype=torch.bfloat16))
    # Stride 0 on dims of size 1 (`t.expand(batch)`, how WanPipeline and FluxPipeline pass the timestep at batch 1)
    scalar = torch.tensor(999.0)
    assert scalar.expand(1).stride() == (0,) and _fp(scalar.expand(1)) == _fp(torch.tensor([999.0]))
    assert _fp(torch.tensor([[3.0]]).expand(1, 1).as_strided((1, 1), (0, 0))) == _fp(torch.tensor([[3.0]]))


def test_check_inputs_values():
    assert [parse_mode(v) for v in (True, False, "broadcast")] == ["check", "off", "broadcast"]
    with pytest.raises(UsageError, match="check_inputs='always'") as info:
        parse_mode("always")
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- on the ranks


def _inputs(seed: int = 0, seq: int = SEQ) -> dict:
    return make_inputs(tiny_config(), seq, seed=seed)


def _attempt(net, inputs: dict):
    """(max diff to the reference, None) or (None, the refusal's message)."""
    try:
        with torch.no_grad():
            out = net(**inputs, return_dict=False)
        return out, None
    except PreshardError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _diff(out, reference) -> float:
    return max((o - r).abs().max().item() for o, r in zip(out, reference, strict=True))


def _compiled_case(net, reference, rank: int) -> dict:
    """torch.compile(fullgraph=True) at tp=2 with the check on: equal output, the op in the graph, still refusing."""
    import torch._dynamo

    graphs: list[list[str]] = []

    def recording(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes])
        return gm.forward

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen = torch.compile(net, fullgraph=True, backend=recording)
    with torch.no_grad():
        seen(**_inputs(), return_dict=False)
    module_graphs = list(graphs)
    # Called from a compiled function (a pipeline step compiled whole), the hooks are traced inline: one graph.
    torch._dynamo.reset()
    graphs.clear()
    step = torch.compile(lambda inputs: net(**inputs, return_dict=False), fullgraph=True, backend=recording)
    with torch.no_grad():
        step(_inputs())
    inline_graphs = list(graphs)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    out, _ = _attempt(compiled, _inputs())
    _, refused = _attempt(compiled, _inputs(seed=rank))
    torch._dynamo.reset()
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        # torch.compile(module): the forward pre-hooks and the forward are separate frames, each compiled whole.
        "graphs": [sum("preshard.check_inputs" in t for t in g) for g in module_graphs],
        "inline": [sum("preshard.check_inputs" in t for t in g) for g in inline_graphs],
        "diff": _diff(out, reference),
        "refused": refused,
    }


def _rank(rank: int, world: int, checkpoints: dict[int, str], reference) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for mesh in MESHES[world]:
        tp, ring, ulysses = mesh
        net = load_sharded(H3, checkpoints[tp], ring=ring, ulysses=ulysses)
        same, _ = _attempt(net, _inputs())
        one_arg = _inputs()
        if rank == 1:
            one_arg["timestep"] = one_arg["timestep"] + 0.25
        extra = _inputs()
        if rank == world - 1:
            extra["attention_kwargs"] = {"scale": torch.tensor(2.0)}
        run = {
            "same": _diff(same, reference),
            "seeded": _attempt(net, _inputs(seed=rank))[1],
            "one_arg": _attempt(net, one_arg)[1],
            "shape": _attempt(net, _inputs(seq=SEQ + rank))[1],
            "extra": _attempt(net, extra)[1],
        }
        net.preshard_input_check.mode = "off"  # the switch on the model: the next forward is not checked
        run["switched_off"] = _attempt(net, _inputs(seed=rank))[1]
        run["after"] = _attempt(net, _inputs())[0] is not None
        broadcast = load_sharded(H3, checkpoints[tp], ring=ring, ulysses=ulysses, check_inputs="broadcast")
        out, _ = _attempt(broadcast, _inputs(seed=rank))  # rank 0's inputs are seed 0's
        run["broadcast"] = _diff(out, reference) if out is not None else float("inf")
        run["broadcast_shape"] = _attempt(broadcast, _inputs(seq=SEQ + rank))[1]
        if mesh == (2, 1, 1):
            unchecked = load_sharded(H3, checkpoints[tp], check_inputs=False)
            out, refused = _attempt(unchecked, _inputs(seed=rank))
            run["unchecked"] = (refused, _diff(out, reference) if out is not None else None)
            run["compiled"] = _compiled_case(load_sharded(H3, checkpoints[tp]), reference, rank)
        results[mesh] = run
    return results


@pytest.fixture(scope="module")
def reference(tiny_models):
    return reference_forward(tiny_models("float32"), _inputs())


@pytest.fixture(scope="module")
def checkpoints(converted) -> dict[int, str]:
    return {tp: str(converted("float32", tp)) for tp in (1, 2)}


@pytest.fixture(scope="module")
def world2(checkpoints, reference):
    return run_ranks(_rank, 2, checkpoints, reference, timeout=600)


@pytest.fixture(scope="module")
def world4(checkpoints, reference):
    return run_ranks(_rank, 4, checkpoints, reference, timeout=600)


ALL = [(world, mesh) for world, meshes in MESHES.items() for mesh in meshes]


def _id(case) -> str:
    return "tp{}-ring{}-uly{}".format(*case[1])


def _messages(request, case, key: str) -> list[str]:
    world, mesh = case
    return [results[mesh][key] for results in request.getfixturevalue(f"world{world}")]


def _one_line_on_every_rank(messages: list, *expected: str) -> None:
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages  # every rank raises the same line
    (message,) = set(messages)
    assert "\n" not in message
    assert message.startswith("InconsistentInputsError: MiniMaxH3Transformer3DModel: the ranks were given")
    for text in expected:
        assert text in message, (text, message)


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_same_inputs_pass(request, case):
    world, mesh = case
    for results in request.getfixturevalue(f"world{world}"):
        assert results[mesh]["same"] <= TOL


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_per_rank_seeds_are_refused_naming_the_argument_and_the_fix(request, case):
    world = case[0]
    others = list(range(1, world))
    _one_line_on_every_rank(
        _messages(request, case, "seeded"),
        f"input 'hidden_states' (float32 [1, 24, 16]) holds other values on ranks {others} than on ranks [0]",
        "also different: 'audio_hidden_states', 'encoder_hidden_states'",
        FIX, "broadcast the inputs from rank 0", "check_inputs='broadcast'",
    )  # fmt: skip


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_one_differing_argument_on_one_rank(request, case):
    _one_line_on_every_rank(
        _messages(request, case, "one_arg"), "input 'timestep' (float32 [2]) holds other values on ranks [1]"
    )


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_shapes_and_missing_arguments(request, case):
    world = case[0]
    shapes = {  # rank r passes a sequence of 37 + r rows: 24, 24, 25, 26 video rows and 7, 8, 8, 8 audio rows
        2: "input 'audio_hidden_states' has shape [1, 7, 8] on ranks [0]; [1, 8, 8] on ranks [1]",
        4: "input 'hidden_states' has shape [1, 24, 16] on ranks [0, 1]; [1, 25, 16] on ranks [2]; [1, 26, 16] on "
        "ranks [3]",
    }
    _one_line_on_every_rank(_messages(request, case, "shape"), shapes[world])
    _one_line_on_every_rank(
        _messages(request, case, "extra"),
        f"input \"attention_kwargs['scale']\" is given on ranks [{world - 1}] but not on ranks "
        f"{list(range(world - 1))}",
    )


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_the_mode_on_the_model_switches_it_off(request, case):
    world, mesh = case
    for results in request.getfixturevalue(f"world{world}"):
        assert results[mesh]["switched_off"] is None and results[mesh]["after"]


def test_opt_out_runs_per_rank_inputs_silently_wrong(world2):
    """The negative control: check_inputs=False really skips the check, and nothing else notices."""
    refused = [results[(2, 1, 1)]["unchecked"][0] for results in world2]
    diffs = [results[(2, 1, 1)]["unchecked"][1] for results in world2]
    assert refused == [None, None]
    assert max(diffs) > 1e-2, diffs


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_broadcast_uses_rank0_inputs(request, case):
    world, mesh = case
    for results in request.getfixturevalue(f"world{world}"):
        assert results[mesh]["broadcast"] <= TOL, results[mesh]["broadcast"]
    _one_line_on_every_rank(_messages(request, case, "broadcast_shape"), "has shape")


def test_compiled_fullgraph_at_tp2_keeps_the_check(world2):
    for rank, results in enumerate(world2):
        compiled = results[(2, 1, 1)]["compiled"]
        assert compiled["graph_breaks"] == 0
        assert compiled["graphs"] == [1, 0]  # the hook's frame holds the check (not traced away), then the forward's
        assert compiled["inline"] == [1]  # compiled from a caller: one graph, the check in it
        assert compiled["diff"] <= TOL, (rank, compiled["diff"])
        assert compiled["refused"] is not None and "holds other values" in compiled["refused"], compiled["refused"]


def _counted_under_inductor(rank: int, world: int) -> list[int]:
    from preshard.runtime.consistency import attach_input_check

    init_gloo()
    net = torch.nn.Linear(4, 4)
    check = attach_input_check(net, "check", torch.device("cpu"))
    counts = []
    with torch.no_grad():
        net(torch.ones(2, 4))
        counts.append(int(check.checked))
        compiled = torch.compile(net, fullgraph=True, backend="inductor")
        compiled(torch.ones(2, 4))
        compiled(torch.ones(2, 4))
        counts.append(int(check.checked))
        check.mode = "broadcast"
        compiled(torch.ones(2, 4))
        counts.append(int(check.checked))
    return counts


def test_every_compiler_keeps_the_check():
    """Each checked forward adds one to `checked`, compiled by inductor too: torch 2.9's inductor dropped the op
    when it only had a registered side effect and no output, so the counter is a real mutation it must keep."""
    [counts] = run_ranks(_counted_under_inductor, 1, timeout=300)
    assert counts == [1, 3, 4]
