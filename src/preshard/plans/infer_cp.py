"""A CP plan inferred for a diffusers class that declares no `_cp_plan` and has no built-in plan, only where a probe
of its forward on the meta device shows a shape CP can split without knowing the class: Flux's (here), or a list
of per-token blocks over a patched latent (`plans/infer_cp_blocks.py`, tried where this one fails).

Why a probe and not the module tree alone: where a sequence is split, and whether every attention sees the whole
of it, is decided by the forward's code, not by which modules exist. The probe runs the model's forward on the meta
device (no memory, no weights, no values) with inputs shaped from its config, the text and the image sequences at
two lengths no width can take (37 and 41 tokens), and records, through a `TorchFunctionMode` scoped to that call,
every `scaled_dot_product_attention` call and every `torch.cat` of exactly those two lengths. CP is inferred only
where all of these hold, else the class stays TP-only (a CP mesh refused in one line, as for any plan without CP):

- the forward takes the token sequences and their position ids as inputs: `hidden_states` [B, S, in_channels]
  and `encoder_hidden_states` [B, T, joint_attention_dim] already per token (the model's only top-level
  layers they meet are Linear layers and no top-level module is a convolution), `img_ids` [S, d] and `txt_ids`
  [T, d] (the rotary tables are a function of each row's ids, so splitting the ids splits the tables with the
  tokens);
- every attention call attends over both sequences joined, queries and keys alike (S + T rows), with no mask:
  nothing attends over a part of the sequence (windows, frames) or only over one stream;
- every `torch.cat` that joins the two sequences puts them in one order: the plan's `cp_join_order`, which
  context parallelism needs to drop each sequence's padding at lengths the CP size does not divide;
- the forward returns `proj_out`'s output, of S rows, and calls `proj_out` once, after the last attention: the
  gather point.

The plan then splits the four inputs at the model's forward (sequence dim 1 of the 3-dim states, dim 0 of the
2-dim ids), gathers `proj_out`'s output along dim 1, and every attention module runs context parallel. Text kept
whole (cross-attention to an unsplit text) is not inferred: no zoo class has that shape with ids as inputs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from preshard.format.plan import CPEntry, SeqDim
from preshard.plans.infer_cp_blocks import IMAGE, TEXT, InferredCP, block_list_plan, sdpa_call

_INPUTS = ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids", "timestep")
_SDPA = F.scaled_dot_product_attention


@dataclass
class _Record:
    attention: list[tuple[int, int, bool]] = field(default_factory=list)  # (query rows, key rows, masked)
    joins: list[tuple[int, ...]] = field(default_factory=list)  # lengths joined along a dim, in order
    events: list[str] = field(default_factory=list)  # "sdpa" and "proj_out", in call order


class _Recorder(TorchFunctionMode):
    def __init__(self, record: _Record) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            self.record.attention.append(sdpa_call(args, kwargs))
            self.record.events.append("sdpa")
        elif func is torch.cat:
            tensors = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if len(tensors) >= 2 and all(isinstance(t, torch.Tensor) for t in tensors):
                lengths = tuple(t.shape[dim] for t in tensors)
                if sorted(lengths) == [TEXT, IMAGE]:
                    self.record.joins.append(lengths)
        return func(*args, **kwargs)


def _meta_inputs(model: nn.Module, config: dict[str, Any]) -> dict[str, torch.Tensor] | str:
    params = inspect.signature(model.forward).parameters
    missing = [name for name in _INPUTS if name not in params]
    if missing:
        return f"its forward takes no {', '.join(missing)} (CP is inferred for token sequences with position ids)"
    width, text_width, axes = config.get("in_channels"), config.get("joint_attention_dim"), config.get("axes_dims_rope")
    if not (isinstance(width, int) and isinstance(text_width, int) and isinstance(axes, (list, tuple)) and axes):
        return "its config gives no in_channels, joint_attention_dim and axes_dims_rope to shape the tokens by"
    for name, child in model.named_children():
        if isinstance(child, nn.modules.conv._ConvNd):
            return f"its top-level {name} is a convolution (the inputs may not be per-token)"
    takers = {
        name: child.in_features
        for name, child in model.named_children()
        if isinstance(child, nn.Linear) and child.in_features in (width, text_width)
    }
    if set(takers.values()) != {width, text_width}:
        return "no top-level Linear layers take the image and text tokens"
    with torch.device("meta"):
        return {
            "hidden_states": torch.empty(1, IMAGE, width),
            "encoder_hidden_states": torch.empty(1, TEXT, text_width),
            "img_ids": torch.empty(IMAGE, len(axes)),
            "txt_ids": torch.empty(TEXT, len(axes)),
            "timestep": torch.empty(1),
        }


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def infer_cp_plan(model: nn.Module, config: dict[str, Any] | None) -> InferredCP:
    """The CP plan a probe of `model`'s forward proves right (see the module docstring), or why none.

    Args:
        model: the model on the meta device.
        config: its config.json.

    Returns:
        `InferredCP`: the plan and join order, or `plan` None and `why_not` saying which condition failed for each
        shape.
    """
    tokens = _token_inputs_plan(model, config or {})
    if tokens.plan is not None:
        return tokens
    blocks = block_list_plan(model, config or {})
    if blocks.plan is not None:
        return blocks
    return InferredCP(None, why_not=f"{tokens.why_not}; and as a block list, {blocks.why_not}")


def _token_inputs_plan(model: nn.Module, config: dict[str, Any]) -> InferredCP:
    inputs = _meta_inputs(model, config)
    if isinstance(inputs, str):
        return InferredCP(None, why_not=inputs)
    proj_out = getattr(model, "proj_out", None)
    if not isinstance(proj_out, nn.Linear):
        return InferredCP(None, why_not="it has no top-level Linear proj_out to gather the sequence at")
    record = _Record()
    outputs: list[torch.Tensor] = []

    def after_proj_out(module: nn.Module, args: Any, output: Any) -> None:
        record.events.append("proj_out")
        outputs.append(output)

    handle = proj_out.register_forward_hook(after_proj_out)
    try:
        with torch.no_grad(), _Recorder(record):
            out = model(**inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means: not provably right, no CP
        return InferredCP(None, why_not=f"its forward does not run on the probe's inputs ({type(exc).__name__})")
    finally:
        handle.remove()
    joined = TEXT + IMAGE
    if not record.attention:
        return InferredCP(None, why_not="its forward makes no scaled_dot_product_attention call")
    partial = [(q, k) for q, k, masked in record.attention if (q, k) != (joined, joined) or masked]
    if partial:
        q, k = partial[0]
        return InferredCP(
            None,
            why_not=f"an attention call is not over the whole joined sequence ({q} query and {k} key rows of "
            f"{joined}, or masked)",
        )
    orders = set(record.joins)
    if len(orders) != 1:
        return InferredCP(None, why_not="its forward joins the text and image sequences in no single order")
    order = next(iter(orders))
    text_first = order[0] == TEXT
    join = ("encoder_hidden_states", "hidden_states") if text_first else ("hidden_states", "encoder_hidden_states")
    result = _first_tensor(out)
    if record.events.count("proj_out") != 1 or record.events[-1] != "proj_out":
        return InferredCP(None, why_not="proj_out does not run once, after the last attention")
    if result is None or result.dim() != 3 or result.shape[1] != IMAGE or result is not outputs[0]:
        return InferredCP(None, why_not="the forward does not return proj_out's output of one row per image token")
    plan = {
        "": CPEntry(
            split_inputs={
                "hidden_states": SeqDim(1, 3),
                "encoder_hidden_states": SeqDim(1, 3),
                "img_ids": SeqDim(0, 2),
                "txt_ids": SeqDim(0, 2),
            }
        ),
        "proj_out": CPEntry(gather_output=SeqDim(1, 3)),
    }
    return InferredCP(plan, join)
