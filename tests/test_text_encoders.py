"""transformers text encoders (the models beside the diffusers transformers) convert with no --plan, the plan inferred
from their blocks (`preshard.plans.hf_transformers`), and, loaded by 2 gloo ranks, compute the unsharded model's last
hidden state within 1e-5 (float32); grouped KV heads fewer than the TP degree are computed whole (tp4 over 2 KV heads);
without the TP forwards the output differs; verify and unshard give back the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks
from safetensors.torch import load_file

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.tools.unshard import unshard_checkpoint
from preshard.tools.verify import verify_checkpoint

TOL = 1e-5  # float32
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
PIXTRAL = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
CLIP = dict(PIXTRAL, model_type="clip_vision_model")
MROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)


def _configs() -> dict:
    """(class, config) for each family: 4 query heads over 2 KV heads where the family groups them."""
    import transformers as tf

    return {
        "qwen3vl_text": (tf.Qwen3VLTextModel, tf.Qwen3VLTextConfig(**TEXT)),  # MiniMax-H3's conditioner's text model
        "t5": (tf.T5EncoderModel, tf.T5Config(**T5, feed_forward_proj="gated-gelu")),  # Flux, SD3 (v1.1: gated)
        "umt5": (tf.UMT5EncoderModel, tf.UMT5Config(**T5, feed_forward_proj="gated-gelu")),  # Wan
        # Whole vision-language models, as the pipelines hold them: the vision tower stays whole, the stored names
        # (`model.layers.*`, `visual.*`) are renamed as transformers loads them (`model.language_model.layers.*`).
        "qwen25vl": (  # QwenImage, HunyuanVideo 1.5
            tf.Qwen2_5_VLForConditionalGeneration,
            tf.Qwen2_5_VLConfig(
                text_config=dict(TEXT, rope_parameters=MROPE), vision_config=dict(VISION, fullatt_block_indexes=[0])
            ),
        ),
        "qwen3vl": (  # MiniMax-H3's conditioner
            tf.Qwen3VLForConditionalGeneration,
            tf.Qwen3VLConfig(
                text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_interleaved=True)),
                vision_config=dict(VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
            ),
        ),
        "llava": (  # HunyuanVideo's LLaVA-Llama-3
            tf.LlavaForConditionalGeneration,
            tf.LlavaConfig(text_config=dict(TEXT, model_type="llama"), vision_config=dict(CLIP, projection_dim=16)),
        ),
        "mistral3": (  # FLUX.2's Mistral-Small 3
            tf.Mistral3ForConditionalGeneration,
            tf.Mistral3Config(text_config=dict(TEXT, model_type="mistral"), vision_config=dict(PIXTRAL, head_dim=8)),
        ),
        "gemma3": (  # LTX-2
            tf.Gemma3ForConditionalGeneration,
            tf.Gemma3Config(text_config=dict(TEXT, sliding_window=4), vision_config=PIXTRAL, mm_tokens_per_image=4),
        ),
    }


NAMES = ["qwen3vl_text", "t5", "umt5", "qwen25vl", "qwen3vl", "llava", "mistral3", "gemma3"]


def hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last hidden state (a vision-language model's: its last entry of `hidden_states`)."""
    out = model(input_ids=ids, output_hidden_states=True)
    last = getattr(out, "last_hidden_state", None)
    return last if last is not None else out.hidden_states[-1]


def build(name: str, seed: int = 0):
    """(model in eval mode with seeded random float32 weights, input_ids)."""
    cls, config = _configs()[name]
    config._attn_implementation = "eager"  # repeat_kv by num_key_value_groups: what the KV head count must fit
    torch.manual_seed(seed)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * scale + (p.dim() == 1))
    return model, torch.randint(0, 64, (2, 7), generator=g)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("text-encoders")
    out = {}
    for name in NAMES:
        model, _ = build(name)
        model.save_pretrained(root / f"src-{name}")
        convert_checkpoint(root / f"src-{name}", root / name, tp=2, progress=False)  # no plan: inferred
        out[name] = str(root / name)
    model, _ = build("qwen3vl_text")
    convert_checkpoint(root / "src-qwen3vl_text", root / "qwen3vl_text-tp4", tp=4, progress=False)
    out["qwen3vl_text-tp4"] = str(root / "qwen3vl_text-tp4")
    return out


def _strip_tp(net: torch.nn.Module) -> None:
    """The negative control: the same local shards, with the TP forwards (all-reduce, head select, output
    slices) taken off."""
    from preshard.runtime.tp import ParallelLinear, unparallelize_linear

    for module in net.modules():
        if isinstance(module, ParallelLinear):
            unparallelize_linear(module)
        for key, hook in list(module._forward_hooks.items()):  # preshard's only: transformers records outputs by hooks
            if getattr(hook, "__module__", "").startswith("preshard."):
                del module._forward_hooks[key]


