"""The published shapes of every model family preshard shards, for the full-size memory table.

Each entry names the public checkpoint and the transformer config it publishes, as the constructor arguments
that differ from the diffusers 0.42.1 class defaults, with where that config comes from. `write_published` writes
the model's real safetensors headers over holes (`examples.synthetic`): every tensor at its full shape, no data,
no disk, so `preshard plan` and the memory table see exactly what the real checkpoint would show them.

Dtypes are bf16, with the class's `_keep_in_fp32_modules` in fp32: what a bf16 load holds per rank (several of
these repositories store fp32 or mixed files; convert with `--dtype bf16` to get these figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preshard.errors import PreshardError
from preshard.examples.synthetic import TensorSpecs, model_tensors, write_safetensors_checkpoint

GIB = 1 << 30


@dataclass(frozen=True)
class Published:
    """One public checkpoint's transformer: its diffusers class and config, and where the config comes from."""

    name: str  # as the table shows it
    class_name: str
    repo: str  # the Hub repository (the transformer subfolder)
    source: str  # where the config below was taken from
    config: dict[str, Any] = field(default_factory=dict)  # constructor arguments differing from the defaults


_CONVERT = "diffusers' scripts/{} (the config the published diffusers checkpoint was converted with)"
# Wan 14B (T2V; the class defaults), its image-to-video additions, and LTX-2, as their published configs give them.
_WAN14: dict[str, Any] = dict(
    patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, eps=1e-6,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)  # fmt: skip
_WAN_I2V: dict[str, Any] = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
_LTX2: dict[str, Any] = dict(
    in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
    audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32, audio_attention_head_dim=64,
    audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840, norm_elementwise_affine=False,
    rope_type="split", use_prompt_embeddings=True, gated_attn=False, cross_attn_mod=False,
)  # fmt: skip

