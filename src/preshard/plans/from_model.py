"""Plans a diffusers model class declares itself: `_tp_plan` for TP, `_cp_plan` for CP.

diffusers 0.42.1 declares `_tp_plan` on Flux, Flux.2, QwenImage and QwenImage 2.1 transformers. Their
packed styles take block sizes from attributes the model sets on each Linear in `__init__`
(`_tp_packed_col_blocks` / `_tp_packed_row_blocks`), so the class is built on the meta device from the
checkpoint's config (no memory, no weights) to read them, and every rule is checked against the real
module tree: a rule on something that is not an `nn.Linear`, a style preshard does not know, or a
norm that normalises across all heads of a column-sharded projection (TP would give each rank a part of
what it normalises; the message says to write a plan file giving it the `tp_rms_norm` style) is an error
naming the module, at conversion time rather than at load.

Attention processors of these classes reshape by `head_dim` ("TP-agnostic"), so no head-count attribute
is divided; every attention module runs context parallel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from preshard.errors import PlanError
from preshard.format.plan import AttentionRule, CPEntry, LinearRule, Plan, SeqDim, matches
from preshard.format.styles import Colwise, PackedColwise, PackedRowwise, Rowwise, Style
from preshard.plans.model_check import (
    check_model_structure,
    check_norms_across_heads,
    folded,
    is_attention,
)
from preshard.plans.model_class import check_cp_plan, declared_class, import_model_class, is_transformers_config

# Where a class's `_cp_plan` splits several sequences that its attention joins, the order of the join (the
# processors' `torch.cat([encoder_query, query])`): context parallelism needs it to drop each sequence's padding.
DIFFUSERS_CP_JOIN_ORDER: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("encoder_hidden_states", "hidden_states"),
    "Flux2Transformer2DModel": ("encoder_hidden_states", "hidden_states"),
    "QwenImageTransformer2DModel": ("encoder_hidden_states", "hidden_states"),
}


def build_on_meta(cls: type, config: dict[str, Any]) -> nn.Module:
    """The model with every parameter and buffer on the meta device (nothing allocated)."""
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            if hasattr(cls, "from_config"):
                return cls.from_config(kwargs)
            return cls(**kwargs)
    except Exception as exc:  # a config the class rejects fails in arbitrary ways
        raise PlanError(f"cannot build {cls.__name__} from the checkpoint's config.json: {exc}") from None


def plan_from_model_class(
    class_name: str, config: dict[str, Any], *, infer: bool = False, passed_over: str | None = None, tp: int = 1
) -> Plan:
    """The plan `diffusers.<class_name>` declares (`_tp_plan`), resolved on a meta-device instance built from
    `config`; where it declares none, or `infer` asks for it, the plan inferred from its modules
    (`plans/infer.py`), with the class's `_cp_plan` if it has one, else the CP plan a probe of its forward proves
    right, if any (`plans/infer_cp.py`).

    Args:
        passed_over: why the built-in plan for the class was not used (its config differs), for the plan's
            description and origin.
        tp: the TP degree an inferred plan is for (grouped KV heads it exceeds take `kv_head_select`).
    """
    cls = import_model_class(class_name)
    model = build_on_meta(cls, config)
    if infer or not getattr(cls, "_tp_plan", None):
        from preshard.plans.infer import infer_plan_keeping

        plan, whole = infer_plan_keeping(model, config, tp)
        cp = getattr(cls, "_cp_plan", None)
        local = [name for name in whole if is_attention(model.get_submodule(name))]
        if local and not cp:  # CP routes the attention a plan splits; one kept whole would attend to its part only
            plan = replace(plan, description=f"{plan.description}; no CP plan: attention {local[0]} is kept whole")
        elif cp:
            plan = replace(
                plan,
                description=f"{plan.description}, with the class's _cp_plan",
                cp_plan=cp_plan_from_diffusers(cp),
                cp_join_order=DIFFUSERS_CP_JOIN_ORDER.get(class_name),
            )
        else:
            plan = _with_inferred_cp(plan, model, config)
    else:
        plan = plan_from_model(model, config)
    if plan.cp_plan and getattr(cls, "_cp_plan", None):
        plan = _cp_for_config(plan, cls, model, config)
    if passed_over is None:
        return plan
    return replace(
        plan,
        description=f"{plan.description} (passed over: {passed_over})",
        origin=f"{plan.origin} (the built-in plan for the class does not fit its config)",
    )


def _with_inferred_cp(plan: Plan, model: nn.Module, config: dict[str, Any]) -> Plan:
    """`plan` with the CP plan a probe of the model's forward proves right (`plans/infer_cp.py`); else as it is,
    its description saying why there is no CP."""
    from preshard.plans.infer_cp import infer_cp_plan

    found = infer_cp_plan(model, config)
    if found.plan is None:
        return replace(plan, description=f"{plan.description}; no CP plan: {found.why_not}")
    attention = []
    names = [name for name, m in model.named_modules() if name and is_attention(m)]
    for rule in plan.attention:
        hits = [name for name in names if matches(rule.match, name)]
        local = [name for name in hits if name in found.local_attention]
        if local and len(local) != len(hits):  # one rule over modules of both kinds: keep it exact
            why = f"attention rule {rule.match} covers modules that attend to the whole text and others"
            return replace(plan, description=f"{plan.description}; no CP plan: {why}")
        attention.append(replace(rule, context_parallel=False) if local else rule)
    joined = f"joined {' then '.join(found.join_order)}" if found.join_order else "text kept whole"
    return replace(
        plan,
        description=f"{plan.description}, with a CP plan inferred from a probe of its forward ({joined})",
        attention=tuple(attention),
        cp_plan=found.plan,
        cp_join_order=found.join_order,
    )


def unmatched_cp_entries(cp_plan: dict[str, CPEntry], model: nn.Module) -> list[str]:
    """The entries of `cp_plan` that match no module of `model`."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in cp_plan if not any(matches(pattern, name) for name in names)]


