"""Hostile soak, class `custommodels` (issue 36): models of a user's own, built from diffusers' blocks with custom
code where plan inference would guess (tests/support/custom_models.py, and more variants here: a forward hook on a
split layer, a unit reached through `getattr`, a block handed to a checkpointing function, a processor that is a
lambda, a FeedForward with a softmax appended to its `net`), each converted at tp=2 with no --plan and loaded on
two gloo ranks: it must compute the unsharded output within 1e-5 (fp32), or be refused in one line naming the
module. Also at tp=4 for a few, where four ranks fit.

    python scripts/hostile_soak.py --classes custommodels
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import custom_models
import diffusers
import torch
import torch.nn.functional as F
from custom_models import DIM, INNER, AttnBlock, CustomModel
from hostile_soak import Case, Soak
from torch import nn

TOL = 1e-5


class HookedBlock(AttnBlock):
    """A pre-hook of the user's on the down projection: a softmax over the hidden width it is given."""

    def __init__(self):
        super().__init__()
        self.ff.net[2].register_forward_pre_hook(lambda module, args: (torch.softmax(args[0], dim=-1) * INNER,))


class GetattrBlock(AttnBlock):
    def forward(self, x):
        x = x + self.attn(x) + getattr(self, "attn").to_q(x).mean(-1, keepdim=True)  # noqa: B009
        return x + self.ff(x)


def _outside(block, x):
    return block(x) + block.attn.to_q(x).mean(-1, keepdim=True)


class CheckpointedModel(CustomModel):
    """Its forward hands each block to a function (as gradient checkpointing does), which reaches into it."""

    def forward(self, hidden_states, return_dict: bool = False):
        x = hidden_states
        for block in self.blocks:
            x = _outside(block, x)
        return (x + self.ff_out(x),)


class LambdaProcessorBlock(AttnBlock):
    def __init__(self):
        super().__init__()
        heads = 4

        def processor(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
            q, k, v = (p(hidden_states) for p in (attn.to_q, attn.to_k, attn.to_v))
            b, s, _ = q.shape
            q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
            return attn.to_out[0](out)

        self.attn.processor = processor


class AppendedSoftmaxBlock(AttnBlock):
    def __init__(self):
        super().__init__()
        self.ff.net.insert(1, nn.Softmax(dim=-1))


def _model(name: str, block: type) -> type:
    return type(name, (CustomModel,), {"__module__": __name__, "block": block})


EXTRA: dict[str, type] = {
    "hook-on-down-projection": _model("HookedModel", HookedBlock),
    "getattr-reaches-in": _model("GetattrModel", GetattrBlock),
    "block-handed-to-function": CheckpointedModel,
    "lambda-processor": _model("LambdaProcessorModel", LambdaProcessorBlock),
    "ff-net-softmax-appended": _model("AppendedSoftmaxModel", AppendedSoftmaxBlock),
}
for _cls in EXTRA.values():
    globals()[_cls.__name__] = _cls
MODELS: dict[str, type] = {**custom_models.CASES, **EXTRA}
TP4 = ("processor-global-heads", "block-calls-to_q", "ff-softmax", "model-calls-to_q")  # heads 4: tp=4 divides


def _build(key: str):
    torch.manual_seed(0)
    model = MODELS[key]().eval()
    return model, {"hidden_states": torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(1))}


def _rank(rank: int, world: int, key: str, folder: str) -> float:
    from multiproc import init_gloo

    from preshard.runtime.load import load_sharded

    init_gloo()
    warnings.filterwarnings("ignore")
    model, inputs = _build(key)
    with torch.no_grad():
        want = model(**inputs)[0]
        got = load_sharded(type(model), folder)(**inputs)[0]
    return ((got - want).abs().max() / want.abs().max()).item()


def _case(key: str, tp: int) -> Callable[[Path], str | None]:
    def run(folder: Path) -> str | None:
        from multiproc import run_ranks
        from tiny_diffusers import save

        from preshard.converter.convert import convert_checkpoint
        from preshard.errors import PlanError

        cls = MODELS[key]
        setattr(diffusers, cls.__name__, cls)  # found by its config's _class_name, as a class diffusers adds
        try:
            source = save(_build(key)[0], folder / "src")
            try:
                convert_checkpoint(source, folder / "out", tp=tp, progress=False)
            except PlanError as exc:
                message = str(exc)
                if "\n" in message or "blocks." not in message:
                    return f"refused, but not in one line naming the module: {message[:300]}"
                return None
            rel = max(run_ranks(_rank, tp, key, str(folder / "out"), timeout=300))
            return None if rel <= TOL else f"tp={tp} differs from the unsharded model by {rel:.3g} (relative)"
        finally:
            delattr(diffusers, cls.__name__)

    return run


def custommodel_cases(soak: Soak) -> list[Case]:
    cases = [Case("custommodels", f"{key}, tp=2", _case(key, 2)) for key in MODELS]
    return cases + [Case("custommodels", f"{key}, tp=4", _case(key, 4)) for key in TP4]


CASES: dict[str, Callable[[Soak], list[Case]]] = {"custommodels": custommodel_cases}
