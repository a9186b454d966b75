"""Sharding plans: plain JSON data on disk, typed objects in memory, parsed and validated once.

A plan names Linear modules (dotted paths; `*` matches one path component) with a style (a packed style's
blocks given, or read from the widths of named sibling Linears, `blocks_from`; norms take the `tp_rms_norm`
style), attention modules whose head-count attributes are divided by the TP degree and whose attention runs
context parallel, config keys that must divide by the TP degree, config values the plan is made for, outputs
of replicated modules that each TP rank slices to its own heads (LTX-2's rotary embeddings), forward inputs that
span every head, which each rank slices likewise (the SANA-WM LTX-2 refiner's rotary tables, `tp_split_inputs`), and
optionally a CP plan (which inputs to split along the sequence and which outputs to gather), the order in which the
model joins split sequences for attention (`cp_join_order`, e.g. Flux's text before image: CP needs it to find
the padded rows of each at any length) and the config values CP works for (`cp_config_requires`: HunyuanVideo's
token-replace I2V variant treats the first frame's rows apart, which a split sequence cannot). The manifest
embeds the resolved plan, so the runtime needs nothing but the checkpoint to shard the model.

`resolve_plan` applies a plan to a checkpoint's tensor names and shapes: one `TensorLayout` each.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

from preshard.errors import PlanError
from preshard.format.dtypes import DType, as_dtype, cast_dtype
from preshard.format.layout import TensorLayout
from preshard.format.quant import companion_style, is_companion, recognise
from preshard.format.styles import REPLICATE, STYLES, Style, make_style

PLAN_FORMAT = 1
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_UNPACKED = {name for name, cls in STYLES.items() if not cls.packed}


def matches(pattern: str, module: str) -> bool:
    """`*` (or any fnmatch pattern) matches exactly one dotted path component; "" is the root module."""
    if pattern == "" or module == "":
        return pattern == module
    compiled = _compiled(pattern)
    if compiled is not None:
        return compiled.match(module) is not None
    want, have = pattern.split("."), module.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern | None:
    """`pattern` as one regular expression (`*` and `?` kept inside a component), so that resolving a plan over
    100 000 tensors costs one match per rule and tensor; None for bracket classes (matched component-wise)."""
    if "[" in pattern:
        return None
    parts = []
    for component in pattern.split("."):
        parts.append("".join("[^.]*" if ch == "*" else "[^.]" if ch == "?" else re.escape(ch) for ch in component))
    return re.compile(r"\.".join(parts) + r"\Z")


@dataclass(frozen=True)
class LinearRule:
    """A style for the Linear modules `match` names. A packed style takes its block sizes from `style.blocks`, or,
    with `blocks_from`, from the checkpoint: block i is as wide as the output of the Linear at `blocks_from[i]`,
    a path relative to the matched module's parent (`["attn.to_q", "proj_mlp"]` for a `proj_out` over
    `cat([attention, mlp])`), so one plan fits every width of a family. `optional`: the module exists in some
    checkpoints of the class only (Wan I2V's image cross-attention), so matching nothing is not an error."""

    match: str
    style: Style
    blocks_from: tuple[str, ...] = ()
    optional: bool = False

    def to_dict(self) -> dict[str, Any]:
        if self.blocks_from:
            data = {"match": self.match, "style": self.style.name, "blocks_from": list(self.blocks_from)}
        else:
            data = {"match": self.match, **self.style.to_dict()}
        return data | ({"optional": True} if self.optional else {})

    def style_for(self, module: str, tensors: Mapping[str, tuple[tuple[int, ...], Any]], origin: str) -> Style:
        """The style of `module`'s tensors: `style`, with `blocks_from` resolved against the checkpoint's shapes.

        Raises:
            PlanError: a `blocks_from` path naming no Linear weight of the checkpoint.
        """
        if not self.blocks_from:
            return self.style
        parent = module.rpartition(".")[0]
        sizes = []
        for path in self.blocks_from:
            weight = f"{parent}.{path}.weight" if parent else f"{path}.weight"
            shape = tensors.get(weight, ((),))[0]
            if len(shape) != 2:
                raise PlanError(
                    f"{origin}: rule {self.match!r} takes a block size from {weight}, which this checkpoint lacks or "
                    "is not a Linear weight; fix blocks_from"
                )
            sizes.append(int(shape[0]))
        return type(self.style)(blocks=tuple(sizes))


@dataclass(frozen=True)
class AttentionRule:
    """Attention modules whose head-count attributes `divide` names are divided by the TP degree.
    `context_parallel`: their attention runs context parallel. `per_head_masks`: a 3-D attention mask given with
    one row per (batch, head) of the full head count (PriorTransformer repeats its mask by the config's head count)
    is cut to this rank's heads' rows at TP. `one_kv_head`: attributes holding the grouped KV heads' count or width
    (`kv_heads`, `inner_kv_dim`), each divided by the KV head count it maps to, where a rank computes one KV head
    (`kv_head_select`: TP exceeds the KV heads)."""

    match: str
    divide: tuple[str, ...] = ()
    context_parallel: bool = True
    per_head_masks: bool = False
    one_kv_head: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"match": self.match, "divide": list(self.divide)}
        data["context_parallel"] = self.context_parallel
        if self.per_head_masks:
            data["per_head_masks"] = True
        if self.one_kv_head:
            data["one_kv_head"] = dict(self.one_kv_head)
        return data

    def divided_values(self, name: str, module: Any, tp: int) -> dict[str, int]:
        """The values `module` (named `name`) takes for each attribute in `divide` at TP degree `tp`, and (at tp > 1)
        for each in `one_kv_head`.

        Raises:
            PlanError: an attribute that is missing, not an integer, or not divisible by `tp`.
        """
        values = {}
        for attr in self.divide:
            value = getattr(module, attr, None)
            if not _is_int(value):
                raise PlanError(f"{name} has no integer attribute {attr!r} to divide by tp={tp}")
            if value % tp:
                works = ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)
                raise PlanError(
                    f"--tp {tp} does not divide {name}.{attr} = {value}; TP degrees that divide it: {works}"
                )
            values[attr] = value // tp
        for attr, kv_heads in self.one_kv_head if tp > 1 else ():
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool) or value % kv_heads:
                raise PlanError(
                    f"{name}.{attr} = {value!r} is not a whole multiple of the {kv_heads} KV heads the plan computes "
                    "one of per rank; the plan does not fit this model"
                )
            values[attr] = value // kv_heads
        return values


