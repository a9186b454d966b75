"""Resolve a plan against a checkpoint's tensor names and shapes: one TensorPlan per tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from preshard.errors import PreshardError
from preshard.plans.plan import Plan
from preshard.plans.styles import SHARD_DIM, Chunk, Style, local_shape, rank_chunks


@dataclass(frozen=True)
class TensorPlan:
    name: str
    style: Style
    shard_dim: int | None
    blocks: tuple[int, ...] | None
    shape: tuple[int, ...]
    dtype: str

    def chunks(self, tp: int, tp_rank: int) -> list[Chunk]:
        return rank_chunks(self.shape, self.shard_dim, list(self.blocks) if self.blocks else None, tp, tp_rank)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        return local_shape(self.shape, self.shard_dim, tp)

    def to_dict(self) -> dict[str, Any]:
        return {
            "style": self.style.value,
            "shard_dim": self.shard_dim,
            "blocks": list(self.blocks) if self.blocks else None,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


def matches(pattern: str, module: str) -> bool:
    """`*` (or any fnmatch pattern) matches exactly one dotted path component."""
    want, have = pattern.split("."), module.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def resolve_plan(
    plan: Plan,
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    tp: int,
    config: Mapping[str, Any] | None = None,
) -> dict[str, TensorPlan]:
    """Every tensor's style and shard dim; errors for rules that match nothing and for T that do not divide."""
    if not isinstance(tp, int) or tp < 1:
        raise PreshardError(f"--tp must be a whole number >= 1, got {tp!r}")
    resolved: dict[str, TensorPlan] = {}
    hits = {rule.match: 0 for rule in plan.linear}
    for name, (shape, dtype) in tensors.items():
        module, _, param = name.rpartition(".")
        rules = [rule for rule in plan.linear if matches(rule.match, module)]
        if len(rules) > 1:
            raise PreshardError(
                f"{plan.name}: module {module} matches both {rules[0].match!r} and {rules[1].match!r}; "
                "make the plan's rules disjoint"
            )
        if not rules:
            resolved[name] = TensorPlan(name, Style.REPLICATE, None, None, tuple(shape), dtype)
            continue
        rule = rules[0]
        hits[rule.match] += 1
        if param not in ("weight", "bias") or len(shape) != (2 if param == "weight" else 1):
            raise PreshardError(
                f"{plan.name}: rule {rule.match!r} matches {name} of shape {list(shape)}, which is not a "
                "Linear weight [out, in] or bias [out]; point the rule at Linear modules only"
            )
        shard_dim = SHARD_DIM.get((rule.style, param))
        style = rule.style if shard_dim is not None else Style.REPLICATE
        blocks = None
        if rule.style is Style.PACKED_COLWISE:
            blocks = _block_sizes(rule.blocks, shape[0], name, plan.name)
        resolved[name] = TensorPlan(name, style, shard_dim, blocks, tuple(shape), dtype)
    unmatched = [pattern for pattern, count in hits.items() if count == 0]
    if unmatched:
        raise PreshardError(
            f"{plan.name}: rule {unmatched[0]!r} matches no tensor of this checkpoint"
            + (f" (nor do {len(unmatched) - 1} other rules)" if len(unmatched) > 1 else "")
            + "; fix the pattern or pick the plan made for this model"
        )
    check_divisible(resolved, tp, plan, config or {})
    return resolved


def _block_sizes(blocks: int | list[int] | None, rows: int, name: str, plan_name: str) -> tuple[int, ...]:
    if isinstance(blocks, int):
        if rows % blocks:
            raise PreshardError(
                f"{plan_name}: {name} has {rows} rows, which do not split into {blocks} equal packed blocks"
            )
        return (rows // blocks,) * blocks
    sizes = tuple(blocks or ())
    if sum(sizes) != rows:
        raise PreshardError(f"{plan_name}: packed blocks {list(sizes)} of {name} add up to {sum(sizes)}, not {rows}")
    return sizes


def _sharded_sizes(resolved: Mapping[str, TensorPlan], config: Mapping[str, Any], plan: Plan):
    for tensor in resolved.values():
        if tensor.shard_dim is None:
            continue
        for size in tensor.blocks or (tensor.shape[tensor.shard_dim],):
            yield f"{tensor.name} dim {tensor.shard_dim}" + (" block" if tensor.blocks else ""), size
    for key in plan.config_divisible:
        value = config.get(key)
        if isinstance(value, int):
            yield f"config {key}", value


def valid_tp_degrees(resolved: Mapping[str, TensorPlan], plan: Plan, config: Mapping[str, Any]) -> list[int]:
    g = 0
    for _, size in _sharded_sizes(resolved, config, plan):
        g = math.gcd(g, size)
    if g == 0:
        return [1]
    return [d for d in range(1, g + 1) if g % d == 0]


def check_divisible(resolved: Mapping[str, TensorPlan], tp: int, plan: Plan, config: Mapping[str, Any]) -> None:
    for what, size in _sharded_sizes(resolved, config, plan):
        if size % tp:
            valid = ", ".join(map(str, valid_tp_degrees(resolved, plan, config)))
            raise PreshardError(
                f"--tp {tp} does not divide {what} (size {size}); TP degrees that work for this checkpoint: {valid}"
            )
