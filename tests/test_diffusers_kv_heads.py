"""Grouped KV heads in diffusers attention when the TP degree exceeds them: the inferred plan keeps the separate k/v
projections whole with `kv_head_select` (each rank computes the one KV head its query heads share) and makes the KV
attributes one head's worth (`one_kv_head`), as for the transformers text encoders.

ACE-Step's transformer (4 query heads, 2 KV heads; its processor reshapes keys by `attn.kv_heads`) and Lumina2's (4
and 2; its processor counts the KV heads from the key's width) converted at tp4 and run on 4 gloo ranks match the
unsharded forward within 1e-5. Negative control: each rank computing the other KV head (the k/v projections told
another rank) gives a wrong output. At tp2 the same classes split their KV heads as before (colwise), and a degree
neither dividing nor a multiple of the KV heads is refused in one line.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save
from tiny_zoo import build

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.format.plan import resolve_plan
from preshard.plans.from_model import build_on_meta
from preshard.plans.infer import infer_plan

CLASSES = ("AceStepTransformer1DModel", "Lumina2Transformer2DModel")
TOL = 1e-5


def _outputs(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out.sample


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs().max() / want.abs().max()).item()


def _rank(rank: int, world: int, folders: dict[str, str]) -> dict:
    from multiproc import init_gloo

    from preshard.format.styles import KVHeadSelect
    from preshard.runtime.load import load_sharded

    init_gloo()
    warnings.filterwarnings("ignore")
    results = {}
    for key, folder in folders.items():
        model, inputs = build(key)
        net = load_sharded(type(model), folder)
        selects = [m for m in net.modules() if isinstance(getattr(m, "preshard_style", None), KVHeadSelect)]
        with torch.no_grad():
            want = _outputs(model(**inputs))
            got = _outputs(net(**inputs))
            for m in selects:  # negative control: the KV head of the ranks two places on, not this rank's
                m.tp_rank = (rank + 2) % world
            wrong = _outputs(net(**inputs))
        results[key] = {"rel": _rel(got, want), "wrong": _rel(wrong, want), "selects": len(selects)}
    return results


@pytest.fixture(scope="module")
def tp4(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kv")
    warnings.filterwarnings("ignore")
    folders = {}
    for key in CLASSES:
        model, _ = build(key)
        convert_checkpoint(save(model, root / f"src-{key}"), root / key, tp=4, progress=False)
        folders[key] = str(root / key)
    return folders


@pytest.mark.parametrize("key", CLASSES)
def test_the_plan_at_tp4_selects_a_kv_head_and_keeps_one_kv_heads_attributes(tp4, key):
    plan = read_manifest(Path(tp4[key])).plan
    leaf = {rule.match.rpartition("attn.")[2]: rule.style for rule in plan.linear if "attn." in rule.match}
    assert leaf["to_k"].name == leaf["to_v"].name == "kv_head_select" and leaf["to_k"].blocks == 2
    assert leaf["to_q"].name == "colwise"
    attention = [rule for rule in plan.attention if rule.one_kv_head]
    assert attention and all(dict(rule.one_kv_head) in ({"kv_heads": 2}, {"inner_kv_dim": 2}) for rule in attention)
    assert all(not {"kv_heads", "inner_kv_dim"} & set(rule.divide) for rule in attention)
    assert not {"num_key_value_heads", "num_kv_heads"} & set(plan.config_divisible)


def test_tp4_over_two_kv_heads_matches_the_unsharded_forward_and_needs_the_right_kv_head(tp4):
    for result in run_ranks(_rank, 4, tp4, timeout=600):
        for key, got in result.items():
            assert got["selects"] > 0, (key, got)
            assert got["rel"] <= TOL, (key, got)
            assert got["wrong"] > 1e-3, (key, got)


@pytest.mark.parametrize("key", CLASSES)
def test_a_degree_the_kv_heads_divide_still_splits_them(key):
    model, _ = build(key)
    plan = infer_plan(build_on_meta(type(model), dict(model.config)), dict(model.config), tp=2)
    assert not [rule for rule in plan.linear if rule.style.name == "kv_head_select"]
    assert not [rule for rule in plan.attention if rule.one_kv_head]


def test_a_degree_neither_dividing_nor_a_multiple_of_the_kv_heads_is_one_line(tmp_path):
    model, _ = build("AceStepTransformer1DModel")
    with pytest.raises(PlanError) as info:
        convert_checkpoint(save(model, tmp_path / "src"), tmp_path / "tp3", tp=3, progress=False)
    assert "--tp 3 does not divide" in str(info.value) and "\n" not in str(info.value)


def test_the_tp4_plan_is_refused_at_a_degree_that_is_not_a_multiple_of_the_kv_heads(tp4):
    """At tp1 kv_head_select would compute one KV head for all 4 query heads (Lumina2 counts the KV heads from the
    key's width: silently wrong), so the plan is refused there; at tp2 each rank's one KV head is its own."""
    model, _ = build("Lumina2Transformer2DModel")
    plan = read_manifest(Path(tp4["Lumina2Transformer2DModel"])).plan
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    config = dict(model.config)
    resolve_plan(plan, shapes, 2, config=config)
    with pytest.raises(PlanError) as info:
        resolve_plan(plan, shapes, 1, config=config)
    assert "--tp 1 is not a multiple of the 2 KV heads" in str(info.value) and "\n" not in str(info.value)
