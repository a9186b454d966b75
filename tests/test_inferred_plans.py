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

Video latents (`assembled_video`, classes assembled here from diffusers blocks): with full spatio-temporal attention
CP is inferred and matches at an odd token count, and is wrong with its self-attention left local; with attention
within a frame, or alternating within a frame and across frames (Latte's layout), no CP is inferred (a CP mesh is
refused in one line), and the full-attention plan forced onto the per-frame class gives a wrong output. Every class
with CP (its own `_cp_plan`, as Wan's, or inferred) runs also at uneven lengths: a latent drawn again at an odd
number of patches each way (frames too). The run's cost (each rank's CPU seconds) is written with the results.
"""

from __future__ import annotations

import json
import os
import resource
import warnings
from pathlib import Path

import assembled_model
import assembled_video
import diffusers
import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save
from tiny_zoo import build, zoo

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.plans.from_model import cp_plan_from_diffusers

pytestmark = pytest.mark.timeout(1500)  # one fixture runs the whole zoo (about 2 min on an idle 2-core machine)
TOL = 1e-5
# Classes that convert but do not load as they should, each with why (strict: fixing one fails the test until it
# is taken off the list).
KNOWN_FAILURES: dict[str, str] = {}
ASSEMBLED = assembled_model.AssembledTransformer2DModel.__name__
CP_CONTROL = "ChromaTransformer2DModel"  # an inferred CP plan (text and image split at the forward), for controls
BLOCK_CONTROL = "PixArtTransformer2DModel"  # one split at its first block, its cross-attention to the text local
VIDEO, FRAME, TEMPORAL = assembled_video.CLASSES  # full spatio-temporal attention, per frame, alternating
FORCED = f"forced:{FRAME}"  # per-frame attention converted with the full-attention class's inferred CP plan
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


def _patches(config) -> tuple[int, int, int]:
    """(frames, height, width) per patch from a config's `patch_size` (an int, or Wan's 3-tuple) and `patch_size_t`."""
    patch = config.get("patch_size") or 1
    if isinstance(patch, (list, tuple)):
        return tuple(patch)  # type: ignore[return-value]
    return config.get("patch_size_t") or 1, patch, patch


def _odd(k: int) -> int:
    """A patch count `k` made odd: one fewer, or 3 for 2 (1 token per rank would prove little)."""
    return k if k % 2 else (k - 1 if k > 2 else 3)


def uneven(inputs: dict, splits: dict[str, int], config, cp: int = 2) -> dict:
    """`inputs` at sequence lengths `cp` does not divide: each input the CP plan splits at the model's forward
    (name -> sequence dim) one row shorter where `cp` divides it; where it splits inside (at a block), a latent
    `[B, C, H, W]` (or a video's `[B, C, F, H, W]` or `[B, F, C, H, W]`) drawn again at an odd number of patches
    each way (frames too), and the text one token shorter where even."""
    out = dict(inputs)
    for name, dim in splits.items():
        x = out.get(name)
        if isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] % cp == 0:
            out[name] = x.narrow(dim, 0, x.shape[dim] - 1)
    latent, text = out.get("hidden_states"), out.get("encoder_hidden_states")
    if "hidden_states" not in splits and isinstance(latent, torch.Tensor) and latent.dim() in (4, 5):
        pt, ph, pw = _patches(config)
        shape = list(latent.shape)
        shape[-2], shape[-1] = _odd(shape[-2] // ph) * ph, _odd(shape[-1] // pw) * pw
        if latent.dim() == 5:  # the frames: dim 2 where dim 1 is the channels, else dim 1
            frames = 2 if latent.shape[1] == config.get("in_channels") else 1
            shape[frames] = _odd(shape[frames] // pt) * pt
        out["hidden_states"] = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=latent.dtype)
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
        if key == ASSEMBLED:
            model, inputs = assembled_model.build()
        elif key == FORCED:  # 2 frames of 3 x 4 patches: each rank's 12 rows reshape into frames, wrongly
            model, inputs = assembled_video.build(FRAME, frames=2, height=6, width=8)
        elif key in assembled_video.CLASSES:
            model, inputs = assembled_video.build(key)
        else:
            model, inputs = build(key)
        case = f"{key}|u{ulysses}r{ring}" + ("odd" if splits is not None else "")
        if splits is not None:
            inputs = uneven(inputs, splits, dict(model.config))
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

        if key == VIDEO and ulysses * ring > 1:  # the video block list with its attention left local: wrong
            routed = [m for m in net.modules() if hasattr(m, "_preshard_cp_router")]
            for m in routed:
                unroute_attention(m)
            with torch.no_grad():
                results[f"video-unrouted|u{ulysses}r{ring}"] = {"rel": _rel(_outputs(net(**inputs)), reference),
                                                                "modules": len(routed)}  # fmt: skip
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
    usage = resource.getrusage(resource.RUSAGE_SELF)
    results["cpu_s"] = usage.ru_utime + usage.ru_stime  # this rank's CPU seconds, for the zoo's cost
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
            cp = bool(plan.cp_plan or getattr(type(model), "_cp_plan", None))  # Wan's own, applied at load
        except PlanError:
            cp = False
        inferred = cp and plan.name.startswith("inferred-") and not getattr(type(model), "_cp_plan", None)
        own = cp and not plan.cp_plan  # the class's _cp_plan, applied at load (Wan, ChronoEdit)
        cp_plan = cp_plan_from_diffusers(type(model)._cp_plan) if own else plan.cp_plan or {}
        at_forward = cp_plan.get("")  # inputs split at the model's forward
        splits = {arg: s.dim for arg, s in at_forward.split_inputs.items()} if at_forward else {}
        plans[key] = {"name": plan.name, "cp": cp, "cp_inferred": inferred, "cp_own": own, "splits": splits}
    with pytest.MonkeyPatch.context() as patch:  # as a class a later diffusers adds: found by its config's name
        patch.setattr(diffusers, ASSEMBLED, assembled_model.AssembledTransformer2DModel, raising=False)
        source = save(assembled_model.build()[0], root / "src-assembled")
        convert_checkpoint(source, root / ASSEMBLED, tp=2, progress=False)
        for name, cls in assembled_video.CLASSES.items():  # video latents: full, per-frame, alternating attention
            patch.setattr(diffusers, name, cls, raising=False)
            source = save(assembled_video.build(name)[0], root / f"src-{name}")
            convert_checkpoint(source, root / name, tp=2, progress=False)
        video_plan = read_manifest(root / VIDEO).plan
        convert_checkpoint(root / f"src-{FRAME}", root / FORCED, tp=2, plan=video_plan, progress=False)
    converted[ASSEMBLED] = str(root / ASSEMBLED)
    plans[ASSEMBLED] = {"name": read_manifest(root / ASSEMBLED).plan.name, "cp": False, "cp_inferred": False}
    for name in (*assembled_video.CLASSES, FORCED):
        plan = read_manifest(root / name).plan
        plans[name] = {"name": plan.name, "cp": bool(plan.cp_plan), "cp_inferred": False,
                       "description": plan.description}  # fmt: skip
    assembled = [(VIDEO, 1, 1), (VIDEO, 2, 1), (VIDEO, 1, 2), (FRAME, 1, 1), (FRAME, 2, 1), (TEMPORAL, 1, 1),
                 (TEMPORAL, 1, 2), (FORCED, 2, 1), (FORCED, 1, 2)]  # fmt: skip
    tp_cases = [(key, folder, 1, 1, None) for key, folder in converted.items()]
    meshes = ((2, 1), (1, 2))  # ulysses2, ring2
    cp_cases = [(key, folder, u, r, None) for key, folder in converted.items() if plans[key]["cp"] for u, r in meshes]
    cp_cases += [  # an inferred CP plan, or the class's own: also at lengths the CP size does not divide
        (key, folder, u, r, plans[key]["splits"])
        for key, folder in converted.items()
        if plans[key]["cp_inferred"] or plans[key].get("cp_own")
        for u, r in meshes
    ]
    tp_cases += [(key, str(root / key), u, r, None) for key, u, r in assembled if u * r == 1]
    cp_cases += [(key, str(root / key), u, r, None) for key, u, r in assembled if u * r > 1]
    ranks = run_ranks(_rank_all, 2, tp_cases, timeout=900)
    if cp_cases:
        ranks += run_ranks(_rank_all, 4, cp_cases, timeout=900)
    results = ranks[0] | (ranks[2] if cp_cases else {})
    results.pop("cpu_s")
    cpu = {"ranks": round(sum(r["cpu_s"] for r in ranks), 1), "cases": len(tp_cases) + len(cp_cases)}
    run = {"converted": converted, "refused": refused, "plans": plans, "results": results, "cost": cpu}
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
        "AllegroTransformer3DModel", "BriaTransformer2DModel", "ChromaTransformer2DModel",
        "CogVideoXTransformer3DModel", "CogView3PlusTransformer2DModel#2", "CogView4Transformer2DModel",
        "EasyAnimateTransformer3DModel", "LongCatImageTransformer2DModel", "MotifVideoTransformer3DModel",
        "OvisImageTransformer2DModel", "PixArtTransformer2DModel", "PixArtTransformer2DModel#2",
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


def test_a_video_class_with_full_spatio_temporal_attention_gets_cp_inferred_and_matches(zoo_run):
    """Assembled from diffusers blocks: its latent 3 x 3 x 5 patches (45 tokens, odd) and its text of 7 tokens."""
    plan = zoo_run["plans"][VIDEO]
    assert plan["cp"] and "CP plan inferred from a probe of its forward (text kept whole)" in plan["description"]
    for mesh in ("u1r1", "u2r1", "u1r2"):
        result = zoo_run["results"][f"{VIDEO}|{mesh}"]
        assert result["error"] is None and result["rel"] <= TOL, (mesh, result)
    for mesh in ("u2r1", "u1r2"):  # its self-attention left local (not routed across the CP group): wrong
        control = zoo_run["results"][f"video-unrouted|{mesh}"]
        assert control["modules"] == 2 and control["rel"] > 1e-2, (mesh, control)


def test_video_classes_attending_within_a_frame_or_across_frames_get_no_cp_and_the_full_plan_is_wrong_for_them(
    zoo_run,
):
    for key in (FRAME, TEMPORAL):
        plan = zoo_run["plans"][key]
        assert not plan["cp"], key
        why = "blocks.0.attn1 attends 35 query rows to 35 key rows (over a frame's patches only)"
        assert why in plan["description"], plan["description"]
        result = zoo_run["results"][f"{key}|u1r1"]  # TP alone still matches
        assert result["error"] is None and result["rel"] <= TOL, (key, result)
    for case in (f"{FRAME}|u2r1", f"{TEMPORAL}|u1r2"):  # a CP mesh: refused in one line
        refused = zoo_run["results"][case]
        assert refused["rel"] is None and "no cp_plan" in refused["error"], (case, refused)
    for mesh in ("u2r1", "u1r2"):  # the full-attention plan forced onto per-frame attention: a wrong output
        forced = zoo_run["results"][f"{FORCED}|{mesh}"]
        assert forced["error"] is None and forced["rel"] > 1e-2, (mesh, forced)
