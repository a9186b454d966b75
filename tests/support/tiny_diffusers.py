"""Tiny random-weight diffusers models that declare their own `_tp_plan` (Flux, Flux.2, QwenImage, QwenImage 2.1),
with a valid input for each. Weights are seeded, every Linear scaled by 1/sqrt(fan_in) and every norm weight near
1, so outputs stay O(1) and a float32 comparison at 1e-5 means something."""

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


BUILDERS = {"flux": _flux, "flux2": _flux2, "qwenimage": _qwen, "qwenimage21": _qwen21}


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
