"""Tiny random LoRA files for a tiny model, in the diffusers/PEFT format (optionally with `.alpha`) and in kohya's
Flux format, and diffusers' own way of fusing them into the unsharded model (the reference a fused conversion and a
sharded model with the same LoRA must equal)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn


def linear_names(model: nn.Module, pattern: str = r".*") -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and re.fullmatch(pattern, name)]


def make_lora(
    model: nn.Module,
    path: Path,
    *,
    pattern: str = r".*",
    rank: int = 4,
    alpha: float | None = 2.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    prefix: str = "transformer",
) -> Path:
    """A diffusers-format LoRA on every Linear of `model` whose name matches `pattern`. A and B are both random
    (a trained LoRA's B is not zero), sized so that the delta is a few percent of the weight."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in linear_names(model, pattern):
        m = model.get_submodule(name)
        key = f"{prefix}.{name}" if prefix else name
        state[f"{key}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5).to(dtype)
        state[f"{key}.lora_B.weight"] = (0.3 * torch.randn(m.out_features, rank, generator=g) / rank**0.5).to(dtype)
        if bias and m.bias is not None:
            state[f"{key}.lora_B.bias"] = (0.05 * torch.randn(m.out_features, generator=g)).to(dtype)
        if alpha is not None:
            state[f"{key}.alpha"] = torch.tensor(float(alpha))
    assert state, f"no Linear matches {pattern}"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def make_kohya_flux_lora(path: Path, *, inner: int, rank: int = 4, alpha: float = 2.0, seed: int = 0) -> Path:
    """A kohya (sd-scripts) Flux LoRA on block 0's fused image QKV and output projection and single block 0's
    output projection, in the original Flux names that diffusers' kohya converter maps (`lora_unet_...`)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = {
        "lora_unet_double_blocks_0_img_attn_qkv": (3 * inner, inner),
        "lora_unet_double_blocks_0_img_attn_proj": (inner, inner),
        "lora_unet_single_blocks_0_linear2": (inner, inner + 4 * inner),
    }
    state = {}
    for key, (out, inp) in shapes.items():
        state[f"{key}.lora_down.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
        state[f"{key}.lora_up.weight"] = 0.3 * torch.randn(out, rank, generator=g)
        state[f"{key}.alpha"] = torch.tensor(float(alpha))
    save_file(state, str(path))
    return path


def diffusers_fused(
    model: nn.Module, loras: list[tuple[Path, float]], loader: str = "FluxLoraLoaderMixin"
) -> dict[str, torch.Tensor]:
    """The state dict of `model` (changed in place) after diffusers loads each LoRA as its pipeline would
    (`<loader>.lora_state_dict` then `load_lora_adapter`), sets the scales and runs `fuse_lora`."""
    import inspect

    import diffusers.loaders.lora_pipeline as pipelines

    mixin = getattr(pipelines, loader)
    names = []
    for i, (path, _) in enumerate(loras):
        if "return_alphas" in inspect.signature(mixin.lora_state_dict).parameters:
            state, alphas = mixin.lora_state_dict(str(path), return_alphas=True)
        else:
            state, alphas = mixin.lora_state_dict(str(path)), None
            alpha_keys = [k for k in state if k.endswith(".alpha")]
            alphas = {k: state.pop(k) for k in alpha_keys} or None
        model.load_lora_adapter(state, network_alphas=alphas, adapter_name=f"l{i}")
        names.append(f"l{i}")
    model.set_adapters(names, [scale for _, scale in loras])
    model.fuse_lora(adapter_names=names)
    model.unload_lora()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
