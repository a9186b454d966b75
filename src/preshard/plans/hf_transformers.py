"""TP plans for transformers models (the text encoders beside diffusers transformers), inferred from their modules.

A checkpoint folder is a transformers model when its config.json names `architectures` and a `model_type` (and no
diffusers `_class_name`). The class is built on the meta device from that config, and the plan is read from the
blocks it is made of, not from its name:

- attention: a module with Linear children `q_proj, k_proj, v_proj, o_proj` (Llama, Mistral, Gemma-3, Qwen2.5-VL,
  Qwen3, Qwen3-VL) or `q, k, v, o` (T5, UMT5), and an integer `head_dim` (`key_value_proj_dim` for T5) giving the
  heads: q/k/v colwise and o rowwise. Grouped KV heads are split with the query heads when T divides them; when
  T exceeds them (and they divide T) k/v keep the `kv_head_select` style (whole, each rank computing the KV head
  its query heads share). Head-count attributes on the module (`n_heads`, `num_heads`, `inner_dim`, ...) are
  divided by T (T5 reshapes by `n_heads`); per-head norms (over `head_dim`) stay whole; T5/UMT5's
  `relative_attention_bias` (an Embedding with one column per head) stays whole and each rank keeps its heads of
  its output (`tp_split_outputs`). Anything else with weights inside the attention is refused, naming it.
- feed-forward: Linear children `gate_proj, up_proj, down_proj` (SwiGLU), `wi_0, wi_1, wo` (T5 v1.1/UMT5 gated
  GELU), `wi, wo` (T5): the input projections colwise, the output projection rowwise, when nothing else in the
  module holds weights (a norm over the intermediate features would see a slice).
- the vocabulary: the input embedding (`get_input_embeddings()`) and the output one (`get_output_embeddings()`, an
  lm_head, tied to the input embedding or not), and every module holding the same weight under another name (T5's
  `shared` and `encoder.embed_tokens`), are split by vocabulary rows (`vocab_parallel` for an Embedding,
  `colwise_gather` for a Linear) when they are "as memory asks": at least `VOCAB_SPLIT_SHARE` of the model's
  parameters (whole, counted once). The rule does not depend on T, so the plan written at tp=1 (`--show-plan`)
  carries the choice; at a T that does not divide the vocabulary the rows cannot be cut evenly, and the vocabulary
  stays whole. The plan's description says which, with the numbers; a plan file overrides it (the rules
  themselves: `replicate` keeps a module whole).
- everything else stays whole: final norms, and every vision tower or projector (a path component naming
  `vision`/`visual`/`multi_modal_projector`), which is always exact.

transformers' own `base_model_tp_plan` (Llama, Mistral, Gemma-3, Qwen2.5-VL, Qwen3 declare one) is compared with
what is inferred: the plan says it agrees, or which module it disagrees on; the inferred styles are what runs.
Mixture-of-experts layers (experts not held as Linear children by these names) stay whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from preshard.errors import PlanError
from preshard.format.plan import AttentionRule, LinearRule, Plan, SeqDim, matches
from preshard.format.styles import Colwise, ColwiseGather, KVHeadSelect, Rowwise, Style, VocabParallel
from preshard.plans.model_check import folded, norm_size, rule_styles

_ATTENTION_NAMES: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj", "o_proj"), ("q", "k", "v", "o"))
_MLP_NAMES: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo"), ("wi", "wo"))
_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "inner_dim")
_KV_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads")
_REPLICATED_TOWERS = ("vision", "visual", "multi_modal_projector")
# The vocabulary (embedding and lm_head) is split by rows when it holds at least this share of the model's parameters:
# below it the memory saved is small beside the rest of a rank's weights, and the split costs a collective on each
# side of the model. Every published encoder in docs/models-text-encoders.md is above it (T5-XXL lowest, at 2.8 %).
VOCAB_SPLIT_SHARE = 0.02


def transformers_class(config: dict[str, Any]) -> type:
    """`transformers.<architectures[0]>`.

    Raises:
        PlanError: transformers is not installed or has no such class.
    """
    name = config["architectures"][0]
    try:
        import transformers
    except ImportError:
        raise PlanError(
            f"the checkpoint is a transformers model ({name}); planning it needs transformers: pip install "
            "transformers, or pass --plan FILE"
        ) from None
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise PlanError(
            f"transformers {transformers.__version__} has no model class {name} (config.json's architectures); "
            "upgrade transformers, or pass --plan FILE"
        )
    return cls


def transformers_config(cls: type, config: dict[str, Any]) -> Any:
    """The class's config object from config.json's dict.

    Raises:
        PlanError: a config the config class rejects.
    """
    try:
        return cls.config_class.from_dict(dict(config))  # type: ignore[attr-defined]
    except Exception as exc:  # a config class rejects a config in arbitrary ways
        raise PlanError(f"cannot read {cls.__name__}'s config from the checkpoint's config.json: {exc}") from None


def build_transformers_on_meta(config: dict[str, Any]) -> nn.Module:
    """The model config.json's `architectures` names, every tensor on the meta device.

    Raises:
        PlanError: transformers lacks the class, or the class rejects the config.
    """
    cls = transformers_class(config)
    with torch.device("meta"):
        return build_transformers(cls, config)


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    found = [getattr(module, n, None) for n in names]
    return found if all(isinstance(m, nn.Linear) for m in found) else None  # type: ignore[return-value]


def _weighted_children(module: nn.Module, skip: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    return [
        (name, child)
        for name, child in module.named_children()
        if name not in skip and any(True for _ in child.parameters())
    ]


def _works(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


class _Inferred:
    """What inference found: a style per sharded Linear, attention rules, outputs to split."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.styles: dict[str, Style] = {}
        self.attention: dict[str, tuple[str, ...]] = {}
        self.split_outputs: dict[str, dict[int, SeqDim]] = {}
        self.heads: list[int] = []  # each attention block's query heads

    def attention_block(self, name: str, module: nn.Module, names: tuple[str, ...], linears: list[nn.Linear]) -> None:
        q, k, v, o = linears
        head_dim = getattr(module, "head_dim", getattr(module, "key_value_proj_dim", None))
        if not isinstance(head_dim, int) or head_dim <= 0 or q.out_features % head_dim:
            raise PlanError(
                f"{name} ({type(module).__name__}) has no integer head_dim dividing its query features, so its "
                "heads cannot be split; pass a plan file (--plan FILE) or use --tp 1"
            )
        heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
        self.heads.append(heads)
        if heads % self.tp:
            raise PlanError(
                f"--tp {self.tp} does not divide the {heads} attention heads of {name}; TP degrees that divide "
                f"them: {_works(heads)}"
            )
        if kv_heads * head_dim != v.out_features or o.in_features != q.out_features or heads % max(kv_heads, 1):
            raise PlanError(
                f"{name} ({type(module).__name__}): its k/v/o widths do not fit {heads} heads of {head_dim}, so "
                "inference cannot place them; pass a plan file (--plan FILE) or use --tp 1"
            )
        kv_style: Style = Colwise()
        if kv_heads % self.tp:
            if self.tp % kv_heads:
                raise PlanError(
                    f"--tp {self.tp} neither divides nor is a multiple of the {kv_heads} key/value heads of {name}; "
                    f"TP degrees that work: divisors of {heads} that divide or are multiples of {kv_heads}"
                )
            kv_style = KVHeadSelect(blocks=kv_heads)
        for projection, style in zip(names, (Colwise(), kv_style, kv_style, Rowwise())):
            self.styles[f"{name}.{projection}"] = style
        for child_name, child in _weighted_children(module, names):
            full = f"{name}.{child_name}"
            if child_name == "relative_attention_bias" and isinstance(child, nn.Embedding):
                if child.embedding_dim != heads:
                    raise PlanError(f"{full} has {child.embedding_dim} columns, not one per head of {name} ({heads})")
                self.split_outputs[full] = {0: SeqDim(-1, 3)}
            elif norm_size(child) != head_dim and self.tp > 1:  # at tp=1 nothing is split
                raise PlanError(
                    f"{full} ({type(child).__name__}) holds weights inside the attention {name} that inference "
                    "cannot place (not a per-head norm over head_dim); pass a plan file (--plan FILE) or use --tp 1"
                )
        divide = [a for a in _HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)]
        if isinstance(kv_style, Colwise):
            divide += [a for a in _KV_ATTRIBUTES if isinstance(getattr(module, a, None), int)]
        self.attention[name] = tuple(divide)

    def mlp_block(self, name: str, module: nn.Module, names: tuple[str, ...], linears: list[nn.Linear]) -> None:
        *inputs, output = linears
        width = output.in_features
        if any(m.out_features != width for m in inputs) or _weighted_children(module, names):
            return  # not a plain elementwise feed-forward: left whole (exact)
        if width % self.tp:
            return  # an intermediate width the degree does not divide stays whole (exact)
        for child in names[:-1]:
            self.styles[f"{name}.{child}"] = Colwise()
        self.styles[f"{name}.{names[-1]}"] = Rowwise()