@dataclass(frozen=True)
class SeqDim:
    """A tensor's sequence dimension, and how many dims the tensor must have (None: any)."""

    dim: int
    expected_dims: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "expected_dims": self.expected_dims}


@dataclass(frozen=True)
class SplitInput:
    """Items of a forward input that span every head at once (rotary tables for a column-split query): on `dim`
    they are `whole` wide, and each TP rank keeps its `whole / tp` part; items already that narrow (made by the
    sharded model's own rotary module, whose output `tp_split_outputs` slices) pass as they are."""

    dim: int
    whole: int
    expected_dims: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "whole": self.whole, "expected_dims": self.expected_dims}


@dataclass(frozen=True)
class CPEntry:
    """What context parallelism does at one module: split named inputs / numbered outputs, or gather the output."""

    split_inputs: dict[str, SeqDim] = field(default_factory=dict)
    split_outputs: dict[int, SeqDim] = field(default_factory=dict)
    gather_output: SeqDim | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.split_inputs:
            data["split_inputs"] = {k: v.to_dict() for k, v in self.split_inputs.items()}
        if self.split_outputs:
            data["split_outputs"] = {str(k): v.to_dict() for k, v in self.split_outputs.items()}
        if self.gather_output is not None:
            data["gather_output"] = self.gather_output.to_dict()
        return data


