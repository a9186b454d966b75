"""Dtypes as preshard names them, and the one rule for what a `--dtype` cast touches.

A dtype is a `DType` (torch's name, item size, kind, safetensors' code), not torch's dtype: the tools that only
move bytes (convert, unshard, reshard, verify, inspect) then never import torch; the runtime asks `DType.torch`.
safetensors names dtypes with short codes (`BF16`), the manifest with torch's names (`bfloat16`). Both
directions and the cast rule live here so that the converter, the runtime and verify cannot disagree about them.
"""

from __future__ import annotations

from typing import Any

from preshard.errors import UsageError
from preshard.format._torch_names import DTYPES, DType

__all__ = [
    "BFLOAT16", "CAST_TARGETS", "DType", "FLOAT16", "FLOAT32", "FLOAT64", "SAFETENSORS_DTYPES", "UINT8",
    "as_dtype", "cast_dtype", "cast_is_lossless", "dtype_from_name", "dtype_name", "parse_cast",
]  # fmt: skip

# safetensors dtype code -> dtype
SAFETENSORS_DTYPES: dict[str, DType] = {d.code: d for d in DTYPES}
# torch name -> dtype, for exactly the dtypes a checkpoint may hold
DTYPES_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
FLOAT64, FLOAT32, FLOAT16, BFLOAT16, UINT8 = (
    DTYPES_BY_NAME[n] for n in ("float64", "float32", "float16", "bfloat16", "uint8")
)

# What `--dtype` / `dtype=` accept: a precision for 16/32/64-bit floating tensors.
CAST_ALIASES: dict[str, DType] = {
    "bf16": BFLOAT16, "bfloat16": BFLOAT16,
    "fp16": FLOAT16, "float16": FLOAT16, "half": FLOAT16,
    "fp32": FLOAT32, "float32": FLOAT32, "float": FLOAT32,
}  # fmt: skip
CAST_TARGETS = (BFLOAT16, FLOAT16, FLOAT32)


def _torch_dtype_name(value: Any) -> str | None:
    """`bfloat16` for torch's `torch.bfloat16` (told without importing torch), else None."""
    kind = type(value)
    if kind.__name__ == "dtype" and kind.__module__ == "torch":
        return str(value).removeprefix("torch.")
    return None


def as_dtype(value: DType | Any) -> DType:
    """The `DType` of a `DType`, of torch's dtype of the same name, or of a torch name (`"bfloat16"`).

    Raises:
        ValueError: for a dtype no checkpoint preshard writes can hold (complex, float4, ...).
    """
    if isinstance(value, DType):
        return value
    name = value if isinstance(value, str) else _torch_dtype_name(value)
    found = DTYPES_BY_NAME.get(name) if name is not None else None
    if found is None:
        raise ValueError(f"dtype {value} is not one preshard stores ({', '.join(DTYPES_BY_NAME)})")
    return found


def dtype_name(dtype: DType | Any) -> str:
    """torch's own name without the prefix: `bfloat16` (for a `DType` or torch's dtype)."""
    return dtype.name if isinstance(dtype, DType) else str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> DType | None:
    """The checkpoint dtype of that name, or None when it is not one preshard stores."""
    return DTYPES_BY_NAME.get(name) if isinstance(name, str) else None


def parse_cast(value: str | DType | Any | None, what: str = "--dtype") -> DType | None:
    """A user's cast request as a dtype (None: keep every tensor's own dtype).

    Raises:
        UsageError: for anything but bf16/fp16/fp32 (or torch's bfloat16/float16/float32 themselves).
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value.lower() in CAST_ALIASES:
            return CAST_ALIASES[value.lower()]
    else:
        name = value.name if isinstance(value, DType) else _torch_dtype_name(value)
        if name is not None and DTYPES_BY_NAME.get(name) in CAST_TARGETS:
            return DTYPES_BY_NAME[name]
    raise UsageError(
        f"{what} {value!r} is not supported; use one of bf16, fp16, fp32 (or torch.bfloat16/float16/float32)"
    )


def parse_load_dtype(torch_dtype: str | DType | Any | None, dtype: str | DType | Any | None) -> DType | None:
    """What a load casts floating tensors to, from `torch_dtype=` (diffusers' name) and its alias `dtype=`:
    None (neither given, or "auto") keeps each tensor's stored dtype.

    Example:
        >>> parse_load_dtype("bf16", None).name, parse_load_dtype(None, "auto")
        ('bfloat16', None)

    Raises:
        UsageError: a dtype other than bf16/fp16/fp32 (or "auto"); both given, naming different dtypes.
    """
    given = {
        what: None if isinstance(value, str) and value.lower() == "auto" else parse_cast(value, what)
        for what, value in (("torch_dtype=", torch_dtype), ("dtype=", dtype))
        if value is not None
    }
    if len(given) == 2 and given["torch_dtype="] != given["dtype="]:
        names = [c.name if c is not None else "auto" for c in given.values()]
        raise UsageError(
            f"torch_dtype={names[0]} and dtype={names[1]} differ (dtype= is an alias of torch_dtype=); pass one"
        )
    return next(iter(given.values()), None)


def cast_dtype(source: DType, requested: DType | None) -> DType:
    """A cast changes 16/32/64-bit floating tensors only; integers and float8 (quantised data) are kept."""
    if requested is None or not source.is_floating_point or source.itemsize == 1:
        return source
    return requested


def cast_is_lossless(source: DType, target: DType) -> bool:
    """Whether every value of `source` survives a cast to `target` (so the cast can be undone bit for bit)."""
    if source is target:
        return True
    widening = {
        (BFLOAT16, FLOAT32), (FLOAT16, FLOAT32), (BFLOAT16, FLOAT64), (FLOAT16, FLOAT64), (FLOAT32, FLOAT64),
    }  # fmt: skip
    return (source, target) in widening