def _cp_for_config(plan: Plan, cls: type, model: nn.Module, config: dict[str, Any]) -> Plan:
    """The class's `_cp_plan` as it fits this config. Helios's names each of its default 40 blocks
    (`blocks.39.attn1`); at a config with fewer, those entries match nothing, and which blocks' outputs CP gathers
    is then not what the class says. CP is kept for the config value that gives the blocks named (found by
    building the class with it on the meta device: `cp_config_requires`, so a CP mesh is refused in one line at
    conversion and at load, and TP alone converts); where no single config value does, CP stays as declared and
    the model check refuses a CP mesh (`check_cp_entries`)."""
    missing = unmatched_cp_entries(plan.cp_plan or {}, model)
    if not missing:
        return plan
    lists = {name: len(m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    folded = fold_every_block(plan.cp_plan or {}, set(lists))
    if folded is not None and not unmatched_cp_entries(folded[0], model):
        return replace(
            plan,
            description=f"{plan.description} (its _cp_plan names each of {folded[1]}: applied to every block)",
            cp_plan=folded[0],
        )
    needed: dict[str, int] = {}  # ModuleList -> blocks the entries name
    for pattern in missing:
        head, _, rest = pattern.partition(".")
        while rest and head not in lists:
            step, _, rest = rest.partition(".")
            head = f"{head}.{step}"
        index = rest.partition(".")[0]
        if head not in lists or not index.isdigit():
            return plan
        needed[head] = max(needed.get(head, 0), int(index) + 1)
    if len(needed) != 1:
        return plan
    ((blocks, count),) = needed.items()
    fits = []
    for key, value in config.items():
        if key.startswith("_") or not isinstance(value, int) or isinstance(value, bool) or value != lists[blocks]:
            continue
        try:
            variant = build_on_meta(cls, {**config, key: count})
        except PlanError:
            continue
        if not unmatched_cp_entries(plan.cp_plan or {}, variant):
            fits.append(key)
    if len(fits) != 1:
        return plan
    key = fits[0]
    return replace(
        plan,
        description=f"{plan.description} (its _cp_plan names {missing[0]} and the other blocks of config "
        f"{key} = {count}: context parallel at that config only)",
        cp_config_requires={**plan.cp_config_requires, key: count},
    )


def fold_every_block(cp_plan: dict[str, CPEntry], lists: set[str]) -> tuple[dict[str, CPEntry], str] | None:
    """`cp_plan` with entries that name every block of a list alike, from 0 on (Helios's `blocks.{i}.attn1` for i
    in range(40), its default `num_layers`), as one entry `blocks.*.attn1`, merged with an entry of that pattern;
    None where no entry names blocks so, or a merge would put two specs in one place. What the class says of each
    block then holds for each block of a model with another number of them: every block alike."""
    named: dict[tuple[str, str], dict[int, CPEntry]] = {}
    for pattern in cp_plan:
        for head in lists:
            index, _, rest = pattern.removeprefix(f"{head}.").partition(".")
            if pattern.startswith(f"{head}.") and index.isdigit() and rest:
                named.setdefault((head, rest), {})[int(index)] = cp_plan[pattern]
    folds = {
        key: entries[0]
        for key, entries in named.items()
        if len(entries) > 1 and set(entries) == set(range(len(entries))) and len(set(map(repr, entries.values()))) == 1
    }
    if not folds:
        return None
    out = {p: e for p, e in cp_plan.items() if not any(p.startswith(f"{h}.") and p.partition(f"{h}.")[2].partition(
        ".")[0].isdigit() and p.partition(f"{h}.")[2].partition(".")[2] == r for h, r in folds)}  # fmt: skip
    for (head, rest), entry in folds.items():
        pattern = f"{head}.*.{rest}"
        have = out.get(pattern, CPEntry())
        if set(have.split_inputs) & set(entry.split_inputs) or set(have.split_outputs) & set(entry.split_outputs):
            return None
        if have.gather_output is not None and entry.gather_output is not None:
            return None
        out[pattern] = CPEntry(
            {**have.split_inputs, **entry.split_inputs},
            {**have.split_outputs, **entry.split_outputs},
            have.gather_output or entry.gather_output,
        )
    (head, rest), count = next(iter(folds.items()))[0], len(named[next(iter(folds))])
    return out, f"{head}.0.{rest} to {head}.{count - 1}.{rest}"


def check_cp_entries(plan: Plan, model: nn.Module) -> None:
    """Every entry of the CP plan a CP mesh would use (the plan's, else the class's `_cp_plan`) matches a module.

    Raises:
        PlanError: naming the first entry that matches none, and the fix.
    """
    declared = getattr(type(model), "_cp_plan", None)
    cp_plan = plan.cp_plan or (cp_plan_from_diffusers(declared) if declared else {})
    missing = unmatched_cp_entries(cp_plan, model)
    if missing:
        raise PlanError(
            f"{plan.origin}: cp plan entry {missing[0]!r} matches no module of {type(model).__name__} at this config, "
            "so no rank could load a context-parallel mesh: use ring=1 and ulysses=1 (--cp 1), or give a plan "
            "file whose cp_plan names its modules (--plan FILE)"
        )


def plan_from_model(model: nn.Module, config: dict[str, Any] | None = None) -> Plan:
    """The plan `type(model)._tp_plan` / `_cp_plan` declare, checked against `model`'s modules."""
    cls = type(model)
    origin = f"{cls.__name__}._tp_plan"
    modules = dict(model.named_modules())
    linear: list[LinearRule] = []
    sharded: dict[str, Style] = {}
    for pattern, declared in cls._tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise PlanError(f"{origin}: key {pattern!r} is not a module pattern")
        hits = [name for name in modules if name and matches(pattern, name)]
        if not hits:
            raise PlanError(f"{origin}: {pattern!r} matches no module of {cls.__name__}")
        styles = {}
        for name in hits:
            module = modules[name]
            if not isinstance(module, nn.Linear):
                raise PlanError(
                    f"{origin}: {name} is a {type(module).__name__}, not an nn.Linear; preshard shards Linear layers"
                )
            styles[name] = _style(declared, module, f"{origin}: {name}")
        sharded.update(styles)
        if len(set(styles.values())) == 1:
            linear.append(LinearRule(pattern, next(iter(styles.values()))))
        else:  # per-instance block sizes differ: one exact rule each
            linear += [LinearRule(name, style) for name, style in styles.items()]
    attention = _attention_rules(modules)
    attention_modules = [name for name, m in modules.items() if name and is_attention(m)]
    check_norms_across_heads(origin, modules, sharded, attention_modules)
    config = config or {}
    return Plan(
        name=f"{cls.__name__}._tp_plan",
        linear=tuple(linear),
        attention=tuple(attention),
        config_divisible=tuple(k for k in ("num_attention_heads",) if isinstance(config.get(k), int)),
        model_classes=(cls.__name__,),
        description=f"the TP plan {cls.__name__} declares (diffusers _tp_plan), with its _cp_plan",
        cp_plan=cp_plan_from_diffusers(cls._cp_plan) if getattr(cls, "_cp_plan", None) else None,
        cp_join_order=DIFFUSERS_CP_JOIN_ORDER.get(cls.__name__) if getattr(cls, "_cp_plan", None) else None,
        origin=origin,
    )


def _style(declared: Any, module: nn.Linear, where: str) -> Style:
    if declared == "colwise":
        return Colwise()
    if declared == "rowwise":
        return Rowwise()
    kind = type(declared).__name__
    if kind not in ("PackedColwiseParallel", "PackedRowwiseParallel"):
        raise PlanError(f"{where}: style {declared!r} is not one preshard knows (colwise, rowwise, packed)")
    column = kind == "PackedColwiseParallel"
    size = module.weight.shape[0 if column else 1]
    blocks = getattr(declared, "blocks", None)
    if blocks:  # proportions, e.g. [1, 1] or [1, 1, 1, 3, 3]
        if size % sum(blocks):
            raise PlanError(f"{where}: packed proportions {list(blocks)} do not divide its {size} features")
        sizes = tuple(b * (size // sum(blocks)) for b in blocks)
    else:  # absolute sizes set on the Linear in __init__
        attr = "_tp_packed_col_blocks" if column else "_tp_packed_row_blocks"
        sizes = tuple(getattr(module, attr, None) or ())
        if not sizes or sum(sizes) != size:
            raise PlanError(f"{where}: {kind} needs {attr} on the Linear adding up to {size}, found {list(sizes)}")
    return (PackedColwise if column else PackedRowwise)(blocks=sizes)


def _attention_rules(modules: dict[str, nn.Module]) -> list[AttentionRule]:
    """One rule per attention module path with numbered blocks folded into `*` (only where the fold is exact)."""
    names = [name for name, m in modules.items() if name and is_attention(m)]
    patterns: dict[str, None] = {}
    for name in names:
        pattern = folded(name)
        exact = all(is_attention(modules[m]) for m in modules if m and matches(pattern, m))
        patterns[pattern if exact else name] = None
    return [AttentionRule(pattern, (), True) for pattern in patterns]


def cp_plan_from_diffusers(plan: dict[Any, Any]) -> dict[str, CPEntry]:
    """Translate a diffusers `_cp_plan` (ContextParallelInput/Output objects) into preshard's typed form."""
    result: dict[str, CPEntry] = {}
    for module, spec in plan.items():
        inputs: dict[str, SeqDim] = {}
        outputs: dict[int, SeqDim] = {}
        gather = None
        specs = spec if isinstance(spec, dict) else {None: spec}
        for key, item in specs.items():
            if hasattr(item, "gather_dim"):
                gather = SeqDim(item.gather_dim, item.expected_dims)
            elif getattr(item, "split_output", False):
                outputs[int(key)] = SeqDim(item.split_dim, item.expected_dims)
            elif hasattr(item, "split_dim"):
                inputs[str(key)] = SeqDim(item.split_dim, item.expected_dims)
            else:
                raise PlanError(f"_cp_plan entry {module}.{key} is neither a split nor a gather")
        result[module] = CPEntry(inputs, outputs, gather)
    return result


def check_plan_against_model(plan: Plan, config: dict[str, Any] | None, tp: int, cp: int = 1) -> None:
    """At conversion time, the plan against the model's modules: the attention attributes it divides exist and
    divide by `tp`; every rule fits what it names; in attention whose heads it divides, no Linear is left whole
    and every norm across the heads has `tp_rms_norm` (`model_check.check_model_structure`); and a CP mesh
    (`cp` = ring x ulysses > 1) has a CP plan (`check_cp_plan`).

    Needs the model class (from diffusers, named by config.json's `_class_name`); without it the same checks
    run at load time instead (the structure checks only as far as the forward shows them).

    Raises:
        PlanError: one line naming the module and why (an attribute missing, not an integer or not divisible
            by `tp`, with the TP degrees that work; a rule that does not fit; a module the plan leaves whole
            that must be split); a CP mesh with no CP plan anywhere.
    """
    if is_transformers_config(config):
        from preshard.plans.hf_transformers import check_transformers_plan  # torch and transformers

        check_transformers_plan(plan, config or {}, cp)
        return
    check_cp_plan(plan, config, cp)
    rules = [rule for rule in plan.attention if rule.divide]
    cls = declared_class(config) if rules or plan.linear else None
    if cls is None:
        return
    model = build_on_meta(cls, config or {})
    check_model_structure(plan, model, tp)
    if cp > 1:
        check_cp_entries(plan, model)
    for rule in rules:
        for name, module in model.named_modules():
            if name and matches(rule.match, name):
                rule.divided_values(name, module, tp)