@dataclass(frozen=True)
class Plan:
    name: str
    linear: tuple[LinearRule, ...]
    attention: tuple[AttentionRule, ...] = ()
    config_divisible: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()
    description: str = ""
    cp_plan: dict[str, CPEntry] | None = None
    # Split inputs (cp_plan argument names) in the order the model joins their rows where it attends over
    # several at once, e.g. ("encoder_hidden_states", "hidden_states") for Flux. None: never joined.
    cp_join_order: tuple[str, ...] | None = None
    origin: str = "plan"  # where it came from, for messages ("built-in plan minimax-h3", a file, a model class)
    # Replicated modules whose outputs each TP rank slices to its 1/tp part along a dim (per-head rotary tables).
    tp_split_outputs: dict[str, dict[int, SeqDim]] = field(default_factory=dict)
    # Inputs of the model's forward whose items (by index; a tensor is item 0) span every head: each TP rank
    # slices its part (the SANA-WM LTX-2 refiner's video_rotary_emb).
    tp_split_inputs: dict[str, dict[int, SplitInput]] = field(default_factory=dict)
    # Config values the plan is made for (LTX-2's rope_type): another value is refused at conversion.
    config_requires: dict[str, Any] = field(default_factory=dict)
    # Config values the CP plan works for, each a value or a list of the values allowed: another is refused on a
    # CP mesh (at conversion and at load).
    cp_config_requires: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "name": self.name,
            "description": self.description,
            "model_classes": list(self.model_classes),
            "linear": [rule.to_dict() for rule in self.linear],
            "attention": [a.to_dict() for a in self.attention],
            "config_divisible": list(self.config_divisible),
        }
        if self.cp_plan is not None:
            data["cp_plan"] = {k: v.to_dict() for k, v in self.cp_plan.items()}
        if self.tp_split_outputs:
            data["tp_split_outputs"] = {
                module: {str(i): spec.to_dict() for i, spec in outputs.items()}
                for module, outputs in self.tp_split_outputs.items()
            }
        if self.tp_split_inputs:
            data["tp_split_inputs"] = {
                name: {str(i): spec.to_dict() for i, spec in items.items()}
                for name, items in self.tp_split_inputs.items()
            }
        if self.config_requires:
            data["config_requires"] = dict(self.config_requires)
        if self.cp_join_order is not None:
            data["cp_join_order"] = list(self.cp_join_order)
        if self.cp_config_requires:
            data["cp_config_requires"] = dict(self.cp_config_requires)
        return data

    @classmethod
    def from_dict(cls, data: Any, origin: str = "plan") -> Plan:
        """Validate plain data into a Plan.

        Raises:
            PlanError: one line naming `origin` and the field at fault.
        """
        return _parse_plan(data, origin)

    def context_parallel_attention(self) -> tuple[AttentionRule, ...]:
        return tuple(a for a in self.attention if a.context_parallel)

    def check_cp_config(self, config: Mapping[str, Any] | None) -> None:
        """The config has a value `cp_config_requires` allows for every key it names (not checked without a config).

        Raises:
            PlanError: a value the CP plan does not work for, naming the key, the values it works for and the fix.
        """
        if not config:
            return
        for key, want in self.cp_config_requires.items():
            allowed = want if isinstance(want, list) else [want]
            have = config.get(key)
            if have not in allowed:
                works = " or ".join(repr(v) for v in allowed)
                raise PlanError(
                    f"{self.origin}: context parallelism works for config {key} = {works}, not {have!r} (see the "
                    "plan's description); use ring=1 and ulysses=1 (--cp 1) for this checkpoint"
                )

    def norm_rules(self) -> tuple[LinearRule, ...]:
        """The rules that shard norms (`tp_rms_norm`): they name modules, which may hold no tensor at all."""
        return tuple(r for r in self.linear if r.style.module_kind == "norm")

    def check_config(self, config: Mapping[str, Any] | None) -> None:
        """The checkpoint's config has every value in `config_requires` (not checked without a config).

        Raises:
            PlanError: a value differs, naming the key, both values and the fix.
        """
        why = self.config_mismatch(config)
        if why is not None:
            raise PlanError(f"{why}; write a plan file for this variant and pass --plan FILE")

    def config_mismatch(self, config: Mapping[str, Any] | None) -> str | None:
        """Why the checkpoint's config does not have the values `config_requires` names, else None (also without a
        config: nothing to compare)."""
        for key, want in self.config_requires.items() if config else ():
            have = config.get(key) if config else None
            if have != want:
                has = f"the checkpoint's config.json has {have!r}"
                return f"{self.origin} is made for config {key} = {want!r}, but {has}"
        return None


