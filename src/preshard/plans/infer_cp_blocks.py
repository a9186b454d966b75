"""The second shape a CP plan is inferred for (`plans/infer_cp.py`): an image or video model whose forward
patches a latent into tokens and runs them through lists of transformer blocks, found by a probe of its forward on
the meta device.

Why the blocks: in such a model everything before the first block (patching, embeddings, position tables) runs on
whole inputs on every rank, so the split can sit at the first block's input, and the gather at the output
projection after the last block; only what happens in between must be per token or attention over the whole
sequence. The probe shows that. An image latent is shaped `[1, in_channels, p, 41 p]` (41 tokens, a length no
width takes). A video latent (a 3-D `patch_size`, a `patch_size_t`, or a class named 3D) is probed twice, at 3 x 5
x 7 and at 5 x 3 x 9 patches (frames x height x width: 105 and 135 tokens, a frame's 35 and 27), laid out `[1, C, F,
H, W]`, else `[1, F, C, H, W]` where the first does not run, and both probes must give one plan: what a frame count
or a shape would change is not split. The text is `[1, 37, width]`, the other inputs named as diffusers names
them. It records which tensors reach the blocks, every SDPA call (by attention module), every `torch.cat` of text
and latent, and every convolution or reduction over a sequence dim between the first block and the gather. CP is
inferred only where:

- the first block called takes `hidden_states` of one row per latent token `[1, N, C]` (and, if passed,
  `encoder_hidden_states` of the 37 text tokens);
- every other tensor a block receives (nested in tuples, lists or dicts too) with a dim of a sequence's length
  (text, latent, both joined, a frame, the frames) is an output of a top-level module (the rotary tables), of the
  latent rows only: that output is split along that dim; nothing else per token (a mask, a per-token timestep, a
  table a method computed) reaches the blocks;
- every attention call is unmasked over the whole sequence: latent with latent (N, N), text and latent joined
  (N + 37; the text is then split with the latent, in the one order every join uses) or latent queries on the whole
  text (N, 37: cross-attention, run locally on every rank, its module not routed); never one module both ways. An
  attention within a frame (35 rows) or across the frames at one place (3 rows), as Latte's alternating blocks
  have, is refused, naming the module: a split of the flattened sequence would cut it;
- between the first block and the gather nothing convolves (no token grid rebuilt) and nothing reduces over a
  sequence dim;
- no top-level module runs between the first and the last block (nothing else feeds the later blocks);
- a top-level Linear returns `[1, N, C]` once, after the last attention: its output is gathered.

Not covered: inputs the probe does not know how to shape (masks, ids, sizes of other names), timesteps per token
(the probe gives one per sample): those classes stay TP-only, or fail in one line at a shape that does not
broadcast.
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
VIDEO_PROBES = ((3, 5, 7), (5, 3, 9))  # frames, height, width in patches of the two video probes
_SDPA = F.scaled_dot_product_attention
_CONV = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_REDUCE = {"mean", "sum", "cumsum", "amax", "amin", "max", "min", "std", "var", "logsumexp", "softmax", "prod"}
_TEXT_WIDTH_KEYS = ("joint_attention_dim", "text_embed_dim", "caption_channels", "cross_attention_dim", "text_dim")
_SIZE_INPUTS = ("original_size", "target_size", "crop_coords")


@dataclass(frozen=True)
class InferredCP:
    """An inferred CP plan with its join order, or why none (`plan` None)."""

    plan: dict[str, CPEntry] | None
    join_order: tuple[str, ...] | None = None
    why_not: str = ""
    local_attention: tuple[str, ...] = ()  # attention modules over the whole text, run locally (not routed)


@dataclass(frozen=True)
class _Lengths:
    """The sequence lengths one probe runs at: the text's, the latent's tokens (every frame's patches), and the
    lengths of its parts (a frame's patches, the frames at one position), which an attention over a part shows."""

    text: int = TEXT
    tokens: int = IMAGE
    parts: tuple[tuple[int, str], ...] = ()

    @property
    def joined(self) -> int:
        return self.text + self.tokens

    @property
    def sequence(self) -> tuple[int, ...]:
        return (self.text, self.tokens, self.joined, *(n for n, _ in self.parts))


IMAGE_PROBE = _Lengths()


@dataclass
class _Probe:
    lengths: _Lengths = IMAGE_PROBE
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
                if sorted(lengths) == sorted([probe.lengths.text, probe.lengths.tokens]):
                    probe.joins.append(lengths)
        elif probe.in_blocks and func in _CONV:
            probe.mixing.append((f"a convolution ({func.__name__})", probe.step))
        elif probe.in_blocks and _is_reduction(func, args):
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim")
            x = args[0]
            dims = dim if isinstance(dim, (tuple, list)) else ([dim] if isinstance(dim, int) else list(range(x.dim())))
            if any(x.shape[d] in probe.lengths.sequence for d in dims if -x.dim() <= d < x.dim()):
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


def _latent_shapes(model: nn.Module, config: dict[str, Any]) -> list[tuple[tuple[int, ...], _Lengths]] | str:
    """The latent shapes to probe with, and the lengths each gives: one image of 1 x 41 patches, or, for a video
    model (a 3-D patch size, a `patch_size_t`, or a forward that takes `num_frames`-free 5-D latents: a class
    whose name says 3D), two videos of frames x height x width patches, 3 x 5 x 7 and 5 x 3 x 9 (105 and 135
    tokens; a frame's 35 and 27; no part any other length takes), each laid out `[B, C, F, H, W]`."""
    channels, patch = config.get("in_channels"), config.get("patch_size") or 1
    if isinstance(patch, (list, tuple)) and len(patch) == 3 and all(isinstance(p, int) for p in patch):
        pt, ph, pw = (int(p) for p in patch)
        video = True
    elif isinstance(patch, int):
        pt, ph, pw = config.get("patch_size_t") or 1, patch, patch
        video = "patch_size_t" in config or "3D" in type(model).__name__
    else:
        return "its config gives no patch_size"
    if not isinstance(channels, int) or not isinstance(pt, int):
        return "its forward takes no hidden_states latent of in_channels with a patch_size"
    if not video:
        return [((1, channels, ph, IMAGE * pw), IMAGE_PROBE)]
    shapes: list[tuple[tuple[int, ...], _Lengths]] = []
    for f, h, w in VIDEO_PROBES:
        lengths = _Lengths(tokens=f * h * w, parts=((h * w, "a frame's patches"), (f, "the frames at one place")))
        shapes.append(((1, channels, f * pt, h * ph, w * pw), lengths))
    return shapes


def _inputs(model: nn.Module, config: dict[str, Any], latent: tuple[int, ...]) -> dict[str, Any] | str:
    params = inspect.signature(model.forward).parameters
    if "hidden_states" not in params:
        return "its forward takes no hidden_states latent of in_channels with a patch_size"
    with torch.device("meta"):
        inputs: dict[str, Any] = {"hidden_states": torch.empty(latent)}
        for name, param in params.items():
            if name == "hidden_states" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if name == "encoder_hidden_states":
                width = next((config[k] for k in _TEXT_WIDTH_KEYS if isinstance(config.get(k), int)), None)
                if width is None:
                    return "its config gives no text width for encoder_hidden_states"
                inputs[name] = torch.empty(1, TEXT, width)
            elif name in ("timestep", "timesteps", "r_timestep"):
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


def _leaves(value: Any) -> list[Any]:
    """Every tensor in a value as a block takes it (tuples, lists and dicts, at any depth)."""
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return [value]


def _seq_dims(x: Any, lengths: _Lengths) -> list[int]:
    return [d for d, n in enumerate(x.shape) if n in lengths.sequence] if isinstance(x, torch.Tensor) else []


def block_list_plan(model: nn.Module, config: dict[str, Any]) -> InferredCP:
    """The CP plan the block-list probe proves right (see the module docstring), or why none: for a video model,
    the plan both video probes prove, the same from each."""
    lists = _blocks(model)
    if not lists:
        return InferredCP(None, why_not="it has no top-level list of blocks with attention")
    config = {**dict(getattr(model, "config", None) or {}), **config}  # the class's defaults where config.json omits
    shapes = _latent_shapes(model, config)
    if isinstance(shapes, str):
        return InferredCP(None, why_not=shapes)
    found: InferredCP | None = None
    for latent, lengths in shapes:
        layouts = [latent] if len(latent) == 4 else [latent, (latent[0], latent[2], latent[1], *latent[3:])]
        for layout in layouts:  # [B, C, F, H, W], else [B, F, C, H, W] (CogVideoX's)
            inputs = _inputs(model, config, layout)
            if isinstance(inputs, str):
                return InferredCP(None, why_not=inputs)
            result = _probe_once(model, lists, inputs, lengths)
            if not result.why_not.startswith("its forward does not run"):
                break
        if result.plan is None:
            return result
        if found is not None and (found.plan, found.join_order, found.local_attention) != (
            result.plan, result.join_order, result.local_attention,
        ):  # fmt: skip
            return InferredCP(None, why_not="its two video probes (frames and sizes differ) give different plans")
        found = result
    assert found is not None
    return found


def _probe_once(
    model: nn.Module, lists: list[tuple[str, nn.ModuleList]], inputs: dict[str, Any], lengths: _Lengths
) -> InferredCP:
    probe = _Probe(lengths)
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
    n = probe.lengths
    tokens, text, joined = n.tokens, n.text, n.joined
    if not probe.block_inputs:
        return InferredCP(None, why_not="its forward calls no block")
    start = probe.block_inputs[0]
    hidden, text_in = start.get("hidden_states"), start.get("encoder_hidden_states")
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == tokens):
        return InferredCP(None, why_not="its first block does not take hidden_states of one row per latent token")
    if text_in is not None and not (
        isinstance(text_in, torch.Tensor) and text_in.dim() == 3 and text_in.shape[1] == text
    ):
        return InferredCP(None, why_not="its first block does not take encoder_hidden_states of one row per text token")
    outputs: dict[int, tuple[str, int, int, int]] = {}  # id(tensor) -> top-level module, output index, dim, dims
    for name, output, _ in probe.top:
        items = list(output) if isinstance(output, (tuple, list)) else [output]
        for i, item in enumerate(items):
            dims = _seq_dims(item, n)
            if len(dims) == 1 and item.shape[dims[0]] == tokens:
                outputs[id(item)] = (name, i, dims[0], item.dim())
    split_outputs: dict[str, dict[int, SeqDim]] = {}
    for call in probe.block_inputs:
        for arg, value in call.items():
            if arg in ("block", "step", "hidden_states", "encoder_hidden_states"):
                continue
            for item in _leaves(value):  # nested too: JoyImage passes ((cos, sin), text tables) per token
                if not _seq_dims(item, n):
                    continue
                found = outputs.get(id(item))
                if found is None:
                    return InferredCP(None, why_not=f"its blocks take {arg} per token, which is no latent-only output "
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
    allowed = {(tokens, tokens), (joined, joined), (tokens, text)}
    parts = dict(n.parts)
    for module, seen in kinds.items():
        if not seen <= allowed or len(seen) > 1:
            q, k = sorted(seen - allowed or seen)[0]
            what = f" (over {parts[q]} only)" if q in parts else ""
            return InferredCP(None, why_not=f"{module} attends {q} query rows to {k} key rows{what}, not over the "
                              f"whole sequence (latent {tokens}, text {text})")  # fmt: skip
    joins = any((joined, joined) in s for s in kinds.values())
    cross = any((tokens, text) in s for s in kinds.values())
    if joins and cross:
        return InferredCP(None, why_not="its attention both joins the text to the latent and attends to it whole")
    last_attention = probe.attention[-1][4]
    gathers = [
        (name, step)
        for name, output, step in probe.top
        if step > last_attention
        and isinstance(getattr(model, name), nn.Linear)
        and isinstance(output, torch.Tensor)
        and output.dim() == 3
        and output.shape[1] == tokens
    ]
    if len(gathers) != 1:
        return InferredCP(None, why_not="no single top-level Linear returns the latent tokens after the last attention")
    gather = gathers[0][0]
    if any(step > gathers[0][1] for _, _, _, _, step in probe.attention):
        return InferredCP(None, why_not=f"attention runs after {gather}")
    mixing = [what for what, step in probe.mixing if step < gathers[0][1]]
    if mixing:
        return InferredCP(None, why_not=f"its blocks apply {mixing[0]}, which a split sequence cannot")
    split_inputs = {"hidden_states": SeqDim(1, 3)}
    join = None
    if joins:
        orders = set(probe.joins)
        if len(orders) != 1 or text_in is None:
            return InferredCP(None, why_not="its forward joins the text and latent sequences in no single order")
        split_inputs["encoder_hidden_states"] = SeqDim(1, 3)
        text_first = next(iter(orders))[0] == text
        join = ("encoder_hidden_states", "hidden_states") if text_first else ("hidden_states", "encoder_hidden_states")
    plan: dict[str, CPEntry] = {first[0]: CPEntry(split_inputs=split_inputs)}
    for module, specs in split_outputs.items():
        plan[module] = CPEntry(split_outputs=specs)
    plan[gather] = CPEntry(gather_output=SeqDim(1, 3))
    local = tuple(sorted(m for m, s in kinds.items() if (tokens, text) in s))
    return InferredCP(plan, join, local_attention=local)
