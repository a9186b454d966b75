"""Context parallelism: split the sequence where the CP plan says, attend across ranks, gather at the end.

Every rank receives the same full inputs. Forward hooks split the planned inputs/outputs along the
sequence (padded to a multiple of the CP size: collectives are always equal-sized), the model's own
attention call (`torch.nn.functional.scaled_dot_product_attention`, as diffusers' native backend
issues it) is routed to Ulysses / ring attention while a planned attention module runs, and the
planned outputs are all-gathered and trimmed back to the real length.

The CP plan is plain data (module pattern -> what to split or gather). It comes from the preshard
plan's `cp_plan` if given, else from the model class's own `_cp_plan` (diffusers declares one).
"""

from __future__ import annotations

import contextvars
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from preshard.errors import PlanError, PreshardError
from preshard.format.plan import CPEntry, Plan, SeqDim, matches
from preshard.plans.from_model import cp_plan_from_diffusers
from preshard.runtime import collectives
from preshard.runtime.cp_attention import CPGroups, cp_attention, neuron_flash_advice
from preshard.runtime.devices import RankDevice
from preshard.runtime.groups import MeshGroups
from preshard.runtime.report import LoadReport

# ---------------------------------------------------------------- the plan


def resolve_cp_plan(model: nn.Module, plan: Plan) -> dict[str, CPEntry]:
    """The preshard plan's `cp_plan`, else the model class's `_cp_plan`; an error if neither exists."""
    if plan.cp_plan:
        return plan.cp_plan
    declared = getattr(type(model), "_cp_plan", None)
    if declared:
        return cp_plan_from_diffusers(declared)
    raise PlanError(
        f"{type(model).__name__} declares no _cp_plan and the preshard plan has no cp_plan; "
        "add a cp_plan to the plan file, or load with ring=1, ulysses=1"
    )


# ---------------------------------------------------------------- per-forward state


@dataclass
class CPState:
    """What one forward pass has learned: the real sequence length, and what attention saw."""

    groups: CPGroups
    cp_group: Any
    cp_order: list[int]  # cp rank of each member of the cp group, in group-rank order
    neuron: bool = False
    seq_len: int | None = None
    padded: bool = False  # the one split length was padded up to a multiple of the CP size
    attention_rows: dict[str, int] = field(default_factory=dict)
    advised: set[int] = field(default_factory=set)

    @property
    def cp_size(self) -> int:
        return self.groups.cp_size

    def local_rows(self, length: int) -> int:
        return math.ceil(length / self.cp_size)

    def note_length(self, length: int, where: str) -> None:
        """Padding works for one sequence per forward; several (Flux's text and image) must each divide evenly."""
        if self.seq_len is None:
            self.seq_len, self.padded = length, length % self.cp_size != 0
        elif self.seq_len != length and (self.padded or length % self.cp_size):
            raise PreshardError(
                f"context parallel: {where} has sequence length {length}, and this forward pass split {self.seq_len} "
                f"rows earlier; when sequences of different lengths are split, each must be a multiple of the CP "
                f"size {self.cp_size}: in a pipeline, pick the height, width, num_frames or max_sequence_length that "
                f"make each sequence a multiple of {self.cp_size} (or run with a CP size dividing both); calling the "
                f"model directly, pad each input sequence to a multiple of {self.cp_size}"
            )

    def attention_length(self, local_rows: int) -> int:
        """The real length of the sequence an attention call sees (padding is cut only when there is one)."""
        return self.seq_len if self.padded else local_rows * self.cp_size


_ACTIVE_ATTENTION: contextvars.ContextVar[tuple[str, CPState, list[int]] | None] = contextvars.ContextVar(
    "preshard_cp_attention", default=None
)
_ORIGINAL_SDPA = F.scaled_dot_product_attention


