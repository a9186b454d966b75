"""The second shape a CP plan is inferred for (`plans/infer_cp.py`): an image model whose forward patches a latent
into tokens and runs them through lists of transformer blocks, found by a probe of its forward on the meta device.

Why the blocks: in such a model everything before the first block (patching, embeddings, position tables) runs on
whole inputs on every rank, so the split can sit at the first block's input, and the gather at the output
projection after the last block; only what happens in between must be per token or attention over the whole
sequence. The probe shows that: the latent is shaped `[1, in_channels, p, 41 p]` (41 image tokens, a length no
width takes), the text `[1, 37, width]`, the other inputs named as diffusers names them, and it records which
tensors reach the blocks, every SDPA call (by attention module), every `torch.cat` of text and image, and every
convolution or reduction over a sequence dim between the first block and the gather. CP is inferred only where:

- the first block called takes `hidden_states` of the 41 image tokens `[1, 41, C]` (and, if passed,
  `encoder_hidden_states` of the 37 text tokens);
- every other tensor a block receives with a dim of 37, 41 or 78 rows is an output of a top-level module (the
  rotary tables), of the 41 image rows only: that output is split along that dim; nothing else per token (a mask,
  a per-token timestep) reaches the blocks;
- every attention call is unmasked over the whole sequence: image with image (41, 41), text and image joined (78,
  78; the text is then split with the image, in the one order every join uses) or image queries on the whole text
  (41, 37: cross-attention, run locally on every rank, its module not routed); never one module both ways;
- between the first block and the gather nothing convolves (no token grid rebuilt) and nothing reduces over a
  sequence dim;
- no top-level module runs between the first and the last block (nothing else feeds the later blocks);
- a top-level Linear returns `[1, 41, C]` once, after the last attention: its output is gathered.

Not covered: video latents (a probe of one frame cannot tell attention within a frame from attention over all of
them), inputs the probe does not know how to shape (masks, ids, sizes of other names): those classes stay TP-only.
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
from preshard.plans.model_check import is_attention

TEXT, IMAGE = 37, 41  # probe lengths (both shapes): primes no width or head count of a real config takes
JOINED = TEXT + IMAGE
_SDPA = F.scaled_dot_product_attention
_CONV = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_REDUCE = {"mean", "sum", "cumsum", "amax", "amin", "max", "min", "std", "var", "logsumexp", "softmax", "prod"}
_TEXT_WIDTH_KEYS = ("joint_attention_dim", "text_embed_dim", "caption_channels", "cross_attention_dim")
_SIZE_INPUTS = ("original_size", "target_size", "crop_coords")


@dataclass(frozen=True)
class InferredCP:
    """An inferred CP plan with its join order, or why none (`plan` None)."""

    plan: dict[str, CPEntry] | None
    join_order: tuple[str, ...] | None = None
    why_not: str = ""
    local_attention: tuple[str, ...] = ()  # attention modules over the whole text, run locally (not routed)


@dataclass
class _Probe:
    active: list[str] = field(default_factory=list)  # attention modules running now (innermost last)
    in_blocks: bool = False
    attention: list[tuple[str, int, int, bool, int]] = field(default_factory=list)  # module, q, k, masked, step
    joins: list[tuple[int, ...]] = field(default_factory=list)
    mixing: list[tuple[str, int]] = field(default_factory=list)  # a conv or a reduction over a sequence dim, step
    top: list[tuple[str, Any, int]] = field(default_factory=list)  # top-level module outputs, with the step
    block_inputs: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0


def sdpa_call(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int, bool]:
    """An SDPA call's query rows, key rows and whether it has a mask, from its arguments as given."""
    query = args[0] if args else kwargs["query"]
    key = args[1] if len(args) > 1 else kwargs["key"]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    return query.shape[-2], key.shape[-2], mask is not None


class _Recorder(TorchFunctionMode):
    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        probe.step += 1
        if func is _SDPA:
            module = probe.active[-1] if probe.active else ""
            probe.attention.append((module, *sdpa_call(args, kwargs), probe.step))
        elif func is torch.cat:
            tensors = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if len(tensors) >= 2 and all(isinstance(t, torch.Tensor) for t in tensors):
                lengths = tuple(t.shape[dim] for t in tensors)
                if sorted(lengths) == [TEXT, IMAGE]:
                    probe.joins.append(lengths)
        elif probe.in_blocks and func in _CONV:
            probe.mixing.append((f"a convolution ({func.__name__})", probe.step))
        elif probe.in_blocks and _is_reduction(func, args):
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim")
            x = args[0]
            dims = dim if isinstance(dim, (tuple, list)) else ([dim] if isinstance(dim, int) else list(range(x.dim())))
            if any(x.shape[d] in (TEXT, IMAGE, JOINED) for d in dims if -x.dim() <= d < x.dim()):
                probe.mixing.append((f"a reduction ({func.__name__}) over a sequence dim", probe.step))
        return func(*args, **kwargs)