def infer(model: nn.Module, tp: int) -> _Inferred:
    """Walk `model`'s modules and place every attention and feed-forward block (see the module docstring)."""
    found = _Inferred(tp)
    for name, module in model.named_modules():
        if not name or _in_tower(name):
            continue
        for names in _ATTENTION_NAMES:
            linears = _linears(module, names)
            if linears is not None:
                found.attention_block(name, module, names, linears)
                break
        else:
            for names in _MLP_NAMES:
                linears = _linears(module, names)
                if linears is not None:
                    found.mlp_block(name, module, names, linears)
                    break
    return found


def _in_tower(name: str) -> bool:
    return any(t in part for part in name.split(".") for t in _REPLICATED_TOWERS)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M" if n >= 10**6 else str(n)


def vocabulary(model: nn.Module, tp: int) -> tuple[dict[str, Style], str]:
    """The vocabulary's modules and their styles at `tp` (none: kept whole), and the choice in words for the plan's
    description (see the module docstring for the rule)."""
    weights: list[nn.Parameter] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            found = getattr(model, getter)() if callable(getattr(model, getter, None)) else None
        except (AttributeError, NotImplementedError):  # a class without one
            found = None
        weight = getattr(found, "weight", None)
        if isinstance(found, (nn.Embedding, nn.Linear)) and isinstance(weight, nn.Parameter):
            if all(weight is not w for w in weights):
                weights.append(weight)
    modules = {
        name: module
        for name, module in model.named_modules(remove_duplicate=False)
        if name and not _in_tower(name) and any(getattr(module, "weight", None) is w for w in weights)
    }
    styles: dict[str, Style] = {}
    for name, module in modules.items():
        if isinstance(module, nn.Embedding) and VocabParallel.unsupported(module) is None:
            styles[name] = VocabParallel()
        elif isinstance(module, nn.Linear) and module.bias is None:
            styles[name] = ColwiseGather()
        else:
            return {}, f"vocabulary whole: {name} ({type(module).__name__}) cannot be split by vocabulary rows"
    if not styles:
        return {}, "vocabulary whole: the model names no input or output embedding"
    vocab = weights[0].shape[0]
    total = sum(p.numel() for p in model.parameters())
    held = sum(w.numel() for w in weights)
    share = held / max(total, 1)
    numbers = f"{_count(held)} of {_count(total)} parameters ({share:.1%})"
    if any(w.shape[0] != vocab for w in weights):
        return {}, "vocabulary whole: the input and output embeddings have different vocabularies"
    if share < VOCAB_SPLIT_SHARE:
        return {}, f"vocabulary whole: {numbers}, under the {VOCAB_SPLIT_SHARE:.0%} split by vocabulary rows"
    if vocab % tp:
        return {}, f"vocabulary whole at tp={tp}: {tp} does not divide its {vocab} rows ({numbers})"
    names = ", ".join(f"{n} {s.name}" for n, s in styles.items())
    return styles, (
        f"vocabulary split by rows ({names}): {numbers}, at least {VOCAB_SPLIT_SHARE:.0%} (a plan file's rules "
        "of style replicate keep it whole)"
    )


