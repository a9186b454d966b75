"""Tiny random-weight diffusers models, with a valid input for each: those that declare their own `_tp_plan` (Flux,
Flux.2, QwenImage, QwenImage 2.1) and the video families preshard has built-in plans for (Wan T2V and I2V,
SkyReels-V2, ChronoEdit, Wan VACE, LTX-2 and LTX-2.3 with their audio stream). Weights are seeded, every Linear
scaled by 1/sqrt(fan_in) and every norm weight near 1, so outputs stay O(1) and a float32 comparison at 1e-5 means
something."""

from __future__ import annotations

from pathlib import Path

import torch

# Sequence lengths divide by 2 and 4: with several sequences (text and image) CP needs each to divide evenly.
IMAGE, TEXT = 12, 8


def _flux():
    from diffusers import FluxTransformer2DModel

    config = dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    inputs = dict(
        hidden_states=torch.randn(1, IMAGE, 4, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
        pooled_projections=torch.randn(1, 24, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randint(0, 5, (IMAGE, 3), generator=g).float(),
        txt_ids=torch.zeros(TEXT, 3),
    )
    return FluxTransformer2DModel(**config), inputs


def _flux2():
    from diffusers import Flux2Transformer2DModel

    config = dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, timestep_guidance_channels=16, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(12)
    inputs = dict(
        hidden_states=torch.randn(1, IMAGE, 4, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randint(0, 5, (1, IMAGE, 4), generator=g).float(),
        txt_ids=torch.zeros(1, TEXT, 4),
    )
    return Flux2Transformer2DModel(**config), inputs


def _qwen():
    from diffusers import QwenImageTransformer2DModel

    config = dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    g = torch.Generator().manual_seed(13)
    inputs = dict(
        hidden_states=torch.randn(1, IMAGE, 16, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, 3, 4)]],
    )
    return QwenImageTransformer2DModel(**config), inputs


def _qwen21():
    from diffusers import QwenImage21Transformer2DModel

    config = dict(
        patch_size=1, in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    g = torch.Generator().manual_seed(14)
    height, width = 4, 4  # one target image of 16 latent tokens: 4 image slots of 2x2 tokens after the text
    inputs = dict(
        hidden_states=torch.randn(1, height * width, 8, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, height, width)]],
        img_mask=torch.tensor([[False] * TEXT + [True] * (height * width // 4)]),
    )
    return QwenImage21Transformer2DModel(**config), inputs


# Video models: 4 heads of 8 (inner 32), a 2x4x4 latent video patchified (1, 2, 2) to 8 tokens, 6 text tokens.
_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip
FRAMES, HEIGHT, WIDTH = 2, 4, 4
VIDEO_TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)


def _wan_inputs(seed: int, in_channels: int = 4, text: int = 6, image: int | None = None, image_dim: int = 12):
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(1, in_channels, FRAMES, HEIGHT, WIDTH, generator=g),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, text, 16, generator=g),
    )
    if image is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(1, image, image_dim, generator=g)
    return inputs


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**_WAN), _wan_inputs(21)


def _wan_i2v():
    """Wan 2.1 I2V: image cross-attention (add_k_proj/add_v_proj, norm_added_k); the processor takes the last 512
    context rows as text, the rows before them as the image."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**{**_WAN, "in_channels": 8, "image_dim": 12, "added_kv_proj_dim": 32})
    return model, _wan_inputs(22, in_channels=8, text=512, image=4)


def _skyreels():
    from diffusers import SkyReelsV2Transformer3DModel

    return SkyReelsV2Transformer3DModel(**_WAN), _wan_inputs(23)


def _chronoedit():
    from diffusers import ChronoEditTransformer3DModel

    return ChronoEditTransformer3DModel(**_WAN, rope_temporal_skip_len=2), _wan_inputs(24)


def _wan_vace():
    from diffusers import WanVACETransformer3DModel

    model = WanVACETransformer3DModel(**_WAN, vace_layers=[0, 1], vace_in_channels=6)
    inputs = _wan_inputs(25)
    g = torch.Generator().manual_seed(26)
    inputs["control_hidden_states"] = torch.randn(1, 6, FRAMES, HEIGHT, WIDTH, generator=g)
    return model, inputs


# LTX-2: video 4 heads of 8, audio 4 heads of 4, split rotary tables as the published configs, 8 video tokens
# (2x2x2 latent) and 8 audio tokens (the CP tests also run other, unequal lengths: test_video_plans.uneven).
LTX2_VIDEO, LTX2_AUDIO = 8, 8


def _ltx2(**overrides):
    from diffusers import LTX2VideoTransformer3DModel

    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=4, audio_attention_head_dim=4,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=24, rope_type="split",
    )  # fmt: skip
    g = torch.Generator().manual_seed(27)
    inputs = dict(
        hidden_states=torch.randn(1, LTX2_VIDEO, 4, generator=g),
        audio_hidden_states=torch.randn(1, LTX2_AUDIO, 4, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 24, generator=g),
        audio_encoder_hidden_states=torch.randn(1, 6, 24, generator=g),
        timestep=torch.tensor([500.0]),
        num_frames=2,
        height=2,
        width=2,
        audio_num_frames=LTX2_AUDIO,
    )
    return LTX2VideoTransformer3DModel(**{**config, **overrides}), inputs


def _ltx23():
    """LTX-2.3: per-head attention gates (to_gate_logits), prompt modulation from sigma, perturbed attention."""
    model, inputs = _ltx2(
        gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
        use_prompt_embeddings=False, perturbed_attn=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(28)  # no caption projection: the text arrives at the streams' widths
    inputs.update(
        encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
        audio_encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        sigma=torch.tensor([0.5]),
    )
    return model, inputs


BUILDERS = {
    "flux": _flux, "flux2": _flux2, "qwenimage": _qwen, "qwenimage21": _qwen21, "wan": _wan, "wan_i2v": _wan_i2v,
    "skyreels_v2": _skyreels, "chronoedit": _chronoedit, "wan_vace": _wan_vace, "ltx2": _ltx2, "ltx23": _ltx23,
}  # fmt: skip


def build(name: str, seed: int = 0):
    """(model in eval mode with seeded random float32 weights, inputs)."""
    model, inputs = BUILDERS[name]()
    return randomize(model, seed), inputs


def randomize(model, seed: int = 0):
    """`model` in eval mode with seeded random float32 weights, scaled to keep activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "norm" in param_name and param_name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def save(model, folder: Path) -> Path:
    """The diffusers layout: config.json (with _class_name) and one safetensors file."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder
