"""A transformer that diffusers does not ship, assembled from diffusers' own blocks: what a class added to
diffusers after preshard's release looks like to it. Joint text/image attention with added projections and per-head
q/k RMSNorms, AdaLN-Zero modulation (most of the parameters), SwiGLU and GEGLU feed-forwards, and a
single-stream block whose `proj_out` takes cat([attention, mlp])."""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormZero
from diffusers.models.transformers.transformer_flux import FluxAttention
from torch import nn


class _SingleStream(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.attn = FluxAttention(dim, heads=heads, dim_head=head_dim, bias=True, pre_only=True)
        self.proj_mlp = nn.Linear(dim, 4 * dim)
        self.proj_out = nn.Linear(heads * head_dim + 4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = nn.functional.gelu(self.proj_mlp(x))
        return x + self.proj_out(torch.cat([self.attn(x), mlp], dim=-1))


class _JointBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.attn = Attention(
            dim, heads=heads, dim_head=head_dim, qk_norm="rms_norm",
            added_kv_proj_dim=dim, context_pre_only=False, bias=True, out_bias=True, processor=JointAttnProcessor2_0(),
        )  # fmt: skip
        self.ff = FeedForward(dim, activation_fn="swiglu")
        self.ff_context = FeedForward(dim, activation_fn="geglu")

    def forward(self, x, context, temb):
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=temb)
        attn, context_attn = self.attn(h, encoder_hidden_states=context)
        x = x + gate_msa.unsqueeze(1) * attn
        x = x + gate_mlp.unsqueeze(1) * self.ff(x * (1 + scale_mlp[:, None]) + shift_mlp[:, None])
        context = context + context_attn
        return x, context + self.ff_context(context)


class AssembledTransformer2DModel(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim: int = 32, heads: int = 4, head_dim: int = 8, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_JointBlock(dim, heads, head_dim) for _ in range(layers))
        self.single = _SingleStream(dim, heads, head_dim)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, return_dict: bool = False):
        x, context = hidden_states, encoder_hidden_states
        for block in self.blocks:
            x, context = block(x, context, temb)
        return (self.proj_out(self.single(x)),)


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = AssembledTransformer2DModel().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {
        "hidden_states": torch.randn(2, 6, 32, generator=gen),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=gen),
        "temb": torch.randn(2, 32, generator=gen),
    }
    return model, inputs
