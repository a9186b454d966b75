"""Models of a user's own, built from diffusers' blocks with custom code where plan inference used to guess: each
computes a different function at tp=2 if its custom attention processor, feed-forward or block is split as the
diffusers module it looks like. Every model also holds a diffusers FeedForward (`ff_out`) that inference splits, so
a model that loads sharded has something sharded.

`CASES` maps a case name to its model class; `build(name)` gives the model (seeded, fp32, eval) and its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

DIM, HEADS, HEAD_DIM, INNER = 32, 4, 8, 64
HEAD_COUNT = 4  # a module-level head count a processor reshapes by


def _attend(attn, q, k, v, heads):
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
    return attn.to_out[1](attn.to_out[0](out))


class GlobalHeadsProcessor:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        return _attend(attn, attn.to_q(x), attn.to_k(x), attn.to_v(x), HEAD_COUNT)


class OwnHeadsProcessor:
    def __init__(self, heads: int = HEADS):
        self.count = heads

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        return _attend(attn, attn.to_q(x), attn.to_k(x), attn.to_v(x), self.count)


class WidthNormProcessor:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        q, k = (F.rms_norm(t, (t.shape[-1],)) for t in (attn.to_q(x), attn.to_k(x)))  # over every head at once
        return _attend(attn, q, k, attn.to_v(x), attn.heads)


class SubclassedProcessor(AttnProcessor2_0):
    """A diffusers processor's subclass whose __call__ is the user's."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        return _attend(attn, attn.to_q(x), attn.to_k(x), attn.to_v(x), HEAD_COUNT)


class AttnProcessor2_0Spoof:  # noqa: N801 - named as diffusers' to pass a check by name
    """Claims diffusers' module and name."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        return _attend(attn, attn.to_q(x), attn.to_k(x), attn.to_v(x), HEAD_COUNT)


AttnProcessor2_0Spoof.__module__ = "diffusers.models.attention_processor"
AttnProcessor2_0Spoof.__qualname__ = AttnProcessor2_0Spoof.__name__ = "AttnProcessor2_0"


class CorrectProcessor:
    """Custom, but right at any TP degree (reshapes by the head width): kept whole all the same."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        x = hidden_states
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        return _attend(attn, q, k, v, q.shape[-1] // HEAD_DIM)


class ScaledAttention(Attention):
    """diffusers' Attention with a forward of the user's that reads the head count."""

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states) * (self.heads / HEADS) ** 2


def _attention(processor=None, cls=Attention):
    return cls(DIM, heads=HEADS, dim_head=HEAD_DIM, bias=True, out_bias=True, processor=processor or AttnProcessor2_0())


class AttnBlock(nn.Module):
    processor_class: type | None = None
    attention_class: type = Attention

    def __init__(self):
        super().__init__()
        self.attn = _attention(self.processor_class() if self.processor_class else None, self.attention_class)
        self.ff = FeedForward(DIM, inner_dim=INNER, activation_fn="gelu")

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


def _block(name: str, **attrs) -> type:
    return type(name, (AttnBlock,), {"__module__": __name__, **attrs})


class CallsToQBlock(AttnBlock):
    def forward(self, x):
        x = x + self.attn(x) + self.attn.to_q(x).mean(-1, keepdim=True)
        return x + self.ff(x)


class ReadsHeadsBlock(AttnBlock):
    def forward(self, x):
        x = x + self.attn(x) * self.attn.heads / HEADS
        return x + self.ff(x)


class AliasBlock(AttnBlock):
    def forward(self, x):
        attn = self.attn
        x = x + attn(x) + attn.to_v(x).sum(-1, keepdim=True) * 0.1
        return x + self.ff(x)


class FFInsideBlock(AttnBlock):
    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x) + self.ff.net[0](x).mean(-1, keepdim=True)


class PassesUnitBlock(AttnBlock):
    def forward(self, x):
        x = x + _outside(self.attn, x)
        return x + self.ff(x)


def _outside(attn, x):
    return attn(x) + attn.to_k(x).mean(-1, keepdim=True)


class WalksBlock(AttnBlock):
    def forward(self, x):
        widths = sum(m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        x = x + self.attn(x) * (widths / 1000)
        return x + self.ff(x)


class _Net(nn.Module):
    """A feed-forward laid out as diffusers' (`net.0.proj`, `net.2`), with a forward of the user's."""

    def __init__(self):
        super().__init__()
        self.net = nn.ModuleList([GELU(DIM, INNER), nn.Dropout(0.0), nn.Linear(INNER, DIM)])

    def hidden(self, x):
        return self.net[1](self.net[0](x))


class SoftmaxFF(_Net):
    def forward(self, x):
        return self.net[2](torch.softmax(self.hidden(x), dim=-1) * INNER)


class L2FF(_Net):
    def forward(self, x):
        return self.net[2](F.normalize(self.hidden(x), dim=-1) * 8)


class SliceFF(_Net):
    def forward(self, x):
        h = self.hidden(x)
        return self.net[2](h) + h[..., :DIM]


class SumFF(_Net):
    def forward(self, x):
        h = self.hidden(x)
        return self.net[2](h) + h.sum(-1, keepdim=True) * 0.1


class SoftmaxFeedForward(FeedForward):
    """diffusers' FeedForward, its forward overridden."""

    def forward(self, hidden_states, *args, **kwargs):
        h = torch.softmax(self.net[0](hidden_states), dim=-1) * INNER
        return self.net[2](self.net[1](h))


class SoftmaxActivation(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1) * INNER


def _custom_activation_ff():
    ff = FeedForward(DIM, inner_dim=INNER, activation_fn="gelu")
    ff.net[0] = SoftmaxActivation(DIM, INNER)
    return ff


class CustomMLP(nn.Module):
    """A gated MLP (`fc1` of [hidden; gate]) of the user's, a softmax over its hidden width."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * INNER), nn.Linear(INNER, DIM)

    def forward(self, x):
        hidden, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(torch.softmax(hidden, dim=-1) * F.silu(gate) * INNER)


class BlockMLP(nn.Module):
    """A block's own `ff_in`/`ff_out` (MiniMax-Music-3's layout), its forward the user's."""

    def __init__(self):
        super().__init__()
        self.attn = _attention()
        self.ff_in, self.ff_out = nn.Linear(DIM, INNER), nn.Linear(INNER, DIM)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff_out(F.normalize(self.ff_in(x), dim=-1) * 8)