def _rank(rank: int, world: int, checkpoints: dict[str, str], names: list[str]) -> dict:
    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for name in names:
        model, ids = build(name.removesuffix("-tp4"))
        with torch.no_grad():
            reference = hidden(model, ids)
            net = load_sharded(type(model), checkpoints[name])
            out = hidden(net, ids)
            _strip_tp(net)
            try:
                bare = (hidden(net, ids) - reference).abs().max().item()
            except RuntimeError:  # shapes that no longer fit are as good a sign
                bare = float("inf")
        report = net.preshard_report
        results[name] = {
            "diff": (out - reference).abs().max().item(),
            "bare": bare,
            "hooks": sorted({h for hooks in report.hooks.values() for h in hooks}),
            "heads": dict(report.heads_divided),
        }
    return results


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return run_ranks(_rank, 2, checkpoints, NAMES, timeout=300)


@pytest.fixture(scope="module")
def tp4(checkpoints):
    return run_ranks(_rank, 4, checkpoints, ["qwen3vl_text-tp4"], timeout=300)


def test_the_plan_is_inferred_by_block_kind(checkpoints):
    manifest = read_manifest(checkpoints["mistral3"])
    assert manifest.plan.name == "Mistral3ForConditionalGeneration.inferred"
    assert "agrees with transformers' base_model_tp_plan" in manifest.plan.description
    styles = {name: record.layout.style.name for name, record in manifest.tensors.items()}
    text = "model.language_model"
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"{text}.layers.1.self_attn.{proj}.weight"] == "colwise"
    assert styles[f"{text}.layers.0.self_attn.o_proj.weight"] == "rowwise"
    assert styles[f"{text}.layers.0.mlp.gate_proj.weight"] == styles[f"{text}.layers.0.mlp.up_proj.weight"] == "colwise"
    assert styles[f"{text}.layers.0.mlp.down_proj.weight"] == "rowwise"
    assert styles[f"{text}.norm.weight"] == "replicate"
    assert styles[f"{text}.embed_tokens.weight"] == "vocab_parallel"  # tied to lm_head: stored once, split by rows
    assert "lm_head.weight" not in styles
    pixtral = {s for n, s in styles.items() if n.startswith("model.vision_tower.")}  # q/k/v/o_proj, yet whole
    assert pixtral == {"replicate"}
    gemma = read_manifest(checkpoints["gemma3"])  # per-head q/k norms stay whole
    assert gemma.tensors[f"{text}.layers.0.self_attn.q_norm.weight"].layout.style.name == "replicate"
    t5 = read_manifest(checkpoints["umt5"])  # heads divided, the per-head position bias sliced on every layer
    bias = "encoder.block.*.layer.*.SelfAttention.relative_attention_bias"
    assert list(t5.plan.tp_split_outputs) == [bias]
    assert [r.divide for r in t5.plan.attention] == [("n_heads", "inner_dim")]
    vl = read_manifest(checkpoints["qwen3vl"])  # renamed as transformers loads it; the vision tower whole
    assert vl.tensors["model.language_model.layers.0.self_attn.q_proj.weight"].layout.style.name == "colwise"
    assert "model.layers.0.self_attn.q_proj.weight" not in vl.tensors
    visual = [r.layout.style.name for n, r in vl.tensors.items() if n.startswith("model.visual.")]
    assert visual and set(visual) == {"replicate"}
    tp4 = read_manifest(checkpoints["qwen3vl_text-tp4"])  # 2 KV heads at tp4: whole, one head per rank
    assert tp4.tensors["layers.0.self_attn.k_proj.weight"].layout.style.name == "kv_head_select"
    assert tp4.tensors["layers.0.self_attn.q_proj.weight"].layout.style.name == "colwise"


@pytest.mark.parametrize("name", NAMES)
def test_tp2_last_hidden_state_equals_unsharded(tp2, name):
    for rank in tp2:
        result = rank[name]
        assert result["diff"] <= TOL, result["diff"]
        assert any("all-reduce" in h for h in result["hooks"])
        assert result["bare"] > 1e3 * TOL, "without the TP forwards the output must differ"


def test_tp4_over_2_kv_heads_computes_each_ranks_kv_head(tp4):
    for rank in tp4:
        result = rank["qwen3vl_text-tp4"]
        assert result["diff"] <= TOL, result["diff"]
        assert result["bare"] > 1e3 * TOL
        assert result["heads"]["layers.0.self_attn"] == ["num_key_value_groups=1"]


def test_verify_and_unshard_give_back_the_source(checkpoints, tmp_path):
    folder = Path(checkpoints["t5"])
    source = folder.parent / "src-t5"
    assert verify_checkpoint(folder, source=source).problems == []
    unshard_checkpoint(folder, tmp_path / "back", progress=False)
    back, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(source / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)


