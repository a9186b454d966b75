"""Context parallelism: split the sequences where the CP plan says, attend across ranks, gather at the end.

Every rank receives the same full inputs. Forward hooks split the planned inputs/outputs along the
sequence, the attention of the planned attention modules runs across the CP group (Ulysses / ring, in
`cp_attention`), and the planned outputs are all-gathered and trimmed back to their real length.

Any length, several sequences. Each sequence a forward splits (Flux: text and image; LTX-2: video and
audio) is padded to a multiple of the CP size on its own, so every collective is equal-sized (the
Neuron/XLA rule). A sequence is known by its real length; its rows per rank are kept distinct from every
other sequence's (one more row of padding where two would coincide), so a tensor's rows name its sequence:
the gather trims to that sequence's length and attention finds which of its key rows are padding and
drops them. Where a model joins several sequences for one attention (Flux's text + image), the plan's
`cp_join_order` says in which order; with padding, CP needs it.

Routing attention, and why this way. State lives on the modules: a `CPRuntime` on the model (mesh place
and this forward's sequence table, reset by a root pre-hook), a `_CPAttentionRouter` on each planned
attention module. The module's class is switched to a subclass (as TP does for Linear) whose forward runs
the original one inside its router, a `TorchFunctionMode` that sends that module's calls of
`torch.nn.functional.scaled_dot_product_attention` to `cp_attention` and passes everything else through.
This was chosen over the alternatives diffusers 0.42.1 offers: processors call
`dispatch_attention_fn(..., backend=self._attention_backend, parallel_config=self._parallel_config)`, whose
backends are a closed enum in a process-wide registry (registering one is process-wide state) and whose
`parallel_config` path is diffusers' own CP on a DeviceMesh, with ragged all-gathers for uneven lengths
and none of preshard's collectives; wrapping each processor would be undone by `set_attn_processor`; a
custom op would hide the collectives from the graph. A mode entered by the module's own forward is scoped
to that call and thread, patches nothing, survives `set_attn_processor` and `set_attention_backend("native")`
(anything that still calls SDPA), and torch.compile traces it with no graph break. The collectives are
torch's functional collectives (`collectives`), traced into the graph. A backend that does not call SDPA
(flash-attn, sage, diffusers' own `enable_parallelism`) is refused in one line before it runs.

The CP plan is plain data (module pattern -> what to split or gather). It comes from the preshard
plan's `cp_plan` if given (built in, a plan file's, or inferred by `plans/infer_cp.py`), else from the model
class's own `_cp_plan` (diffusers declares one).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator, Mapping
from itertools import combinations
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from preshard.errors import PlanError, UsageError
from preshard.format.plan import CPEntry, Plan, SeqDim, matches
from preshard.plans.from_model import DIFFUSERS_CP_JOIN_ORDER, cp_plan_from_diffusers
from preshard.runtime import collectives
from preshard.runtime.changes import ModelChanges
from preshard.runtime.cp_attention import CPGroups, KeySequence, cp_attention, neuron_flash_advice
from preshard.runtime.devices import RankDevice
from preshard.runtime.groups import MeshGroups
from preshard.runtime.report import LoadReport

_SDPA = F.scaled_dot_product_attention
# diffusers attention backends that compute through torch's SDPA (so the router sees them).
_SDPA_BACKENDS = {"native", "_native_flash", "_native_efficient", "_native_math"}
_MAX_EXTRA_ROWS = 64  # bound on the padding added to keep two sequences' rows per rank apart

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


def resolve_join_order(model: nn.Module, plan: Plan, cp_plan: dict[str, CPEntry]) -> tuple[str, ...]:
    """The order in which the model joins split sequences: the plan's, else the one preshard knows for the class."""
    order = plan.cp_join_order or DIFFUSERS_CP_JOIN_ORDER.get(type(model).__name__) or ()
    split = {arg for entry in cp_plan.values() for arg in entry.split_inputs}
    missing = [arg for arg in order if arg not in split]
    if missing:
        raise PlanError(f"cp_join_order names {missing}, which the CP plan of {type(model).__name__} does not split")
    return tuple(order)