# ---------------------------------------------------------------------------------------------------------
# Parsing: strict types, every problem one line naming where it is


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_plan(data: Any, origin: str) -> Plan:
    def bad(msg: str) -> PlanError:
        return PlanError(f"{origin}: {msg}")

    if not isinstance(data, dict):
        raise bad("must be a JSON object with 'name' and 'linear'")
    known = {
        "format", "name", "description", "model_classes", "linear", "attention", "config_divisible", "cp_plan",
        "tp_split_outputs", "tp_split_inputs", "config_requires", "cp_join_order", "cp_config_requires",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise bad(f"unknown keys {unknown}; a plan has {sorted(known)}")
    if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
        raise bad(f"format {data.get('format')!r} is not supported; this preshard reads plan format {PLAN_FORMAT}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("'name' must be a non-empty string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise bad("'description' must be a string")
    model_classes = data.get("model_classes", [])
    if not isinstance(model_classes, list) or not all(isinstance(c, str) for c in model_classes):
        raise bad("'model_classes' must be a list of class names")
    raw_linear = data.get("linear")
    if not isinstance(raw_linear, list):
        raise bad("'linear' must be a list of {match, style} rules")
    linear = []
    for i, rule in enumerate(raw_linear):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str) or not rule["match"]:
            raise bad(f"linear rule {i} needs a non-empty string 'match'")
        extra = sorted(set(rule) - {"match", "style", "blocks", "blocks_from", "optional"})
        if extra:
            raise bad(f"linear rule {rule['match']!r} has unknown keys {extra}")
        optional = rule.get("optional", False)
        if not isinstance(optional, bool):
            raise bad(f"linear rule {rule['match']!r}: 'optional' must be true or false")
        parsed = _parse_linear_rule(rule, f"{origin}: linear rule {rule['match']!r}")
        linear.append(replace(parsed, optional=optional) if optional else parsed)
    raw_attention = data.get("attention", [])
    if not isinstance(raw_attention, list):
        raise bad("'attention' must be a list of {match, divide, context_parallel} rules")
    attention = []
    for i, rule in enumerate(raw_attention):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str) or not rule["match"]:
            raise bad(f"attention rule {i} needs a non-empty string 'match'")
        extra = sorted(set(rule) - {"match", "divide", "context_parallel", "per_head_masks", "one_kv_head"})
        if extra:
            raise bad(f"attention rule {rule['match']!r} has unknown keys {extra}")
        divide = rule.get("divide", [])
        if not isinstance(divide, list) or not all(isinstance(d, str) and _IDENTIFIER.match(d) for d in divide):
            raise bad(f"attention rule {rule['match']!r}: 'divide' must be a list of attribute names")
        context_parallel = rule.get("context_parallel", True)
        if not isinstance(context_parallel, bool):
            raise bad(f"attention rule {rule['match']!r}: 'context_parallel' must be true or false")
        per_head_masks = rule.get("per_head_masks", False)
        if not isinstance(per_head_masks, bool):
            raise bad(f"attention rule {rule['match']!r}: 'per_head_masks' must be true or false")
        one_kv_head = rule.get("one_kv_head", {})
        if not isinstance(one_kv_head, dict) or not all(
            isinstance(a, str) and _IDENTIFIER.match(a) and _is_int(n) and n >= 1 for a, n in one_kv_head.items()
        ):
            raise bad(f"attention rule {rule['match']!r}: 'one_kv_head' must map attribute names to KV head counts")
        attention.append(
            AttentionRule(rule["match"], tuple(divide), context_parallel, per_head_masks, tuple(one_kv_head.items()))
        )
    config_divisible = data.get("config_divisible", [])
    if not isinstance(config_divisible, list) or not all(isinstance(k, str) for k in config_divisible):
        raise bad("'config_divisible' must be a list of config keys")
    cp_plan = _parse_cp_plan(data["cp_plan"], bad) if data.get("cp_plan") is not None else None
    tp_split_outputs = _parse_tp_split_outputs(data.get("tp_split_outputs", {}), bad)
    tp_split_inputs = _parse_tp_split_inputs(data.get("tp_split_inputs", {}), bad)
    config_requires = data.get("config_requires", {})
    if not isinstance(config_requires, dict) or not all(
        isinstance(v, (str, int, float, bool)) or v is None for v in config_requires.values()
    ):
        raise bad("'config_requires' must map config keys to JSON scalars (strings, numbers, true/false, null)")
    cp_config_requires = data.get("cp_config_requires", {})
    scalar = (str, int, float, bool, type(None))
    if not isinstance(cp_config_requires, dict) or not all(
        isinstance(v, scalar) or (isinstance(v, list) and v and all(isinstance(x, scalar) for x in v))
        for v in cp_config_requires.values()
    ):
        raise bad("'cp_config_requires' must map config keys to a JSON scalar or a non-empty list of them")
    join = data.get("cp_join_order")
    if join is not None:
        if (
            not isinstance(join, list)
            or len(join) < 2
            or not all(isinstance(a, str) and _IDENTIFIER.match(a) for a in join)
        ):
            raise bad(
                "'cp_join_order' must list two or more split input names, e.g. [encoder_hidden_states, hidden_states]"
            )
        if len(set(join)) != len(join):
            raise bad(f"'cp_join_order' {join} names an input twice")
        split = {arg for entry in (cp_plan or {}).values() for arg in entry.split_inputs}
        unknown_args = [a for a in join if cp_plan is not None and a not in split]
        if unknown_args:
            raise bad(f"'cp_join_order' names {unknown_args}, which no cp_plan entry splits")
    return Plan(
        name=name,
        linear=tuple(linear),
        attention=tuple(attention),
        config_divisible=tuple(config_divisible),
        model_classes=tuple(model_classes),
        description=description,
        cp_plan=cp_plan,
        cp_join_order=tuple(join) if join is not None else None,
        origin=origin,
        tp_split_outputs=tp_split_outputs,
        tp_split_inputs=tp_split_inputs,
        config_requires=dict(config_requires),
        cp_config_requires=dict(cp_config_requires),
    )