PUBLISHED: tuple[Published, ...] = (
    Published(
        "MiniMax-H3", "MiniMaxH3Transformer3DModel", "MiniMax-AI/MiniMax-H3 (transformer)",
        "the class defaults, which are the released model (33.1 B parameters, 638 tensors)",
    ),
    Published(
        "FLUX.1-dev", "FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev (transformer)",
        "transformer/config.json: the class defaults with guidance_embeds true", {"guidance_embeds": True},
    ),
    Published(
        "FLUX.2-dev", "Flux2Transformer2DModel", "black-forest-labs/FLUX.2-dev (transformer)",
        "the class defaults, which are FLUX.2-dev (8 double, 48 single blocks, 48 heads)",
    ),
    Published(
        "Qwen-Image", "QwenImageTransformer2DModel", "Qwen/Qwen-Image (transformer)",
        "the class defaults, which are Qwen-Image (60 blocks, 24 heads)",
    ),
    Published(
        "Qwen-Image 2.1", "QwenImage21Transformer2DModel", "Qwen/Qwen-Image-2.1 (transformer)",
        "the class defaults of diffusers 0.42.1 (32 blocks, 32 heads); not checked against the repository",
    ),
    Published(
        "HunyuanVideo", "HunyuanVideoTransformer3DModel", "hunyuanvideo-community/HunyuanVideo (transformer)",
        "the class defaults, which are HunyuanVideo T2V (20 double, 40 single blocks, 24 heads)",
    ),
    Published(
        "HunyuanVideo 1.5", "HunyuanVideo15Transformer3DModel",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v (transformer)",
        "the class defaults, which are HunyuanVideo 1.5 (54 blocks, 16 heads; the 480p/720p and t2v/i2v variants "
        "share these shapes)",
    ),
    Published(
        "HunyuanImage 2.1", "HunyuanImageTransformer2DModel", "hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
        _CONVERT.format("convert_hunyuan_image_to_diffusers.py") + ": the class defaults with the ByT5 glyph "
        "projection (text_embed_2_dim 1472)", {"text_embed_2_dim": 1472},
    ),
    Published(
        "Cosmos 1.0 14B", "CosmosTransformer3DModel", "nvidia/Cosmos-1.0-Diffusion-14B-Text2World (transformer)",
        _CONVERT.format("convert_cosmos_to_diffusers.py") + " for Cosmos-1.0-Diffusion-14B-Text2World",
        {"num_attention_heads": 40, "num_layers": 36, "rope_scale": [2.0, 2.0, 2.0]},
    ),
    Published(
        "SD 3.5 Large", "SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-large (transformer)",
        "transformer/config.json (38 blocks, 38 heads of 64, qk RMSNorm, no dual attention)",
        {
            "num_layers": 38, "num_attention_heads": 38, "attention_head_dim": 64, "caption_projection_dim": 2432,
            "pooled_projection_dim": 2048, "joint_attention_dim": 4096, "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
        },
    ),
    Published(
        "Wan 2.1 T2V 14B", "WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-14B-Diffusers (transformer)",
        _CONVERT.format("convert_wan_to_diffusers.py") + " for Wan-T2V-14B (= the class defaults; also each expert "
        "of Wan2.2-T2V-A14B)",
    ),
    Published(
        "Wan 2.1 I2V 14B", "WanTransformer3DModel", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers (transformer)",
        _CONVERT.format("convert_wan_to_diffusers.py") + " for Wan-I2V-14B (image cross-attention)", _WAN_I2V,
    ),
    Published(
        "Wan 2.2 TI2V 5B", "WanTransformer3DModel", "Wan-AI/Wan2.2-TI2V-5B-Diffusers (transformer)",
        _CONVERT.format("convert_wan_to_diffusers.py") + " for Wan-TI2V-5B",
        {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48, "out_channels": 48},
    ),
    Published(
        "Wan 2.1 T2V 1.3B", "WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (transformer)",
        _CONVERT.format("convert_wan_to_diffusers.py") + " for Wan-T2V-1.3B",
        {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
    ),
    Published(
        "SkyReels-V2 14B", "SkyReelsV2Transformer3DModel", "Skywork/SkyReels-V2-T2V-14B-720P-Diffusers (transformer)",
        _CONVERT.format("convert_skyreelsv2_to_diffusers.py") + " for SkyReels-V2-T2V-14B-720P",
        {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
    ),
    Published(
        "ChronoEdit 14B", "ChronoEditTransformer3DModel", "nvidia/ChronoEdit-14B-Diffusers (transformer)",
        "Wan-I2V-14B's shapes with rope_temporal_skip_len 8, as its transformer/config.json gives them; not checked "
        "against the repository", {**_WAN14, **_WAN_I2V, "rope_temporal_skip_len": 8},
    ),
    Published(
        "Wan 2.1 VACE 14B", "WanVACETransformer3DModel", "Wan-AI/Wan2.1-VACE-14B-diffusers (transformer)",
        _CONVERT.format("convert_wan_to_diffusers.py") + " for Wan-VACE-14B (VACE blocks every 5 layers)",
        {**_WAN14, "vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96},
    ),
    Published(
        "LTX-2", "LTX2VideoTransformer3DModel", "Lightricks/LTX-2 (transformer)",
        "48 blocks, video 32 x 128 and audio 32 x 64 heads, rope_type split, as its transformer/config.json gives "
        "them; not checked against the repository", _LTX2,
    ),
    Published(
        "LTX-2.3", "LTX2VideoTransformer3DModel", "Lightricks/LTX-2.3 (transformer)",
        "LTX-2's shapes with gated attention, cross-attention modulation and perturbed attention, as its "
        "transformer/config.json gives them; not checked against the repository",
        {
            **_LTX2, "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True,
            "audio_cross_attn_mod": True, "use_prompt_embeddings": False, "perturbed_attn": True,
        },
    ),
)  # fmt: skip


def published(name: str) -> Published:
    """The entry called `name`.

    Raises:
        PreshardError: no such entry (the message lists them).
    """
    for entry in PUBLISHED:
        if entry.name == name:
            return entry
    raise PreshardError(f"no published model {name!r}; known: {', '.join(e.name for e in PUBLISHED)}")


def published_tensors(entry: Published) -> tuple[TensorSpecs, dict[str, Any]]:
    """Every tensor of `entry` at full size as {name: (dtype code, shape)}, and its config.json dict."""
    try:
        import diffusers
    except ImportError:  # pragma: no cover - depends on the environment
        raise PreshardError("the published shapes need diffusers: pip install 'preshard[diffusers]'") from None
    cls = getattr(diffusers, entry.class_name, None)
    if cls is None:
        raise PreshardError(f"diffusers {diffusers.__version__} has no {entry.class_name}")
    return model_tensors(cls, **entry.config)


def write_published(entry: Published, folder: str | Path) -> Path:
    """`entry`'s full-size checkpoint in diffusers' layout in `folder`: real headers over holes (no data).

    Returns:
        The folder.
    """
    tensors, config = published_tensors(entry)
    write_safetensors_checkpoint(folder, tensors, config, data="hole", max_shard_bytes=10 * GIB)
    return Path(folder)