@pytest.mark.quick
def test_a_tp_degree_neither_dividing_nor_a_multiple_of_the_kv_heads_is_refused_naming_the_module(tmp_path):
    from preshard.plans.hf_transformers import plan_for_transformers

    config = json.loads(_configs()["qwen3vl_text"][1].to_json_string())
    config.update(architectures=["Qwen3VLTextModel"], num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    with pytest.raises(PlanError, match=r"--tp 3 neither divides nor is a multiple of the 2 key/value heads of "
                       r"layers\.0\.self_attn"):  # fmt: skip
        plan_for_transformers(config, 3)
    with pytest.raises(PlanError, match=r"--tp 4 does not divide the 6 attention heads of layers\.0\.self_attn"):
        plan_for_transformers(config, 4)


@pytest.mark.quick
def test_a_context_parallel_mesh_is_refused_for_a_text_encoder(tmp_path):
    model, _ = build("qwen3vl_text")
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(PlanError, match="tensor parallel only, not context parallel"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", tp=2, cp=2, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_the_planner_reads_a_renamed_checkpoint_and_lists_the_degrees_the_heads_allow(tmp_path):
    from preshard.tools.planner import plan_meshes

    model, _ = build("qwen25vl")
    model.save_pretrained(tmp_path / "src")
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(tmp_path / "src" / "model.safetensors")
    report = plan_meshes(tmp_path / "src")
    assert report.tp_degrees == [1, 2, 4]  # 4 query heads over 2 KV heads: tp4 computes one KV head per rank


def test_reshard_infers_the_plan_again_at_the_new_degree(checkpoints, tmp_path):
    from preshard.tools.reshard import reshard_checkpoint

    reshard_checkpoint(checkpoints["qwen3vl_text"], tmp_path / "tp4", tp=4, progress=False)
    manifest = read_manifest(tmp_path / "tp4")  # 2 KV heads: split at tp2, computed whole at tp4
    assert manifest.tensors["layers.0.self_attn.k_proj.weight"].layout.style.name == "kv_head_select"
    reshard_checkpoint(checkpoints["qwen3vl"], tmp_path / "vl-tp1", tp=1, progress=False)  # module names kept
    assert set(read_manifest(tmp_path / "vl-tp1").tensors) == set(read_manifest(checkpoints["qwen3vl"]).tensors)


@pytest.mark.quick
def test_weights_inside_attention_that_inference_cannot_place_are_refused_naming_the_module():
    from torch import nn

    from preshard.plans.hf_transformers import infer

    class Attention(nn.Module):  # OLMo-2's q/k norm: across every head at once, which TP would split
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = 8
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
            self.o_proj, self.q_norm = nn.Linear(32, 32), nn.RMSNorm(32)

    model = nn.Sequential(Attention())
    with pytest.raises(PlanError, match=r"0\.q_norm \(RMSNorm\) holds weights inside the attention 0 that inference"):
        infer(model, 2)
    assert infer(model, 1).styles["0.q_proj"].name == "colwise"  # at tp=1 the same walk places it; nothing splits


@pytest.mark.quick
def test_another_models_class_is_refused_at_load(tmp_path):
    import transformers as tf

    from preshard.errors import MismatchError
    from preshard.runtime.construct import build_model

    model, _ = build("qwen3vl_text")
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    with pytest.raises(
        MismatchError, match=r"holds a Qwen3VLTextModel checkpoint \(qwen3_vl_text\), not T5EncoderModel"
    ):
        build_model(tf.T5EncoderModel, tmp_path / "src", config)
    built = build_model(type(model), tmp_path / "src", config)
    assert not built.training and next(built.parameters()).device.type == "meta"


@pytest.mark.quick
def test_the_vocabulary_is_split_as_memory_asks_and_kept_whole_where_the_degree_does_not_divide_it():
    from dataclasses import replace

    from preshard.format.plan import resolve_plan
    from preshard.plans.hf_transformers import plan_for_transformers

    def vocab_rules(plan):
        return {r.match: r.style.name for r in plan.linear if r.style.name in ("vocab_parallel", "colwise_gather")}

    config = json.loads(_configs()["qwen3vl_text"][1].to_json_string()) | {"architectures": ["Qwen3VLTextModel"]}
    assert vocab_rules(plan_for_transformers(config, 2)) == {"embed_tokens": "vocab_parallel"}
    odd = plan_for_transformers(config | {"vocab_size": 63}, 2)  # 63 rows do not split in two: whole, and why
    assert vocab_rules(odd) == {} and "vocabulary whole at tp=2: 2 does not divide its 63 rows" in odd.description
    small = plan_for_transformers(config | {"vocab_size": 8}, 2)  # 256 of ~18 600 parameters: under 2 %
    assert vocab_rules(small) == {} and "under the 2% split by vocabulary rows" in small.description
    # A plan file naming the split where the degree does not divide the rows is refused, naming the degrees.
    split = plan_for_transformers(config, 2)
    split = replace(split, linear=tuple(r for r in split.linear if r.match == "embed_tokens"), attention=())
    with pytest.raises(PlanError, match=r"--tp 2 does not divide embed_tokens\.weight dim 0 \(size 63\)"):
        resolve_plan(split, {"embed_tokens.weight": ((63, 32), torch.float32)}, 2)
