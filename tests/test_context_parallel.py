"""Context parallelism on the real diffusers MiniMax-H3: every TP x ring x Ulysses mesh of up to 8 ranks
computes the unsharded model's function, with the CP hooks really in place and Neuron's collective rules kept.

The tiny seeded model (preshard.examples.minimax_h3, 12 heads, float32) is converted at tp 1 and 2; CP
is chosen at load time. Spawning ranks is the slow part (each imports diffusers), so there is one spawn
per world size (2, 4, 8): in it every rank loads every mesh of that world size in turn (each
`load_sharded` builds its own groups) and runs every sequence length, inside a `NeuronRuleChecker`,
then strips the hooks for the negative control; world 4 also runs the non-default axis orders. Ranks
hand back compact values (max diffs, rows seen by attention, hook descriptions, the checker's calls)
and the tests below assert on them. World 1 runs in this process.

Output values alone cannot show that CP is in place: a rank without its CP hooks computes the whole
sequence and still returns the right answer (the negative control shows exactly that). So the tests
also assert the hooks (the load report, and that the modules really carry forward hooks) and the number
of query rows each transformer-block attention saw (`report.attention_rows`, plus an independent probe).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multiproc import init_gloo, run_ranks
from torch import nn

from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config
from preshard.format.manifest import read_manifest
from preshard.format.mesh import DEFAULT_ORDER, MeshSpec
from preshard.runtime import cp as CP
from preshard.runtime.collectives import CollectiveRuleViolation, NeuronRuleChecker
from preshard.runtime.cp_attention import CPGroups
from preshard.runtime.load import load_sharded

TOL = 1e-5  # float32; measured max abs diff is ~1e-6 (other summation order in the sharded matmuls)
SEQ_LENS = (5, 24, 37)  # shorter than cp=8 (ranks with only padding), even, prime
NEGATIVE_LEN = 37
NUM_BLOCKS = tiny_config()["num_layers"]
BLOCK_ATTN = [f"transformer_blocks.{i}.attn" for i in range(NUM_BLOCKS)]
REFINER_ATTN = [f"token_refiner.refiner_blocks.{i}.attn" for i in range(tiny_config()["num_refiner_layers"])]
ALL_ATTN = BLOCK_ATTN + REFINER_ATTN
CP_MODULES = sorted(
    ["rope", "norm_out", "proj_out", "audio_proj_out"]
    + [f"transformer_blocks.{i}" for i in range(NUM_BLOCKS)]
    + BLOCK_ATTN
)
LIVE_MODULES = ["", *CP_MODULES, *REFINER_ATTN]  # "" is the model itself (per-forward reset hook)

# Every mesh with tp in {1, 2}, ring in {1, 2}, ulysses in {1, 2, 4} and world size <= 8.
MESHES = [(tp, ring, ulysses) for tp in (1, 2) for ring in (1, 2) for ulysses in (1, 2, 4) if tp * ring * ulysses <= 8]

# Non-default axis orders, loaded from the default-order checkpoints (world 4). "strided": Ulysses
# groups are not contiguous ranks, so the Neuron checker must refuse the all-to-all.
ORDER_CASES = {
    "tp,ulysses,ring@1x2x2": ((1, 2, 2), "tp,ulysses,ring", True),  # also: cp group [0, 2, 1, 3]
    "ulysses,ring,tp@2x1x2": ((2, 1, 2), "ulysses,ring,tp", True),  # also: tp groups [0, 1], [2, 3]
    "ring,tp,ulysses@2x2x1": ((2, 2, 1), "ring,tp,ulysses", False),  # no Ulysses: strided ring is fine
}


def meshes_of(world: int) -> list[tuple[int, int, int]]:
    return [m for m in MESHES if m[0] * m[1] * m[2] == world]


def _mesh_id(mesh: tuple[int, int, int]) -> str:
    return "tp{}-ring{}-uly{}".format(*mesh)


def _spec(mesh: tuple[int, int, int], order: str | tuple[str, ...] = DEFAULT_ORDER) -> MeshSpec:
    return MeshSpec.build(tp=mesh[0], ring=mesh[1], ulysses=mesh[2], order=order)


# --------------------------------------------------------------------------------------------------
# Fixtures: seeded model, checkpoints (default order), unsharded reference outputs


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("float32")


@pytest.fixture(scope="module")
def references(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {n: reference_forward(model, make_inputs(tiny_config(), n)) for n in SEQ_LENS}


@pytest.fixture(scope="module")
def checkpoints(converted) -> dict[int, str]:
    return {tp: str(converted("float32", tp)) for tp in (1, 2)}


# --------------------------------------------------------------------------------------------------
# What each rank does (top-level functions: run_ranks pickles them by reference)


def _forward(net: nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = net(**inputs, return_dict=False)
    return video, audio


def _diffs(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> dict[str, float]:
    result = {}
    for what, g, w in zip(("video", "audio"), got, want, strict=True):
        result[what] = (g - w).abs().max().item() if g.shape == w.shape else math.inf
    return result


def _live_hooks(net: nn.Module) -> dict[str, tuple[int, int, bool]]:
    """(forward pre-hooks, forward hooks, attention routed) really on the modules CP should hook."""
    modules = dict(net.named_modules())
    return {
        n: (len(modules[n]._forward_pre_hooks), len(modules[n]._forward_hooks), CP.is_routed(modules[n]))
        for n in LIVE_MODULES
    }


def _strip_forward_hooks(net: nn.Module) -> None:
    """The negative control: every forward hook and attention router gone (TP lives in the Linear classes)."""
    for module in net.modules():
        for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks"):
            getattr(module, attr).clear()
        for attr in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if hasattr(module, attr):
                getattr(module, attr).clear()
        CP.unroute_attention(module)


def _add_probe(net: nn.Module) -> dict[str, int]:
    """Record the rows of hidden_states each attention module receives (independent of the report)."""
    seen: dict[str, int] = {}
    for name in ALL_ATTN:

        def probe(module, args, kwargs, name=name):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[name] = hidden.shape[1]

        net.get_submodule(name).register_forward_pre_hook(probe, with_kwargs=True)
    return seen


def _compact_calls(checker: NeuronRuleChecker) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(c.op, c.ranks, c.shape) for c in checker.calls]


def _run_mesh(net: nn.Module, inputs: dict[int, dict], refs: dict, seq_lens) -> dict[int, dict]:
    report = net.preshard_report
    probe = _add_probe(net)
    by_len = {}
    for n in seq_lens:
        report.attention_rows.clear()
        probe.clear()
        with NeuronRuleChecker() as checker:
            out = _forward(net, inputs[n])
        by_len[n] = {
            "diff": _diffs(out, refs[n]),
            "rows": dict(report.attention_rows),
            "probe": dict(probe),
            "calls": _compact_calls(checker),
            "violations": list(checker.violations),
        }
    return by_len


def _plain_sdpa_check() -> str | float:
    """An SDPA call outside any model (say, a text encoder's) must not be routed to CP attention, even
    right after a forward that raised inside a CP attention module, and nothing patches the public name:
    max diff to torch's own CPU kernel, or what went wrong."""
    if F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention:
        return "torch.nn.functional.scaled_dot_product_attention is patched"
    q, k, v = torch.randn(3, 1, 2, 5, 8).unbind(0)
    try:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
        return (F.scaled_dot_product_attention(q, k, v) - kernel).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - reported to the parent test
        return repr(exc)


def _rank_runs(rank: int, world: int, ckpts: dict[int, str], refs: dict, with_orders: bool) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    init_gloo()
    inputs = {n: make_inputs(tiny_config(), n) for n in refs}
    runs: dict[Any, dict] = {}
    for mesh in meshes_of(world):
        tp, ring, ulysses = mesh
        net = load_sharded(H3, ckpts[tp], ring=ring, ulysses=ulysses)
        report = net.preshard_report
        run = {
            "mesh": report.mesh,
            "groups": report.groups,
            "hooks": {m: [h for h in hs if h.startswith("cp:")] for m, hs in report.hooks.items()},
            "live": _live_hooks(net),
        }
        run["by_len"] = _run_mesh(net, inputs, refs, refs)

        # Negative control: the same model with every forward hook removed, on every rank.
        _strip_forward_hooks(net)
        stripped_live = _live_hooks(net)
        probe = _add_probe(net)
        report.attention_rows.clear()
        out = _forward(net, inputs[NEGATIVE_LEN])
        run["stripped"] = {
            "diff": _diffs(out, refs[NEGATIVE_LEN]),
            "rows": dict(report.attention_rows),
            "probe": dict(probe),
            "live": stripped_live,
            "hooks": run["hooks"],  # the report still describes them: only the live check can tell
        }
        runs[mesh] = run

    if with_orders:
        for key, (mesh, order, _) in ORDER_CASES.items():
            tp, ring, ulysses = mesh
            net = load_sharded(H3, ckpts[tp], ring=ring, ulysses=ulysses, order=order)
            run = {"mesh": net.preshard_report.mesh, "groups": net.preshard_report.groups}
            checker = NeuronRuleChecker()
            try:
                with checker:
                    _forward(net, inputs[NEGATIVE_LEN])
                run["raised"] = None
            except CollectiveRuleViolation as exc:
                run["raised"] = str(exc)
            run["violations"] = list(checker.violations)
            run["checked_calls"] = _compact_calls(checker)
            run["sdpa_after"] = _plain_sdpa_check()
            # The same model, same process, without the checker: the right answer.
            run["diff"] = {n: _diffs(_forward(net, inputs[n]), refs[n]) for n in refs}
            runs[key] = run
    return runs


# --------------------------------------------------------------------------------------------------
# The spawns: one per world size, each run once per module


def _spawn(world: int, checkpoints, references) -> list[dict]:
    return run_ranks(_rank_runs, world, checkpoints, references, world == 4, timeout=300)


@pytest.fixture(scope="module")
def world2(checkpoints, references):
    return _spawn(2, checkpoints, references)


@pytest.fixture(scope="module")
def world4(checkpoints, references):
    return _spawn(4, checkpoints, references)


@pytest.fixture(scope="module")
def world8(checkpoints, references):
    return _spawn(8, checkpoints, references)


def _per_rank(request, mesh: tuple[int, int, int]) -> list[dict]:
    """Every rank's run of `mesh` (from the spawn of its world size)."""
    world = mesh[0] * mesh[1] * mesh[2]
    return [ranks[mesh] for ranks in request.getfixturevalue(f"world{world}")]


CP_MESHES = [m for m in MESHES if m[1] * m[2] > 1]
SPAWNED = [m for m in MESHES if m[0] * m[1] * m[2] > 1]


# --------------------------------------------------------------------------------------------------
# What the hooks must look like


def cp_evidence_problems(run: dict, seq_len: int, spec: MeshSpec, rank: int) -> list[str]:
    """Everything that shows CP is really in place on this rank for this forward; [] when all is well.

    `run` holds the report's cp hook descriptions ("hooks"), the hooks really registered ("live"),
    the rows `report.attention_rows` recorded ("rows") and the rows a probe saw entering every
    attention module ("probe").
    """
    problems: list[str] = []
    hooks: dict[str, list[str]] = {m: hs for m, hs in run["hooks"].items() if hs}
    cp_group = sorted(spec.group_of("cp", rank))
    over = f"over cp group {cp_group}"
    if sorted(hooks) != CP_MODULES:
        problems.append(f"cp hooks on {sorted(hooks)}, expected exactly {CP_MODULES}")

    def need(module: str, text: str) -> None:
        if not any(h.startswith(text) and h.endswith(over) for h in hooks.get(module, [])):
            problems.append(f"{module} lacks '{text} ... {over}': {hooks.get(module)}")

    need("rope", "cp: split output 0 dim 0")
    need("rope", "cp: split output 1 dim 0")
    need("transformer_blocks.0", "cp: split input hidden_states dim 1")
    for i in range(NUM_BLOCKS):
        need(f"transformer_blocks.{i}", "cp: split input adaln_indices dim 0")
    need("norm_out", "cp: split input timestep_indices dim 0")
    need("proj_out", "cp: all-gather output dim 1")
    need("audio_proj_out", "cp: all-gather output dim 1")
    for name in BLOCK_ATTN:
        entries = [h for h in hooks.get(name, []) if h.startswith("cp: attention")]
        if len(entries) != 1:
            problems.append(f"{name}: expected one 'cp: attention' hook, got {entries}")
            continue
        for axis in ("ulysses", "ring"):
            naming = f"{axis} over group {spec.group_of(axis, rank)}"
            if (naming in entries[0]) != (spec.size(axis) > 1):
                problems.append(f"{name}: '{entries[0]}' should {'' if spec.size(axis) > 1 else 'not '}say {naming}")

    # The hooks must exist on the modules, not only in the report.
    live = run["live"]
    wanted_live = {
        "": (1, 0, False),  # the per-forward reset
        "rope": (0, 1, False),
        "transformer_blocks.0": (2, 0, False),  # hidden_states split + adaln_indices split
        "norm_out": (1, 0, False),
        "proj_out": (0, 1, False),
        "audio_proj_out": (0, 1, False),
        **{f"transformer_blocks.{i}": (1, 0, False) for i in range(1, NUM_BLOCKS)},
        **dict.fromkeys(BLOCK_ATTN, (0, 0, True)),  # attention runs inside its router
    }
    for name, (pre, post, routed) in wanted_live.items():
        if live[name][0] < pre or live[name][1] < post or live[name][2] != routed:
            problems.append(
                f"{name} carries {live[name]} (pre, post forward hooks, routed), expected {(pre, post, routed)}"
            )

    rows = math.ceil(seq_len / spec.cp)
    if run["rows"] != dict.fromkeys(BLOCK_ATTN, rows):
        problems.append(f"report.attention_rows {run['rows']}, expected {rows} for each of {BLOCK_ATTN}")
    seen = {n: run["probe"].get(n) for n in BLOCK_ATTN}
    if seen != dict.fromkeys(BLOCK_ATTN, rows):
        problems.append(f"attention modules received {seen} rows, expected {rows} each")
    return problems


def _text_rows(seq_len: int) -> int:
    return len(make_inputs(tiny_config(), seq_len)["text_indices"])


# --------------------------------------------------------------------------------------------------
# Same function as the unsharded model


def test_single_rank_in_process(checkpoints, references):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    net = load_sharded(H3, checkpoints[1])
    assert not net.preshard_report.modules_with("cp:")
    for n in SEQ_LENS:
        diff = _diffs(_forward(net, make_inputs(tiny_config(), n)), references[n])
        assert max(diff.values()) <= TOL, (n, diff)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("mesh", SPAWNED, ids=_mesh_id)
def test_forward_equals_unsharded(request, mesh, seq_len):
    for rank, run in enumerate(_per_rank(request, mesh)):
        diff = run["by_len"][seq_len]["diff"]
        assert diff["video"] <= TOL and diff["audio"] <= TOL, f"rank {rank}: {diff}"


def test_uneven_heads_per_rank_are_covered():
    # tp=2 leaves 6 local heads, which Ulysses 4 does not divide (padded to 8 in the all-to-all).
    heads = tiny_config()["num_attention_heads"]
    assert any(heads // tp % uly for tp, _, uly in SPAWNED)
    assert (2, 1, 4) in SPAWNED and (2, 2, 2) in SPAWNED


# --------------------------------------------------------------------------------------------------
# The hooks are there, and attention sees only this rank's share of the rows


@pytest.mark.parametrize("mesh", CP_MESHES, ids=_mesh_id)
def test_report_and_live_hooks(request, mesh):
    spec = _spec(mesh)
    for rank, run in enumerate(_per_rank(request, mesh)):
        assert run["mesh"] == spec.to_dict()
        for n in SEQ_LENS:
            assert cp_evidence_problems({**run, **run["by_len"][n]}, n, spec, rank) == [], (rank, n)
        for name in REFINER_ATTN:  # the text refiner attends over text only: never CP
            assert not run["hooks"].get(name), run["hooks"][name]
            assert run["live"][name] == (0, 0, False)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("mesh", CP_MESHES, ids=_mesh_id)
def test_attention_sees_only_local_rows(request, mesh, seq_len):
    rows = math.ceil(seq_len / (mesh[1] * mesh[2]))
    assert rows < seq_len
    for run in _per_rank(request, mesh):
        got = run["by_len"][seq_len]
        assert got["rows"] == dict.fromkeys(BLOCK_ATTN, rows)  # no refiner entry: it is not routed
        assert got["probe"] == {**dict.fromkeys(BLOCK_ATTN, rows), **dict.fromkeys(REFINER_ATTN, _text_rows(seq_len))}


@pytest.mark.parametrize("mesh", [m for m in SPAWNED if m not in CP_MESHES], ids=_mesh_id)
def test_no_cp_hooks_without_cp(request, mesh):
    for run in _per_rank(request, mesh):
        assert not any(run["hooks"].values())
        assert all(run["by_len"][n]["rows"] == {} for n in SEQ_LENS)
        assert run["by_len"][NEGATIVE_LEN]["probe"] == {
            **dict.fromkeys(BLOCK_ATTN, NEGATIVE_LEN),
            **dict.fromkeys(REFINER_ATTN, _text_rows(NEGATIVE_LEN)),
        }


@pytest.mark.parametrize("mesh", CP_MESHES, ids=_mesh_id)
def test_negative_control_without_hooks(request, mesh):
    """Hooks stripped on every rank: the values are still right, so only the hook/row checks can tell."""
    spec = _spec(mesh)
    for rank, run in enumerate(_per_rank(request, mesh)):
        stripped = run["stripped"]
        assert max(stripped["diff"].values()) <= TOL, (rank, stripped["diff"])
        problems = cp_evidence_problems(stripped, NEGATIVE_LEN, spec, rank)
        assert problems, "the checks must fail for a model without CP hooks"
        assert any("carries" in p for p in problems)
        assert any("attention_rows" in p for p in problems)
        assert stripped["rows"] == {}
        assert stripped["probe"] == {
            **dict.fromkeys(BLOCK_ATTN, NEGATIVE_LEN),  # every rank attends over the whole sequence
            **dict.fromkeys(REFINER_ATTN, _text_rows(NEGATIVE_LEN)),
        }


# --------------------------------------------------------------------------------------------------
# Neuron's collective rules


@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("mesh", SPAWNED, ids=_mesh_id)
def test_collectives_keep_neuron_rules(request, mesh, seq_len):
    spec = _spec(mesh)
    runs = _per_rank(request, mesh)
    gathers_by_rank = {}
    for rank, run in enumerate(runs):
        got = run["by_len"][seq_len]
        assert got["violations"] == []
        calls = got["calls"]
        ops = [op for op, _, _ in calls]
        for op, ranks, shape in calls:
            if op == "all_to_all_equal":
                assert list(ranks) == spec.group_of("ulysses", rank)
                assert list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))), ranks
                assert shape[0] == spec.ulysses
            elif op == "all_gather_cat":
                assert sorted(ranks) == sorted(spec.group_of("cp", rank))
                assert shape[1] == math.ceil(seq_len / spec.cp)
            elif op == "all_reduce_sum":
                assert list(ranks) == spec.group_of("tp", rank)
            elif op == "ring_pass":
                assert list(ranks) == spec.group_of("ring", rank)
        expected_a2a = 2 * NUM_BLOCKS if spec.ulysses > 1 else 0  # q/k/v stacked in, output back
        assert ops.count("all_to_all_equal") == expected_a2a
        assert ops.count("ring_pass") == ((spec.ring - 1) * NUM_BLOCKS)
        assert ops.count("all_gather_cat") == (2 if spec.cp > 1 else 0)  # video and audio outputs
        assert (ops.count("all_reduce_sum") > 0) == (spec.tp > 1)
        gathers_by_rank[rank] = [(r, s) for op, r, s in calls if op == "all_gather_cat"]
    for group in spec.groups("cp"):  # equal sizes on every member of each all-gather
        assert len({tuple(gathers_by_rank[r]) for r in group}) == 1


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_non_default_order(world4, case):
    """Loaded with another axis order: the checker refuses strided Ulysses groups (the reason for the
    default order); without the checker the same model, same ranks, still computes the right answer
    (the gather puts the chunks back in sequence order when group order and cp order differ)."""
    mesh, order, strided = ORDER_CASES[case]
    spec = _spec(mesh, order)
    for rank, ranks in enumerate(world4):
        run = ranks[case]
        assert run["mesh"] == spec.to_dict()
        if strided:
            ulysses = spec.group_of("ulysses", rank)
            assert ulysses != list(range(ulysses[0], ulysses[0] + len(ulysses)))
            assert run["raised"] is not None and "contiguous" in run["raised"], run["raised"]
            assert str(ulysses) in run["raised"]
            assert len(run["violations"]) == 1
        else:
            assert run["raised"] is None and run["violations"] == []
            assert "ring_pass" in [op for op, _, _ in run["checked_calls"]]
        assert run["sdpa_after"] == 0.0, run["sdpa_after"]
        for n, diff in run["diff"].items():
            assert max(diff.values()) <= TOL, (rank, n, diff)


