"""A plan checked against the model's module tree (built on the meta device), at conversion rather than at load.

Three things a plan can get wrong that the tensor names and shapes alone do not show:
- a rule naming something that is not what its style shards (a Linear style on a ModuleList, `tp_rms_norm` on
  a LayerNorm, which takes `tp_layer_norm`), or a norm rule on a norm whose features no column-split projection
  beside it produces;
- a norm across every head of a column-split projection left whole (Wan's and LTX-2's
  `qk_norm="rms_norm_across_heads"`): each rank holds a part of what it normalises. The message says to use
  `tp_rms_norm` or `tp_layer_norm` where one applies (a norm on the attention's input, `pre_*`, is not one);
- inside an attention module whose head count the plan divides, a Linear left whole: it would see every head
  on every rank (LTX-2.3's per-head gate `to_gate_logits` under a plan written for LTX-2.0).

Each problem is one line naming the module and why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from preshard.errors import PlanError
from preshard.format.plan import AttentionRule, Plan, matches
from preshard.format.styles import Colwise, SplitExperts, Style, TPNorm, VocabParallel, tp_norm_style

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def is_attention(module: nn.Module) -> bool:
    """diffusers' attention modules: they carry a processor and can swap it, or call it (Mochi's `MochiAttention`,
    whose processor is fixed)."""
    if not hasattr(module, "processor"):
        return False
    return callable(getattr(module, "set_processor", None)) or callable(module.processor)


def norm_size(module: nn.Module) -> int | None:
    """The features a norm module normalises over (one trailing dim), else None: its `weight`'s, or that of its
    only parameter where that is 1-D (StableAudio-3's `gamma`), or its `normalized_shape` / `dim`."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.shape[0]
    own = list(module.parameters(recurse=False))
    if weight is None and len(own) == 1 and own[0].dim() == 1:
        return own[0].shape[0]
    return TPNorm.width(module)


def on_input(child: str, module: nn.Module, attention: nn.Module) -> bool:
    """Whether norm `child` of `attention` normalises the attention's input rather than a projection's output:
    named `pre_*` (WanAnimate's face adapter: `pre_norm_q(hidden_states)` before `to_q`) and as wide as the
    input of a Linear in it. Its input is whole on every rank, so it stays whole."""
    if not child.rpartition(".")[2].startswith("pre_"):
        return False
    size = norm_size(module)
    return any(isinstance(m, nn.Linear) and m.in_features == size for m in attention.modules())


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or "norm" in name.rpartition(".")[2].lower()


def _head_dim(module: nn.Module) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    inner, heads = getattr(module, "inner_dim", None), getattr(module, "heads", None)
    if isinstance(inner, int) and isinstance(heads, int) and heads > 0 and inner % heads == 0:
        return inner // heads
    return None


def folded(name: str) -> str:
    """A module name with its numbered blocks as `*` (`blocks.3.attn1.norm_q` -> `blocks.*.attn1.norm_q`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _column_split_outputs(modules: dict[str, nn.Module], styles: dict[str, Style]) -> dict[str, dict[int, list[str]]]:
    """Parent module -> out features -> names of the column-split Linear layers directly in it (one pass over the
    styles: asked once per attention module, a scan each was quadratic in the module count)."""
    found: dict[str, dict[int, list[str]]] = {}
    for name, style in styles.items():
        if isinstance(style, Colwise) and isinstance(modules.get(name), nn.Linear):
            widths = found.setdefault(name.rpartition(".")[0], {})
            widths.setdefault(modules[name].weight.shape[0], []).append(name)
    return found


def _producer(norm: str, candidates: list[str]) -> str:
    """The projection a norm most likely follows: `norm_q` -> `to_q`, `norm_added_k` -> `add_k_proj`."""
    token = norm.rsplit("_", 1)[-1]
    for name in candidates:
        if name.rpartition(".")[2] in (f"to_{token}", f"add_{token}_proj"):
            return name
    return candidates[0]


def check_norms_across_heads(
    origin: str, modules: dict[str, nn.Module], styles: dict[str, Style], attention: Iterable[str]
) -> None:
    """A norm in one of the `attention` modules that spans the whole output of a column-split projection beside it
    (every head at once) must have a TP norm style (`tp_rms_norm`, `tp_layer_norm`).

    Raises:
        PlanError: naming the norm, the projection, and the rule to add (or why no style can split it).
    """
    outputs = _column_split_outputs(modules, styles)
    for name in attention:
        module = modules[name]
        split = outputs.get(name, {})
        head_dim = _head_dim(module)
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}"
            size = norm_size(child) if _is_norm(full, child) else None
            if size is None or size not in split or size == head_dim or full in styles:
                continue
            if on_input(child_name, child, module):
                continue
            across = (
                f"{origin}: {full} normalises across all {size} features of the column-split "
                f"{_producer(child_name, split[size])} (every head at once), which TP splits across ranks"
            )
            style = tp_norm_style(child)
            if isinstance(style, str):
                raise PlanError(f"{across}; it {style}, so this model cannot be sharded across heads yet")
            raise PlanError(
                f'{across}; shard it with the {style.name} style: add {{"match": "{folded(full)}", "style": '
                f'"{style.name}"}} to the plan\'s "linear" rules (a plan file: --plan FILE)'
            )


def rule_styles(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, Style]:
    """The style of every module a rule of `plan` names, checked against what the module is.

    Raises:
        PlanError: a rule that matches no module (unless optional), a Linear rule on something else, a
            `vocab_parallel` or `split_experts` rule on a module it does not support, a TP norm rule on a norm it
            does not support or whose features no column-split projection beside it produces.
    """
    cls = type(next(iter(modules.values()))).__name__
    styles: dict[str, Style] = {}
    for rule in plan.linear:
        hits = [name for name in modules if name and matches(rule.match, name)]
        if not hits and not rule.optional:
            raise PlanError(f"{plan.origin}: rule {rule.match!r} matches no module of {cls}; fix the pattern")
        if rule.style.name == "replicate":
            continue  # keeps whatever it names whole: nothing to check
        for name in hits:
            module = modules[name]
            if isinstance(rule.style, (TPNorm, VocabParallel, SplitExperts)):  # of a norm, embedding, experts module
                why = rule.style.unsupported(module)
                if why is not None:
                    raise PlanError(
                        f"{plan.origin}: rule {rule.match!r} gives {name} the {rule.style.name} style, but it {why}"
                    )
            elif not isinstance(module, nn.Linear):
                raise PlanError(
                    f"{plan.origin}: rule {rule.match!r} names {name}, a {type(module).__name__}, not an nn.Linear; "
                    "point it at Linear modules"
                )
            styles[name] = rule.style
    outputs = _column_split_outputs(modules, styles)
    for name, style in styles.items():
        if style.module_kind != "norm":
            continue
        parent = name.rpartition(".")[0]
        if norm_size(modules[name]) not in outputs.get(parent, {}):
            raise PlanError(
                f"{plan.origin}: {name} has the {style.name} style, but no column-split Linear beside it produces its "
                f"{norm_size(modules[name])} features, so its input is not split; leave it replicated"
            )
    return styles


def _heads_of(rule: AttentionRule, module: nn.Module) -> bool:
    """Whether `rule` divides `module`'s heads: an attention module, or an attribute named for heads; not a block
    whose split MLP width alone it divides (a single-stream block's `mlp_hidden_dim`, `infer._single_stream`),
    whose other Linear layers (its modulation) see no head."""
    return is_attention(module) or any("head" in attr for attr in rule.divide)


def check_model_structure(plan: Plan, model: nn.Module, tp: int = 2) -> None:
    """Every rule fits the module it names; at `tp` > 1, in every attention module whose heads the plan divides,
    each Linear is sharded and each norm across the heads has a TP norm style (at tp=1 nothing is divided).

    Raises:
        PlanError: one line naming the module that blocks the plan and why.
    """
    modules = dict(model.named_modules())
    styles = rule_styles(plan, modules)
    if tp == 1:
        return
    divided = [
        name
        for name in modules
        if name and any(r.divide and matches(r.match, name) and _heads_of(r, modules[name]) for r in plan.attention)
    ]
    check_norms_across_heads(plan.origin, modules, styles, divided)
    for name in divided:
        for child_name, child in modules[name].named_modules():
            full = f"{name}.{child_name}"
            if child_name and isinstance(child, nn.Linear) and full not in styles:
                raise PlanError(
                    f"{plan.origin}: {full} is a Linear inside {name}, whose heads the plan divides by the TP degree, "
                    "but no rule shards it, so every rank would compute it for every head (a variant of the model "
                    "the plan does not cover); add a rule for it in a plan file, --plan (colwise if it produces "
                    "per-head features, rowwise if it consumes them), or use --tp 1"
                )
