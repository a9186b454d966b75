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
    # the single-stream block is the assembler's own code (it joins the heads in cat([attention, mlp])): whole
    assert not any(match.startswith("single.") for match in styles)
    assert "single.attn (it has no output projection and its block _SingleStream is custom code)" in plan.description
    assert styles["blocks.*.norm1.linear"] == "replicated_input_rowwise"  # AdaLN-Zero: over a tenth of the weights
    assert "proj_out" not in styles and "blocks.*.attn.norm_q" not in styles  # whole: outside units, per head
    assert {r.match: r.divide for r in plan.attention}["blocks.*.attn"][0] == "heads"


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


def test_a_class_cp_plan_naming_every_block_of_its_default_applies_to_every_block_at_any_block_count():
    from tiny_zoo import config

    from preshard.format.plan import CPEntry, SeqDim
    from preshard.plans.from_model import check_plan_against_model, fold_every_block

    helios = config("HeliosTransformer3DModel")  # 2 blocks; the class's _cp_plan names blocks.0 to blocks.39
    plan = choose_plan(None, helios)
    assert plan.cp_config_requires == {}
    assert "names each of blocks.0.attn1 to blocks.39.attn1: applied to every block" in plan.description
    assert set(plan.cp_plan) == {"blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"}
    attn1 = plan.cp_plan["blocks.*.attn1"]  # its split (every block) and its gather (each of 40) in one entry
    assert set(attn1.split_inputs) == {"hidden_states", "rotary_emb"} and attn1.gather_output == SeqDim(1, 3)
    check_plan_against_model(plan, helios, 2, cp=2)  # a CP mesh converts
    typo = replace(plan, cp_plan={**plan.cp_plan, "blocks.0.atn1": CPEntry({}, {}, SeqDim(1))})
    with pytest.raises(PlanError, match=r"cp plan entry 'blocks\.0\.atn1' matches no module of Helios.*\(--cp 1\)"):
        check_plan_against_model(typo, helios, 2, cp=2)
    gather = CPEntry({}, {}, SeqDim(1, 3))
    # not every block from 0 (1 and 2 only), or blocks named unlike: nothing folded, kept as the class says
    assert fold_every_block({"blocks.1.ff": gather, "blocks.2.ff": gather}, {"blocks"}) is None
    unlike = {"blocks.0.ff": gather, "blocks.1.ff": CPEntry({}, {}, SeqDim(2, 3))}
    assert fold_every_block(unlike, {"blocks"}) is None
    clash = {"blocks.*.ff": gather, "blocks.0.ff": gather, "blocks.1.ff": gather}  # two gathers in one place
    assert fold_every_block(clash, {"blocks"}) is None


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


class _Joint(nn.Module):
    """A Flux-shaped toy: per-token embedders, one attention over [text; image] (or less), proj_out at the end."""

    def __init__(self, text_first: bool = True, over: str = "joined", mask: bool = False) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = nn.Linear(4, 8), nn.Linear(6, 8)
        self.proj_out = nn.Linear(8, 4)
        self.text_first, self.over, self.mask = text_first, over, mask

    def forward(self, hidden_states, encoder_hidden_states, img_ids, txt_ids, timestep):
        image, text = self.x_embedder(hidden_states), self.context_embedder(encoder_hidden_states)
        x = torch.cat([text, image] if self.text_first else [image, text], dim=1)
        if self.over == "image":
            x = image
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device) if self.mask else None
        out = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).flatten(2)
        if self.over != "image":
            t = text.shape[1]
            out = out[:, t:] if self.text_first else out[:, : out.shape[1] - t]
        return (self.proj_out(out),)


_TOY_CONFIG = {"in_channels": 4, "joint_attention_dim": 6, "axes_dims_rope": [2, 2]}


def _toy(**kwargs) -> nn.Module:
    with torch.device("meta"):
        return _Joint(**kwargs)


@pytest.mark.quick
def test_a_cp_plan_is_inferred_where_every_attention_is_over_both_sequences_joined_in_one_order():
    from preshard.format.plan import SeqDim
    from preshard.plans.infer_cp import infer_cp_plan

    found = infer_cp_plan(_toy(), _TOY_CONFIG)
    assert found.plan is not None and found.join_order == ("encoder_hidden_states", "hidden_states")
    assert found.plan[""].split_inputs == {
        "hidden_states": SeqDim(1, 3), "encoder_hidden_states": SeqDim(1, 3),
        "img_ids": SeqDim(0, 2), "txt_ids": SeqDim(0, 2),
    }  # fmt: skip
    assert found.plan["proj_out"].gather_output == SeqDim(1, 3)
    assert infer_cp_plan(_toy(text_first=False), _TOY_CONFIG).join_order == ("hidden_states", "encoder_hidden_states")


