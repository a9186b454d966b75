"""Sharding plans as plain data: what a user writes in a JSON plan file, and the built-in plans.

A plan names Linear modules (dotted paths; `*` matches one path component) with a style, attention
modules whose head count is divided by the TP degree, and config keys that must divide by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from preshard.errors import PreshardError
from preshard.plans.styles import Style

PLAN_FORMAT = 1


@dataclass(frozen=True)
class LinearRule:
    match: str
    style: Style
    blocks: int | list[int] | None = None


@dataclass(frozen=True)
class AttentionRule:
    match: str
    divide: tuple[str, ...] = ("heads",)
    context_parallel: bool = True


@dataclass(frozen=True)
class Plan:
    name: str
    linear: tuple[LinearRule, ...]
    attention: tuple[AttentionRule, ...] = ()
    config_divisible: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()
    description: str = ""
    cp_plan: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "name": self.name,
            "description": self.description,
            "model_classes": list(self.model_classes),
            "linear": [_rule_to_dict(r) for r in self.linear],
            "attention": [
                {"match": a.match, "divide": list(a.divide), "context_parallel": a.context_parallel}
                for a in self.attention
            ],
            "config_divisible": list(self.config_divisible),
        }
        if self.cp_plan is not None:
            data["cp_plan"] = self.cp_plan
        return data


def _rule_to_dict(rule: LinearRule) -> dict[str, Any]:
    data: dict[str, Any] = {"match": rule.match, "style": rule.style.value}
    if rule.blocks is not None:
        data["blocks"] = rule.blocks
    return data


def plan_from_dict(data: Any, origin: str = "plan") -> Plan:
    """Validate plain data into a Plan; every problem is a one-line error naming `origin`."""

    def bad(msg: str) -> PreshardError:
        return PreshardError(f"{origin}: {msg}")

    if not isinstance(data, dict):
        raise bad("must be a JSON object with 'name' and 'linear'")
    if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
        raise bad(f"format {data.get('format')!r} is not supported; this preshard reads format {PLAN_FORMAT}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("'name' must be a non-empty string")
    raw_linear = data.get("linear")
    if not isinstance(raw_linear, list):
        raise bad("'linear' must be a list of {match, style} rules")
    styles = ", ".join(s.value for s in Style)
    linear = []
    for i, rule in enumerate(raw_linear):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str) or not rule["match"]:
            raise bad(f"linear rule {i} needs a non-empty string 'match'")
        try:
            style = Style(rule.get("style"))
        except ValueError:
            raise bad(
                f"linear rule {rule['match']!r} has unknown style {rule.get('style')!r}; use one of {styles}"
            ) from None
        blocks = rule.get("blocks")
        if style is Style.PACKED_COLWISE:
            ok = (isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 1) or (
                isinstance(blocks, list) and blocks and all(isinstance(b, int) and b >= 1 for b in blocks)
            )
            if not ok:
                raise bad(
                    f"packed_colwise rule {rule['match']!r} needs 'blocks': a count (2 for [gate; up]) "
                    "or a list of block sizes"
                )
        elif blocks is not None:
            raise bad(f"'blocks' only applies to packed_colwise, not to {style.value} rule {rule['match']!r}")
        unknown = set(rule) - {"match", "style", "blocks"}
        if unknown:
            raise bad(f"linear rule {rule['match']!r} has unknown keys {sorted(unknown)}")
        linear.append(LinearRule(rule["match"], style, blocks))
    attention = []
    for i, rule in enumerate(data.get("attention", [])):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
            raise bad(f"attention rule {i} needs a string 'match'")
        divide = rule.get("divide", ["heads"])
        if not isinstance(divide, list) or not all(isinstance(d, str) for d in divide):
            raise bad(f"attention rule {rule['match']!r}: 'divide' must be a list of attribute names")
        attention.append(AttentionRule(rule["match"], tuple(divide), bool(rule.get("context_parallel", True))))
    config_divisible = data.get("config_divisible", [])
    if not isinstance(config_divisible, list) or not all(isinstance(k, str) for k in config_divisible):
        raise bad("'config_divisible' must be a list of config keys")
    cp_plan = data.get("cp_plan")
    if cp_plan is not None and not isinstance(cp_plan, dict):
        raise bad("'cp_plan' must be an object mapping module names to split/gather specs")
    return Plan(
        name=name,
        linear=tuple(linear),
        attention=tuple(attention),
        config_divisible=tuple(config_divisible),
        model_classes=tuple(data.get("model_classes", [])),
        description=str(data.get("description", "")),
        cp_plan=cp_plan,
    )


def builtin_plan_names() -> list[str]:
    folder = resources.files("preshard.plans") / "builtin"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_plan(name_or_path: str | Path) -> Plan:
    """A built-in plan by name, or a JSON plan file by path."""
    text = str(name_or_path)
    if text in builtin_plan_names():
        source = resources.files("preshard.plans") / "builtin" / f"{text}.json"
        return plan_from_dict(json.loads(source.read_text()), origin=f"built-in plan {text}")
    path = Path(text)
    if not path.suffix == ".json" and not path.exists():
        raise PreshardError(
            f"unknown plan {text!r}: built-in plans are {', '.join(builtin_plan_names())}; "
            "or pass the path of a JSON plan file"
        )
    if not path.is_file():
        raise PreshardError(f"plan file {text} does not exist; pass a JSON plan file or a built-in plan name")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PreshardError(f"plan file {text} is not valid JSON ({exc}); fix the file") from None
    return plan_from_dict(data, origin=f"plan file {text}")


def plan_for_class(class_name: str | None) -> Plan | None:
    """The built-in plan that declares `class_name`, if any."""
    if not class_name:
        return None
    for name in builtin_plan_names():
        plan = load_plan(name)
        if class_name in plan.model_classes:
            return plan
    return None
