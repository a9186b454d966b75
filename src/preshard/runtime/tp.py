"""Tensor-parallel forward for styles that rewire their module (rowwise and its variants, the TP RMSNorm), and
the slicing of replicated outputs, of forward inputs and of per-head attention masks that each rank needs only its
heads of (hooks: what the model computes or is given whole, attention holding this rank's heads reads in part).

A row-parallel layer's partial products are summed with an all-reduce over the TP group and the bias is
added once, after the reduce. That ordering cannot be expressed with forward hooks around
`nn.Linear.forward` (its bias is already added on every rank), so the module's class is switched to a
subclass whose forward is the style's own `parallel_forward`: names, parameters and
`isinstance(m, nn.Linear)` are unchanged. Styles whose local output is already this rank's slice of the
features (colwise, packed colwise) need nothing. A norm across the heads of a column-split projection
(`tp_rms_norm`, `tp_layer_norm`) is switched the same way, to a subclass of its own class; everything its
forward reads (group, rank, full width) is set on the module once, so torch.compile traces it with no graph
break. An embedding split by vocabulary (`vocab_parallel`) is switched likewise, and an lm_head over that
vocabulary (`colwise_gather`) all-gathers its logits rather than all-reducing them. A module of expert weights
split by whole experts (`split_experts`) is switched likewise, its forward calling its own class's on its experts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from preshard.errors import PlanError
from preshard.format.plan import Plan, SeqDim, SplitInput, matches
from preshard.format.styles import Style, TPNorm
from preshard.runtime import collectives
from preshard.runtime.changes import ModelChanges


class _StyleForward:
    """A module whose forward is its sharding style's, with the TP group's all-reduce (state on the module)."""

    preshard_style: Style
    preshard_forward: Callable[..., torch.Tensor]
    tp_group: ProcessGroup | None
    tp_rank: int
    tp_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        combine = self._all_gather if self.preshard_style.collective == "all_gather" else self._all_reduce
        return self.preshard_forward(self, x, self.tp_rank, self.tp_size, combine)

    def _all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce_sum(out, self.tp_group) if self.tp_group is not None else out

    def _all_gather(self, out: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather_cat(out, self.tp_group, -1) if self.tp_group is not None else out


class ParallelLinear(_StyleForward, nn.Linear):
    """nn.Linear whose forward is its sharding style's, with the TP group's all-reduce."""


def parallelize_linear(
    module: nn.Linear,
    style: Style,
    group: ProcessGroup | None,
    tp_rank: int,
    tp: int,
    changes: ModelChanges | None = None,
    where: str = "",
) -> str | None:
    """Switch `module` to `style`'s forward; returns the description for the model's report (None: unchanged).

    Args:
        changes, where: the model's record of changes and the module's name in it (None: not recorded, as for
            the factors of a LoRA adapter, which go with the adapter).
    """
    forward = style.parallel_forward()
    if forward is None:
        return None
    what = "slice replicated input, " if style.name == "replicated_input_rowwise" else ""
    described = f"tp: {style.name}: {what}all-reduce(sum) over tp group, bias after reduce"
    if style.collective == "all_gather":
        described = f"tp: {style.name}: this rank's output features, all-gather(last dim) over tp group"
    _switch(changes or ModelChanges(module), module, where, ParallelLinear, described, {
        "preshard_style": style, "preshard_forward": forward, "tp_group": group, "tp_rank": tp_rank, "tp_size": tp,
    })  # fmt: skip
    return described


def _switch(changes: ModelChanges, module: nn.Module, where: str, cls: type, what: str, attributes: dict) -> None:
    """Switch `module` to `cls` with the attributes its forward reads, recorded in `changes`."""
    changes.swap_class(module, where, cls, f"{cls.__name__} ({what})")
    for name, value in attributes.items():
        changes.set_attribute(module, where, name, value)


def unparallelize_linear(module: nn.Linear) -> None:
    """Back to a plain nn.Linear (for negative controls: the output must then be wrong)."""
    module.__class__ = nn.Linear


class ParallelEmbedding(_StyleForward, nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows, its lookups all-reduced over the TP group (`vocab_parallel`).
    A subclass of nn.Embedding (Gemma-3's scaled embedding) is switched to a class with this one after it in the
    method order, so that its own forward calls this lookup through `super()`."""


