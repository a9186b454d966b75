"""The sharded transformer inside real diffusers pipelines under gloo ranks: MiniMaxH3ModularPipeline (t2va),
FluxPipeline and WanPipeline (the built-in `wan` plan: q/k norms under tp_rms_norm), built offline from tiny
random components (tests/support/tiny_pipelines.py), run two denoising steps on 2 and 4 ranks (TP, Ulysses,
ring, TP x CP), and every rank's latents equal the unsharded pipeline's.

One spawn per world size: each rank loads every mesh of that size for every pipeline and hands back max
differences (the references are computed once, here, with the unsharded transformer), how often the pipeline
called the sharded transformer, and the hooks it carries. On one TP and one CP mesh it also runs what pipelines do
to their transformer: batches, classifier-free guidance, a callback that changes the latents, decoding,
`pipe.to(dtype)` / `pipe.to(device)`, `set_attn_processor`, a move to another device (refused in one line) and
per-rank generators (refused in one line on every rank; with the check off they silently give wrong latents).
"""

from __future__ import annotations

import pytest
import torch
from multiproc import init_gloo, run_ranks
from tiny_pipelines import CASES, MESHES

pytestmark = pytest.mark.timeout(1200)  # the spawned ranks run every case first

TOL = 1e-5  # float32
SURFACE_MESHES = {(2, 1, 1), (1, 1, 2), (2, 1, 2)}  # TP, CP and TP x CP: the variants and pipeline calls


@pytest.fixture(scope="module")
def cases():
    return {name: factory() for name, factory in CASES.items()}


@pytest.fixture(scope="module")
def checkpoints(cases, tmp_path_factory) -> dict[str, dict[int, str]]:
    from preshard.converter.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("pipelines")
    out = {}
    for name, case in cases.items():
        source = case.save_transformer(root / f"src-{name}")
        out[name] = {}
        for tp in (1, 2):
            convert_checkpoint(source, root / f"{name}-tp{tp}", tp=tp, progress=False)
            out[name][tp] = str(root / f"{name}-tp{tp}")
    return out


@pytest.fixture(scope="module")
def references(cases) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """The unsharded pipelines' outputs: the base run and every variant, from seed 0."""
    refs = {}
    for name, case in cases.items():
        pipe = case.pipeline(case.transformer(), case.components())
        for variant, options in {"base": {}, **case.variants}.items():
            refs[name, variant] = case.run(pipe, torch.Generator().manual_seed(0), **options)
    return refs


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(
        (g.float() - w.float()).abs().max().item() if g.shape == w.shape else float("inf")
        for g, w in ((got[k], want[k]) for k in want)
    )


def _surface(rank: int, case, net, pipe, refs: dict) -> dict:
    """What pipelines call on their transformer, on one mesh."""
    from preshard.errors import DeviceError, InconsistentInputsError

    out: dict = {}
    pipe.to(torch.float32)
    pipe.to("cpu")
    out["dtype"], out["device"] = str(net.dtype), str(net.device)
    out["variants"] = {
        variant: _max_diff(case.run(pipe, torch.Generator().manual_seed(0), **options), refs[case.name, variant])
        for variant, options in case.variants.items()
    }
    try:
        net.to("meta")
        out["moved"] = None
    except DeviceError as exc:
        out["moved"] = str(exc)
    out["after_move"] = _max_diff(case.run(pipe, torch.Generator().manual_seed(0)), refs[case.name, "base"])
    try:
        case.run(pipe, torch.Generator().manual_seed(rank))  # each rank seeds its own generator
        out["per_rank_seeds"] = None
    except InconsistentInputsError as exc:
        out["per_rank_seeds"] = str(exc)
    net.set_attn_processor({key: type(processor)() for key, processor in net.attn_processors.items()})
    out["set_attn_processor"] = _max_diff(case.run(pipe, torch.Generator().manual_seed(0)), refs[case.name, "base"])
    return out


