"""A TP plan inferred from the model's own modules (built on the meta device), for classes no plan covers.

Sharding stays inside units whose input and output are whole on every rank, so that whatever lies between them
runs replicated, unchanged and correct:
- attention (diffusers' modules with a processor): the q/k/v projections (separate, Kandinsky's `to_query`/
  `to_key`/`to_value` too, or fused `to_qkv`/`to_kv` as packed blocks, grouped KV heads included) and the added
  text projections colwise, the output projections (`out_layer` too) rowwise, the head-count attributes divided;
  grouped KV heads that the TP degree exceeds (dividing it) computed one per rank, `kv_head_select`, their
  attributes one head's worth (`one_kv_head`); a 3-D mask with a row per (batch, head) cut to the rank's heads
  (`per_head_masks`);
  a q/k norm over one head (the query's width over the head count where no attribute gives it) or on the
  attention's input stays whole, one across all heads of a column-split projection takes `tp_rms_norm` or
  `tp_layer_norm`;
- feed-forwards: diffusers' `FeedForward` (GELU, GEGLU, SwiGLU, ...; a packed `[hidden; gate]` projection as two
  packed blocks), MLP modules of two or three Linear layers (up/gate colwise, down rowwise; where the shapes read
  both ways round, the reading that maps back to the input's width, else whole) and a block's own `ff_in`/`ff_out`
  pair (MiniMax-Music-3's);
- single-stream blocks whose attention has no output projection and whose `proj_out` takes `cat([attn, mlp])`:
  `proj_out` packed rowwise with the attention's and the MLP's widths;
- rotary tables that span every head at once (LTX-Video's, Mochi's per-head ones): each rank slices its part
  (`tp_split_outputs`), and of such tables given to the model's forward (`tp_split_inputs`);
- AdaLN modulation projections, split along their (replicated) input with `replicated_input_rowwise`, only where
  together they are more than a tenth of the parameters (else the all-reduce costs more than the memory saved).

Mixture-of-experts layers: experts that are feed-forward modules (HiDream's) get each expert split by TP like any
feed-forward; experts stored as parameters `[experts, ...]` (NucleusMoE's `SwiGLUExperts`) are split by whole
experts (`split_experts`: rank r holds experts `[r*E/T, (r+1)*E/T)`, computes their rows and all-reduces). Either
way the router stays whole and every TP rank holds every token and routes it alike, so no token moves between ranks
(the all-to-all of expert parallelism exists to move tokens that are split across ranks, which TP's are not).
Whole experts rather than each expert split: the output's rows each come from one rank (exact), expert-choice
routing balances the ranks, and the converter cuts tensors along dim 0 (docs/design.md says more). Everything else
is replicated. What inference cannot place correctly (a Linear, a parameter or a norm inside an attention module
that it does not recognise) is refused naming the module and why: no guess. Nor is anything split by its names and
layout alone: only units whose code inference knows (`plans/known_code.py`: diffusers' attention and processor
classes, the feed-forward and block classes the plans handle, by identity); a unit whose code it does not know, or
that custom code around it reaches into, is kept whole (exact: its inputs are whole), named in the description.
CP is not placed here: it comes from the class's own `_cp_plan`, else from `plans/infer_cp.py`, which infers one
only where a probe of the forward on the meta device proves a shape it can split (Flux's: both sequences joined in
every attention, position ids as inputs; or a list of per-token blocks over a patched latent, attention over the
whole sequence); else none.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from preshard.errors import PlanError
from preshard.format.plan import AttentionRule, LinearRule, Plan, SeqDim, SplitInput, matches
from preshard.format.styles import (
    Colwise,
    KVHeadSelect,
    PackedColwise,
    PackedRowwise,
    ReplicatedInputRowwise,
    Rowwise,
    SplitExperts,
    Style,
    tp_norm_style,
)
from preshard.plans.known_code import (
    BLOCK_MLPS,
    SINGLE_STREAM_BLOCKS,
    custom_classes,
    known_by_name,
    known_feed_forward,
    library_class,
    reached_units,
    unknown_attention,
)
from preshard.plans.model_check import folded, is_attention, norm_size, on_input

# Head-count attributes of attention modules that a processor may reshape by: divided by the TP degree.
HEAD_ATTRIBUTES = (
    "heads", "kv_heads", "num_heads", "num_kv_heads", "num_attention_heads", "num_key_value_heads",
    "sliceable_head_dim", "inner_dim", "inner_kv_dim", "kv_inner_dim",
)  # fmt: skip
# config.json keys holding head counts: the TP degree must divide each.
HEAD_CONFIG_KEYS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "num_heads", "num_single_heads")
KV_CONFIG_KEYS = ("num_key_value_heads", "num_kv_heads")
# Attributes holding the grouped KV heads' count or width: one KV head's worth on a rank that computes one.
KV_ATTRIBUTES = ("kv_heads", "num_kv_heads", "num_key_value_heads", "inner_kv_dim", "kv_inner_dim")
ADALN_SHARE = 0.10  # modulation projections are split only above this share of the parameters

_OUTPUT = re.compile(r"^(to_out(\.0)?|to_add_out|to_out_t|o_proj|out_proj|out_layer|.*attn_proj|.*_out)$")
_QKV = re.compile(r"qkv")
_KV = re.compile(r"(^|_)kv(_|$)")
_SINGLE = re.compile(
    r"^(to_[qkv](_t)?|to_(query|key|value)|add_[qkv]_proj|[qkv]_proj|to_gate|gate_proj|to_gate_logits)$"
)
_QUERY = ("to_q", "to_query", "q_proj", "q_linear")  # a query projection's names, whose width is the heads'
_MLP_CLASS = re.compile(r"feedforward|mlp|ffn|swiglu|glu", re.IGNORECASE)
_MLP_NAME = re.compile(r"^(ff|ffn|mlp|feed_forward|ff_context|ffn_context|mlp_context|txt_mlp|img_mlp)$")
_ADALN = re.compile(r"(^|\.)(norm[^.]*\.linear|[^.]*adaln[^.]*|[^.]*modulation[^.]*)(\.|$)", re.IGNORECASE)


def infer_plan(model: nn.Module, config: dict[str, Any] | None = None, tp: int = 1) -> Plan:
    """The TP plan `model`'s modules call for (see the module docstring); no CP plan (`plan_from_model_class`
    adds the class's `_cp_plan`, else the one `plans/infer_cp.py` infers, if any).

    Args:
        model: the model, on the meta device (no memory needed).
        config: its config.json, for the head counts the TP degree must divide.
        tp: the TP degree it is for: where it exceeds an attention's grouped KV heads (which divide it, and it the
            query heads), the separate k/v projections take `kv_head_select` (each rank computes the one KV head
            its query heads share) instead of being split.

    Returns:
        A plan named after the class, origin "inferred plan for CLASS".

    Raises:
        PlanError: a module inference cannot place correctly, named with the reason; or nothing to shard.
    """
    return infer_plan_keeping(model, config, tp)[0]


def infer_plan_keeping(
    model: nn.Module, config: dict[str, Any] | None = None, tp: int = 1
) -> tuple[Plan, dict[str, str]]:
    """`infer_plan`, with the units it keeps whole because custom code runs them or reaches into them (module name
    -> why; `plans/known_code.py`)."""
    cls = type(model)
    origin = f"inferred plan for {cls.__name__}"
    modules = dict(model.named_modules())
    whole: dict[str, str] = {}
    for _ in range(len(modules) + 1):  # each round keeps at least one more unit whole, or ends
        placed = _place(origin, model, modules, tp, whole)
        reached = {u: w for u, w in reached_units(model, placed.units).items() if u not in whole}
        if not reached:
            break
        whole |= reached
    styles, attention = placed.styles, placed.attention
    kept = whole | placed.left
    inside = tuple(f"{name}." for name in attention)
    split_outputs = _rotary_across_heads(modules, styles, attention, inside)
    split_inputs = _rotary_inputs(model, modules, split_outputs)
    _refuse_rotary_beside_custom_code(origin, model, split_outputs, split_inputs, whole)
    masked = {name for name in attention if _takes_mask(modules[name])}
    if not any(style.name != "replicate" for style in styles.values()):
        raise PlanError(
            f"{origin}: found no attention or feed-forward module to shard in {cls.__name__}"
            + (f" (kept whole: {_kept(kept)})" if kept else "")
            + "; write a plan file and pass --plan plan.json"
        )
    config = config or {}
    selected = placed.selected
    plan = Plan(
        name=f"inferred-{cls.__name__}",
        linear=tuple(_fold_rules(styles, modules)),
        attention=(
            *_fold_attention(placed.divides, modules, masked=masked, selected=selected),
            *_fold_attention(placed.widths, modules, context_parallel=False),
        ),
        config_divisible=tuple(
            k for k in HEAD_CONFIG_KEYS if _is_int(config.get(k)) and not (selected and k in KV_CONFIG_KEYS)
        ),
        model_classes=(cls.__name__,),
        description=f"inferred by preshard from the modules of {cls.__name__}"
        + (f"; kept whole, as custom code runs them: {_kept(kept)}" if kept else ""),
        origin=origin,
        tp_split_outputs=split_outputs,
        tp_split_inputs=split_inputs,
    )
    return plan, kept


def _kept(whole: dict[str, str]) -> str:
    shown = [f"{name} ({why})" for name, why in sorted(whole.items())[:3]]
    more = f" and {len(whole) - 3} more" if len(whole) > 3 else ""
    return "; ".join(shown) + more


@dataclass
class _Placement:
    styles: dict[str, Style] = field(default_factory=dict)
    divides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    selected: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)  # attention -> one_kv_head attrs
    widths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # blocks -> attributes holding a split width
    attention: list[str] = field(default_factory=list)  # the attention modules split across heads
    units: set[str] = field(default_factory=set)  # every module whose inside is split
    left: dict[str, str] = field(default_factory=dict)  # feed-forwards of unknown code left whole -> why


def _place(origin: str, model: nn.Module, modules: dict[str, nn.Module], tp: int, whole: dict[str, str]) -> _Placement:
    """Where every unit not in `whole` goes; attention and feed-forwards whose code inference does not know are
    added to `whole` (with why) and left out."""
    placed = _Placement()
    styles, divides, selected = placed.styles, placed.divides, placed.selected

    def kept(name: str) -> bool:
        return any(name == w or name.startswith(f"{w}.") or not w for w in whole)

    attention_all = [name for name, m in modules.items() if name and is_attention(m)]
    outputless: dict[str, int] = {}  # attention modules with no output projection -> their output width
    for name in attention_all:
        if kept(name):
            continue
        why = unknown_attention(modules[name])
        if why is not None:
            whole[name] = why
            continue
        width = _attention(origin, name, modules[name], styles, divides)
        _differential(origin, name, modules[name], styles)
        _kv_head_select(origin, name, modules[name], tp, styles, divides, selected)
        placed.attention.append(name)
        placed.units.add(name)
        if width is not None:
            outputless[name] = width
    for name, width in outputless.items():
        block = name.rpartition(".")[0]
        holder = modules[block] if block else model
        if block and not kept(block) and known_by_name(type(holder), SINGLE_STREAM_BLOCKS):
            _single_stream(origin, name, width, modules, styles, placed.widths)
            placed.units.add(block)
            continue
        if library_class(type(holder)):  # a diffusers block whose forward reduces it some other way: unknown
            raise PlanError(
                f"{origin}: attention {name} has no output projection and its block {block or '(the model)'} "
                f"({type(holder).__name__}) is not a single-stream block preshard knows (proj_out over cat([attention, "
                "proj_mlp])); write a plan file for this model (--plan FILE)"
            )
        for key in [k for k in styles if k.startswith(f"{name}.")]:  # its custom block joins its heads: whole
            del styles[key]
        divides.pop(name, None)
        selected.pop(name, None)
        placed.attention.remove(name)
        placed.units.discard(name)
        whole[name] = f"it has no output projection and its block {type(holder).__name__} is custom code"
    inside = tuple(f"{name}." for name in attention_all)
    for name, module in modules.items():
        if name and not name.startswith(inside) and name not in styles and not kept(name):
            if SplitExperts.unsupported(module) is None:
                styles[name] = SplitExperts()
                placed.units.add(name)
                continue
            found: dict[str, Style] = {}
            _feed_forward(name, module, found)
            _block_mlp(name, module, found)
            if not found:
                continue
            if known_feed_forward(module) or known_by_name(type(module), BLOCK_MLPS):
                styles.update(found)
                placed.units.add(name)
            else:  # laid out as a feed-forward, but its forward is code inference has not seen
                why = f"its class {type(module).__name__} is not a feed-forward whose forward preshard knows"
                placed.left[name] = why
    for name in _adaln(model, modules, styles, kept):
        placed.units.add(name)
    return placed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_attr(module: nn.Module, attr: str) -> int | None:
    value = getattr(module, attr, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _head_dim(module: nn.Module) -> int | None:
    for attr in ("head_dim", "dim_head", "dim_heads", "attention_head_dim"):
        value = _int_attr(module, attr)
        if value is not None:
            return value
    inner, heads = _int_attr(module, "inner_dim"), _int_attr(module, "heads") or _int_attr(module, "num_heads")
    if inner is None:  # no width attribute (Kandinsky's attention): the query projection's
        query = next((getattr(module, n) for n in _QUERY if isinstance(getattr(module, n, None), nn.Linear)), None)
        inner = query.out_features if query is not None else None
    if inner is not None and heads is not None and heads > 0 and inner % heads == 0:
        return inner // heads
    return None


def _packed_blocks(leaf: str, out: int, module: nn.Module, head_dim: int | None) -> tuple[int, ...] | None:
    """The [q, k, v] (or [k, v]) widths of a fused projection, from the module's head counts; None if unknown."""
    heads = _int_attr(module, "heads")
    kv = _int_attr(module, "kv_heads") or _int_attr(module, "num_kv_heads")
    parts = 3 if _QKV.search(leaf) else 2
    if heads is not None and kv is not None and head_dim and kv != heads:
        q, k = heads * head_dim, kv * head_dim
        sizes = (q, k, k) if parts == 3 else (k, k)
        return sizes if sum(sizes) == out else None
    return (out // parts,) * parts if out % parts == 0 else None


def _attention(
    origin: str, name: str, module: nn.Module, styles: dict[str, Style], divides: dict[str, tuple[str, ...]]
) -> int | None:
    """Place `module`'s projections and norms; returns its output width if it has no output projection."""
    head_dim = _head_dim(module)
    split_widths: set[int] = set()
    outputs = 0
    width = None
    for child, sub in module.named_modules():
        if not child:
            continue
        full = f"{name}.{child}"
        if isinstance(sub, nn.Linear):
            out = sub.weight.shape[0]
            if _OUTPUT.match(child):
                styles[full] = Rowwise()
                outputs += 1
            elif _QKV.search(child) or (_KV.search(child) and not _SINGLE.match(child)):
                blocks = _packed_blocks(child, out, module, head_dim)
                if blocks is None:
                    raise PlanError(
                        f"{origin}: {full} is a fused projection of {out} features that the head counts of {name} "
                        "do not divide into q/k/v blocks; write a plan file (--plan FILE)"
                    )
                styles[full] = PackedColwise(blocks=blocks)
                split_widths.update(blocks)
            elif _SINGLE.match(child):
                styles[full] = Colwise()
                split_widths.add(out)
                if child in ("to_v", "to_q") and width is None:
                    width = out
            else:
                raise PlanError(
                    f"{origin}: {full} is a Linear inside attention {name} that preshard cannot place (neither a "
                    "q/k/v nor an output projection); write a plan file for this model (--plan FILE)"
                )
    for child, sub in module.named_modules():  # after the projections: a norm may be registered before them
        if child and not isinstance(sub, nn.Linear):
            if list(sub.parameters(recurse=False)) or "norm" in child.rpartition(".")[2].lower():
                _attention_norm(origin, name, f"{name}.{child}", child, sub, module, head_dim, split_widths, styles)
    for param, _ in module.named_parameters(recurse=False):
        raise PlanError(
            f"{origin}: {name}.{param} is a parameter of attention {name} itself (per-head values preshard cannot "
            "split); write a plan file for this model (--plan FILE)"
        )
    attrs = tuple(a for a in HEAD_ATTRIBUTES if _is_int(getattr(module, a, None)))
    query = getattr(module, "to_q", None)
    if isinstance(query, nn.Linear) and _int_attr(module, "out_dim") == query.out_features:
        attrs += ("out_dim",)  # as wide as the heads (OmniGen reshapes the heads' output by it), so divided too
    if not {"heads", "num_heads", "num_attention_heads"} & set(attrs):
        raise PlanError(f"{origin}: attention {name} has no integer head count (heads) to divide by the TP degree")
    divides[name] = attrs
    return width if outputs == 0 else None


def _kv_head_select(
    origin: str,
    name: str,
    module: nn.Module,
    tp: int,
    styles: dict[str, Style],
    divides: dict[str, tuple[str, ...]],
    selected: dict[str, tuple[tuple[str, int], ...]],
) -> None:
    """Grouped KV heads that `tp` exceeds (KV heads dividing `tp`, `tp` dividing the query heads): the k/v
    projections (column-split Linears as wide as the KV heads) keep their weights whole and each rank computes the
    KV head its query heads share (`kv_head_select`); the KV attributes become one head's worth (`one_kv_head`)
    instead of being divided. A fused projection holding the KV heads cannot be computed so: refused, naming it."""
    heads = next((v for a in ("heads", "num_heads", "num_attention_heads") if (v := _int_attr(module, a))), None)
    kv = next((v for a in KV_ATTRIBUTES[:3] if (v := _int_attr(module, a)) is not None), None)
    head_dim = _head_dim(module)
    inner_kv = next((v for a in KV_ATTRIBUTES[3:] if (v := _int_attr(module, a)) is not None), None)
    if kv is None and inner_kv is not None and head_dim and inner_kv % head_dim == 0:
        kv = inner_kv // head_dim  # diffusers' Attention keeps the KV width only (`inner_kv_dim`)
    if tp == 1 or heads is None or kv is None or head_dim is None or kv >= heads or kv % tp == 0:
        return
    if tp % kv or heads % tp:
        return  # no KV head per rank: the divided attributes name the degrees that work
    width = kv * head_dim
    for child, sub in module.named_modules():
        full = f"{name}.{child}"
        style = styles.get(full)
        if not isinstance(sub, nn.Linear) or style is None:
            continue
        if isinstance(style, PackedColwise) and isinstance(style.blocks, tuple) and width in style.blocks:
            raise PlanError(
                f"{origin}: {full} fuses the {kv} grouped KV heads of {name} with other features, and --tp {tp} "
                f"exceeds them, so no rank can hold whole KV heads of it; use a --tp that divides {kv}, or a plan file"
            )
        if isinstance(style, Colwise) and not isinstance(style, PackedColwise) and sub.out_features == width:
            styles[full] = KVHeadSelect(blocks=kv)
    kv_attrs = tuple(a for a in KV_ATTRIBUTES if _int_attr(module, a) is not None)
    divides[name] = tuple(a for a in divides[name] if a not in kv_attrs)
    selected[name] = tuple((a, kv) for a in kv_attrs)


def _differential(origin: str, name: str, module: nn.Module, styles: dict[str, Style]) -> None:
    """Differential attention (StableAudio-3's `use_differential`: `Attn(q1, k1, v) - Attn(q2, k2, v)`) fuses
    `[q1 | q2 | k1 | k2 | v]`, `[q1 | q2]` and `[k1 | k2 | v]`, each part as wide as the heads: each of its
    column-split projections is packed in parts of that width (what `chunk` cuts on every rank), whatever its
    name says."""
    if not getattr(module, "use_differential", False):
        return
    heads, head_dim = _int_attr(module, "heads"), _head_dim(module)
    if heads is None or head_dim is None:
        raise PlanError(f"{origin}: differential attention {name} has no heads and head_dim to cut its parts by")
    width = heads * head_dim
    for child, sub in module.named_modules():
        full = f"{name}.{child}"
        if not isinstance(sub, nn.Linear) or not isinstance(styles.get(full), Colwise):
            continue
        if sub.out_features % width:
            raise PlanError(
                f"{origin}: {full} ({sub.out_features} features) of differential attention {name} is not made of "
                f"parts as wide as its {heads} heads ({width}); write a plan file for this model (--plan FILE)"
            )
        parts = sub.out_features // width
        styles[full] = PackedColwise(blocks=(width,) * parts) if parts > 1 else Colwise()


def _attention_norm(
    origin: str,
    name: str,
    full: str,
    child: str,
    sub: nn.Module,
    module: nn.Module,
    head_dim: int | None,
    split_widths: set[int],
    styles: dict[str, Style],
) -> None:
    """A norm in attention `module`: over one head, or on its whole input (`model_check.on_input`), stays whole;
    across every head of a split projection takes the TP norm style for its class (`tp_rms_norm`,
    `tp_layer_norm`)."""
    size = norm_size(sub)
    if (size is not None and size == head_dim) or on_input(child, sub, module):
        return  # per head, or on the whole input
    if size is None and not list(sub.parameters(recurse=False)):
        return  # Identity and friends
    if size in split_widths:
        style = tp_norm_style(sub)
        if isinstance(style, str):
            raise PlanError(
                f"{origin}: {full} normalises across all {size} features of a column-split projection of {name}, "
                f"and it {style}; this model cannot be sharded across heads yet"
            )
        styles[full] = style
        return
    raise PlanError(
        f"{origin}: {full} ({type(sub).__name__}, {size} features) in attention {name} is neither per head nor "
        "across the heads of its projections; write a plan file for this model (--plan FILE)"
    )


def _single_stream(
    origin: str,
    name: str,
    width: int,
    modules: dict[str, nn.Module],
    styles: dict[str, Style],
    widths: dict[str, tuple[str, ...]],
) -> None:
    """An attention with no output projection: its block's `proj_out` must take cat([attention, mlp]).

    A gated MLP (`proj_mlp` of `[hidden; gate]`, `proj_out` over `width + hidden`, Ovis-Image's) is packed colwise
    in its two halves; a block that splits them by an integer attribute holding `hidden` (`torch.split(x,
    [self.mlp_hidden_dim] * 2)`) has that attribute divided by the TP degree, as an attention's head counts are.
    A block with no such attribute would split by a width it holds elsewhere: refused.
    """
    block = name.rpartition(".")[0]
    where = f"{block}." if block else ""
    out = modules.get(f"{where}proj_out")
    mlp = modules.get(f"{where}proj_mlp")
    if isinstance(out, nn.Linear) and isinstance(mlp, nn.Linear):
        hidden = mlp.weight.shape[0]
        if out.weight.shape[1] == width + hidden:
            styles[f"{where}proj_mlp"] = Colwise()
            styles[f"{where}proj_out"] = PackedRowwise(blocks=(width, hidden))
            return
        half = hidden // 2
        if hidden % 2 == 0 and out.weight.shape[1] == width + half:  # a gated MLP: [hidden; gate]
            holder = modules[block] if block else None
            attrs = tuple(a for a, v in vars(holder).items() if _is_int(v) and v == half) if holder else ()
            if len(attrs) != 1:
                raise PlanError(
                    f"{origin}: {where}proj_mlp feeds a gated MLP of {half} features that its block "
                    f"{block or '(the model)'} splits by a width preshard does not find as one integer attribute "
                    f"(found {list(attrs)}); write a plan file for this model (--plan FILE)"
                )
            styles[f"{where}proj_mlp"] = PackedColwise(blocks=(half, half))
            styles[f"{where}proj_out"] = PackedRowwise(blocks=(width, half))
            widths[block] = attrs
            return
    raise PlanError(
        f"{origin}: attention {name} has no output projection and its block has no proj_out over "
        "cat([attention, proj_mlp]) to reduce it; write a plan file for this model (--plan FILE)"
    )


def _feed_forward(name: str, module: nn.Module, styles: dict[str, Style]) -> None:
    """diffusers' FeedForward (`net`: activation with `proj`, ..., Linear) or an MLP of 2-3 Linear children. Where
    the shapes read both ways round (which Linear is the down projection), the one reading whose down gives back
    the width the ups take is kept (an MLP from d features to d); else it is left whole."""
    net = getattr(module, "net", None)
    first = net[0] if isinstance(net, nn.ModuleList) and len(net) >= 2 else None
    up = getattr(first, "proj", None)
    if isinstance(net, nn.ModuleList) and isinstance(first, nn.Module) and isinstance(up, nn.Linear):
        steps = [(i, m) for i, m in enumerate(net) if isinstance(m, nn.Linear)]
        rest = [m for m in list(net)[1:] if not isinstance(m, nn.Linear) and _has_params(m)]
        rest += [m for n, m in first.named_children() if n != "proj" and _has_params(m)]
        if len(steps) != 1 or rest or any(True for _ in first.parameters(recurse=False)):
            return
        index, down = steps[0]
        style = _up_style(up, down)
        if style is not None:
            styles[f"{name}.net.0.proj"] = style
            styles[f"{name}.net.{index}"] = Rowwise()
        return
    if not (_MLP_CLASS.search(type(module).__name__) or _MLP_NAME.match(name.rpartition(".")[2])):
        return
    children = list(module.named_children())
    linears = {n: m for n, m in children if isinstance(m, nn.Linear)}
    heavy = [n for n, m in children if n not in linears and _has_params(m)]
    if len(linears) not in (2, 3) or heavy or any(True for _ in module.parameters(recurse=False)):
        return
    readings: list[tuple[str, dict[str, Style]]] = []
    for down_name, down in linears.items():
        ups = {n: _up_style(m, down) for n, m in linears.items() if n != down_name}
        inputs = {m.weight.shape[1] for n, m in linears.items() if n != down_name}
        if all(s is not None for s in ups.values()) and len(inputs) == 1:
            placed = {n: s for n, s in ups.items() if s is not None} | {down_name: Rowwise()}
            readings.append((down_name, placed))
    if len(readings) > 1:  # the shapes fit both ways round (Flux3's `linear_in [2h, d]`, `linear_out [d, h]`)
        readings = [(d, p) for d, p in readings if _gives_back_input(d, linears)]
    if len(readings) == 1:  # else two readings (a square MLP: only its forward tells) or none: left whole
        for child, style in readings[0][1].items():
            styles[f"{name}.{child}"] = style


def _gives_back_input(down_name: str, linears: dict[str, nn.Linear]) -> bool:
    """Whether down `down_name` gives back the width the up projections take (an MLP from d features to d)."""
    inputs = {m.in_features for n, m in linears.items() if n != down_name}
    return inputs == {linears[down_name].out_features}


_BLOCK_UP = re.compile(r"^(ff|ffn|mlp)_(in|up)$")


def _block_mlp(name: str, module: nn.Module, styles: dict[str, Style]) -> None:
    """An MLP whose two Linear layers are children of the block itself (MiniMax-Music-3's `ff_in [2h, d]`,
    `ff_out [d, h]`), named `ff_in`/`ff_out` (`ffn_`, `mlp_`; `_up`/`_down`): up colwise (packed `[hidden; gate]` as
    two blocks), down rowwise, where the shapes chain."""
    for child, up in module.named_children():
        match = _BLOCK_UP.match(child)
        if match is None or not isinstance(up, nn.Linear):
            continue
        down_name = f"{match[1]}_{'out' if match[2] == 'in' else 'down'}"
        down = getattr(module, down_name, None)
        up_full, down_full = f"{name}.{child}", f"{name}.{down_name}"
        if not isinstance(down, nn.Linear) or up_full in styles or down_full in styles:
            continue
        style = _up_style(up, down)
        if style is not None:
            styles[up_full], styles[down_full] = style, Rowwise()


def _up_style(up: nn.Linear, down: nn.Linear) -> Style | None:
    out, hidden = up.weight.shape[0], down.weight.shape[1]
    if out == hidden:
        return Colwise()
    if out == 2 * hidden:
        return PackedColwise(blocks=(hidden, hidden))
    return None


def _adaln(
    model: nn.Module, modules: dict[str, nn.Module], styles: dict[str, Style], kept: Callable[[str], bool]
) -> list[str]:
    """Modulation projections left whole, split along their input where together they are a large share; returns
    the ones split."""
    total = sum(p.numel() for p in model.parameters())
    found = [
        name
        for name, m in modules.items()
        if isinstance(m, nn.Linear)
        and name not in styles
        and _ADALN.search(name)
        and not name.startswith("norm_out")
        and not kept(name)
    ]
    share = sum(p.numel() for n in found for p in modules[n].parameters())
    if not (total and share > ADALN_SHARE * total):
        return []
    for name in found:
        styles[name] = ReplicatedInputRowwise()
    return found


def _refuse_rotary_beside_custom_code(
    origin: str,
    model: nn.Module,
    split_outputs: dict[str, dict[int, SeqDim]],
    split_inputs: dict[str, dict[int, SplitInput]],
    whole: dict[str, str],
) -> None:
    """Rotary tables split per rank reach every attention they are given to: one kept whole, or custom code that
    may use them otherwise, would see a rank's part as the whole. Refused, naming the module."""
    tables = [*split_outputs, *(f"the input {name}" for name in split_inputs)]
    if not tables:
        return
    custom = custom_classes(model)
    if whole or custom:
        name, module = next(iter(custom.items())) if custom else (next(iter(whole)), None)
        who = (
            f"custom code ({type(module).__name__} at {name or 'the model'})"
            if module is not None
            else (f"attention {name}, kept whole ({whole[name]}),")
        )
        raise PlanError(
            f"{origin}: the rotary tables of {tables[0]} span every head and TP gives each rank its part, but "
            f"{who} may use them whole; write a plan file for this model (--plan FILE)"
        )


def _rotary_across_heads(
    modules: dict[str, nn.Module], styles: dict[str, Style], attention: list[str], inside: tuple[str, ...]
) -> dict[str, dict[int, SeqDim]]:
    """Rotary modules outside attention whose (cos, sin) tables span every head at once (`dim` as wide as a
    column-split query, LTX-Video's): each rank slices its part of the last dim, as the queries it rotates; or of
    the heads dim, for tables already per head (LTX-2's `rope_type="split"`, [B, heads, S, D/2]; Mochi's
    [S, heads, D/2], from the model's per-head frequencies `[3, heads, head_dim / 2]` the rope module is given)."""
    head_dims = {_head_dim(modules[name]) for name in attention}
    widths = set()
    for name, style in styles.items():
        linear = modules[name]
        if name.startswith(inside) and style.name == "colwise" and isinstance(linear, nn.Linear):
            widths.add(linear.out_features)
    head_counts = {_int_attr(modules[name], "heads") for name in attention} - {None, 1}
    per_head = any(  # Mochi's `pos_frequencies [3, heads, head_dim / 2]`, which its rope module turns into tables
        p.dim() == 3 and p.shape[1] in head_counts and 2 * p.shape[2] in head_dims
        for p in modules[""].parameters(recurse=False)
    )
    found: dict[str, dict[int, SeqDim]] = {}
    for name, module in modules.items():
        if not name or name.startswith(inside) or not re.search(r"rotary|rope", type(module).__name__, re.I):
            continue
        dim, heads = _int_attr(module, "dim"), _int_attr(module, "num_attention_heads")
        # its own head count says whether `dim` spans heads (LTX-2's tiny audio width equals a video head_dim)
        if dim in widths and (dim not in head_dims if heads is None else heads > 1):
            split = getattr(module, "rope_type", None) == "split"  # LTX-2's per-head tables [B, H, S, D/2]
            found[name] = {i: SeqDim(1, 4) if split else SeqDim(-1) for i in (0, 1)}
        elif dim is None and per_head and not _has_params(module):  # tables [S, heads, D/2] from the model's
            found[name] = {i: SeqDim(1, 3) for i in (0, 1)}
    return found


def _rotary_inputs(
    model: nn.Module, modules: dict[str, nn.Module], split_outputs: dict[str, dict[int, SeqDim]]
) -> dict[str, dict[int, SplitInput]]:
    """Forward inputs holding (cos, sin) rotary tables that span every head (the SANA-WM LTX-2 refiner's
    `video_rotary_emb`, made by its own `rope` module, which the pipeline calls apart): each rank slices them as
    that module's output (`_rotary_across_heads`). The input `X_rotary_emb` goes with the rotary module whose name
    holds X, else with the unprefixed one (`rope`); one whose module is not found unambiguously is left alone."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    found: dict[str, dict[int, SplitInput]] = {}
    tables = {name: spec for name, spec in split_outputs.items() if "." not in name}
    for param in parameters:
        match = re.fullmatch(r"(?:(\w+)_)?(rotary_emb|rope|rotary_pos_emb|freqs_cis)", param)
        if not match or not tables:
            continue
        prefix = match.group(1)
        named = [n for n in tables if prefix and prefix in n]
        plain = [n for n in tables if re.fullmatch(r"rope|rotary_emb|rotary_pos_emb|pos_embed", n)]
        chosen = named or plain
        if len(chosen) != 1:
            continue
        module = modules[chosen[0]]
        split = tables[chosen[0]][0].expected_dims == 4  # per-head tables [B, H, S, D/2]: split on the heads
        whole = _int_attr(module, "num_attention_heads") if split else _int_attr(module, "dim")
        if whole is None:
            continue
        found[param] = {i: SplitInput(1, whole, 4) if split else SplitInput(-1, whole) for i in (0, 1)}
    return found


def _takes_mask(module: nn.Module) -> bool:
    """An attention module whose forward takes the hidden states and an attention mask (diffusers' `Attention`:
    a 3-D mask may come with a row per batch item and head, `prepare_attention_mask`'s layout)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "hidden_states" in parameters and "attention_mask" in parameters and _int_attr(module, "heads") is not None


def _fold(name: str) -> str:
    """Numbered blocks as `*`, but a last component kept (`to_out.0` must not also name the Dropout `to_out.1`)."""
    head, dot, last = name.rpartition(".")
    return f"{folded(head)}{dot}{last}" if dot else name


def _fold_rules(styles: dict[str, Style], modules: dict[str, nn.Module]) -> Iterable[LinearRule]:
    """One rule per pattern with numbered blocks as `*` where every module it matches has the same style."""
    groups: dict[str, list[str]] = {}
    for name in styles:
        groups.setdefault(_fold(name), []).append(name)
    rules: list[LinearRule] = []
    for pattern, names in groups.items():
        kinds = {styles[n] for n in names}
        matched = [m for m in modules if m and matches(pattern, m)]
        if len(kinds) == 1 and len(matched) == len(names):
            rules.append(LinearRule(pattern, styles[names[0]]))
        else:
            rules += [LinearRule(n, styles[n]) for n in names]
    return rules


def _fold_attention(
    divides: dict[str, tuple[str, ...]],
    modules: dict[str, nn.Module],
    context_parallel: bool = True,
    masked: set[str] | None = None,
    selected: dict[str, tuple[tuple[str, int], ...]] | None = None,
) -> list[AttentionRule]:
    masked, selected = masked or set(), selected or {}

    def rule(pattern: str, name: str) -> AttentionRule:
        return AttentionRule(pattern, divides[name], context_parallel, name in masked, selected.get(name, ()))

    groups: dict[str, list[str]] = {}
    for name in divides:
        groups.setdefault(_fold(name), []).append(name)
    rules = []
    for pattern, names in groups.items():
        kinds = {(divides[n], n in masked, selected.get(n, ())) for n in names}
        matched = [m for m in modules if m and matches(pattern, m)]
        if len(kinds) == 1 and len(matched) == len(names):
            rules.append(rule(pattern, names[0]))
        else:
            rules += [rule(n, n) for n in names]
    return rules
