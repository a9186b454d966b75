"""Tiny random-weight diffusers models of the families preshard shards with a built-in plan (HunyuanVideo,
HunyuanVideo 1.5, HunyuanImage 2.1, Cosmos, SD3), with a valid input for each: 4 heads of width 8 (so tp=3 is
refused), one or two blocks of each kind, a dozen latent tokens and a text of 8 rows whose last two are padding
where the model takes a text mask. Weights as `tiny_diffusers.randomize` makes them."""

from __future__ import annotations

import torch
from tiny_diffusers import randomize

TEXT = 8  # text rows; IMAGE-like latents below have 12 or 16 tokens, so CP sizes 2 and 4 divide both


def _text_mask(g: torch.Generator) -> torch.Tensor:
    del g
    return torch.tensor([[1] * (TEXT - 2) + [0, 0]])


def _hunyuanvideo():
    from diffusers import HunyuanVideoTransformer3DModel

    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )  # fmt: skip
    g = torch.Generator().manual_seed(21)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 2, 3, generator=g),  # 12 latent tokens
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
        encoder_attention_mask=_text_mask(g),
        pooled_projections=torch.randn(1, 8, generator=g),
        guidance=torch.tensor([4000.0]),
    )
    return HunyuanVideoTransformer3DModel(**config), inputs


def _hunyuanvideo15():
    from diffusers import HunyuanVideo15Transformer3DModel

    config = dict(
        in_channels=5, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=12, image_embed_dim=10, rope_axes_dim=(2, 2, 4),
    )  # fmt: skip
    g = torch.Generator().manual_seed(22)
    inputs = dict(
        hidden_states=torch.randn(1, 5, 2, 2, 3, generator=g),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
        encoder_attention_mask=_text_mask(g),
        encoder_hidden_states_2=torch.randn(1, 4, 12, generator=g),
        encoder_attention_mask_2=torch.tensor([[1, 1, 1, 0]]),
        image_embeds=torch.randn(1, 4, 10, generator=g),  # image-to-video: the image tokens take part
    )
    return HunyuanVideo15Transformer3DModel(**config), inputs


def _hunyuanimage21():
    from diffusers import HunyuanImageTransformer2DModel

    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=16, rope_axes_dim=(4, 4),
    )  # fmt: skip
    g = torch.Generator().manual_seed(23)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, 4, generator=g),  # 16 latent tokens
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
        encoder_attention_mask=_text_mask(g),
    )
    return HunyuanImageTransformer2DModel(**config), inputs


def _cosmos():
    from diffusers import CosmosTransformer3DModel

    # head_dim 12: its RoPE needs 4 channels per spatial axis; concat_padding_mask (off) resizes with torchvision
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12, num_layers=2, text_embed_dim=16,
        adaln_lora_dim=8, max_size=(4, 8, 8), patch_size=(1, 2, 2), concat_padding_mask=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(24)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 4, 6, generator=g),  # 12 latent tokens
        timestep=torch.tensor([0.5]),
        encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
    )
    return CosmosTransformer3DModel(**config), inputs


def _sd3():
    from diffusers import SD3Transformer2DModel

    config = dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8, qk_norm="rms_norm",
    )  # fmt: skip
    g = torch.Generator().manual_seed(25)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),  # 16 latent tokens
        encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
        pooled_projections=torch.randn(1, 8, generator=g),
        timestep=torch.tensor([500.0]),
    )
    return SD3Transformer2DModel(**config), inputs


def _sd35_medium():
    """SD 3.5 Medium's layout: the first block also has a second, image-only attention (attn2)."""
    from diffusers import SD3Transformer2DModel

    model, inputs = _sd3()
    return SD3Transformer2DModel(**{**dict(model.config), "dual_attention_layers": (0,)}), inputs


BUILDERS = {
    "hunyuanvideo": _hunyuanvideo,
    "hunyuanvideo15": _hunyuanvideo15,
    "hunyuanimage21": _hunyuanimage21,
    "cosmos": _cosmos,
    "sd3": _sd3,
    "sd35_medium": _sd35_medium,
}


def build(name: str, seed: int = 0):
    """(model in eval mode with seeded random float32 weights, inputs)."""
    model, inputs = BUILDERS[name]()
    return randomize(model, seed), inputs