def test_load_time_order_override(world4, checkpoints):
    assert read_manifest(Path(checkpoints[2])).mesh.order == DEFAULT_ORDER
    for case in ORDER_CASES:
        mesh, order, _ = ORDER_CASES[case]
        spec, default = _spec(mesh, order), _spec(mesh)
        for rank, ranks in enumerate(world4):
            groups = ranks[case]["groups"]
            for axis in ("tp", "ring", "ulysses", "cp"):
                assert groups[axis] == spec.group_of(axis, rank), (case, rank, axis)
            assert any(groups[a] != default.group_of(a, rank) for a in ("tp", "ring", "ulysses"))
    tp_groups = {tuple(ranks["ulysses,ring,tp@2x1x2"]["groups"]["tp"]) for ranks in world4}
    assert tp_groups == {(0, 1), (2, 3)}


# --------------------------------------------------------------------------------------------------
# Neuron advice. Neuron's documented behaviour (the NKI flash kernel only for sequence lengths that are
# multiples of 512), simulated on CPU: a CPRuntime with neuron=True, its attention called on one rank.


def _single_rank_runtime(seq_len: int, neuron: bool = True) -> CP.CPRuntime:
    runtime = CP.CPRuntime(CPGroups(None, 1, 0, None, 1, 0), None, [0], neuron=neuron)
    runtime.rows_for(seq_len, "hidden_states", "test")
    return runtime


