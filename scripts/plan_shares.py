"""Where the weights of the video models with built-in plans lie, at full size, and which TP degrees they allow.

    python scripts/plan_shares.py            # a table: parameters, share of each group of weights, TP degrees
    python scripts/plan_shares.py --json

Each model is built on the meta device (no memory, no download) from its published config (the values below, as
the diffusers configs on the Hub give them), its built-in plan resolved against its parameter names and shapes, and
every parameter counted into a group by its style and role: attention projections (q/k/v colwise, out rowwise),
q/k norms across heads (tp_rms_norm), feed-forward (up colwise, down rowwise), and what stays replicated (of which
the modulation/AdaLN projections are named, to show they do not dominate these models). The TP degrees are those
every split dimension and every head count the plan names divide.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from preshard.format.plan import resolve_plan, valid_tp_degrees
from preshard.plans.from_model import build_on_meta, import_model_class
from preshard.plans.registry import choose_plan

_WAN14 = dict(
    patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, eps=1e-6,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)  # fmt: skip
_WAN13 = {**_WAN14, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
_I2V = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
_LTX2 = dict(
    in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
    audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32, audio_attention_head_dim=64,
    audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840, norm_elementwise_affine=False,
    rope_type="split", use_prompt_embeddings=True, gated_attn=False, cross_attn_mod=False,
)  # fmt: skip

MODELS = {
    "Wan2.1-T2V-14B (and each Wan2.2-T2V-A14B expert)": ("WanTransformer3DModel", _WAN14),
    "Wan2.1-I2V-14B": ("WanTransformer3DModel", {**_WAN14, **_I2V}),
    "Wan2.2-I2V-A14B (each expert)": ("WanTransformer3DModel", {**_WAN14, "in_channels": 36}),
    "Wan2.2-TI2V-5B": (
        "WanTransformer3DModel",
        {
            **_WAN14,
            "num_attention_heads": 24,
            "ffn_dim": 14336,
            "num_layers": 30,
            "in_channels": 48,
            "out_channels": 48,
        },
    ),
    "Wan2.1-T2V-1.3B": ("WanTransformer3DModel", _WAN13),
    "SkyReels-V2-T2V-14B": ("SkyReelsV2Transformer3DModel", _WAN14),
    "SkyReels-V2-I2V-14B": ("SkyReelsV2Transformer3DModel", {**_WAN14, **_I2V}),
    "ChronoEdit-14B": ("ChronoEditTransformer3DModel", {**_WAN14, **_I2V, "rope_temporal_skip_len": 8}),
    "Wan2.1-VACE-14B": (
        "WanVACETransformer3DModel",
        {**_WAN14, "vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96},
    ),
    "LTX-2": ("LTX2VideoTransformer3DModel", _LTX2),
    "LTX-2.3": (
        "LTX2VideoTransformer3DModel",
        {
            **_LTX2,
            "gated_attn": True,
            "cross_attn_mod": True,
            "audio_gated_attn": True,
            "audio_cross_attn_mod": True,
            "use_prompt_embeddings": False,
            "perturbed_attn": True,
        },
    ),  # fmt: skip
}
GROUPS = ["attention", "qk norms", "feed-forward", "replicated: modulation", "replicated: other"]
_MODULATION = ("time_proj", "time_embed.linear", "audio_time_embed.linear", "av_cross_attn_", "prompt_adaln")


def _group(name: str, style: str) -> str:
    if style == "tp_rms_norm":
        return "qk norms"
    if style != "replicate":
        return "feed-forward" if (".ffn." in name or ".ff." in name or ".audio_ff." in name) else "attention"
    return "replicated: modulation" if any(m in name for m in _MODULATION) else "replicated: other"


def measure(class_name: str, config: dict) -> dict:
    model = build_on_meta(import_model_class(class_name), config)
    full_config = {"_class_name": class_name, **dict(model.config)}
    plan = choose_plan(None, full_config)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    resolved = resolve_plan(plan, shapes, 1, config=full_config, check_divisible=False)
    counts = dict.fromkeys(GROUPS, 0)
    for name, layout in resolved.items():
        counts[_group(name, layout.style.name)] += math.prod(layout.shape)
    total = sum(counts.values())
    return {
        "class": class_name,
        "plan": plan.name,
        "parameters": total,
        "shares": {group: count / total for group, count in counts.items()},
        "tp_degrees": valid_tp_degrees(plan, resolved, full_config),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = {label: measure(cls, config) for label, (cls, config) in MODELS.items()}
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    heads = ["model", "plan", "params", "attn", "qk norm", "ffn", "modul.", "other", "TP degrees"]
    print(f"{heads[0]:<50} {heads[1]:<9} {heads[2]:>8} " + " ".join(f"{h:>7}" for h in heads[3:8]) + f"  {heads[8]}")
    for label, row in rows.items():
        shares = " ".join(f"{100 * row['shares'][g]:>6.2f}%" for g in GROUPS)
        degrees = ", ".join(map(str, row["tp_degrees"]))
        print(f"{label:<50} {row['plan']:<9} {row['parameters'] / 1e9:>7.2f}B {shares}  {degrees}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
