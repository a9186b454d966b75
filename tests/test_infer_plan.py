"""Plan inference on the meta device (plans/infer.py): what it places, what it refuses, in which order plans are
chosen (explicit > built-in > `_tp_plan` > inferred; `auto` forces inference), and `preshard plan --show-plan`
writing the chosen plan as a plan file that `--plan FILE` reads back as the same plan."""

from __future__ import annotations

import json
from dataclasses import replace

import assembled_model
import pytest
import torch
from clitools import cli_runner
from torch import nn

from preshard.cli import main
from preshard.errors import PlanError
from preshard.plans.infer import infer_plan
from preshard.plans.registry import choose_plan, load_plan


def _meta_assembled(**kwargs) -> nn.Module:
    with torch.device("meta"):
        return assembled_model.AssembledTransformer2DModel(**kwargs)


def _styles(plan) -> dict[str, str]:
    return {rule.match: rule.style.name for rule in plan.linear}


@pytest.mark.quick
def test_blocks_are_placed_by_what_they_are():
    plan = infer_plan(_meta_assembled())
    styles = _styles(plan)
    assert styles["blocks.*.attn.to_q"] == styles["blocks.*.attn.add_k_proj"] == "colwise"
    assert styles["blocks.*.attn.to_out.0"] == styles["blocks.*.attn.to_add_out"] == "rowwise"
    assert styles["blocks.*.ff.net.*.proj"] == "packed_colwise"  # SwiGLU's [hidden; gate]
    assert styles["single.proj_out"] == "packed_rowwise"  # over cat([attention, mlp])
    blocks = {r.match: r.style.blocks for r in plan.linear}
    assert blocks["single.proj_out"] == (32, 128)
    assert styles["blocks.*.norm1.linear"] == "replicated_input_rowwise"  # AdaLN-Zero: over a tenth of the weights
    assert "proj_out" not in styles and "single.attn.norm_q" not in styles  # whole: outside units, per head
    assert {r.match: r.divide for r in plan.attention}["single.attn"][0] == "heads"


@pytest.mark.quick
def test_modulation_below_a_tenth_of_the_weights_stays_whole():
    plan = infer_plan(_meta_assembled(dim=32, head_dim=64))  # wide attention: AdaLN is a small share
    assert "blocks.*.norm1.linear" not in _styles(plan)


@pytest.mark.quick
def test_a_linear_inside_attention_that_it_cannot_place_is_refused_naming_it():
    model = _meta_assembled()
    with torch.device("meta"):
        model.blocks[1].attn.to_mystery = nn.Linear(32, 32)
    with pytest.raises(PlanError, match=r"blocks\.1\.attn\.to_mystery is a Linear inside attention blocks\.1\.attn"):
        infer_plan(model)


@pytest.mark.quick
def test_a_norm_across_heads_it_cannot_split_is_refused_naming_it():
    model = _meta_assembled()
    with torch.device("meta"):
        model.blocks[0].attn.norm_q = nn.GroupNorm(4, 32)  # across every head of to_q, no TP norm style for it
    with pytest.raises(PlanError, match=r"blocks\.0\.attn\.norm_q normalises across all 32 features .* GroupNorm"):
        infer_plan(model)


@pytest.mark.quick
def test_a_layer_norm_across_heads_takes_tp_layer_norm_and_one_on_the_attention_input_stays_whole():
    model = _meta_assembled()
    with torch.device("meta"):
        for block in model.blocks:
            block.attn.norm_q = nn.LayerNorm(32)  # across every head of to_q (LuminaNext's layer_norm_across_heads)
            block.attn.pre_norm_k = nn.LayerNorm(32)  # as wide as to_k's input: on it (WanAnimate's face adapter)
    styles = _styles(infer_plan(model))
    assert styles["blocks.*.attn.norm_q"] == "tp_layer_norm"
    assert not any("pre_norm_k" in match for match in styles)