@pytest.mark.quick
@pytest.mark.parametrize(
    ("toy", "config", "why"),
    [
        ({"over": "image"}, _TOY_CONFIG, "not over the whole joined sequence"),
        ({"mask": True}, _TOY_CONFIG, "or masked"),
        ({}, {"in_channels": 4}, "no in_channels, joint_attention_dim and axes_dims_rope"),
        ({}, {**_TOY_CONFIG, "in_channels": 5}, "no top-level Linear layers take the image and text tokens"),
    ],
)
def test_no_cp_plan_is_inferred_where_the_probe_cannot_prove_it_and_it_says_why(toy, config, why):
    from preshard.plans.infer_cp import infer_cp_plan

    found = infer_cp_plan(_toy(**toy), config)
    assert found.plan is None and why in found.why_not, found.why_not


@pytest.mark.quick
def test_a_convolution_or_a_forward_without_position_ids_gets_no_cp_plan():
    from preshard.plans.infer_cp import infer_cp_plan

    model = _toy()
    with torch.device("meta"):
        model.patch = nn.Conv2d(4, 4, 1)
    assert "is a convolution" in infer_cp_plan(model, _TOY_CONFIG).why_not
    with torch.device("meta"):
        no_ids = nn.Linear(4, 4)
    assert "takes no" in infer_cp_plan(no_ids, _TOY_CONFIG).why_not


def test_which_diffusers_classes_get_an_inferred_cp_plan_and_why_the_others_do_not():
    from tiny_zoo import config

    for name in ("ChromaTransformer2DModel", "BriaTransformer2DModel", "OvisImageTransformer2DModel",
                 "LongCatImageTransformer2DModel"):  # fmt: skip
        plan = choose_plan(None, config(name))
        assert set(plan.cp_plan or {}) == {"", "proj_out"}, name
        assert plan.cp_join_order == ("encoder_hidden_states", "hidden_states"), name
        assert "CP plan inferred from a probe of its forward" in plan.description
    why = {
        "SanaVideoTransformer3DModel": "its forward takes no img_ids, txt_ids",  # its linear attention sums tokens
        "Flux3Transformer2DModel": "no top-level Linear layers take the image and text tokens",  # per-mode embedders
        "BriaFiboTransformer2DModel": "its forward does not run on the probe's inputs",  # needs text_encoder_layers
    }
    for name, reason in why.items():
        plan = choose_plan(None, config(name))
        assert plan.cp_plan is None and f"no CP plan: {reason}" in plan.description, (name, plan.description)
    flux = choose_plan("auto", config("FluxTransformer2DModel"))  # the class's own _cp_plan, not probed
    assert "_cp_plan" in flux.description and "probe" not in flux.description