def _parse_linear_rule(rule: dict[str, Any], where: str) -> LinearRule:
    if "blocks_from" not in rule:
        return LinearRule(rule["match"], make_style(rule.get("style"), rule.get("blocks"), where))
    paths = rule["blocks_from"]
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) and _MODULE_PATH.match(p) for p in paths)):
        raise PlanError(f"{where}: 'blocks_from' must be a list of module paths such as \"attn.to_q\"")
    if "blocks" in rule:
        raise PlanError(f"{where}: give 'blocks' or 'blocks_from', not both")
    name = rule.get("style")
    style = make_style(name, None if isinstance(name, str) and name in _UNPACKED else 1, where)
    if not style.packed:
        raise PlanError(f"{where}: 'blocks_from' only applies to packed styles, not to {style.name}")
    return LinearRule(rule["match"], type(style)(), tuple(paths))


def _parse_tp_split_outputs(raw: Any, bad) -> dict[str, dict[int, SeqDim]]:
    if not isinstance(raw, dict):
        raise bad("'tp_split_outputs' must map module names to {output index: {dim, expected_dims}}")
    result = {}
    for module, outputs in raw.items():
        if not isinstance(outputs, dict) or not outputs:
            raise bad(f"tp_split_outputs entry {module!r} must map output indices to {{dim, expected_dims}}")
        specs = {}
        for index, spec in outputs.items():
            if not (isinstance(index, str) and index.isdigit()):
                raise bad(f"tp_split_outputs entry {module!r}: key {index!r} must be an output index (0, 1, ...)")
            specs[int(index)] = _parse_seq_dim(spec, f"{module} output {index}", bad, "tp_split_outputs")
        result[module] = specs
    return result