def test_plan_order_builtin_then_tp_plan_then_inferred_and_auto_forces_inference():
    wan = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 2, "attention_head_dim": 8,
           "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 1,
           "rope_max_seq_len": 32}  # fmt: skip
    assert choose_plan(None, wan).name == "wan"
    assert choose_plan("auto", wan).name == "inferred-WanTransformer3DModel"
    assert _styles(choose_plan("auto", wan))["blocks.*.attn1.norm_q"] == "tp_rms_norm"  # as the built-in plan says
    assert choose_plan(None, {"_class_name": "FluxTransformer2DModel"}).name == "FluxTransformer2DModel._tp_plan"
    assert choose_plan(None, {"_class_name": "AllegroTransformer3DModel"}).name.startswith("inferred-")


def test_a_builtin_plan_made_for_another_config_value_falls_through_to_the_inferred_plan_saying_why():
    from tiny_zoo import config

    interleaved = {**config("LTX2VideoTransformer3DModel"), "rope_type": "interleaved"}
    assert choose_plan(None, {**interleaved, "rope_type": "split"}).name == "ltx2"
    plan = choose_plan(None, interleaved)
    assert plan.name == "inferred-LTX2VideoTransformer3DModel"
    assert plan.origin.endswith("(the built-in plan for the class does not fit its config)")
    assert plan.description.endswith(
        "(passed over: built-in plan ltx2 is made for config rope_type = 'split', but the checkpoint's config.json "
        "has 'interleaved')"
    )
    assert plan.cp_plan  # the class's _cp_plan
    assert set(plan.tp_split_outputs) == {"rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"}
    assert {spec.dim for outputs in plan.tp_split_outputs.values() for spec in outputs.values()} == {-1}


def test_a_class_cp_plan_naming_blocks_the_config_lacks_is_kept_for_the_config_that_has_them():
    from tiny_zoo import config

    from preshard.format.plan import CPEntry, SeqDim
    from preshard.plans.from_model import check_plan_against_model

    helios = config("HeliosTransformer3DModel")  # 2 blocks; the class's _cp_plan names blocks.0 to blocks.39
    plan = choose_plan(None, helios)
    assert plan.cp_config_requires == {"num_layers": 40}
    check_plan_against_model(plan, helios, 2)  # TP alone converts
    with pytest.raises(PlanError, match=r"context parallelism works for config num_layers = 40, not 2 .*\(--cp 1\)"):
        check_plan_against_model(plan, helios, 2, cp=2)
    assert choose_plan(None, {**helios, "num_layers": 40}).cp_config_requires == {}
    typo = replace(plan, cp_config_requires={}, cp_plan={**plan.cp_plan, "blocks.0.atn1": CPEntry({}, {}, SeqDim(1))})
    with pytest.raises(PlanError, match=r"cp plan entry 'blocks\.0\.atn1' matches no module of Helios.*\(--cp 1\)"):
        check_plan_against_model(typo, {**helios, "num_layers": 40}, 2, cp=2)