# ---------------------------------------------------------------- per-model runtime state


class CPRuntime:
    """This rank's CP place, and what the current forward pass has split: lives on the model (`_preshard_cp`).

    `sequences` maps each split sequence's real length to its rows per rank; `named` maps split input names to
    their sequence's length. Both are reset by the root module's pre-hook at the start of every forward.
    """

    def __init__(
        self,
        groups: CPGroups,
        cp_group: Any,
        cp_order: list[int],
        *,
        neuron: bool = False,
        join_order: tuple[str, ...] = (),
    ) -> None:
        self.groups = groups
        self.cp_group = cp_group
        self.cp_order = cp_order  # cp rank of each member of the cp group, in group-rank order
        self.in_order = cp_order == sorted(cp_order)
        self.neuron = neuron
        self.join_order = join_order
        self.advised: set[int] = set()
        self.sequences: dict[int, int] = {}
        self.named: dict[str, int] = {}

    @property
    def cp_size(self) -> int:
        return self.groups.cp_size

    def begin_forward(self) -> None:
        self.sequences = {}
        self.named = {}

    # -- sequences

    def rows_for(self, length: int, name: str | None, where: str) -> int:
        """Rows per rank of the sequence of `length` real rows: the same for every split of it in this forward.

        `name` (the split input's argument name) is kept only where the join order names it: only there does the
        key layout need it, and elsewhere one name may carry sequences of several lengths in one forward (Helios's
        blocks split `hidden_states` with its history frames for self-attention and without for the rest).
        """
        if name not in self.join_order:
            name = None
        if name is not None and name in self.named and self.named[name] != length:
            raise UsageError(
                f"context parallel: {where} has {length} rows, but {name} had {self.named[name]} earlier in this "
                "forward pass; a split input must keep its length through a forward"
            )
        if length not in self.sequences:
            rows = math.ceil(length / self.cp_size)
            named = {**self.named, name: length} if name is not None else self.named
            for _ in range(_MAX_EXTRA_ROWS):
                if not self._ambiguous({**self.sequences, length: rows}, named):
                    break
                rows += 1
            else:  # pragma: no cover - needs dozens of sequences of nearly one length
                raise UsageError(f"context parallel: {where}: cannot keep {len(self.sequences) + 1} sequences apart")
            self.sequences[length] = rows
        if name is not None:
            self.named[name] = length
        return self.sequences[length]

    def _candidates(self, sequences: dict[int, int], named: dict[str, int]) -> list[tuple[int, ...]]:
        """Every layout a key block can have: one sequence, or a run of the join order (real lengths, in order)."""
        found: list[tuple[int, ...]] = [(length,) for length in sequences]
        joined = [named[arg] for arg in self.join_order if arg in named]
        for size in range(2, len(joined) + 1):
            found += [tuple(joined[i : i + size]) for i in range(len(joined) - size + 1)]
        return found

    def _ambiguous(self, sequences: dict[int, int], named: dict[str, int]) -> bool:
        sums: dict[int, tuple[int, ...]] = {}
        for layout in self._candidates(sequences, named):
            rows = sum(sequences[length] for length in layout)
            if sums.setdefault(rows, layout) != layout:
                return True
        return False

    def padded(self) -> bool:
        return any(rows * self.cp_size != length for length, rows in self.sequences.items())

    def key_layout(self, key_rows: int, where: str, exact: bool = False) -> tuple[KeySequence, ...]:
        """Which split sequences, in which order, make up a local key block of `key_rows` rows.

        `exact`: the real layout even where nothing is padded (an attention mask names keys by position).
        """
        if not exact and not self.padded():  # every row of every sequence is real, however they are joined
            return (KeySequence(key_rows * self.cp_size, key_rows),)
        hits = [
            layout
            for layout in self._candidates(self.sequences, self.named)
            if sum(self.sequences[length] for length in layout) == key_rows
        ]
        if len(hits) == 1:
            return tuple(KeySequence(length, self.sequences[length]) for length in hits[0])
        c = self.cp_size
        lengths = sorted(self.sequences)
        joinable = [
            combo
            for size in range(2, len(lengths) + 1)
            for combo in combinations(lengths, size)
            if sum(self.sequences[x] for x in combo) == key_rows
        ]
        if joinable and not self.padded():
            parts = " and ".join(f"{x} tokens" for x in joinable[0])
            raise PlanError(
                f"context parallel: {where} attends over sequences of {parts} joined, with an attention mask, and "
                "the plan does not say in which order the model joins them; add cp_join_order to the plan"
            )
        if joinable:
            parts = " and ".join(f"{x} tokens" for x in joinable[0])
            raise UsageError(
                f"context parallel: {where} attends over sequences of {parts} joined, which are not multiples of "
                f"the CP size {c}, and the plan does not say in which order the model joins them; choose sizes "
                f"whose token counts divide by {c} (in a pipeline: height/width/num_frames for the image or video "
                f"tokens, max_sequence_length for the text), or add cp_join_order to the plan"
            )
        seen = ", ".join(f"{length} tokens ({rows} per rank)" for length, rows in sorted(self.sequences.items()))
        raise PlanError(
            f"context parallel: {where} attends over {key_rows} key rows per rank, which is none of the sequences "
            f"this forward split ({seen}); if its keys are not split (cross-attention to the whole text), mark it "
            "context_parallel: false in the plan"
        )

    # -- split and gather

    def split(self, x: Any, spec: SeqDim, where: str, name: str | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise UsageError(f"context parallel: {where} is {type(x).__name__}, not a tensor the CP plan can split")
        if spec.expected_dims is not None and x.dim() != spec.expected_dims:
            # As diffusers reads its `_cp_plan`: the split applies to tensors of that many dims only (Wan splits its
            # timestep when it is per token, `[B, S]`, and leaves the usual `[B]` whole).
            return x
        dim = spec.dim % x.dim()
        length = x.shape[dim]
        if length < 1:
            raise UsageError(f"context parallel: {where} is empty along the sequence dimension {dim}")
        rows = self.rows_for(length, name, where)
        padded = rows * self.cp_size
        if padded != length:
            x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, padded - length])
        return x.narrow(dim, self.groups.cp_rank * rows, rows)

    def gather(self, x: Any, dim: int, where: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise PlanError(f"context parallel: output of {where} is {type(x).__name__}, not a tensor to gather")
        if not self.sequences:
            raise PlanError(f"context parallel: {where} gathers a sequence that was never split in this forward")
        dim = dim % x.dim()
        rows = x.shape[dim]
        lengths = [length for length, r in self.sequences.items() if r == rows]
        if not lengths:
            seen = ", ".join(f"{length} tokens ({r} per rank)" for length, r in sorted(self.sequences.items()))
            raise PlanError(
                f"context parallel: {where} gathers {rows} rows per rank, which is none of the sequences this "
                f"forward split ({seen})"
            )
        full = collectives.all_gather_cat(x.contiguous(), self.cp_group, dim)
        if not self.in_order:
            # Group ranks follow global ranks; the sequence follows cp ranks. Put the chunks in sequence order.
            pieces = full.split(rows, dim)
            full = torch.cat([pieces[self.cp_order.index(c)] for c in range(len(pieces))], dim)
        return full.narrow(dim, 0, lengths[0]) if lengths[0] != full.shape[dim] else full

    # -- attention

    def attend(
        self,
        name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """`scaled_dot_product_attention`'s signature, computed across the CP group."""
        if is_causal or dropout_p or enable_gqa:
            raise UsageError(
                f"context parallel: {name} asked for causal attention, dropout or GQA, which preshard's CP attention "
                "does not support"
            )
        if not self.sequences:
            raise PlanError(f"context parallel: {name} ran before the CP plan split the sequence")
        layout = self.key_layout(key.shape[2], name, exact=attn_mask is not None)
        if self.neuron:
            self._advise_neuron(key.shape[2] * self.groups.ulysses_size, layout)
        if attn_mask is None:
            return cp_attention(query, key, value, groups=self.groups, key_layout=layout, scale=scale)
        key_masks, query_valid = self._key_masks(name, attn_mask, query, key, layout)
        out = cp_attention(query, key, value, groups=self.groups, key_layout=layout, scale=scale, key_masks=key_masks)
        # Query rows the mask leaves no key: SDPA gives them 0.
        return out if query_valid is None else out.masked_fill(~query_valid, 0.0)

    # -- attention masks

    def _key_masks(
        self, name: str, mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, layout: tuple[KeySequence, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An SDPA mask as every CP rank's mask over its local key rows, `[cp, B, key rows]`, and, where the mask also
        masks whole query rows, this rank's query rows that attend (`[B, 1, query rows, 1]`).

        Two kinds are taken, told apart by their key dim: a mask over this rank's key rows (built from split
        inputs: HunyuanVideo 1.5 splits its text mask with the text; all-gathered), and a mask over the whole key
        sequence as the unsharded model sees it (built before the split: HunyuanVideo, HunyuanImage; every rank
        holds it and cuts each rank's rows out of it). A mask over this rank's rows may also depend on the query,
        if it is a key mask and a query mask combined (`q_valid[:, None] & k_valid[None, :]`, as HunyuanVideo 1.5
        builds it): checked on the data. Where both sizes coincide, every real row is on CP rank 0, whose mask is
        then the same either way.
        """
        rows, total = key.shape[2], sum(s.length for s in layout)
        shape = tuple(mask.shape)
        if not 1 <= mask.dim() <= 4:
            raise UsageError(f"context parallel: {name} got an attention mask of shape {shape}, which SDPA cannot take")
        m = mask.reshape((1,) * (4 - mask.dim()) + shape)
        batch, heads, queries, keys = m.shape
        if batch not in (1, query.shape[0]) or heads != 1:
            raise UsageError(
                f"context parallel: {name} got an attention mask of shape {shape}; preshard's CP attention takes a "
                "mask that is the same for every head ([batch or 1, 1, queries or 1, keys])"
            )
        if keys == rows:
            if queries == 1:
                return self._gather_key_masks(m[:, 0, 0]), None
            if queries == query.shape[2] and m.dtype == torch.bool:
                key_valid = m.any(dim=-2)  # [B, 1, keys]
                query_valid = m.any(dim=-1, keepdim=True)  # [B, 1, queries, 1]
                self._check_factorised(name, m, query_valid & key_valid.unsqueeze(-2))
                return self._gather_key_masks(key_valid[:, 0]), query_valid
        elif keys == total and queries == 1:
            return self._cut_key_masks(m[:, 0, 0], layout), None
        raise UsageError(
            f"context parallel: {name} got an attention mask of shape {shape}, which preshard's CP attention cannot "
            f"split: it takes a mask over the keys (the whole {total} keys or this rank's {rows}) that is the same "
            "for every query, or this rank's bool mask that is a key mask and a query mask combined"
        )

    def _gather_key_masks(self, local: torch.Tensor) -> torch.Tensor:
        """Every CP rank's `[B, rows]` key mask, `[cp, B, rows]` in CP rank order (Ulysses inside, ring outside)."""
        masks = local.unsqueeze(0)
        wire = masks.to(torch.uint8) if masks.dtype == torch.bool else masks  # bool does not travel everywhere
        if self.groups.ulysses_size > 1:
            wire = collectives.all_gather_cat(wire.contiguous(), self.groups.ulysses_group, 0)
        if self.groups.ring_size > 1:
            wire = collectives.all_gather_cat(wire.contiguous(), self.groups.ring_group, 0)
        return wire.bool() if masks.dtype == torch.bool else wire

    def _cut_key_masks(self, full: torch.Tensor, layout: tuple[KeySequence, ...]) -> torch.Tensor:
        """Each CP rank's rows of a `[B, total keys]` mask over the joined unsplit sequences, `[cp, B, rows]`."""
        blocks = []
        for cp_rank in range(self.cp_size):
            pieces, offset = [], 0
            for seq in layout:
                start, real = offset + cp_rank * seq.rows, seq.real_rows(cp_rank)
                pieces.append(full[:, start : start + real])
                if real < seq.rows:  # padding rows: dropped before attention, any value
                    pieces.append(full.new_zeros(full.shape[0], seq.rows - real))
                offset += seq.length
            blocks.append(torch.cat(pieces, dim=1))
        return torch.stack(blocks)

    @staticmethod
    def _check_factorised(name: str, mask: torch.Tensor, product: torch.Tensor) -> None:
        message = (
            f"context parallel: {name} got a [queries, keys] attention mask that is not a key mask and a query "
            "mask combined, which preshard's CP attention cannot split"
        )
        same = torch.eq(mask, product).all()
        if torch.compiler.is_compiling():
            torch._assert_async(same, message)
        elif not bool(same):
            raise UsageError(message)

    def _advise_neuron(self, block_len: int, layout: tuple[KeySequence, ...]) -> None:
        length = sum(s.length for s in layout) if self.groups.ring_size == 1 else block_len
        advice = neuron_flash_advice(length)
        if advice and length not in self.advised:
            self.advised.add(length)
            warnings.warn(advice, stacklevel=3)


# ---------------------------------------------------------------- attention routing


class _CPAttentionRouter(TorchFunctionMode):
    """While its attention module runs: SDPA goes to `CPRuntime.attend`, every other torch call passes through."""

    def __init__(self, runtime: CPRuntime, name: str) -> None:
        super().__init__()
        self.runtime = runtime
        self.name = name
        self.calls = 0
        self.rows: int | None = None  # query rows of the last call (for the load report)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            self.calls += 1
            self.rows = (args[0] if args else kwargs["query"]).shape[2]
            return self.runtime.attend(self.name, *args, **kwargs)
        if (
            getattr(func, "__module__", None) == "torch._tensor"
            and args
            and isinstance(args[0], torch.Tensor)
            and getattr(type(args[0]), getattr(func, "__name__", ""), None) is func
        ):
            # A Tensor method written in Python (unflatten, split, ...): call it as a method. Called as a plain
            # function, dynamo inlines it and stops at its `super()` call (a graph break under the mode).
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)
        return func(*args, **kwargs)

    def skipped_attention(self, module: nn.Module) -> bool:
        """Whether a forward that made no SDPA call skipped attention on purpose: its processor is one the class
        ships (LTX-2.3's perturbed attention passes the values through for spatio-temporal guidance) and dispatches
        to an SDPA backend, so it would have called SDPA had it attended."""
        cls = type(module)
        own = {getattr(cls, "_default_processor_cls", None), *(getattr(cls, "_available_processors", None) or ())}
        processor = getattr(module, "processor", None)
        if processor is None or type(processor) not in own - {None}:
            return False
        backend = getattr(processor, "_attention_backend", None)
        backend = getattr(backend, "value", backend)
        return str(backend if backend is not None else _active_diffusers_backend()) in _SDPA_BACKENDS

    def refuse_other_backends(self, module: nn.Module) -> None:
        """What a pipeline may have set on the module's processor that would bypass SDPA, refused in one line."""
        processor = getattr(module, "processor", None)
        if getattr(processor, "_parallel_config", None) is not None:
            raise UsageError(
                f"context parallel: {self.name} has diffusers' own context parallelism enabled (enable_parallelism); "
                "a model loaded by preshard is already context parallel: drop the enable_parallelism call"
            )
        backend = getattr(processor, "_attention_backend", None)
        backend = getattr(backend, "value", backend)
        if backend is not None and str(backend) not in _SDPA_BACKENDS:
            raise UsageError(
                f"context parallel: {self.name} uses the attention backend {str(backend)!r}, which preshard cannot "
                "run across ranks; use model.set_attention_backend('native') (or model.reset_attention_backend())"
            )


def _active_diffusers_backend() -> str | None:
    """The attention backend diffusers dispatches to when a processor names none (`attention_backend(...)`,
    `DIFFUSERS_ATTN_BACKEND`), if this diffusers has that registry."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:  # pragma: no cover - diffusers is what runs these modules
        return None
    backend = getattr(_AttentionBackendRegistry, "_active_backend", None)
    return None if backend is None else str(getattr(backend, "value", backend))


class _RoutedAttention(nn.Module):
    """Mixin placed before an attention module's own class: its forward runs inside the module's router."""

    _preshard_cp_router: _CPAttentionRouter

    def forward(self, *args, **kwargs):
        router = self._preshard_cp_router
        router.refuse_other_backends(self)
        router.calls = 0
        with router:
            out = super().forward(*args, **kwargs)
        if router.calls == 0 and not router.skipped_attention(self):
            raise UsageError(
                f"context parallel: {router.name} did not call torch.nn.functional.scaled_dot_product_attention "
                f"(its processor is {type(getattr(self, 'processor', None)).__name__}), so its sequence could not be "
                "attended across ranks; use diffusers' native attention backend and the module's default processor"
            )
        return out


_ROUTED_CLASSES: dict[type, type] = {}  # one routed subclass per attention class (a class cache, not state)


def route_attention(module: nn.Module, runtime: CPRuntime, name: str, changes: ModelChanges | None = None) -> None:
    """Run `module`'s SDPA calls across the CP group: switch it to a routed subclass carrying its router (recorded
    in the model's `changes`)."""
    changes = changes or ModelChanges(module)
    cls = type(module)
    if not issubclass(cls, _RoutedAttention):
        routed = _ROUTED_CLASSES.get(cls)
        if routed is None:
            routed = type(cls.__name__, (_RoutedAttention, cls), {"__module__": cls.__module__})
            _ROUTED_CLASSES[cls] = routed
        changes.swap_class(module, name, routed, f"routed {cls.__name__} (its SDPA calls across the cp group)")
    changes.set_attribute(module, name, "_preshard_cp_router", _CPAttentionRouter(runtime, name))


def unroute_attention(module: nn.Module) -> None:
    """Back to the module's own class (for negative controls: attention then stays local)."""
    cls = type(module)
    if issubclass(cls, _RoutedAttention):
        module.__class__ = next(c for c in cls.__mro__[1:] if not issubclass(c, _RoutedAttention))
        del module._preshard_cp_router


def is_routed(module: nn.Module) -> bool:
    return isinstance(module, _RoutedAttention)


class AttentionRows(Mapping):
    """`report.attention_rows`: the query rows each routed attention module saw in its last call.

    Read from the routers rather than written into a dict by the forward, so a compiled graph neither guards
    on nor replays the report.
    """

    def __init__(self, routers: dict[str, _CPAttentionRouter]) -> None:
        self._routers = routers

    def __getitem__(self, name: str) -> int:
        rows = self._routers[name].rows
        if rows is None:
            raise KeyError(name)
        return rows

    def __iter__(self) -> Iterator[str]:
        return (name for name, router in self._routers.items() if router.rows is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        for router in self._routers.values():
            router.rows = None


# ---------------------------------------------------------------- hooks


def _argument_positions(module: nn.Module) -> dict[str, int]:
    params = list(inspect.signature(module.forward).parameters)
    return {name: i for i, name in enumerate(params)}


def _split_inputs_hook(runtime: CPRuntime, name: str, specs: dict[str, SeqDim], positions: dict[str, int]):
    def hook(module, args, kwargs):
        args = list(args)
        for arg, spec in specs.items():
            where = f"{name or type(module).__name__}({arg})"
            if kwargs.get(arg) is not None:
                kwargs[arg] = runtime.split(kwargs[arg], spec, where, arg)
            elif arg in positions and positions[arg] < len(args) and args[positions[arg]] is not None:
                i = positions[arg]
                args[i] = runtime.split(args[i], spec, where, arg)
            # else: not passed (or None), so there is nothing of it to split
        return tuple(args), kwargs

    return hook


def _split_outputs_hook(runtime: CPRuntime, name: str, specs: dict[int, SeqDim]):
    def hook(module, args, output):
        single = not isinstance(output, (tuple, list))
        items = [output] if single else list(output)
        for i, spec in specs.items():
            items[i] = runtime.split(items[i], spec, f"{name} output {i}")
        return items[0] if single else type(output)(items)

    return hook


def _gather_hook(runtime: CPRuntime, name: str, spec: SeqDim):
    def hook(module, args, output):
        return runtime.gather(output, spec.dim, name)

    return hook


def _begin_forward_hook(runtime: CPRuntime):
    def hook(module, args):
        runtime.begin_forward()

    return hook


# ---------------------------------------------------------------- attach


def attach_context_parallel(
    model: nn.Module, plan: Plan, groups: MeshGroups, rank_device: RankDevice, report: LoadReport
) -> CPRuntime:
    """Register the split/gather hooks and route the planned attention modules; describe them in the report."""
    spec = groups.spec
    coords = groups.coords
    cp_groups = CPGroups(
        ring_group=groups.ring, ring_size=spec.ring, ring_rank=coords["ring"],
        ulysses_group=groups.ulysses, ulysses_size=spec.ulysses, ulysses_rank=coords["ulysses"],
    )  # fmt: skip
    cp_members = groups.ranks.get("cp", [groups.rank])
    cp_plan = resolve_cp_plan(model, plan)
    config = getattr(model, "config", None)
    plan.check_cp_config(dict(config.items()) if hasattr(config, "items") else None)
    runtime = CPRuntime(
        cp_groups,
        groups.cp,
        [spec.cp_rank(r) for r in sorted(cp_members)],
        neuron=rank_device.kind == "neuron",
        join_order=resolve_join_order(model, plan, cp_plan),
    )
    attention = plan.context_parallel_attention()
    if not attention:
        raise PlanError("the plan marks no attention module for context parallelism; add one with context_parallel")
    modules = dict(model.named_modules())
    changes = ModelChanges.of(model)
    changes.set_attribute(model, "", "_preshard_cp", runtime)
    changes.hook("", "cp: begin forward", model.register_forward_pre_hook(_begin_forward_hook(runtime)))
    ranks = f"cp group {sorted(cp_members)}"
    for pattern, entry in cp_plan.items():
        hits = [n for n in modules if matches(pattern, n)]
        if not hits:
            raise PlanError(
                f"cp plan entry {pattern!r} matches no module of {type(model).__name__}: load with ring=1 and "
                "ulysses=1, or convert with a plan file whose cp_plan names this model's modules (--plan FILE)"
            )
        for name in hits:
            module = modules[name]
            if entry.split_inputs:
                hook = _split_inputs_hook(runtime, name, entry.split_inputs, _argument_positions(module))
                changes.hook(name, "cp: split inputs", module.register_forward_pre_hook(hook, with_kwargs=True))
                for arg, s in entry.split_inputs.items():
                    report.add_hook(name, f"cp: split input {arg} dim {s.dim} over {ranks}")
            if entry.split_outputs:
                handle = module.register_forward_hook(_split_outputs_hook(runtime, name, entry.split_outputs))
                changes.hook(name, "cp: split outputs", handle)
                for key, s in entry.split_outputs.items():
                    report.add_hook(name, f"cp: split output {key} dim {s.dim} over {ranks}")
            if entry.gather_output is not None:
                handle = module.register_forward_hook(_gather_hook(runtime, name, entry.gather_output))
                changes.hook(name, "cp: all-gather output", handle)
                report.add_hook(name, f"cp: all-gather output dim {entry.gather_output.dim} over {ranks}")

    axes = [axis for axis in ("ulysses", "ring") if spec.size(axis) > 1]
    description = "cp: attention " + " + ".join(f"{axis} over group {groups.ranks[axis]}" for axis in axes)
    routers = {}
    for rule in attention:
        for name, module in modules.items():
            if name and matches(rule.match, name):
                route_attention(module, runtime, name, changes)
                routers[name] = module._preshard_cp_router
                report.add_hook(name, description)
    report.attention_rows = AttentionRows(routers)
    return runtime
