"""Dtype names as they appear on disk, and the one rule for what a `--dtype` cast touches.

safetensors names dtypes with short codes (`BF16`), the manifest with torch's names (`bfloat16`).
Both directions and the cast rule live here so that the converter, the runtime and verify cannot
disagree about them.
"""

from __future__ import annotations

import torch

from preshard.errors import UsageError

# safetensors dtype code -> torch dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
# torch name -> dtype, for exactly the dtypes a checkpoint may hold
DTYPES_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES.values()}

# What `--dtype` / `dtype=` accept: a precision for 16/32/64-bit floating tensors.
CAST_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}  # fmt: skip
CAST_TARGETS = (torch.bfloat16, torch.float16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name without the prefix: `bfloat16`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype | None:
    """The checkpoint dtype of that name, or None when it is not one preshard stores."""
    return DTYPES_BY_NAME.get(name) if isinstance(name, str) else None


def parse_cast(value: str | torch.dtype | None, what: str = "--dtype") -> torch.dtype | None:
    """A user's cast request as a torch dtype (None: keep every tensor's own dtype).

    Raises:
        UsageError: for anything but bf16/fp16/fp32 (or the torch dtypes themselves).
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in CAST_TARGETS:
            return value
    elif isinstance(value, str) and value.lower() in CAST_ALIASES:
        return CAST_ALIASES[value.lower()]
    raise UsageError(
        f"{what} {value!r} is not supported; use one of bf16, fp16, fp32 (or torch.bfloat16/float16/float32)"
    )


def cast_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """A cast changes 16/32/64-bit floating tensors only; integers and float8 (quantised data) are kept."""
    if requested is None or not source.is_floating_point or source.itemsize == 1:
        return source
    return requested


def cast_is_lossless(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of `source` survives a cast to `target` (so the cast can be undone bit for bit)."""
    if source == target:
        return True
    widening = {
        (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
    }  # fmt: skip
    return (source, target) in widening