def _parse_tp_split_inputs(raw: Any, bad) -> dict[str, dict[int, SplitInput]]:
    shape = "{item index: {dim, whole, expected_dims}}"
    if not isinstance(raw, dict):
        raise bad(f"'tp_split_inputs' must map forward input names to {shape}")
    result = {}
    for name, items in raw.items():
        if not (isinstance(name, str) and _IDENTIFIER.match(name)) or not isinstance(items, dict) or not items:
            raise bad(f"tp_split_inputs entry {name!r} must map a forward input's name to {shape}")
        specs = {}
        for index, spec in items.items():
            where = f"tp_split_inputs {name} item {index}"
            if not (isinstance(index, str) and index.isdigit()):
                raise bad(f"{where}: the key must be an item index (0, 1, ...)")
            if not isinstance(spec, dict) or set(spec) - {"dim", "whole", "expected_dims"}:
                raise bad(f"{where} must be {{'dim': int, 'whole': int, 'expected_dims': int or null}}")
            whole = spec.get("whole")
            if not _is_int(whole) or whole < 1:
                raise bad(f"{where}: 'whole' must be the width of the dim across every head, a whole number >= 1")
            seq = _parse_seq_dim({k: v for k, v in spec.items() if k != "whole"}, f"{name} item {index}", bad,
                                 "tp_split_inputs")  # fmt: skip
            specs[int(index)] = SplitInput(seq.dim, whole, seq.expected_dims)
        result[name] = specs
    return result


def _parse_seq_dim(value: Any, where: str, bad, section: str = "cp_plan") -> SeqDim:
    if not isinstance(value, dict) or not _is_int(value.get("dim")) or set(value) - {"dim", "expected_dims"}:
        raise bad(f"{section} {where} must be {{'dim': int, 'expected_dims': int or null}}")
    expected = value.get("expected_dims")
    if expected is not None and (not _is_int(expected) or expected < 1):
        raise bad(f"{section} {where}: 'expected_dims' must be a whole number >= 1 or null")
    if expected is not None and not -expected <= value["dim"] < expected:
        raise bad(f"{section} {where}: dim {value['dim']} is not a dimension of a {expected}-dim tensor")
    return SeqDim(value["dim"], expected)


def _parse_cp_plan(raw: Any, bad) -> dict[str, CPEntry]:
    if not isinstance(raw, dict) or not raw:
        raise bad("'cp_plan' must be an object mapping module names to split/gather specs")
    plan = {}
    for module, entry in raw.items():
        if not isinstance(entry, dict) or not entry or set(entry) - {"split_inputs", "split_outputs", "gather_output"}:
            raise bad(f"cp_plan entry {module!r} must have split_inputs, split_outputs and/or gather_output")
        inputs, outputs = entry.get("split_inputs", {}), entry.get("split_outputs", {})
        if not isinstance(inputs, dict) or not isinstance(outputs, dict):
            raise bad(f"cp_plan entry {module!r}: split_inputs/split_outputs must be objects")
        split_inputs = {}
        for arg, spec in inputs.items():
            if not _IDENTIFIER.match(arg):
                raise bad(f"cp_plan entry {module!r}: {arg!r} is not an argument name")
            split_inputs[arg] = _parse_seq_dim(spec, f"{module}.{arg}", bad)
        split_outputs = {}
        for index, spec in outputs.items():
            if not (isinstance(index, str) and index.isdigit()):
                raise bad(f"cp_plan entry {module!r}: output key {index!r} must be an output index (0, 1, ...)")
            split_outputs[int(index)] = _parse_seq_dim(spec, f"{module} output {index}", bad)
        gather = entry.get("gather_output")
        gather_output = _parse_seq_dim(gather, f"{module} gather_output", bad) if gather is not None else None
        plan[module] = CPEntry(split_inputs, split_outputs, gather_output)
    return plan


# ---------------------------------------------------------------------------------------------------------
# Resolution against a checkpoint


def module_names(tensor_names: Any) -> set[str]:
    """Every module that owns a tensor, directly or below it (the root included as "")."""
    modules = {""}
    for name in tensor_names:
        parts = name.split(".")[:-1]
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return modules