@functools.cache
def _parallel_embedding_class(cls: type) -> type:
    """`cls` itself switched to `ParallelEmbedding`; a subclass of nn.Embedding with `ParallelEmbedding` between it and
    nn.Embedding (one class per embedding class)."""
    if cls is nn.Embedding:
        return ParallelEmbedding
    return type(f"Parallel{cls.__name__}", (cls, ParallelEmbedding), {"__module__": __name__})


def parallelize_embedding(
    module: nn.Embedding,
    style: Style,
    group: ProcessGroup | None,
    tp_rank: int,
    tp: int,
    changes: ModelChanges | None = None,
    where: str = "",
) -> str:
    """Switch `module` (its weight already this rank's vocabulary rows) to `style`'s forward (`vocab_parallel`).

    Returns:
        The description for the model's report.
    """
    described = f"tp: {style.name}: vocabulary rows {tp_rank}/{tp}, lookups all-reduce(sum) over tp group"
    _switch(changes or ModelChanges(module), module, where, _parallel_embedding_class(type(module)), described, {
        "preshard_style": style, "preshard_forward": style.parallel_forward(), "tp_group": group, "tp_rank": tp_rank,
        "tp_size": tp,
    })  # fmt: skip
    return described


def parallelize_module(
    module: nn.Module,
    style: Style,
    group: ProcessGroup | None,
    tp_rank: int,
    tp: int,
    changes: ModelChanges | None = None,
    where: str = "",
) -> str | None:
    """`parallelize_embedding` for an embedding style, `parallelize_experts` for an experts one, else
    `parallelize_linear`."""
    if style.module_kind == "embedding":
        return parallelize_embedding(module, style, group, tp_rank, tp, changes, where)  # type: ignore[arg-type]
    if style.module_kind == "experts":
        return parallelize_experts(module, style, group, tp_rank, tp, changes, where)
    return parallelize_linear(module, style, group, tp_rank, tp, changes, where)  # type: ignore[arg-type]


class ParallelExperts(nn.Module):
    """Mixin put in front of an experts module's own class (`split_experts`): its forward runs the class's own on this
    rank's experts and all-reduces the rows (the style's forward says how); `isinstance(m, cls)` still holds."""

    preshard_style: Style
    preshard_forward: Callable[..., torch.Tensor]
    tp_group: ProcessGroup | None
    tp_rank: int
    tp_size: int

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        local = super().forward  # the experts class's own forward, on this rank's parameters
        return self.preshard_forward(self, local, x, tokens_per_expert, self.tp_rank, self.tp_size, self._all_reduce)

    def _all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce_sum(out, self.tp_group) if self.tp_group is not None else out


@functools.cache
def _parallel_experts_class(cls: type) -> type:
    """`ParallelExperts` in front of `cls` (one class per experts class)."""
    return type(f"Parallel{cls.__name__}", (ParallelExperts, cls), {"__module__": __name__})


def parallelize_experts(
    module: nn.Module,
    style: Style,
    group: ProcessGroup | None,
    tp_rank: int,
    tp: int,
    changes: ModelChanges | None = None,
    where: str = "",
) -> str:
    """Switch an experts module (its parameters already this rank's experts) to `style`'s forward (`split_experts`).

    Returns:
        The description for the model's report.
    """
    experts = next(module.parameters(recurse=False)).shape[0]
    described = (
        f"tp: {style.name}: experts {tp_rank * experts}-{(tp_rank + 1) * experts - 1} of {experts * tp} on their "
        "tokens, all-reduce(sum) over tp group"
    )
    _switch(changes or ModelChanges(module), module, where, _parallel_experts_class(type(module)), described, {
        "preshard_style": style, "preshard_forward": style.parallel_forward(), "tp_group": group, "tp_rank": tp_rank,
        "tp_size": tp,
    })  # fmt: skip
    return described