def _is_reduction(func: Any, args: tuple) -> bool:
    return getattr(func, "__name__", "") in _REDUCE and bool(args) and isinstance(args[0], torch.Tensor)


def _blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) and any(is_attention(m) for m in child.modules()):
            lists.append((name, child))
    return lists


def _inputs(model: nn.Module, config: dict[str, Any]) -> dict[str, Any] | str:
    params = inspect.signature(model.forward).parameters
    channels, patch = config.get("in_channels"), config.get("patch_size") or 1
    if "hidden_states" not in params or not isinstance(channels, int) or not isinstance(patch, int):
        return "its forward takes no hidden_states latent of in_channels with a patch_size"
    with torch.device("meta"):
        inputs: dict[str, Any] = {"hidden_states": torch.empty(1, channels, patch, IMAGE * patch)}
        for name, param in params.items():
            if name == "hidden_states" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if name == "encoder_hidden_states":
                width = next((config[k] for k in _TEXT_WIDTH_KEYS if isinstance(config.get(k), int)), None)
                if width is None:
                    return "its config gives no text width for encoder_hidden_states"
                inputs[name] = torch.empty(1, TEXT, width)
            elif name in ("timestep", "timesteps"):
                inputs[name] = torch.empty(1)
            elif name == "class_labels":
                inputs[name] = torch.empty(1, dtype=torch.long)
            elif name in _SIZE_INPUTS:
                inputs[name] = torch.empty(1, 2)
            elif name == "added_cond_kwargs":  # PixArt's micro-conditions (per sample), where its config uses them
                inputs[name] = {"resolution": torch.empty(1, 2), "aspect_ratio": torch.empty(1, 1)}
            elif param.default is inspect.Parameter.empty:
                return f"its forward needs {name}, which the probe does not know how to shape"
    return inputs


def _seq_dims(x: Any) -> list[int]:
    return [d for d, n in enumerate(x.shape) if n in (TEXT, IMAGE, JOINED)] if isinstance(x, torch.Tensor) else []


