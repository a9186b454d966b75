"""Every forward of a sharded model checks that all ranks were given the same inputs.

Every rank of a TP x CP mesh computes its slice of one forward pass over the *same* full inputs. A rank
given other inputs (the usual cause: each rank seeds its own generator) makes every rank return plausible,
wrong output, with no error. So a forward pre-hook, the first of the model's hooks (before CP splits
anything), fingerprints every tensor input (args and kwargs, also inside lists, tuples and dicts): its
name, dtype, shape and two sums over its raw bytes read as int64 words, modulo 2**64. Integer sums are
exact in any reduction order, so equal inputs give equal fingerprints on every rank, and the
position-weighted sum also changes when values are reordered. One all-gather of four int64 per rank compares them; only
when they differ does a second exchange find the argument, and every rank raises the same one-line
`InconsistentInputsError`.

The comparison and the raise run inside custom ops (`preshard::check_inputs`, `preshard::broadcast_inputs`),
opaque to torch.compile, so that the hook traces with `torch.compile(model, fullgraph=True)` without a graph
break. Each op also adds one to the check's counter (`model.preshard_input_check.checked`, a tensor on the
rank's device): a real mutation, which every compiler keeps. (Registering the ops as having side effects is not
enough: torch 2.9's inductor drops an op with no output.) Mode
"broadcast" replaces every rank's tensor inputs by rank 0's instead (after checking that names, dtypes and
shapes agree), for callers that cannot make their ranks agree. The hook's state (the mode) lives on the
model, as `model.preshard_input_check`. Inputs the plan's `tp_split_inputs` names are neither compared nor
broadcast: a rank may be given its own part of them (rotary tables the sharded model's own rotary module made).
"""

import inspect
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from preshard.errors import InconsistentInputsError, UsageError
from preshard.runtime import collectives
from preshard.runtime.changes import ModelChanges

CHECK_ATTRIBUTE = "preshard_input_check"

_PRIME = 2_147_483_647  # 2**31 - 1: the digest's arithmetic stays far below int64 overflow
_PERIOD = 1021  # position weights cycle with this period (prime, so strides rarely line up)
_MAX_DIMS = 8
# Row of one tensor input: name, dtype, ndim, numel, 8 dims, sum of words, position-weighted sum of words.
_ROW = 4 + _MAX_DIMS + 2
_VALUES = slice(_ROW - 2, _ROW)
_ABSENT = -3  # padding rows of a rank with fewer inputs
_DTYPES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_FIX = (
    "every rank of a sharded model must pass the same full inputs: seed every rank's generator identically "
    "(torch.Generator().manual_seed(seed) with the same seed on every rank) or broadcast the inputs from rank 0 "
    "(torch.distributed.broadcast), or load with load_sharded(..., check_inputs='broadcast') to use rank 0's"
)


@dataclass
class InputCheck:
    """The input check of one sharded model (its forward pre-hook, first of all its hooks)."""

    mode: str  # "check", "broadcast" or "off" (switch at any time; a compiled model recompiles)
    device: str  # where the fingerprints are exchanged: the rank's device
    positional: tuple[str, ...]  # forward's parameter names, to name positional arguments
    model: str  # the model's class name, for messages
    checked: torch.Tensor  # int64 [1] on the device: forwards checked (or broadcast) so far; the ops add one
    skipped: tuple[str, ...] = ()  # inputs left out (each rank may hold its own part: `tp_split_inputs`)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.mode == "off":
            return None
        leaves: list[tuple[str, torch.Tensor]] = []
        arg_names = [self.positional[i] if i < len(self.positional) else f"args[{i}]" for i in range(len(args))]
        for name, value in zip(arg_names, args):
            if name not in self.skipped:
                _collect(value, name, leaves)
        # In the order of forward's signature (then any others by name): the same on every rank.
        keys = [name for name in self.positional if name in kwargs]
        keys += sorted([key for key in kwargs if key not in self.positional])
        for key in keys:
            if key not in self.skipped:
                _collect(kwargs[key], key, leaves)
        names = "\n".join([name for name, _ in leaves])
        tensors = [t for _, t in leaves]
        context = f"{self.model}\n{self.device}"
        if self.mode != "broadcast":
            torch.ops.preshard.check_inputs(self.checked, tensors, names, context)
            return None
        counted, *replaced = torch.ops.preshard.broadcast_inputs(self.checked, tensors, names, context)
        self.checked.copy_(counted)
        position = [0]
        new_args = tuple(
            value if name in self.skipped else _replace(value, replaced, position)
            for name, value in zip(arg_names, args)
        )
        new_kwargs = {
            key: kwargs[key] if key in self.skipped else _replace(kwargs[key], replaced, position) for key in keys
        }
        return new_args, new_kwargs


