"""Large diffusers families that declare no `_tp_plan` convert with preshard's built-in plan (no --plan) and,
loaded by 2 gloo ranks, compute the unsharded model's function: HunyuanVideo, HunyuanVideo 1.5, HunyuanImage 2.1,
Cosmos and SD3 (3.5 Large's layout and 3.5 Medium's, with its second attention); SD3 also at ulysses=2.
A TP degree the heads do not allow is refused at conversion in one line naming what works; every family here has a CP
plan (tested at any length in test_cp_masked.py)."""

from __future__ import annotations

import pytest
import torch
from clitools import assert_one_line, cli_runner
from multiproc import init_gloo, run_ranks
from tiny_builtin import BUILDERS, build
from tiny_diffusers import save

from preshard.cli import main
from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.format.plan import Plan, resolve_plan
from preshard.plans.registry import load_plan

pytest.importorskip("diffusers")

TOL = 1e-5  # float32
MODELS = list(BUILDERS)
PLANS = {
    "hunyuanvideo": "hunyuanvideo",
    "hunyuanvideo15": "hunyuanvideo15",
    "hunyuanimage21": "hunyuanimage21",
    "cosmos": "cosmos",
    "sd3": "sd3",
    "sd35_medium": "sd3",
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("builtin-sources")
    return {name: str(save(build(name)[0], root / name)) for name in MODELS}


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("builtin-plans")
    for name, source in sources.items():
        convert_checkpoint(source, root / name, tp=2, progress=False)  # no plan: the built-in one for the class
    return {name: str(root / name) for name in MODELS}


def _rank(rank: int, world: int, checkpoints: dict[str, str], ulysses: int, names: list[str]) -> dict:
    from tiny_builtin import build

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for name in names:
        model, inputs = build(name)
        with torch.no_grad():
            reference = model(**inputs, return_dict=False)[0]
            net = load_sharded(type(model), checkpoints[name], ulysses=ulysses)
            out = net(**inputs, return_dict=False)[0]
            report = net.preshard_report
            result = {
                "diff": (out - reference).abs().max().item(),
                "shape": tuple(out.shape) == tuple(reference.shape),
                "hooks": {m: list(h) for m, h in report.hooks.items()},
                "rows": dict(report.attention_rows),
            }
            if ulysses == 1:  # negative control: the AdaLN projections' partial sums, not all-reduced
                for module_name, module in net.named_modules():
                    if module_name.endswith("norm1.linear"):
                        module.tp_group = None
                result["diff_without_adaln_reduce"] = (net(**inputs, return_dict=False)[0] - reference).abs().max()
        results[name] = result
    return results


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return run_ranks(_rank, 2, checkpoints, 1, MODELS, timeout=300)


@pytest.fixture(scope="module")
def ulysses2(sources, tmp_path_factory):
    """SD3 converted for tp=1 and loaded by 2 Ulysses ranks (TP x CP composition is covered for Flux and QwenImage;
    2 ranks keep this cheap on a 2-core CI runner)."""
    root = tmp_path_factory.mktemp("builtin-cp")
    names = ["sd3", "sd35_medium"]
    for name in names:
        convert_checkpoint(sources[name], root / name, tp=1, ulysses=2, progress=False)
    return run_ranks(_rank, 2, {name: str(root / name) for name in names}, 2, names, timeout=300)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_forward_equals_unsharded(tp2, name):
    for rank in tp2:
        result = rank[name]
        assert result["shape"] and result["diff"] <= TOL, result["diff"]
        hooks = [h for hs in result["hooks"].values() for h in hs]
        assert any("replicated_input_rowwise" in h for h in hooks) == (name != "cosmos")
        assert any(h.startswith("tp: rowwise") for h in hooks)
        if name != "cosmos":  # the control: the AdaLN projection's partial sums alone give a wrong output
            assert result["diff_without_adaln_reduce"] > 1e-2


@pytest.mark.parametrize("name", ["sd3", "sd35_medium"])
def test_sd3_ulysses2_forward_equals_unsharded_with_the_cp_hooks(ulysses2, name):
    for rank in ulysses2:
        result = rank[name]
        assert result["diff"] <= TOL, result["diff"]
        hooks = result["hooks"]
        assert any(h.startswith("cp: split input hidden_states") for h in hooks["transformer_blocks.0"])
        assert any(h.startswith("cp: split input encoder_hidden_states") for h in hooks["transformer_blocks.0"])
        assert any(h.startswith("cp: all-gather output") for h in hooks["proj_out"])
        # every attention (3.5 Medium's image-only attn2 too) saw this rank's half of its sequence
        expected = {"transformer_blocks.0.attn": 12, "transformer_blocks.1.attn": 12}
        if name == "sd35_medium":
            expected["transformer_blocks.0.attn2"] = 8
        assert result["rows"] == expected


def test_the_plans_come_from_the_builtin_files(checkpoints):
    for name, plan_name in PLANS.items():
        manifest = read_manifest(checkpoints[name])
        assert manifest.plan.name == plan_name, name
        assert manifest.plan.to_dict() == load_plan(plan_name).to_dict()
    hv = read_manifest(checkpoints["hunyuanvideo"]).tensors
    proj_out = hv["single_transformer_blocks.0.proj_out.weight"].layout
    assert proj_out.style.name == "packed_rowwise" and proj_out.blocks == (32, 128)  # cat([attention, mlp])
    assert hv["transformer_blocks.0.norm1.linear.weight"].layout.style.name == "replicated_input_rowwise"
    assert hv["transformer_blocks.0.attn.norm_q.weight"].layout.style.name == "replicate"  # per head: whole


def test_packed_blocks_follow_the_widths_of_their_producers():
    """`blocks_from` reads each block's size off the checkpoint: one plan fits every width of the family; a path
    that names no Linear is refused naming the rule."""
    rule = next(r for r in load_plan("hunyuanvideo").linear if r.match == "single_transformer_blocks.*.proj_out")
    plan = Plan("p", (rule,))
    for width, mlp in ((32, 128), (3072, 12288), (48, 96)):
        tensors = {
            "single_transformer_blocks.0.attn.to_q.weight": ((width, width), torch.bfloat16),
            "single_transformer_blocks.0.proj_mlp.weight": ((mlp, width), torch.bfloat16),
            "single_transformer_blocks.0.proj_out.weight": ((width, width + mlp), torch.bfloat16),
        }
        assert resolve_plan(plan, tensors, 2)["single_transformer_blocks.0.proj_out.weight"].blocks == (width, mlp)
    bad = {"name": "p", "linear": [{"match": "b.proj_out", "style": "packed_rowwise", "blocks_from": ["attn.to_x"]}]}
    with pytest.raises(PlanError, match=r"'b\.proj_out' takes a block size from b\.attn\.to_x\.weight"):
        resolve_plan(Plan.from_dict(bad), {"b.proj_out.weight": ((4, 8), torch.float32)}, 2)
    for rule, message in (
        ({"style": "rowwise", "blocks_from": ["a"]}, "only applies to packed styles, not to rowwise"),
        ({"style": "packed_rowwise", "blocks_from": ["a"], "blocks": 2}, "give 'blocks' or 'blocks_from'"),
        ({"style": "packed_rowwise", "blocks_from": ["../a"]}, "must be a list of module paths"),
        ({"style": "packed_rowwise", "blocks_from": []}, "must be a list of module paths"),
        ({"style": ["packed_rowwise"], "blocks_from": ["a"]}, "unknown style"),
    ):
        with pytest.raises(PlanError, match=message):
            Plan.from_dict({"name": "p", "linear": [{"match": "b.proj_out", **rule}]})


def test_a_tp_degree_the_heads_do_not_allow_is_refused_naming_the_allowed_degrees(sources, tmp_path):
    result = cli_runner().invoke(
        main, ["convert", sources["hunyuanvideo"], str(tmp_path / "out"), "--tp", "3", "--no-progress"]
    )
    line = assert_one_line(result.exit_code, result.stderr, 2, "--tp 3 does not divide", stdout=result.stdout)
    assert line.endswith("TP degrees that work for this checkpoint: 1, 2, 4")
    assert not (tmp_path / "out").exists()


def test_every_family_here_has_a_cp_plan_and_a_cp_mesh_converts(sources, tmp_path):
    """Each built-in plan carries a CP plan (tested at any length in test_cp_masked.py and test_cp_any_length.py),
    so a CP mesh converts and the manifest records how CP splits."""
    for plan_name in set(PLANS.values()):
        assert load_plan(plan_name).cp_plan, plan_name
    result = cli_runner().invoke(
        main,
        ["convert", sources["hunyuanvideo"], str(tmp_path / "out"), "--tp", "2", "--ulysses", "2", "--no-progress"],
    )
    assert result.exit_code == 0, result.stderr
    assert "transformer_blocks.0" in read_manifest(tmp_path / "out").plan.cp_plan


def test_a_variant_with_a_projection_the_plan_leaves_whole_is_refused_at_conversion(tmp_path):
    """Cosmos 2.5's image context adds q_img/k_img/v_img to the cross-attention whose heads the plan divides: left
    whole they would feed every head to a rank that reshapes by its own head count, so the conversion is refused
    (before writing anything) naming the projection; tp=1 still converts."""
    from diffusers import CosmosTransformer3DModel
    from tiny_diffusers import randomize

    model, _ = BUILDERS["cosmos"]()
    variant = CosmosTransformer3DModel(**{**dict(model.config), "img_context_dim_in": 8, "img_context_dim_out": 48})
    source = save(randomize(variant), tmp_path / "src")
    result = cli_runner().invoke(main, ["convert", str(source), str(tmp_path / "out"), "--tp", "2", "--no-progress"])
    assert_one_line(
        result.exit_code, result.stderr, 2, "built-in plan cosmos: transformer_blocks.0.attn2.q_img is a Linear "
        "inside transformer_blocks.0.attn2, whose heads the plan divides", "or use --tp 1", stdout=result.stdout,
    )  # fmt: skip
    assert not (tmp_path / "out").exists()
    convert_checkpoint(source, tmp_path / "tp1", tp=1, progress=False)