def block_list_plan(model: nn.Module, config: dict[str, Any]) -> InferredCP:
    """The CP plan the block-list probe proves right (see the module docstring), or why none."""
    lists = _blocks(model)
    if not lists:
        return InferredCP(None, why_not="it has no top-level list of blocks with attention")
    inputs = _inputs(model, config)
    if isinstance(inputs, str):
        return InferredCP(None, why_not=inputs)
    probe = _Probe()
    handles = []
    first: list[str] = []

    def enter(name: str, module: nn.Module):
        def hook(mod, args, kwargs):
            if not first:
                first.append(name)
            probe.in_blocks = True
            try:
                bound = inspect.signature(mod.forward).bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            probe.block_inputs.append({"block": name, "step": probe.step, **bound})

        return hook

    def attn_in(name: str):
        def hook(mod, args):
            probe.active.append(name)

        return hook

    def attn_out(mod, args, output):
        probe.active.pop()

    def top_out(name: str):
        def hook(mod, args, output):
            probe.top.append((name, output, probe.step))

        return hook

    for list_name, blocks in lists:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(enter(f"{list_name}.{i}", block), with_kwargs=True))
    for name, module in model.named_modules():
        if name and is_attention(module):
            handles.append(module.register_forward_pre_hook(attn_in(name)))
            handles.append(module.register_forward_hook(attn_out))
    for name, child in model.named_children():
        if not isinstance(child, nn.ModuleList):
            handles.append(child.register_forward_hook(top_out(name)))
    try:
        with torch.no_grad(), _Recorder(probe):
            model(**inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means: not provably right, no CP
        return InferredCP(None, why_not=f"its forward does not run on the probe's inputs ({type(exc).__name__})")
    finally:
        for handle in handles:
            handle.remove()
    return _decide(probe, first, model)


def _decide(probe: _Probe, first: list[str], model: nn.Module) -> InferredCP:
    if not probe.block_inputs:
        return InferredCP(None, why_not="its forward calls no block")
    start = probe.block_inputs[0]
    hidden, text = start.get("hidden_states"), start.get("encoder_hidden_states")
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == IMAGE):
        return InferredCP(None, why_not="its first block does not take hidden_states of one row per image token")
    if text is not None and not (isinstance(text, torch.Tensor) and text.dim() == 3 and text.shape[1] == TEXT):
        return InferredCP(None, why_not="its first block does not take encoder_hidden_states of one row per text token")
    outputs: dict[int, tuple[str, int, int, int]] = {}  # id(tensor) -> top-level module, output index, dim, dims
    for name, output, _ in probe.top:
        items = list(output) if isinstance(output, (tuple, list)) else [output]
        for i, item in enumerate(items):
            dims = _seq_dims(item)
            if len(dims) == 1 and item.shape[dims[0]] == IMAGE:
                outputs[id(item)] = (name, i, dims[0], item.dim())
    split_outputs: dict[str, dict[int, SeqDim]] = {}
    for call in probe.block_inputs:
        for arg, value in call.items():
            if arg in ("block", "step", "hidden_states", "encoder_hidden_states"):
                continue
            items = list(value) if isinstance(value, (tuple, list)) else [value]
            for item in items:
                if not _seq_dims(item):
                    continue
                found = outputs.get(id(item))
                if found is None:
                    return InferredCP(None, why_not=f"its blocks take {arg} per token, which is no image-only output "
                                      "of a top-level module (a mask or a per-token input)")  # fmt: skip
                module, index, dim, ndim = found
                split_outputs.setdefault(module, {})[index] = SeqDim(dim, ndim)
    first_step, last_step = probe.block_inputs[0]["step"], probe.block_inputs[-1]["step"]
    between = [name for name, _, step in probe.top if first_step < step < last_step]
    if between:  # it could feed the later blocks with what the split did not reach
        return InferredCP(None, why_not=f"its forward calls {between[0]} between its blocks")
    if not probe.attention:
        return InferredCP(None, why_not="its forward makes no scaled_dot_product_attention call")
    kinds: dict[str, set[tuple[int, int]]] = {}
    for module, q, k, masked, _ in probe.attention:
        if masked or not module:
            return InferredCP(None, why_not="an attention call is masked or outside an attention module")
        kinds.setdefault(module, set()).add((q, k))
    allowed = {(IMAGE, IMAGE), (JOINED, JOINED), (IMAGE, TEXT)}
    for module, seen in kinds.items():
        if not seen <= allowed or len(seen) > 1:
            q, k = sorted(seen - allowed or seen)[0]
            return InferredCP(None, why_not=f"{module} attends {q} query rows to {k} key rows, not over the whole "
                              f"sequence (image {IMAGE}, text {TEXT})")  # fmt: skip
    joined = any((JOINED, JOINED) in s for s in kinds.values())
    cross = any((IMAGE, TEXT) in s for s in kinds.values())
    if joined and cross:
        return InferredCP(None, why_not="its attention both joins the text to the image and attends to it whole")
    last_attention = probe.attention[-1][4]
    gathers = [
        (name, step)
        for name, output, step in probe.top
        if step > last_attention
        and isinstance(getattr(model, name), nn.Linear)
        and isinstance(output, torch.Tensor)
        and output.dim() == 3
        and output.shape[1] == IMAGE
    ]
    if len(gathers) != 1:
        return InferredCP(None, why_not="no single top-level Linear returns the image tokens after the last attention")
    gather = gathers[0][0]
    if any(step > gathers[0][1] for _, _, _, _, step in probe.attention):
        return InferredCP(None, why_not=f"attention runs after {gather}")
    mixing = [what for what, step in probe.mixing if step < gathers[0][1]]
    if mixing:
        return InferredCP(None, why_not=f"its blocks apply {mixing[0]}, which a split sequence cannot")
    split_inputs = {"hidden_states": SeqDim(1, 3)}
    join = None
    if joined:
        orders = set(probe.joins)
        if len(orders) != 1 or text is None:
            return InferredCP(None, why_not="its forward joins the text and image sequences in no single order")
        split_inputs["encoder_hidden_states"] = SeqDim(1, 3)
        text_first = next(iter(orders))[0] == TEXT
        join = ("encoder_hidden_states", "hidden_states") if text_first else ("hidden_states", "encoder_hidden_states")
    plan: dict[str, CPEntry] = {first[0]: CPEntry(split_inputs=split_inputs)}
    for module, specs in split_outputs.items():
        plan[module] = CPEntry(split_outputs=specs)
    plan[gather] = CPEntry(gather_output=SeqDim(1, 3))
    local = tuple(sorted(m for m, s in kinds.items() if (IMAGE, TEXT) in s))
    return InferredCP(plan, join, local_attention=local)