def parse_mode(check_inputs: bool | str) -> str:
    """load_sharded's `check_inputs` (True, False or "broadcast") as a mode.

    Raises:
        UsageError: any other value.
    """
    if check_inputs is True:
        return "check"
    if check_inputs is False:
        return "off"
    if check_inputs == "broadcast":
        return "broadcast"
    raise UsageError(f"check_inputs={check_inputs!r}: use True (compare on every forward), False, or 'broadcast'")


def attach_input_check(model: nn.Module, mode: str, device: torch.device, skipped: tuple[str, ...] = ()) -> InputCheck:
    """Register the check as the model's first forward pre-hook and keep its state on the model.

    Args:
        model: the loaded, sharded model.
        mode: "check", "broadcast" or "off" (see `parse_mode`).
        device: the rank's device, where the fingerprints are exchanged.
        skipped: forward inputs neither compared nor broadcast (a rank may hold its own part of them).

    Returns:
        The check, also at `model.preshard_input_check`.
    """
    positional: list[str] = []
    for name, param in inspect.signature(model.forward).parameters.items():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        positional.append(name)
    check = InputCheck(
        mode=mode,
        device=str(device),
        positional=tuple(positional),
        model=type(model).__name__,
        checked=torch.zeros(1, dtype=torch.int64, device=device),
        skipped=skipped,
    )
    changes = ModelChanges.of(model)
    changes.set_attribute(model, "", CHECK_ATTRIBUTE, check)
    handle = model.register_forward_pre_hook(_input_check_hook, with_kwargs=True, prepend=True)
    changes.hook("", f"input check: {mode}", handle)
    return check


def _input_check_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    # A plain function that reads the check from the module, not the check object as the hook: torch 2.9's
    # dynamo builds a wrong guard for the state of a callable-object hook of a module called inside a compiled
    # function (the pipeline step compiled whole), and fails to compile it.
    return getattr(module, CHECK_ATTRIBUTE)(module, args, kwargs)