def test_show_plan_writes_an_inferred_cp_plan(tmp_path):
    from tiny_diffusers import save
    from tiny_zoo import build

    source = save(build("ChromaTransformer2DModel")[0], tmp_path / "chroma")
    out = tmp_path / "plan.json"
    result = cli_runner().invoke(main, ["plan", str(source), "--show-plan", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["cp_join_order"] == ["encoder_hidden_states", "hidden_states"]
    assert data["cp_plan"]["proj_out"] == {"gather_output": {"dim": 1, "expected_dims": 3}}
    assert load_plan(out).to_dict() == data


class _Block(nn.Module):
    def __init__(self, pool: bool) -> None:
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.attn = Attention(query_dim=8, heads=2, dim_head=4)
        self.pool = pool

    def forward(self, hidden_states, scale=None):
        out = hidden_states + self.attn(hidden_states)
        if self.pool:  # mixes every token: not per token, so a split sequence would change it
            out = out + out.mean(dim=1, keepdim=True)
        return out * scale if scale is not None else out


class _Blocks(nn.Module):
    """A latent patched into tokens, a list of self-attention blocks, proj_out: the block-list shape."""

    def __init__(self, pool: bool = False, per_token: bool = False) -> None:
        super().__init__()
        self.embed, self.proj_out = nn.Linear(4, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList([_Block(pool), _Block(pool)])
        self.per_token = per_token

    def forward(self, hidden_states, timestep):
        x = self.embed(hidden_states.flatten(2).transpose(1, 2))
        scale = torch.ones(1, x.shape[1], 1, device=x.device) if self.per_token else None
        for block in self.blocks:
            x = block(x, scale)
        return (self.proj_out(x),)


@pytest.mark.quick
def test_a_block_list_probe_splits_at_the_first_block_and_gathers_proj_out_where_every_block_is_per_token():
    from preshard.format.plan import SeqDim
    from preshard.plans.infer_cp import infer_cp_plan

    with torch.device("meta"):
        plain, pooled, masked = _Blocks(), _Blocks(pool=True), _Blocks(per_token=True)
    config = {"in_channels": 4, "patch_size": 1}
    found = infer_cp_plan(plain, config)
    assert found.plan is not None and found.join_order is None, found.why_not
    assert found.plan["blocks.0"].split_inputs == {"hidden_states": SeqDim(1, 3)}
    assert found.plan["proj_out"].gather_output == SeqDim(1, 3)
    assert "a reduction (mean) over a sequence dim" in infer_cp_plan(pooled, config).why_not
    assert "its blocks take scale per token" in infer_cp_plan(masked, config).why_not


def test_block_list_classes_split_their_text_where_attention_joins_it_and_keep_it_whole_for_cross_attention():
    from tiny_zoo import config

    cogview = choose_plan(None, config("CogView4Transformer2DModel"))  # text and image joined in every attention
    assert set(cogview.cp_plan) == {"transformer_blocks.0", "rope", "proj_out"}
    assert set(cogview.cp_plan["transformer_blocks.0"].split_inputs) == {"hidden_states", "encoder_hidden_states"}
    assert cogview.cp_join_order == ("encoder_hidden_states", "hidden_states")
    pixart = choose_plan(None, config("PixArtTransformer2DModel"))  # cross-attention to the whole text
    assert set(pixart.cp_plan["transformer_blocks.0"].split_inputs) == {"hidden_states"}
    routed = {rule.match: rule.context_parallel for rule in pixart.attention}
    assert routed == {"transformer_blocks.*.attn1": True, "transformer_blocks.*.attn2": False}
    sana = choose_plan(None, config("SanaTransformer2DModel"))  # a depthwise convolution over the token grid
    assert sana.cp_plan is None and "its blocks apply a convolution (conv2d)" in sana.description


@pytest.mark.quick
def test_a_video_probe_splits_full_spatio_temporal_attention_and_refuses_attention_within_a_frame_or_across_frames():
    import assembled_video

    from preshard.format.plan import SeqDim
    from preshard.plans.from_model import build_on_meta
    from preshard.plans.infer_cp import infer_cp_plan

    config = {"in_channels": 4, "patch_size": 2, "cross_attention_dim": 16}
    full = infer_cp_plan(build_on_meta(assembled_video.AssembledVideoTransformer3DModel, config), config)
    assert full.plan is not None, full.why_not
    assert full.plan["blocks.0"].split_inputs == {"hidden_states": SeqDim(1, 3)}
    assert full.plan["pos"].split_outputs == {0: SeqDim(1, 3)}  # the position table, one row per token
    assert full.plan["proj_out"].gather_output == SeqDim(1, 3)
    assert full.local_attention == ("blocks.0.attn2", "blocks.1.attn2")  # cross-attention to the whole text
    for cls in (assembled_video.AssembledFrameTransformer3DModel, assembled_video.AssembledTemporalTransformer3DModel):
        found = infer_cp_plan(build_on_meta(cls, config), config)
        assert found.plan is None and "blocks.0.attn1 attends 35 query rows to 35 key rows (over a frame's patches " \
            "only)" in found.why_not, found.why_not  # fmt: skip


def test_video_classes_get_a_cp_plan_where_attention_is_global_and_none_where_a_table_hides_in_a_tuple():
    from tiny_zoo import config

    for name in ("CogVideoXTransformer3DModel", "AllegroTransformer3DModel", "EasyAnimateTransformer3DModel",
                 "MotifVideoTransformer3DModel"):  # fmt: skip
        plan = choose_plan(None, config(name))
        assert plan.cp_plan and "CP plan inferred from a probe of its forward" in plan.description, name
    # JoyImage passes its rotary tables ((cos, sin), text tables) to every block, computed by no module
    joy = choose_plan(None, config("JoyImageEditTransformer3DModel"))
    assert joy.cp_plan is None and "its blocks take image_rotary_emb per token" in joy.description, joy.description