def test_show_plan_writes_the_chosen_plan_as_a_plan_file_that_reads_back_the_same(tmp_path):
    from diffusers import CogVideoXTransformer3DModel
    from tiny_diffusers import save

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1, text_embed_dim=16,
        time_embed_dim=8, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
    )  # fmt: skip
    source = save(model, tmp_path / "cogvideox")
    out = tmp_path / "plan.json"
    result = cli_runner().invoke(main, ["plan", str(source), "--show-plan", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan_file"] == str(out)
    written = load_plan(out)
    assert written.to_dict() == choose_plan(None, json.loads((source / "config.json").read_text())).to_dict()
    assert written.name == "inferred-CogVideoXTransformer3DModel"


@pytest.mark.quick
def test_kandinsky_attention_by_its_own_names_with_the_head_width_from_its_query():
    import diffusers
    from tiny_zoo import config

    from preshard.plans.from_model import build_on_meta

    init = {k: v for k, v in config("Kandinsky5Transformer3DModel").items() if not k.startswith("_")}
    model = build_on_meta(diffusers.Kandinsky5Transformer3DModel, init)
    styles = _styles(infer_plan(model))
    attention = "visual_transformer_blocks.*.cross_attention"
    assert {styles[f"{attention}.{p}"] for p in ("to_query", "to_key", "to_value")} == {"colwise"}
    assert styles[f"{attention}.out_layer"] == "rowwise"
    assert f"{attention}.query_norm" not in styles  # over one head (8 of 32 features): whole


def _zoo_on_meta(key: str) -> nn.Module:
    import diffusers
    from tiny_zoo import config

    from preshard.plans.from_model import build_on_meta

    settings = config(key)
    init = {k: v for k, v in settings.items() if not k.startswith("_")}
    return build_on_meta(getattr(diffusers, settings["_class_name"]), init)


@pytest.mark.quick
def test_moe_experts_stored_as_parameters_are_split_by_whole_experts_and_the_router_stays_whole():
    plan = infer_plan(_zoo_on_meta("NucleusMoEImageTransformer2DModel#2"))
    styles = _styles(plan)
    assert styles["transformer_blocks.*.img_mlp.experts"] == "split_experts"  # SwiGLUExperts: [E, in, 2I], [E, I, out]
    assert styles["transformer_blocks.*.img_mlp.shared_expert.net.*.proj"] == "packed_colwise"
    assert styles["transformer_blocks.*.img_mlp.shared_expert.net.2"] == "rowwise"
    assert not any("img_mlp.gate" in match for match in styles)  # the router: whole, every rank routes alike


@pytest.mark.quick
def test_split_experts_keeps_whole_experts_per_rank_and_refuses_what_is_not_an_experts_module():
    from preshard.format.layout import TensorLayout
    from preshard.format.styles import SplitExperts, make_style

    style = make_style("split_experts")
    layout = TensorLayout.make("m.experts.gate_up_proj", style, (4, 64, 16), torch.float32, torch.float32)
    assert layout.boxes(2, 1) == [((2, 0, 0), (2, 64, 16))]  # experts 2 and 3, every feature of them
    assert layout.local_shape(2) == (2, 64, 16)
    with pytest.raises(PlanError, match=r"split_experts names m\.weight of shape \[8, 4\], which is not an experts"):
        TensorLayout.make("m.weight", style, (8, 4), torch.float32, torch.float32)
    assert "knows diffusers' SwiGLUExperts" in str(SplitExperts.unsupported(nn.Linear(4, 4)))


@pytest.mark.quick
def test_a_two_layer_mlp_that_fits_both_ways_round_takes_the_reading_that_maps_back_to_its_input():
    styles = _styles(infer_plan(_zoo_on_meta("Flux3Transformer2DModel")))  # linear_in [2h, d], linear_out [d, h]
    assert styles["single_transformer_blocks.*.ff.linear_in"] == "packed_colwise"
    assert styles["single_transformer_blocks.*.ff.linear_out"] == "rowwise"

    class Mlp(nn.Module):  # d -> d -> d: both readings map back to the input; nothing tells them apart
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    model = _meta_assembled()
    with torch.device("meta"):
        model.blocks[0].mlp = Mlp()
    assert not any(".mlp." in match for match in _styles(infer_plan(model)))  # left whole


@pytest.mark.quick
def test_an_mlp_of_the_block_s_own_linears_and_mochi_s_attention_and_per_head_rotary_tables():
    styles = _styles(infer_plan(_zoo_on_meta("MiniMaxMusic3Transformer1DModel")))
    assert styles["transformer_blocks.*.ff_in"] == "packed_colwise"  # [hidden; gate], chunk(2) in the block
    assert styles["transformer_blocks.*.ff_out"] == "rowwise"
    plan = infer_plan(_zoo_on_meta("MochiTransformer3DModel"))  # MochiAttention calls its processor, cannot swap it
    styles = _styles(plan)
    assert styles["transformer_blocks.*.attn1.to_q"] == styles["transformer_blocks.*.attn1.add_q_proj"] == "colwise"
    assert styles["transformer_blocks.*.attn1.to_out.0"] == "rowwise"
    assert {i: (s.dim, s.expected_dims) for i, s in plan.tp_split_outputs["rope"].items()} == {0: (1, 3), 1: (1, 3)}