def _folded_rules(values: Mapping[str, object], modules: list[str]) -> list[str]:
    """Patterns with numbered blocks as `*` wherever every module a pattern matches has the same value (a style,
    the attributes an attention rule divides)."""
    patterns: dict[str, None] = {}
    for name, value in values.items():
        pattern = folded(name)
        exact = all(values.get(m) == value for m in modules if matches(pattern, m))
        patterns[pattern if exact else name] = None
    return list(patterns)


def _agreement(model: nn.Module, styles: dict[str, Style]) -> str:
    """How transformers' `base_model_tp_plan` (the model's own, else its text model's) compares with the inferred
    styles, for the plan's description."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    declared = getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None) or {}
    linear = {k: v for k, v in declared.items() if v in ("colwise", "rowwise")}
    if not linear:
        return "transformers declares no base_model_tp_plan for its Linear layers"
    for name, style in styles.items():
        for pattern, value in linear.items():
            if name == pattern or name.endswith("." + pattern) or matches("*." + pattern, name):
                want = "colwise" if isinstance(style, Colwise) else "rowwise"
                if isinstance(style, KVHeadSelect) or value == want:
                    break
                return f"transformers' base_model_tp_plan says {value} for {name}, inferred {style.name}"
    return "agrees with transformers' base_model_tp_plan"


def plan_for_transformers(config: dict[str, Any], tp: int = 1) -> Plan:
    """The TP plan inferred for the transformers model config.json describes, at TP degree `tp` (grouped KV heads
    are split or kept whole depending on it).

    Raises:
        PlanError: transformers lacks the class or rejects the config; a block inference cannot place at `tp`
            (one line naming the module and why, with the degrees that work where a degree is the problem).
    """
    return _plan_at(build_transformers_on_meta(config), tp)


def plans_by_degree(config: dict[str, Any]) -> dict[int, Plan]:
    """The plan inferred at every TP degree inference places each block at (divisors of the query heads; one meta
    build for all), as a conversion at that degree infers it: the planner sizes each degree with its own plan,
    since grouped KV heads are split at some degrees and computed whole at others.

    Raises:
        PlanError: transformers lacks the class or rejects the config.
    """
    model = build_transformers_on_meta(config)
    heads = 0
    for h in infer(model, 1).heads:
        heads = math.gcd(heads, h)
    plans = {}
    for tp in [d for d in range(1, heads + 1) if heads % d == 0] or [1]:
        try:
            plans[tp] = _plan_at(model, tp)
        except PlanError:
            continue
    return plans


def _plan_at(model: nn.Module, tp: int) -> Plan:
    cls = type(model)
    found = infer(model, tp)
    names = [n for n, _ in model.named_modules() if n]
    styles = {n: found.styles[n] for n in names if n in found.styles}
    linear = [LinearRule(p, styles[next(n for n in names if matches(p, n) and n in styles)]) for p in
              _folded_rules(styles, names)]  # fmt: skip
    vocab, choice = vocabulary(model, tp)
    # Optional: which of tied modules the checkpoint stores is the checkpoint's choice, and a pipeline may leave the
    # lm_head out (converter/left_out.py); whatever is stored is checked against the model at load.
    linear += [LinearRule(n, style, optional=True) for n, style in vocab.items()]
    attention = [
        AttentionRule(p, found.attention[next(n for n in names if matches(p, n) and n in found.attention)], False)
        for p in _folded_rules(found.attention, names)
    ]
    split = {p: {0: SeqDim(-1, 3)} for p in _folded_rules(dict.fromkeys(found.split_outputs, True), names)}
    return Plan(
        name=f"{cls.__name__}.inferred",
        linear=tuple(linear),
        attention=tuple(attention),
        model_classes=(cls.__name__,),
        description=f"inferred from {cls.__name__}'s modules at tp={tp}; {_agreement(model, styles)}; {choice}",
        tp_split_outputs=split,
        origin=f"the plan inferred for {cls.__name__}",
    )


def check_transformers_plan(plan: Plan, config: dict[str, Any], cp: int = 1) -> None:
    """A plan (inferred, or a plan file) for a transformers model, against the model built on the meta device:
    every rule fits the module it names (`model_check.rule_styles`); CP is refused (preshard runs encoders TP
    only).

    Raises:
        PlanError: a CP mesh; a rule that does not fit, naming the module.
    """
    if cp > 1:
        raise PlanError(
            f"{plan.origin}: preshard runs transformers text encoders tensor parallel only, not context parallel "
            f"(ring x ulysses = {cp}); use --cp 1"
        )
    rule_styles(plan, dict(build_transformers_on_meta(config).named_modules()))


def build_transformers(cls: type, config: dict[str, Any]) -> nn.Module:
    """`cls` built from config.json's dict (the caller chooses the device: the runtime puts parameters on meta and
    keeps the buffers computed in `__init__`, the rotary tables).

    Raises:
        PlanError: the config class rejects the config, or the class rejects it.
    """
    hf_config = transformers_config(cls, config)
    try:
        return cls(hf_config)
    except Exception as exc:  # a config the class rejects fails in arbitrary ways
        raise PlanError(f"cannot build {cls.__name__} from the checkpoint's config.json: {exc}") from None


def checkpoint_renames(config: dict[str, Any], names: list[str]) -> dict[str, str]:
    """Checkpoint tensor name -> the module path it loads into, for the names that differ: transformers renames
    keys on load (Qwen2.5-VL's and Qwen3-VL's `model.layers.*` -> `model.language_model.layers.*`, LLaVA's
    `language_model.*`, a base-model prefix added or dropped), with its own mapping
    (`get_model_conversion_mapping`) applied to the model built on the meta device.

    Raises:
        PlanError: a tensor transformers converts rather than renames (fused or split on load, as MoE experts
            are), which preshard cannot shard as stored; naming it.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = build_transformers_on_meta(config)
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a PreTrainedModel
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    renames: dict[str, str] = {}
    for name in names:
        if name in expected:  # already a module's name (a converted checkpoint read back to reshard)
            continue
        target, converted = rename_source_key(name, renamings, converters, prefix, expected)
        if converted is not None:
            raise PlanError(
                f"{name}: transformers converts this tensor on load ({converted}), rather than loading it as stored, "
                f"so preshard cannot shard {type(model).__name__} as stored; convert it with transformers first"
            )
        if target != name:
            renames[name] = target
    return renames


def workable_degrees(config: dict[str, Any], candidates: list[int]) -> list[int]:
    """The TP degrees among `candidates` the inference places every block at (one meta build for all)."""
    model = build_transformers_on_meta(config)
    works = []
    for tp in candidates:
        try:
            infer(model, tp)
        except PlanError:
            continue
        works.append(tp)
    return works
