"""Every diffusers transformer class in tiny_zoo.json (the configs and inputs of diffusers' own model tests)
converts with no --plan (a built-in plan, the class's `_tp_plan`, or else the plan inferred from its modules) or
is refused in one line naming the module; each converted one, loaded on 2 gloo ranks, computes the unsharded
model's function within 1e-5 (fp32), and at tp2 x ulysses2 / tp2 x ring2 where its plan has CP; where that CP
plan is inferred (`plans/infer_cp.py`: the class declares no `_cp_plan`), also at sequence lengths the CP size
does not divide. One set of ranks runs every class in turn (converted once, in the parent); the results are
written for scripts/models_table.py.

Negative controls: a class assembled here from diffusers' blocks (no diffusers class, no plan) converts and
matches; without the all-reduce of its row-split layers its output is wrong. NucleusMoE with its experts enabled
(`split_experts`, each rank computing its own experts' rows) matches, and without the all-reduce of the experts'
rows its output is wrong. An inferred CP plan at uneven lengths
gives a wrong output with its attention left local (not routed across the CP group) or with its join order
reversed; one split at its first block (PixArt) is refused with its cross-attention to the whole text routed, and
is wrong with no attention routed: so the matches are the inferred plans'.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import assembled_model
import diffusers
import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save
from tiny_zoo import build, zoo

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest

TOL = 1e-5
# Classes that convert but do not load as they should, each with why (strict: fixing one fails the test until it
# is taken off the list).
KNOWN_FAILURES: dict[str, str] = {}
ASSEMBLED = assembled_model.AssembledTransformer2DModel.__name__
CP_CONTROL = "ChromaTransformer2DModel"  # an inferred CP plan (text and image split at the forward), for controls
BLOCK_CONTROL = "PixArtTransformer2DModel"  # one split at its first block, its cross-attention to the text local
RESULTS_ENV = "PRESHARD_ZOO_RESULTS"  # where to write the run's results for scripts/models_table.py


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    flat: list[torch.Tensor] = []
    for item in out if isinstance(out, (list, tuple)) else [out]:
        flat += _outputs(item) if not isinstance(item, torch.Tensor) else [item]
    return flat


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if [g.shape for g in got] != [w.shape for w in want]:
        return float("inf")
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in zip(got, want))


def uneven(inputs: dict, splits: dict[str, int], patch: int, cp: int = 2) -> dict:
    """`inputs` at sequence lengths `cp` does not divide: each input the CP plan splits at the model's forward
    (name -> sequence dim) one row shorter where `cp` divides it; where it splits inside (at a block), a latent
    `[B, C, H, W]` cropped to an odd number of patches each way and the text one token shorter where even."""
    out = dict(inputs)
    for name, dim in splits.items():
        x = out.get(name)
        if isinstance(x, torch.Tensor) and x.shape[dim] % cp == 0:
            out[name] = x.narrow(dim, 0, x.shape[dim] - 1)
    latent, text = out.get("hidden_states"), out.get("encoder_hidden_states")
    if not splits and isinstance(latent, torch.Tensor) and latent.dim() == 4:
        h, w = (n // patch - (n // patch + 1) % 2 for n in latent.shape[-2:])  # an odd number of patches
        out["hidden_states"] = latent[..., : h * patch, : w * patch]
        if isinstance(text, torch.Tensor) and text.shape[1] % cp == 0:
            out["encoder_hidden_states"] = text[:, :-1]
    return out


def _rank_all(rank: int, world: int, cases: list[tuple[str, str, int, int, dict[str, int] | None]]) -> dict:
    """Each case: (zoo key, checkpoint, ulysses, ring, None or the splits for `uneven`)."""
    from multiproc import init_gloo
    from tiny_zoo import build

    from preshard.runtime.cp import route_attention, unroute_attention
    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import ParallelExperts, ParallelLinear

    init_gloo()
    warnings.filterwarnings("ignore")
    results = {}
    for key, folder, ulysses, ring, splits in cases:
        model, inputs = assembled_model.build() if key == ASSEMBLED else build(key)
        case = f"{key}|u{ulysses}r{ring}" + ("odd" if splits is not None else "")
        if splits is not None:
            inputs = uneven(inputs, splits, getattr(model.config, "patch_size", None) or 1)
        try:
            with torch.no_grad():
                reference = _outputs(model(**inputs))
                net = load_sharded(type(model), folder, ulysses=ulysses, ring=ring)
                got = _outputs(net(**inputs))
            results[case] = {"rel": _rel(got, reference), "error": None}
        except Exception as exc:  # noqa: BLE001 - reported to the parent test
            results[case] = {"rel": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        experts = [m for m in net.modules() if isinstance(m, ParallelExperts)]
        if experts and ulysses == ring == 1:  # negative control: the experts' rows without their all-reduce
            for m in experts:
                m.tp_group = None
            with torch.no_grad():
                results[f"no-reduce-experts:{key}"] = {
                    "rel": _rel(_outputs(net(**inputs)), reference),
                    "layers": len(experts),
                }

        if key == CP_CONTROL and splits is not None:  # negative controls of the inferred CP plan
            runtime = net._preshard_cp
            runtime.join_order = tuple(reversed(runtime.join_order))
            with torch.no_grad():
                results[f"reversed-join|u{ulysses}r{ring}"] = {"rel": _rel(_outputs(net(**inputs)), reference)}
            runtime.join_order = tuple(reversed(runtime.join_order))
            routed = [m for m in net.modules() if hasattr(m, "_preshard_cp_router")]
            for m in routed:
                unroute_attention(m)
            with torch.no_grad():
                results[f"unrouted|u{ulysses}r{ring}"] = {"rel": _rel(_outputs(net(**inputs)), reference),
                                                          "modules": len(routed)}  # fmt: skip
        if key == BLOCK_CONTROL and splits is not None:  # its cross-attention routed too: the whole text is no
            cross = [(n, m) for n, m in net.named_modules() if n.endswith("attn2")]  # split sequence
            for name, m in cross:
                route_attention(m, net._preshard_cp, name)
            try:
                with torch.no_grad():
                    results[f"cross-routed|u{ulysses}r{ring}"] = {"rel": _rel(_outputs(net(**inputs)), reference)}
            except Exception as exc:  # noqa: BLE001 - refused: what the control expects, or a wrong output
                results[f"cross-routed|u{ulysses}r{ring}"] = {"rel": None, "error": f"{type(exc).__name__}: {exc}"}
            for _, m in [(n, m) for n, m in net.named_modules() if n.endswith("attn1")] + cross:
                unroute_attention(m)
            with torch.no_grad():
                results[f"block-unrouted|u{ulysses}r{ring}"] = {"rel": _rel(_outputs(net(**inputs)), reference)}
        if key == ASSEMBLED:  # negative control: the row-split layers without their all-reduce
            rowwise = [m for m in net.modules() if isinstance(m, ParallelLinear)]
            for m in rowwise:
                m.tp_group = None
            with torch.no_grad():
                results["no-reduce"] = {"rel": _rel(_outputs(net(**inputs)), reference), "layers": len(rowwise)}
    return results


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zoo")
    warnings.filterwarnings("ignore")
    converted, refused, plans = {}, {}, {}
    for key in zoo():
        model, _ = build(key)
        source = save(model, root / f"src-{key}")
        try:
            convert_checkpoint(source, root / key, tp=2, progress=False)
        except PlanError as exc:
            refused[key] = str(exc)
            continue
        converted[key] = str(root / key)
        plan = read_manifest(root / key).plan
        try:  # a config the CP plan is not made for (HunyuanVideo's token-replace I2V) runs at tp2 only
            plan.check_cp_config(model.config)
            cp = bool(plan.cp_plan)
        except PlanError:
            cp = False
        inferred = cp and plan.name.startswith("inferred-") and not getattr(type(model), "_cp_plan", None)
        at_forward = (plan.cp_plan or {}).get("")  # inputs split at the model's forward
        splits = {arg: s.dim for arg, s in at_forward.split_inputs.items()} if at_forward else {}
        plans[key] = {"name": plan.name, "cp": cp, "cp_inferred": inferred, "splits": splits}
    with pytest.MonkeyPatch.context() as patch:  # as a class a later diffusers adds: found by its config's name
        patch.setattr(diffusers, ASSEMBLED, assembled_model.AssembledTransformer2DModel, raising=False)
        source = save(assembled_model.build()[0], root / "src-assembled")
        convert_checkpoint(source, root / ASSEMBLED, tp=2, progress=False)
    converted[ASSEMBLED] = str(root / ASSEMBLED)
    plans[ASSEMBLED] = {"name": read_manifest(root / ASSEMBLED).plan.name, "cp": False, "cp_inferred": False}
    tp_cases = [(key, folder, 1, 1, None) for key, folder in converted.items()]
    meshes = ((2, 1), (1, 2))  # ulysses2, ring2
    cp_cases = [(key, folder, u, r, None) for key, folder in converted.items() if plans[key]["cp"] for u, r in meshes]
    cp_cases += [  # an inferred CP plan: also at lengths the CP size does not divide
        (key, folder, u, r, plans[key]["splits"])
        for key, folder in converted.items()
        if plans[key]["cp_inferred"]
        for u, r in meshes
    ]
    results = run_ranks(_rank_all, 2, tp_cases, timeout=600)[0]
    if cp_cases:
        results |= run_ranks(_rank_all, 4, cp_cases, timeout=600)[0]
    run = {"converted": converted, "refused": refused, "plans": plans, "results": results}
    if os.environ.get(RESULTS_ENV):
        Path(os.environ[RESULTS_ENV]).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return run


@pytest.mark.parametrize(
    "key",
    [pytest.param(k, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[k], strict=True)) if k in KNOWN_FAILURES else k
     for k in sorted(zoo())],
)  # fmt: skip
def test_class_converts_and_matches_or_is_refused(zoo_run, key):
    if key in zoo_run["refused"]:
        message = zoo_run["refused"][key]
        assert "\n" not in message, message
        # names the module (or the config value) that blocks it, or the class whose plan is inferred
        assert zoo()[key]["class"] in message or "does not divide" in message or "config" in message, message
        return
    runs = {k: v for k, v in zoo_run["results"].items() if k.split("|")[0] == key}
    assert runs, key
    for mesh, result in runs.items():
        assert result["error"] is None and result["rel"] <= TOL, (mesh, result)


def test_a_class_assembled_from_diffusers_blocks_converts_with_no_change_and_matches(zoo_run):
    assert zoo_run["plans"][ASSEMBLED]["name"] == f"inferred-{ASSEMBLED}"
    result = zoo_run["results"][f"{ASSEMBLED}|u1r1"]
    assert result["error"] is None and result["rel"] <= TOL, result
    control = zoo_run["results"]["no-reduce"]  # without the all-reduce: wrong, so the match above is the TP's
    assert control["layers"] >= 10 and control["rel"] > 1e-2, control


@pytest.mark.parametrize("key", ["NucleusMoEImageTransformer2DModel#2", "NucleusMoEImageTransformer2DModel#3"])
def test_moe_experts_split_by_rank_match_and_are_wrong_without_their_reduce(zoo_run, key):
    """#2 runs the experts in the module's per-expert loop, #3 in F.grouped_mm (`use_grouped_mm`)."""
    assert zoo_run["plans"][key]["name"] == "inferred-NucleusMoEImageTransformer2DModel"
    result = zoo_run["results"][f"{key}|u1r1"]
    assert result["error"] is None and result["rel"] <= TOL, result
    # each rank's experts alone, without their all-reduce: wrong, so the match above is the split's
    control = zoo_run["results"][f"no-reduce-experts:{key}"]
    assert control["layers"] == 1 and control["rel"] > 1e-2, control


