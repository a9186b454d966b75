"""Stand-ins for the objects of the `torch` module that preshard's data needs: its dtypes and `Size`.

Why: the converter, unshard, reshard, verify and inspect move bytes and never compute with tensors, so they do
not import torch (over 3 s of a conversion's wall time on a small host: its fixed cost). A dtype is then a
`DType`: torch's name, item size and kind, and safetensors' code; the runtime turns it into torch's dtype with
`DType.torch`. Each stand-in pickles as a global of this module named as torch names it (`bfloat16`, `Size`),
so the DCP `.metadata` writer gets torch's pickle by writing `torch` in place of this module's name (see
`preshard.format.dcp_metadata`), and its restricted reader gives these back in place of torch's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TORCH_MODULE = "torch"


@dataclass(frozen=True, eq=False, slots=True)
class DType:
    """A dtype a checkpoint can hold, by torch's name (one object per dtype: compared by identity)."""

    name: str  # torch's: bfloat16
    itemsize: int
    is_floating_point: bool
    code: str  # safetensors': BF16

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __reduce__(self) -> str:
        return self.name  # a global of this module (below), as torch's own dtypes pickle

    @property
    def torch(self) -> Any:
        """torch's dtype of this name (imports torch: for the runtime, which computes with tensors)."""
        import torch

        return getattr(torch, self.name)


class Size(tuple):
    """torch.Size: a tuple that pickles as one."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (Size, (tuple(self),))


# A copy of the module's name, not the module's own string: torch's `Size` and its dtypes name their module
# with two different string objects, so torch's pickle writes `torch` twice (a pickle memoizes by identity).
Size.__module__ = "".join(list(__name__))


DTYPES: tuple[DType, ...] = (
    DType("float64", 8, True, "F64"),
    DType("float32", 4, True, "F32"),
    DType("float16", 2, True, "F16"),
    DType("bfloat16", 2, True, "BF16"),
    DType("float8_e4m3fn", 1, True, "F8_E4M3"),
    DType("float8_e5m2", 1, True, "F8_E5M2"),
    DType("int64", 8, False, "I64"),
    DType("int32", 4, False, "I32"),
    DType("int16", 2, False, "I16"),
    DType("int8", 1, False, "I8"),
    DType("uint8", 1, False, "U8"),
    DType("uint16", 2, False, "U16"),
    DType("uint32", 4, False, "U32"),
    DType("uint64", 8, False, "U64"),
    DType("bool", 1, False, "BOOL"),
)
globals().update({d.name: d for d in DTYPES})  # what each one's pickle names (`bool` among them: set, not written)