def _collect(value: Any, name: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _collect(item, f"{name}[{i}]", out)
    elif isinstance(value, dict):
        for key in value:
            _collect(value[key], f"{name}[{key!r}]", out)


def _replace(value: Any, replaced: list[torch.Tensor], position: list[int]) -> Any:
    """`value` with its tensors taken from `replaced` in `_collect`'s order."""
    if isinstance(value, torch.Tensor):
        position[0] += 1
        return replaced[position[0] - 1]
    if isinstance(value, list):
        return [_replace(item, replaced, position) for item in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_replace(item, replaced, position) for item in value)
    if isinstance(value, tuple):  # a named tuple
        return type(value)(*[_replace(item, replaced, position) for item in value])
    if isinstance(value, dict):
        return type(value)({key: _replace(value[key], replaced, position) for key in value})
    return value


# ---------------------------------------------------------------- fingerprints (eager, inside the ops)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _word_sums(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[sum of words, sum of word * (position % 1021 + 1)] of `t`'s raw bytes read as int64 words, modulo 2**64.

    Integer addition modulo 2**64 is exact and order-free, so every rank computes the same two numbers for the
    same bytes (whatever its reduction order or thread count), and int64 sums run at memory speed. A tail of
    fewer than 8 bytes counts as one more word.
    """
    x = t.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    if x.is_complex():
        x = torch.view_as_real(x)
    raw = _dense(x).view(torch.uint8)
    if raw.storage_offset() % 8:  # a view starting mid-word cannot be read as int64 words in place
        raw = raw.clone()
    whole = raw.numel() - raw.numel() % 8
    words = raw[:whole].view(torch.int64)
    tail = raw[whole:].to(torch.int64)
    if tail.numel():  # the last partial word, little-endian, as one more word
        shifts = torch.arange(tail.numel(), device=tail.device, dtype=torch.int64) * 8
        words = torch.cat([words, (tail << shifts).sum().reshape(1)])
    rows = words.numel() - words.numel() % _PERIOD
    weights = torch.arange(1, _PERIOD + 1, device=words.device, dtype=torch.int64)
    columns = words[:rows].view(-1, _PERIOD).sum(0)
    rest = words[rows:]
    plain = columns.sum() + rest.sum()
    weighted = (columns * weights).sum() + (rest * weights[: rest.numel()]).sum()
    return torch.stack([plain, weighted]).to(device)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a 1-D tensor of stride 1, so its bytes can be viewed in another dtype. contiguous() is not
    enough: a tensor whose dims are all of size 1 counts as contiguous with any stride (`t.expand(1)`, the
    timestep pipelines pass, has stride 0)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or flat.stride(0) == 1:
        return flat
    return torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)


def _rows(tensors: list[torch.Tensor], names: list[str], device: torch.device, values: bool) -> torch.Tensor:
    """One int64 row per tensor input (see _ROW), on `device`."""
    meta = []
    for name, t in zip(names, tensors, strict=True):
        shape = list(t.shape)
        dims = shape if len(shape) <= _MAX_DIMS else [_crc(str(shape))]
        meta.append([_crc(name), _crc(str(t.dtype)), t.dim(), t.numel(), *dims, *[-1] * (_MAX_DIMS - len(dims))])
    rows = torch.tensor(meta, dtype=torch.int64).reshape(len(meta), _ROW - 2).to(device)
    if values and tensors:
        sums = torch.stack([_word_sums(t, device) for t in tensors])
    else:
        sums = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    return torch.cat([rows, sums], dim=1)


def _digest(rows: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weights = torch.randint(1, _PRIME, tuple(rows.shape), generator=g, dtype=torch.int64).to(rows.device)
    return ((torch.remainder(rows, _PRIME) * weights) % _PRIME).sum() % _PRIME


def compare_across_ranks(
    tensors: list[torch.Tensor], names: list[str], device: torch.device, model: str, values: bool = True
) -> None:
    """Raise on every rank, in one line, if any rank's tensor inputs differ (one small all-gather otherwise).

    Raises:
        InconsistentInputsError: names, dtypes, shapes or (with `values`) values differ between ranks.
    """
    rows = _rows(tensors, names, device, values)
    joined = "\n".join(names).encode()
    summary = torch.stack(
        [
            torch.tensor(len(names), dtype=torch.int64, device=device),
            _digest(rows, 1),
            _digest(rows, 2),
            torch.tensor(len(joined), dtype=torch.int64, device=device),
        ]
    )
    everyone = collectives.all_gather_equal(summary, None).cpu()
    if bool((everyone == everyone[0]).all()):
        return
    raise InconsistentInputsError(
        f"{model}: the ranks were given different inputs: {_what_differs(rows, joined, everyone)}; {_FIX}"
    )


def _what_differs(rows: torch.Tensor, joined: bytes, everyone: torch.Tensor) -> str:
    """The first argument that differs, as every rank sees it (a second exchange: rows and names)."""
    most = int(everyone[:, 0].max())
    padded = torch.full((most, _ROW), _ABSENT, dtype=torch.int64, device=rows.device)
    padded[: rows.shape[0]] = rows
    text = torch.zeros(int(everyone[:, 3].max()), dtype=torch.uint8)
    text[: len(joined)] = torch.tensor(list(joined), dtype=torch.uint8)
    all_rows = collectives.all_gather_equal(padded, None).cpu().tolist()
    all_text = collectives.all_gather_equal(text.to(rows.device), None).cpu()
    per_rank: list[dict[str, list[int]]] = []
    order: list[str] = []
    for r, (count, _, _, length) in enumerate(everyone.tolist()):
        names = _split(bytes(all_text[r, :length].tolist()).decode())
        per_rank.append(dict(zip(names, all_rows[r][:count], strict=True)))
        order += [n for n in names if n not in order]
    found = [d for d in (_difference(name, [ranks.get(name) for ranks in per_rank]) for name in order) if d]
    if not found:
        return f"the tensor inputs (by rank: {everyone[:, 0].tolist()} of them) come in different orders"
    (first, _), others = found[0], [name for _, name in found[1:]]
    also = f" (also different: {', '.join(repr(n) for n in others[:5])}{' ...' if len(others) > 5 else ''})"
    return first + (also if others else "")


def _difference(name: str, got: list[list[int] | None]) -> tuple[str, str] | None:
    """How input `name` differs between ranks (rows by rank, None where absent), or None if it does not."""
    given = [r for r, row in enumerate(got) if row is not None]
    if len(given) < len(got):
        missing = [r for r, row in enumerate(got) if row is None]
        return f"input {name!r} is given on ranks {given} but not on ranks {missing}", name
    for what, key in (("dtype", _dtype_name), ("shape", _shape_text)):
        keys = [key(row) for row in got]
        if len(set(keys)) > 1:
            shown = "; ".join(f"{k} on ranks {[r for r, x in enumerate(keys) if x == k]}" for k in dict.fromkeys(keys))
            return f"input {name!r} has {what} {shown}", name
    values = [tuple(row[_VALUES]) for row in got]
    if len(set(values)) > 1:
        others = [r for r, v in enumerate(values) if v != values[0]]
        same = [r for r, v in enumerate(values) if v == values[0]]
        return (
            f"input {name!r} ({_dtype_name(got[0])} {_shape_text(got[0])}) holds other values on ranks {others} "
            f"than on ranks {same}",
            name,
        )
    return None


def _dtype_name(row: list[int]) -> str:
    dtype = _DTYPES.get(row[1])
    return str(dtype).removeprefix("torch.") if dtype is not None else f"dtype #{row[1]}"


def _shape_text(row: list[int]) -> str:
    ndim = row[2]
    return str(row[4 : 4 + ndim]) if ndim <= _MAX_DIMS else f"({ndim} dims, #{row[4]})"


def broadcast_from_rank0(
    tensors: list[torch.Tensor], names: list[str], device: torch.device, model: str
) -> list[torch.Tensor]:
    """Rank 0's tensors on every rank, after checking that names, dtypes and shapes agree.

    An all-reduce of the raw bytes to which only rank 0 contributes non-zero values: exact for any dtype
    (integer sums of zeros), and a collective every backend runs.

    Raises:
        InconsistentInputsError: the ranks' inputs differ in names, dtypes or shapes, so no broadcast fits.
    """
    compare_across_ranks(tensors, names, device, model, values=False)
    flat = [_dense(t) for t in tensors]
    raw = [(f.view(torch.uint8) if f.numel() else f.new_empty(0, dtype=torch.uint8)).to(device) for f in flat]
    sizes = [r.numel() for r in raw]
    if torch.distributed.get_rank() == 0:
        buffer = torch.cat(raw) if raw else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buffer = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    buffer = collectives.all_reduce_sum(buffer, None)
    out, start = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        piece = buffer[start : start + size].clone()
        start += size
        value = piece.view(t.dtype) if size else torch.empty(0, dtype=t.dtype, device=device)
        out.append(value.reshape(t.shape).to(t.device))
    return out


# ---------------------------------------------------------------- the ops torch.compile sees


def _split(names: str) -> list[str]:
    return names.split("\n") if names else []


@torch.library.custom_op(
    "preshard::check_inputs",
    mutates_args=("checked",),
)
def _check_inputs_op(checked: torch.Tensor, tensors: list[torch.Tensor], names: str, context: str) -> None:
    model, device = context.split("\n")
    compare_across_ranks(list(tensors), _split(names), torch.device(device), model)
    checked.add_(1)


@_check_inputs_op.register_fake
def _(checked: torch.Tensor, tensors: list[torch.Tensor], names: str, context: str) -> None:
    return None


@torch.library.custom_op("preshard::broadcast_inputs", mutates_args=())
def _broadcast_inputs_op(
    checked: torch.Tensor, tensors: list[torch.Tensor], names: str, context: str
) -> list[torch.Tensor]:
    # The count comes back as an output (the hook copies it into `checked`): torch cannot functionalize an op
    # that both mutates an input and returns a list of tensors.
    model, device = context.split("\n")
    return [checked + 1, *broadcast_from_rank0(list(tensors), _split(names), torch.device(device), model)]


@_broadcast_inputs_op.register_fake
def _(checked: torch.Tensor, tensors: list[torch.Tensor], names: str, context: str) -> list[torch.Tensor]:
    return [torch.empty_like(checked), *[torch.empty_like(t) for t in tensors]]