def test_cp_plans_are_inferred_for_the_classes_a_probe_proves_and_match_at_uneven_lengths(zoo_run):
    inferred = sorted(k for k, p in zoo_run["plans"].items() if p["cp_inferred"])
    assert inferred == [
        "BriaTransformer2DModel", "ChromaTransformer2DModel", "CogView3PlusTransformer2DModel#2",
        "CogView4Transformer2DModel", "LongCatImageTransformer2DModel", "OvisImageTransformer2DModel",
        "PixArtTransformer2DModel", "PixArtTransformer2DModel#2",
    ]  # fmt: skip
    # CogView3Plus's test config has a position table of 8 x 8 patches, too small for the probe's 1 x 41 latent
    assert "CogView3PlusTransformer2DModel" not in inferred
    for key in inferred:  # the uneven lengths ran and matched (the parametrised test checks every mesh)
        for mesh in ("u2r1odd", "u1r2odd"):
            result = zoo_run["results"][f"{key}|{mesh}"]
            assert result["error"] is None and result["rel"] <= TOL, (key, mesh, result)


def test_an_inferred_cp_plan_is_wrong_without_its_attention_routing_or_with_its_join_order_reversed(zoo_run):
    for mesh in ("u2r1", "u1r2"):
        unrouted = zoo_run["results"][f"unrouted|{mesh}"]
        assert unrouted["modules"] >= 2 and unrouted["rel"] > 1e-2, (mesh, unrouted)
        reversed_join = zoo_run["results"][f"reversed-join|{mesh}"]
        assert reversed_join["rel"] > 1e-2, (mesh, reversed_join)


def test_a_block_list_cp_plan_is_refused_with_its_cross_attention_routed_and_wrong_with_none_routed(zoo_run):
    for mesh in ("u2r1", "u1r2"):
        cross = zoo_run["results"][f"cross-routed|{mesh}"]
        assert cross["rel"] is None and "context_parallel: false" in cross["error"], (mesh, cross)
        unrouted = zoo_run["results"][f"block-unrouted|{mesh}"]
        assert unrouted["rel"] > 1e-2, (mesh, unrouted)