def _split_tensor(state: CPState, x: Any, dim: int, expected_dims: int | None, where: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise PreshardError(f"context parallel: {where} is {type(x).__name__}, not a tensor the CP plan can split")
    if expected_dims is not None and x.dim() != expected_dims:
        # As diffusers reads its `_cp_plan`: the split applies to tensors of that many dims only (Wan splits its
        # timestep when it is per token, `[B, S]`, and leaves the usual `[B]` whole).
        return x
    dim = dim % x.dim()
    length = x.shape[dim]
    state.note_length(length, where)
    rows = state.local_rows(length)
    padded = rows * state.cp_size
    if padded != length:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, padded - length]
        x = F.pad(x, pad)
    return x.narrow(dim, state.groups.cp_rank * rows, rows)


def _gather_tensor(state: CPState, x: Any, dim: int, where: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise PreshardError(f"context parallel: output of {where} is {type(x).__name__}, not a tensor to gather")
    if state.seq_len is None:
        raise PreshardError(f"context parallel: {where} gathers a sequence that was never split in this forward")
    dim = dim % x.dim()
    full = collectives.all_gather_cat(x.contiguous(), state.cp_group, dim)
    if state.cp_order != sorted(state.cp_order):
        # Group ranks follow global ranks; the sequence follows cp ranks. Put the chunks in sequence order.
        rows = x.shape[dim]
        pieces = full.split(rows, dim)
        full = torch.cat([pieces[state.cp_order.index(c)] for c in range(len(pieces))], dim)
    return full.narrow(dim, 0, state.seq_len) if state.padded else full


# ---------------------------------------------------------------- hooks


def _argument_positions(module: nn.Module) -> dict[str, int]:
    params = list(inspect.signature(module.forward).parameters)
    return {name: i for i, name in enumerate(params)}


def _split_inputs_hook(state: CPState, name: str, specs: dict[str, SeqDim], positions: dict[str, int]):
    def hook(module, args, kwargs):
        args = list(args)
        for arg, spec in specs.items():
            where = f"{name or type(module).__name__}({arg})"
            if kwargs.get(arg) is not None:
                kwargs[arg] = _split_tensor(state, kwargs[arg], spec.dim, spec.expected_dims, where)
            elif arg in positions and positions[arg] < len(args) and args[positions[arg]] is not None:
                i = positions[arg]
                args[i] = _split_tensor(state, args[i], spec.dim, spec.expected_dims, where)
            # else: not passed (or None), so there is nothing of it to split
        return tuple(args), kwargs

    return hook


def _split_outputs_hook(state: CPState, name: str, specs: dict[int, SeqDim]):
    def hook(module, args, output):
        single = not isinstance(output, (tuple, list))
        items = [output] if single else list(output)
        for i, spec in specs.items():
            items[i] = _split_tensor(state, items[i], spec.dim, spec.expected_dims, f"{name} output {i}")
        return items[0] if single else type(output)(items)

    return hook


def _gather_hook(state: CPState, name: str, spec: SeqDim):
    def hook(module, args, output):
        return _gather_tensor(state, output, spec.dim, name)

    return hook


def _reset_hook(state: CPState):
    def hook(module, args):
        state.seq_len, state.padded = None, False
        _ACTIVE_ATTENTION.set(None)  # in case an earlier forward raised inside an attention module

    return hook


def _attention_enter(state: CPState, name: str):
    def hook(module, args):
        calls: list[int] = []
        module._preshard_cp_token = _ACTIVE_ATTENTION.set((name, state, calls))

    return hook


def _attention_exit(state: CPState, name: str):
    def hook(module, args, output):
        # always_call: also runs when the forward raised (output None), so no routing outlives the module.
        token = module.__dict__.pop("_preshard_cp_token", None)
        if token is None:
            return
        _, _, calls = _ACTIVE_ATTENTION.get()
        _ACTIVE_ATTENTION.reset(token)
        if output is not None and not calls:
            raise PreshardError(
                f"context parallel: {name} did not call torch.nn.functional.scaled_dot_product_attention, so its "
                "sequence could not be attended across ranks; use diffusers' native attention backend"
            )

    return hook


def context_parallel_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """`scaled_dot_product_attention`, routed to CP attention while a planned attention module runs."""
    active = _ACTIVE_ATTENTION.get()
    if active is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    name, state, calls = active
    if attn_mask is not None or is_causal or dropout_p or kwargs.get("enable_gqa"):
        raise PreshardError(
            f"context parallel: {name} asked for an attention mask, causal attention, dropout or GQA, "
            "which preshard's CP attention does not support"
        )
    if state.seq_len is None:
        raise PreshardError(f"context parallel: {name} ran before the CP plan split the sequence")
    calls.append(query.shape[2])
    state.attention_rows[name] = query.shape[2]
    if state.neuron:
        _advise_neuron(state, key.shape[2] * state.groups.ulysses_size)
    return cp_attention(
        query,
        key,
        value,
        groups=state.groups,
        seq_len=state.attention_length(query.shape[2]),
        scale=scale,
        local_attention=_ORIGINAL_SDPA,
    )


def _advise_neuron(state: CPState, block_len: int) -> None:
    length = state.seq_len if state.groups.ring_size == 1 else block_len
    advice = neuron_flash_advice(length)
    if advice and length not in state.advised:
        state.advised.add(length)
        warnings.warn(advice, stacklevel=3)


def install_sdpa_router() -> None:
    """Route the public SDPA through preshard (a pass-through unless a CP attention module is running)."""
    if F.scaled_dot_product_attention is not context_parallel_sdpa:
        F.scaled_dot_product_attention = context_parallel_sdpa


# ---------------------------------------------------------------- attach


def attach_context_parallel(
    model: nn.Module, plan: Plan, groups: MeshGroups, rank_device: RankDevice, report: LoadReport
) -> CPState:
    """Register the split/gather hooks and the attention wrappers; describe them in the report."""
    spec = groups.spec
    coords = groups.coords
    cp_groups = CPGroups(
        ring_group=groups.ring, ring_size=spec.ring, ring_rank=coords["ring"],
        ulysses_group=groups.ulysses, ulysses_size=spec.ulysses, ulysses_rank=coords["ulysses"],
    )  # fmt: skip
    cp_members = groups.ranks.get("cp", [groups.rank])
    state = CPState(
        groups=cp_groups,
        cp_group=groups.cp,
        cp_order=[spec.cp_rank(r) for r in sorted(cp_members)],
        neuron=rank_device.kind == "neuron",
    )
    cp_plan = resolve_cp_plan(model, plan)
    attention = plan.context_parallel_attention()
    if not attention:
        raise PlanError("the plan marks no attention module for context parallelism; add one with context_parallel")
    modules = dict(model.named_modules())
    model.register_forward_pre_hook(_reset_hook(state))
    ranks = f"cp group {sorted(cp_members)}"
    for pattern, entry in cp_plan.items():
        hits = [n for n in modules if matches(pattern, n)]
        if not hits:
            raise PlanError(f"cp plan entry {pattern!r} matches no module of {type(model).__name__}")
        for name in hits:
            module = modules[name]
            if entry.split_inputs:
                hook = _split_inputs_hook(state, name, entry.split_inputs, _argument_positions(module))
                module.register_forward_pre_hook(hook, with_kwargs=True)
                for arg, s in entry.split_inputs.items():
                    report.add_hook(name, f"cp: split input {arg} dim {s.dim} over {ranks}")
            if entry.split_outputs:
                module.register_forward_hook(_split_outputs_hook(state, name, entry.split_outputs))
                for key, s in entry.split_outputs.items():
                    report.add_hook(name, f"cp: split output {key} dim {s.dim} over {ranks}")
            if entry.gather_output is not None:
                module.register_forward_hook(_gather_hook(state, name, entry.gather_output))
                report.add_hook(name, f"cp: all-gather output dim {entry.gather_output.dim} over {ranks}")

    install_sdpa_router()
    axes = [axis for axis in ("ulysses", "ring") if spec.size(axis) > 1]
    description = "cp: attention " + " + ".join(f"{axis} over group {groups.ranks[axis]}" for axis in axes)
    for rule in attention:
        for name, module in modules.items():
            if name and matches(rule.match, name):
                module.register_forward_pre_hook(_attention_enter(state, name))
                module.register_forward_hook(_attention_exit(state, name), always_call=True)
                report.add_hook(name, description)
    report.attention_rows = state.attention_rows
    return state