def _rank(rank: int, world: int, checkpoints: dict, refs: dict) -> dict:
    from preshard.runtime.load import load_sharded

    init_gloo()
    results: dict = {}
    for name, factory in CASES.items():
        case = factory()
        cls = type(case.transformer())
        components = case.components()
        for mesh in MESHES[world]:
            tp, ring, ulysses = mesh
            net = load_sharded(cls, checkpoints[name][tp], ring=ring, ulysses=ulysses)
            calls = []
            net.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(1))
            pipe = case.pipeline(net, components)
            got = case.run(pipe, torch.Generator().manual_seed(0))
            report = net.preshard_report
            run = {
                "diff": _max_diff(got, refs[name, "base"]),
                "calls": len(calls),
                "tp_hooks": len(report.modules_with("tp:")),
                "cp_hooks": len(report.modules_with("cp: attention")),
                "input_check": report.input_check,
                "input_hook_live": any(
                    getattr(h, "__name__", "") == "_input_check_hook" for h in net._forward_pre_hooks.values()
                ),
            }
            if mesh in SURFACE_MESHES:
                run["surface"] = _surface(rank, case, net, pipe, refs)
            results[name, mesh] = run
        if world == 2:
            # Negative control: the check off, per-rank generators run to the end with wrong latents.
            net = load_sharded(cls, checkpoints[name][2], check_inputs=False)
            got = case.run(case.pipeline(net, components), torch.Generator().manual_seed(rank))
            results[name, "unchecked"] = _max_diff(got, refs[name, "base"])
    return results


@pytest.fixture(scope="module")
def world2(checkpoints, references):
    return run_ranks(_rank, 2, checkpoints, references, timeout=900)


@pytest.fixture(scope="module")
def world4(checkpoints, references):
    return run_ranks(_rank, 4, checkpoints, references, timeout=900)


def _runs(request, world: int) -> list[dict]:
    return request.getfixturevalue(f"world{world}")


ALL = [(name, world, mesh) for name in CASES for world, meshes in MESHES.items() for mesh in meshes]


def _id(case) -> str:
    name, world, (tp, ring, ulysses) = case
    return f"{name}-tp{tp}-ring{ring}-uly{ulysses}"


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_latents_equal_the_unsharded_pipeline(request, case):
    name, world, mesh = case
    tp, ring, ulysses = mesh
    for rank, results in enumerate(_runs(request, world)):
        run = results[name, mesh]
        assert run["diff"] <= TOL, (rank, run["diff"])
        assert run["calls"] == 2, run["calls"]  # the pipeline really ran the sharded model, twice
        assert run["tp_hooks"] > 0 or tp == 1, run["tp_hooks"]
        assert (run["cp_hooks"] > 0) == (ring * ulysses > 1), run["cp_hooks"]
        assert run["input_check"] == f"fingerprints compared across ranks 0-{world - 1} on every forward"
        assert run["input_hook_live"]


SURFACE = [c for c in ALL if c[2] in SURFACE_MESHES]


@pytest.mark.parametrize("case", SURFACE, ids=_id)
def test_what_pipelines_call_on_their_transformer(request, case):
    name, world, mesh = case
    for rank, results in enumerate(_runs(request, world)):
        surface = results[name, mesh]["surface"]
        assert surface["dtype"] == "torch.float32" and surface["device"] == "cpu"
        for variant, diff in surface["variants"].items():  # batch > 1, CFG, callbacks, decoded images
            assert diff <= TOL, (rank, variant, diff)
        assert surface["set_attn_processor"] <= TOL
        moved = surface["moved"]
        assert moved is not None and "\n" not in moved and "refused" in moved and "load_sharded" in moved
        assert surface["after_move"] <= TOL  # nothing moved before the refusal


@pytest.mark.parametrize("case", SURFACE, ids=_id)
def test_per_rank_generators_are_refused_on_every_rank(request, case):
    name, world, mesh = case
    messages = [results[name, mesh]["surface"]["per_rank_seeds"] for results in _runs(request, world)]
    for message in messages:
        assert message is not None, "per-rank seeds were not refused"
        assert "\n" not in message
        assert "holds other values on ranks" in message and "seed every rank's generator identically" in message
    assert len(set(messages)) == 1  # the same line on every rank


@pytest.mark.parametrize("name", list(CASES))
def test_without_the_check_per_rank_generators_give_wrong_latents(world2, name):
    """Why the check exists: nothing else notices, and the latents are wrong."""
    diffs = [results[name, "unchecked"] for results in world2]
    assert max(diffs) > 1e-2, diffs