def _route(runtime: CP.CPRuntime, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(1, 2, rows, 8, generator=gen) for _ in range(3))
    out = runtime.attend("transformer_blocks.0.attn", q, k, v)
    return out, F.scaled_dot_product_attention(q, k, v)


def test_neuron_router_advises_padding_simulated_on_cpu():
    runtime = _single_rank_runtime(37)
    with pytest.warns(UserWarning, match=r"37 is not a multiple of 512.*add 475 rows \(to 512\)") as caught:
        out, want = _route(runtime, 37)
    assert "trim" not in str(caught[0].message)
    torch.testing.assert_close(out, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # advised once per length
        _route(runtime, 37)

    runtime = _single_rank_runtime(600)
    with pytest.warns(UserWarning, match=r"add 424 rows \(to 1024\) or trim 88 rows \(to 512\)"):
        _route(runtime, 600)


def test_neuron_router_silent_when_aligned_or_not_neuron():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _route(_single_rank_runtime(512), 512)
        _route(_single_rank_runtime(37, neuron=False), 37)


def test_neuron_advice_uses_ring_block_length():
    # With ring > 1 each ring step attends one block: that block's length is what the kernel sees.
    groups = CPGroups(object(), 2, 0, None, 1, 0)  # a stand-in ring group: nothing is communicated
    runtime = CP.CPRuntime(groups, None, [0, 1], neuron=True)
    layout = (CP.KeySequence(1030, 515),)
    with pytest.warns(UserWarning, match=r"length 515 .*add 509 rows \(to 1024\) or trim 3 rows \(to 512\)"):
        runtime._advise_neuron(515, layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime._advise_neuron(512, layout)