def resolve_plan(
    plan: Plan,
    tensors: Mapping[str, tuple[tuple[int, ...], DType | Any]],
    tp: int,
    *,
    cast: DType | Any | None = None,
    config: Mapping[str, Any] | None = None,
    check_divisible: bool = True,
    derive_blocks: bool = False,
) -> dict[str, TensorLayout]:
    """Every tensor's layout under `plan` at TP degree `tp` (tensors the plan does not name are replicated; dtypes
    are `DType`s or torch's; `derive_blocks`: as `format.quant.recognise`'s).

    Raises:
        PlanError: overlapping rules, a rule that matches no tensor (unless optional, or a norm rule: a norm
            without a weight holds none), an attention rule that matches no module, a Linear rule on a
            non-Linear tensor, a config value the plan is not made for, or a `tp` that does not divide a split
            dimension (the message lists the TP degrees that work).
    """
    resolved: dict[str, TensorLayout] = {}
    cast = as_dtype(cast) if cast is not None else None
    hits = {rule.match: 0 for rule in plan.linear}
    recognise(tensors, config, derive_blocks)  # a layout preshard does not handle, or a scale that fits no weight
    for name, (shape, dtype) in tensors.items():
        module = name.rpartition(".")[0]
        rules = [rule for rule in plan.linear if matches(rule.match, module)]
        if len(rules) > 1:
            raise PlanError(
                f"{plan.origin}: module {module} matches both {rules[0].match!r} and {rules[1].match!r}; "
                "make the plan's rules disjoint"
            )
        style = rules[0].style_for(module, tensors, plan.origin) if rules else REPLICATE
        if rules and is_companion(name):  # a weight's scale follows its weight (format/quant.py)
            style = companion_style(name, tuple(shape), style, tensors, config, derive_blocks)
        if rules:
            hits[rules[0].match] += 1
        try:
            resolved[name] = TensorLayout.make(name, style, tuple(shape), cast_dtype(as_dtype(dtype), cast), dtype)
        except PlanError as exc:
            raise PlanError(f"{plan.origin}: {exc}") from None
    may_miss = {rule.match for rule in plan.linear if rule.optional or rule.style.module_kind == "norm"}
    unmatched = [pattern for pattern, count in hits.items() if count == 0 and pattern not in may_miss]
    if unmatched:
        raise PlanError(
            f"{plan.origin}: rule {unmatched[0]!r} matches no tensor of this checkpoint"
            + (f" (nor do {len(unmatched) - 1} other rules)" if len(unmatched) > 1 else "")
            + "; fix the pattern or pick the plan made for this model"
        )
    modules = module_names(tensors)
    for rule in plan.attention:
        if not any(matches(rule.match, m) for m in modules):
            raise PlanError(
                f"{plan.origin}: attention rule {rule.match!r} matches no module of this checkpoint; fix the pattern"
            )
    plan.check_config(config)
    if check_divisible:
        check_tp(plan, resolved, tp, config or {})
    return resolved


def _split_sizes(plan: Plan, resolved: Mapping[str, TensorLayout], config: Mapping[str, Any]):
    for key in plan.config_divisible:  # first, so that a TP degree the heads do not allow is named as such
        value = config.get(key)
        if _is_int(value):
            yield f"config {key}", value
    for layout in resolved.values():
        yield from layout.split_sizes()


def valid_tp_degrees(plan: Plan, resolved: Mapping[str, TensorLayout], config: Mapping[str, Any]) -> list[int]:
    """Every TP degree that divides each split dimension and each `config_divisible` value."""
    g = 0
    for _, size in _split_sizes(plan, resolved, config):
        g = math.gcd(g, size)
    if g == 0:
        return [1]
    return [d for d in range(1, g + 1) if g % d == 0]


def check_tp(plan: Plan, resolved: Mapping[str, TensorLayout], tp: int, config: Mapping[str, Any]) -> None:
    for name, layout in resolved.items():  # a rank computes one KV head: the degree must be a multiple of them
        kv_heads = layout.style.blocks if layout.style.name == "kv_head_select" else None
        if isinstance(kv_heads, int) and tp % kv_heads:
            raise PlanError(
                f"{plan.origin}: --tp {tp} is not a multiple of the {kv_heads} KV heads {name} computes one of per "
                "rank (kv_head_select, inferred at a larger degree); convert from the source at this degree instead"
            )
    for what, size in _split_sizes(plan, resolved, config):
        if size % tp:
            valid = ", ".join(map(str, valid_tp_degrees(plan, resolved, config)))
            raise PlanError(
                f"--tp {tp} does not divide {what} (size {size}); TP degrees that work for this checkpoint: {valid}"
            )