class ParallelNorm(_StyleForward, nn.Module):
    """Mixin put in front of a norm's own class: its forward is the style's, with the TP group's all-reduce."""

    preshard_full_width: int


@functools.cache
def _parallel_norm_class(cls: type) -> type:
    """`ParallelNorm` in front of `cls`, so `isinstance(m, cls)` still holds (one class per norm class)."""
    return type(f"Parallel{cls.__name__}", (ParallelNorm, cls), {"__module__": __name__})


def parallelize_norms(
    model: nn.Module, plan: Plan, group: ProcessGroup | None, tp_rank: int, tp: int, changes: ModelChanges | None = None
) -> dict[str, str]:
    """Switch every norm a `tp_rms_norm` or `tp_layer_norm` rule names (with or without a weight and bias) to the TP
    forward.

    Call after the weights are in place: a norm's weight (if any) must already be its local slice.

    Returns:
        The description of each switched norm, by module name, for the model's report.

    Raises:
        PlanError: a rule matching no module, or a module that is not a norm its style supports, whose width `tp`
            does not divide, or whose weight is not the local slice.
    """
    described: dict[str, str] = {}
    modules = dict(model.named_modules())
    for rule in plan.norm_rules():
        hits = [name for name in modules if name and matches(rule.match, name)]
        if not hits and not rule.optional:
            raise PlanError(f"norm rule {rule.match!r} matches no module of {type(model).__name__}")
        for name in hits:
            module = modules[name]
            if isinstance(module, ParallelNorm):
                continue
            style = rule.style
            why = style.unsupported(module) if isinstance(style, TPNorm) else f"is not a norm {style.name} applies to"
            if why is not None:
                raise PlanError(f"the plan gives {name} the {style.name} style, but it {why}")
            full = TPNorm.width(module) or 0  # (a supported norm has one)
            if full % tp:
                raise PlanError(f"--tp {tp} does not divide the {full} features {name} normalises")
            for param in ("weight", "bias"):
                value = getattr(module, param, None)
                if value is not None and tuple(value.shape) != (full // tp,):
                    raise PlanError(
                        f"{name} has a {param} of shape {list(value.shape)}, not its slice [{full // tp}] at tp={tp}; "
                        f"its {param} must be split by the same {style.name} rule in the checkpoint"
                    )
            what = "sum of squares" if style.name == "tp_rms_norm" else "sum, then sum of squared deviations,"
            described[name] = f"tp: {style.name}: {what} all-reduced(sum) over tp group, width {full}"
            local = {"normalized_shape": (full // tp,)} if hasattr(module, "normalized_shape") else {
                "dim": torch.Size((full // tp,))
            }  # fmt: skip
            _switch(changes or ModelChanges(model), module, name, _parallel_norm_class(type(module)), described[name], {
                "preshard_style": style, "preshard_forward": style.parallel_forward(),
                "preshard_full_width": full, "tp_group": group, "tp_rank": tp_rank, "tp_size": tp, **local,
            })  # fmt: skip
    return described


def _split_outputs_hook(name: str, specs: dict[int, SeqDim], tp_rank: int, tp: int):
    def hook(module, args, output):
        single = not isinstance(output, (tuple, list))
        items = [output] if single else list(output)
        for i, spec in specs.items():
            x = items[i]
            if not isinstance(x, torch.Tensor) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
                got = f"{x.dim()} dims" if isinstance(x, torch.Tensor) else type(x).__name__
                raise PlanError(
                    f"tensor parallel: output {i} of {name} has {got}, the plan's tp_split_outputs expects a tensor "
                    f"with {spec.expected_dims} dims; the plan does not fit this model"
                )
            dim = spec.dim % x.dim()
            if x.shape[dim] % tp:
                raise PlanError(
                    f"tensor parallel: output {i} of {name} has {x.shape[dim]} entries on dim {dim}, which tp={tp} "
                    "does not divide"
                )
            width = x.shape[dim] // tp
            items[i] = x.narrow(dim, tp_rank * width, width)
        return items[0] if single else type(output)(items)

    return hook


def split_outputs(
    model: nn.Module, plan: Plan, tp_rank: int, tp: int, changes: ModelChanges | None = None
) -> dict[str, str]:
    """Each TP rank keeps its 1/tp slice of the outputs `plan.tp_split_outputs` names (per-head rotary tables
    computed whole by a replicated module, consumed by attention that holds this rank's heads only).

    Returns:
        The description of each hook, by module name.

    Raises:
        PlanError: an entry matching no module.
    """
    described: dict[str, str] = {}
    if tp == 1:
        return described
    modules = dict(model.named_modules())
    for pattern, specs in plan.tp_split_outputs.items():
        hits = [name for name in modules if matches(pattern, name)]
        if not hits:
            raise PlanError(f"tp_split_outputs entry {pattern!r} matches no module of {type(model).__name__}")
        for name in hits:
            dims = ", ".join(f"output {i} dim {spec.dim}" for i, spec in specs.items())
            described[name] = f"tp: keep this rank's slice of {dims}"
            handle = modules[name].register_forward_hook(_split_outputs_hook(name, specs, tp_rank, tp))
            (changes or ModelChanges(model)).hook(name, described[name], handle)
    return described


def _narrow_item(x: Any, where: str, spec: SplitInput, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's part of one item spanning every head, or the item itself where it is already that narrow."""
    if not isinstance(x, torch.Tensor) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
        got = f"{x.dim()} dims" if isinstance(x, torch.Tensor) else type(x).__name__
        want = f"a tensor with {spec.expected_dims} dims" if spec.expected_dims is not None else "a tensor"
        raise PlanError(f"tensor parallel: {where} is {got}, the plan's tp_split_inputs expects {want}")
    dim = spec.dim % x.dim()
    width = spec.whole // tp
    if x.shape[dim] == width:  # made by the sharded model's own rotary module: this rank's part already
        return x
    if x.shape[dim] != spec.whole:
        raise PlanError(
            f"tensor parallel: {where} has {x.shape[dim]} entries on dim {dim}, neither the {spec.whole} of every "
            f"head nor this rank's {width}; pass the tables the model's rotary embedding makes for its config"
        )
    return x.narrow(dim, tp_rank * width, width)


def _positions(signature: inspect.Signature, names: Iterable[str]) -> dict[str, int | None]:
    """Where each of `names` stands among forward's positional parameters (None: keyword only)."""
    positional = [
        p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return {name: positional.index(name) if name in positional else None for name in names}


def _get(args: tuple, kwargs: dict, name: str, index: int | None) -> Any:
    """An input by name or position (plain tuple and dict reads: torch.compile traces them)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and index < len(args) else None


def _put(args: tuple, kwargs: dict, name: str, index: int | None, value: Any) -> tuple[tuple, dict]:
    if name in kwargs or index is None:
        return args, {**kwargs, name: value}
    return (*args[:index], value, *args[index + 1 :]), kwargs


def _split_inputs_hook(
    positions: dict[str, int | None], specs: dict[str, dict[int, SplitInput]], tp_rank: int, tp: int
):
    def hook(module, args, kwargs):
        changed = False
        for name, items in specs.items():
            value = _get(args, kwargs, name, positions[name])
            if value is None:
                continue
            single = isinstance(value, torch.Tensor)
            parts = [value] if single else list(value)
            for i, spec in items.items():
                if i >= len(parts):
                    raise PlanError(
                        f"tensor parallel: input {name} has no item {i}, which the plan's tp_split_inputs slices"
                    )
                parts[i] = _narrow_item(parts[i], f"item {i} of input {name}", spec, tp_rank, tp)
            args, kwargs = _put(args, kwargs, name, positions[name], parts[0] if single else type(value)(parts))
            changed = True
        return (args, kwargs) if changed else None

    return hook


def split_inputs(
    model: nn.Module, plan: Plan, tp_rank: int, tp: int, changes: ModelChanges | None = None
) -> dict[str, str]:
    """Each TP rank slices the forward inputs `plan.tp_split_inputs` names to its part (rotary tables across every
    head given to the model's forward, consumed by attention that holds this rank's heads only): a pre-hook on
    the model.

    Returns:
        The hook's description by module name ("" for the model), empty where the plan names no input.

    Raises:
        PlanError: an input the model's forward does not take.
    """
    if tp == 1 or not plan.tp_split_inputs:
        return {}
    signature = inspect.signature(model.forward)
    missing = sorted(set(plan.tp_split_inputs) - set(signature.parameters))
    if missing:
        raise PlanError(
            f"tp_split_inputs names {missing}, which {type(model).__name__}.forward does not take; the plan does not "
            "fit this model"
        )
    what = "; ".join(
        f"{name} item {i} dim {spec.dim} ({spec.whole} -> {spec.whole // tp})"
        for name, items in plan.tp_split_inputs.items()
        for i, spec in items.items()
    )
    described = f"tp: keep this rank's slice of input {what}"
    handle = model.register_forward_pre_hook(
        _split_inputs_hook(_positions(signature, plan.tp_split_inputs), plan.tp_split_inputs, tp_rank, tp),
        with_kwargs=True,
    )
    (changes or ModelChanges(model)).hook("", described, handle)
    return {"": described}


def _head_masks_hook(positions: dict[str, int | None], heads: int, tp_rank: int, tp: int):
    def hook(module, args, kwargs):
        mask = _get(args, kwargs, "attention_mask", positions["attention_mask"])
        hidden = _get(args, kwargs, "hidden_states", positions["hidden_states"])
        if not isinstance(mask, torch.Tensor) or not isinstance(hidden, torch.Tensor) or mask.dim() != 3:
            return None
        batch = hidden.shape[0]
        if mask.shape[0] != batch * heads:
            return None  # one row per batch item (repeated by the local heads in the processor), or broadcast
        local = heads // tp
        rows = mask.view(batch, heads, *mask.shape[1:])[:, tp_rank * local : (tp_rank + 1) * local]
        return _put(
            args, kwargs, "attention_mask", positions["attention_mask"], rows.reshape(batch * local, *mask.shape[1:])
        )

    return hook


def slice_head_masks(
    model: nn.Module, plan: Plan, tp_rank: int, tp: int, changes: ModelChanges | None = None
) -> dict[str, str]:
    """For attention rules with `per_head_masks`: a 3-D attention mask with one row per (batch, head) of the full
    head count (diffusers' layout, batch-major, as `prepare_attention_mask` repeats it) is cut to the rows of this
    rank's heads before the module sees it. Call after the head counts are divided.

    Returns:
        The description of each hook, by module name.

    Raises:
        PlanError: a module with no `heads` or whose forward takes no `hidden_states` and `attention_mask`.
    """
    described: dict[str, str] = {}
    if tp == 1:
        return described
    modules = dict(model.named_modules())
    for rule in plan.attention:
        if not rule.per_head_masks:
            continue
        for name in [n for n in modules if n and matches(rule.match, n)]:
            module = modules[name]
            signature = inspect.signature(module.forward)
            local = getattr(module, "heads", None)
            if not isinstance(local, int) or not {"hidden_states", "attention_mask"} <= set(signature.parameters):
                raise PlanError(
                    f"the plan cuts per-head attention masks at {name}, which has no integer heads or whose forward "
                    "takes no hidden_states and attention_mask; the plan does not fit this model"
                )
            heads = local * tp
            described[name] = f"tp: 3-D attention mask of {heads} heads' rows per batch item: keep this rank's {local}"
            handle = module.register_forward_pre_hook(
                _head_masks_hook(_positions(signature, ("hidden_states", "attention_mask")), heads, tp_rank, tp),
                with_kwargs=True,
            )
            (changes or ModelChanges(model)).hook(name, described[name], handle)
    return described