class SingleStream(nn.Module):
    """Flux's single-stream layout (no output projection, `proj_out` over cat([attention, mlp])), its forward the
    user's: a softmax over the MLP's width."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_flux import FluxAttention

        self.attn = FluxAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, bias=True, pre_only=True)
        self.proj_mlp = nn.Linear(DIM, INNER)
        self.proj_out = nn.Linear(HEADS * HEAD_DIM + INNER, DIM)

    def forward(self, x):
        mlp = torch.softmax(self.proj_mlp(x), dim=-1) * INNER
        return x + self.proj_out(torch.cat([self.attn(x), mlp], dim=-1))


def _ff_block(name: str, make) -> type:
    def init(self):
        AttnBlock.__init__(self)
        self.ff = make()

    return type(name, (AttnBlock,), {"__module__": __name__, "__init__": init})


def _mlp_block(name: str, make) -> type:
    def init(self):
        AttnBlock.__init__(self)
        self.mlp = make()

    def forward(self, x):
        x = x + self.attn(x)
        out = self.mlp(x)
        return x + sum(out.chunk(out.shape[-1] // DIM, dim=-1))

    return type(name, (AttnBlock,), {"__module__": __name__, "__init__": init, "forward": forward})


BLOCKS: dict[str, type] = {
    "processor-global-heads": _block("GlobalHeadsBlock", processor_class=GlobalHeadsProcessor),
    "processor-own-heads": _block("OwnHeadsBlock", processor_class=OwnHeadsProcessor),
    "processor-width-norm": _block("WidthNormBlock", processor_class=WidthNormProcessor),
    "processor-subclass": _block("SubclassedProcessorBlock", processor_class=SubclassedProcessor),
    "processor-spoofed-module": _block("SpoofedProcessorBlock", processor_class=AttnProcessor2_0Spoof),
    "processor-custom-but-correct": _block("CorrectProcessorBlock", processor_class=CorrectProcessor),
    "attention-subclass-forward": _block("ScaledAttentionBlock", attention_class=ScaledAttention),
    "block-calls-to_q": CallsToQBlock,
    "block-reads-heads": ReadsHeadsBlock,
    "block-alias-to_v": AliasBlock,
    "block-ff-inside": FFInsideBlock,
    "block-passes-attention": PassesUnitBlock,
    "block-walks-modules": WalksBlock,
    "ff-softmax": _ff_block("SoftmaxFFBlock", SoftmaxFF),
    "ff-l2-norm": _ff_block("L2FFBlock", L2FF),
    "ff-residual-slice": _ff_block("SliceFFBlock", SliceFF),
    "ff-sum": _ff_block("SumFFBlock", SumFF),
    "ff-subclass-forward": _ff_block("SoftmaxFeedForwardBlock", lambda: SoftmaxFeedForward(DIM, inner_dim=INNER)),
    "ff-custom-activation": _ff_block("CustomActivationBlock", _custom_activation_ff),
    "mlp-custom-class": _mlp_block("CustomMLPBlock", CustomMLP),
    "mlp-sequential-softmax": _mlp_block(
        "SequentialMLPBlock",
        lambda: nn.Sequential(nn.Linear(DIM, INNER), nn.Softmax(dim=-1), nn.Linear(INNER, 2 * DIM)),
    ),
    "block-own-mlp": BlockMLP,
    "single-stream-custom": SingleStream,
}


class CustomModel(ModelMixin, ConfigMixin):
    """Two blocks of `block`, then a diffusers FeedForward that inference splits."""

    block: type = AttnBlock

    @register_to_config
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.blocks = nn.ModuleList(self.block() for _ in range(2))
        self.ff_out = FeedForward(dim, inner_dim=INNER, activation_fn="gelu")

    def forward(self, hidden_states, return_dict: bool = False):
        x = hidden_states
        for block in self.blocks:
            x = block(x)
        return (x + self.ff_out(x),)


class ModelReachesIn(CustomModel):
    """The model's own forward calls a block's attention's projection (`block.attn.to_q(x)`)."""

    def forward(self, hidden_states, return_dict: bool = False):
        x = hidden_states
        for block in self.blocks:
            x = block(x) + block.attn.to_q(x).mean(-1, keepdim=True)
        return (x + self.ff_out(x),)


def _model(key: str, block: type) -> type:
    name = "Custom" + "".join(part.title() for part in key.replace("_", "-").split("-")) + "Model"
    return type(name, (CustomModel,), {"__module__": __name__, "block": block})


CASES: dict[str, type] = {key: _model(key, block) for key, block in BLOCKS.items()}
CASES["model-calls-to_q"] = ModelReachesIn
for _cls in (*BLOCKS.values(), *CASES.values()):
    globals()[_cls.__name__] = _cls  # picklable by reference, for the ranks


def build(key: str, seed: int = 0):
    torch.manual_seed(seed)
    model = CASES[key]().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    return model, {"hidden_states": torch.randn(2, 6, DIM, generator=gen)}
