"""The table of docs/models-text-encoders.md: each text encoder beside a diffusers transformer, at its published size,
with the plan a conversion infers (`preshard.plans.hf_transformers`) and its bf16 weights per rank at TP 1, 2, 4, 8.

The configs are written out below, transcribed from each model's published config.json (the repo named beside it);
only the keys that set a shape are given, the rest are transformers' defaults. Each model is built on the meta
device (no memory, no weights); parameters are counted there, and a rank's bytes are its slice of every sharded
weight plus every replicated tensor, at 2 bytes a parameter.

    python scripts/text_encoder_table.py            # print the table (markdown)
"""

from __future__ import annotations

from typing import Any

from preshard.errors import PlanError
from preshard.plans.hf_transformers import build_transformers_on_meta, infer, vocabulary

GIB = 1024**3

# name, used by, config.json (the shape keys), where it comes from
ENCODERS: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "Qwen3-VL 32B (text + vision)", "MiniMax-H3",
        {
            "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": {
                "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            },
            "vision_config": {
                "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
                "patch_size": 16, "deepstack_visual_indexes": [8, 16, 24],
            },
        },
        "Qwen/Qwen3-VL-32B-Instruct",
    ),
    (
        "Mistral-Small 3.1 24B (text)", "FLUX.2",
        {
            "architectures": ["MistralModel"], "model_type": "mistral", "hidden_size": 5120,
            "intermediate_size": 32768, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 131072,
        },
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503, text_config",
    ),
    (
        "Gemma-3 12B (text)", "LTX-2",
        {
            "architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "hidden_size": 3840,
            "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 256, "vocab_size": 262208,
        },
        "google/gemma-3-12b-it, text_config",
    ),
    (
        "UMT5-XXL encoder", "Wan 2.1 / 2.2",
        {
            "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
            "num_heads": 64, "num_layers": 24, "vocab_size": 256384, "feed_forward_proj": "gated-gelu",
        },
        "google/umt5-xxl",
    ),
    (
        "T5-v1.1-XXL encoder", "Flux, SD3",
        {
            "architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
            "num_heads": 64, "num_layers": 24, "vocab_size": 32128, "feed_forward_proj": "gated-gelu",
        },
        "google/t5-v1_1-xxl (black-forest-labs/FLUX.1-dev text_encoder_2)",
    ),
    (
        "Qwen2.5-VL 7B (text + vision)", "QwenImage, HunyuanVideo 1.5",
        {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": {
                "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "vocab_size": 152064,
            },
            "vision_config": {
                "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
                "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112, "patch_size": 14,
            },
        },
        "Qwen/Qwen2.5-VL-7B-Instruct",
    ),
    (
        "Llama-3 8B (text)", "HunyuanVideo (LLaVA-Llama-3)",
        {
            "architectures": ["LlamaModel"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        },
        "xtuner/llava-llama-3-8b-v1_1-transformers, text_config",
    ),
]  # fmt: skip
DEGREES = (1, 2, 4, 8)


def rank_bytes(model: Any, tp: int) -> int:
    """bf16 bytes of one rank's weights under the plan inferred at `tp` (raises PlanError where it refuses)."""
    styles = {**infer(model, tp).styles, **vocabulary(model, tp)[0]}  # the vocabulary split by rows where it is
    total = 0
    for name, param in model.named_parameters():  # a tied weight once
        module, _, leaf = name.rpartition(".")
        style = styles.get(module)
        split = style is not None and style.shard_dim(leaf) is not None
        total += param.numel() // tp if split else param.numel()
    return 2 * total


def main() -> None:
    header = "| encoder | beside | parameters | " + " | ".join(f"tp{t} GiB/rank" for t in DEGREES) + " | config |"
    print(header)
    print("|" + "---|" * (4 + len(DEGREES)))
    for name, used_by, config, source in ENCODERS:
        model = build_transformers_on_meta(config)
        params = sum(p.numel() for p in model.parameters())
        cells = []
        for tp in DEGREES:
            try:
                cells.append(f"{rank_bytes(model, tp) / GIB:.2f}")
            except PlanError as exc:
                cells.append(f"refused: {str(exc).split(';')[0]}")
        print(f"| {name} | {used_by} | {params / 1e9:.2f} B | " + " | ".join(cells) + f" | {source} |")


if __name__ == "__main__":
    main()
