"""Two video transformers diffusers does not ship, assembled from its blocks, for CP inference on video latents
(`plans/infer_cp_blocks.py`): a latent `[B, C, F, H, W]` patched into tokens frame by frame, a top-level position
table per token, blocks of self-attention and cross-attention to the text (`diffusers.models.attention.Attention`),
and `proj_out`. In `AssembledVideoTransformer3DModel` self-attention runs over every token of every frame (full
spatio-temporal attention: the flattened sequence can be split); in `AssembledFrameTransformer3DModel` it runs
within each frame (the tokens regrouped `[B * F, H * W, C]`), and in `AssembledTemporalTransformer3DModel` the
blocks alternate attention within a frame and across frames at one place (Latte's layout): neither can be split
along the flattened sequence with its attention routed across ranks."""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class _Positions(nn.Module):
    """A sinusoidal table of one row per token `[1, F * H * W, dim]` (frame, row, column each a third)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, frames: int, height: int, width: int, device: torch.device) -> torch.Tensor:
        axes = [torch.arange(n, device=device) for n in (frames, height, width)]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij")).flatten(1)  # [3, S]
        third = self.dim // 3
        freqs = torch.exp(-math.log(1e4) * torch.arange(third // 2, device=device) / max(third // 2, 1))
        angles = grid[:, :, None].float() * freqs  # [3, S, third/2]
        table = torch.cat([angles.sin(), angles.cos()], dim=-1).permute(1, 0, 2).flatten(1)  # [S, 3 * third]
        return nn.functional.pad(table, (0, self.dim - table.shape[-1]))[None]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, text_dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode  # "full", "frame" (within a frame) or "time" (across frames at one place)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads=heads, dim_head=dim // heads, bias=True)
        self.attn2 = Attention(dim, cross_attention_dim=text_dim, heads=heads, dim_head=dim // heads, bias=True)
        self.ff = FeedForward(dim, activation_fn="gelu-approximate")

    def forward(self, hidden_states, encoder_hidden_states, positions, frames: int):
        x = hidden_states + positions
        h = self.norm1(x)
        b, s, c = h.shape
        if self.mode == "frame":
            h = self.attn1(h.reshape(b * frames, s // frames, c)).reshape(b, s, c)
        elif self.mode == "time":
            h = h.reshape(b, frames, s // frames, c).transpose(1, 2).reshape(b * (s // frames), frames, c)
            h = self.attn1(h).reshape(b, s // frames, frames, c).transpose(1, 2).reshape(b, s, c)
        else:
            h = self.attn1(h)
        x = x + h
        x = x + self.attn2(self.norm2(x), encoder_hidden_states=encoder_hidden_states)
        return x + self.ff(self.norm3(x))


class _Video(ModelMixin, ConfigMixin):
    modes: tuple[str, ...] = ("full", "full")

    @register_to_config
    def __init__(self, in_channels: int = 4, patch_size: int = 2, dim: int = 24, heads: int = 2,
                 cross_attention_dim: int = 16) -> None:  # fmt: skip
        super().__init__()
        p = patch_size
        self.patch_embed = nn.Linear(in_channels * p * p, dim)
        self.pos = _Positions(dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, cross_attention_dim, mode) for mode in self.modes)
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels * p * p)

    def forward(self, hidden_states, encoder_hidden_states, timestep=None, return_dict: bool = False):
        b, c, f, h, w = hidden_states.shape
        p = self.config.patch_size
        tokens = hidden_states.reshape(b, c, f, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        x = self.patch_embed(tokens.reshape(b, f * (h // p) * (w // p), c * p * p))
        positions = self.pos(f, h // p, w // p, hidden_states.device)
        for block in self.blocks:
            x = block(x, encoder_hidden_states, positions, f)
        out = self.proj_out(self.norm_out(x))
        out = out.reshape(b, f, h // p, w // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)
        return (out,)


class AssembledVideoTransformer3DModel(_Video):
    modes = ("full", "full")


class AssembledFrameTransformer3DModel(_Video):
    modes = ("frame", "frame")


class AssembledTemporalTransformer3DModel(_Video):
    modes = ("frame", "time")


CLASSES = {cls.__name__: cls for cls in (AssembledVideoTransformer3DModel, AssembledFrameTransformer3DModel,
                                         AssembledTemporalTransformer3DModel)}  # fmt: skip


def build(name: str, seed: int = 0, frames: int = 3, height: int = 6, width: int = 10):
    """The model (seeded) and its inputs: a latent of `frames` x `height / 2` x `width / 2` patches (3 x 3 x 5:
    45 tokens, odd), a text of 7 tokens."""
    torch.manual_seed(seed)
    model = CLASSES[name]().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {
        "hidden_states": torch.randn(1, 4, frames, height, width, generator=gen),
        "encoder_hidden_states": torch.randn(1, 7, 16, generator=gen),
    }
    return model, inputs
