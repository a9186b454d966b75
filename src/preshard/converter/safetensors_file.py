"""Strict reading of one safetensors file: header validation and positional reads of exact byte ranges.

The safetensors library maps the whole file, which makes every page it touches count towards the
process's resident memory and hides where each tensor's bytes lie. The converter needs both bounded
memory and byte offsets, so it validates the header itself (with a one-line error for each way a file
can be broken) and reads ranges with `os.preadv` into buffers it owns.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from preshard.errors import PreshardError

# safetensors dtype code -> torch dtype
DTYPES: dict[str, torch.dtype] = {
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
MAX_HEADER_BYTES = 100 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PreshardError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    size: int
    header_bytes: int  # 8 + JSON length: where the data region starts
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header; raise a one-line PreshardError naming the file and the fault."""
    path = Path(path)
    where = f"{path.name}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise PreshardError(
                    f"{where} is truncated or not a safetensors file ({size} bytes, shorter than the 8-byte header)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise PreshardError(
                    f"{where} has a bad header length ({length} bytes, file is {size} bytes): "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(length)
    except OSError as exc:
        raise PreshardError(f"cannot read {where}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise PreshardError(f"{where}: header is not valid JSON; the file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise PreshardError(f"{where}: header is not a JSON object; the file is corrupt or not safetensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise PreshardError(f"{where}: __metadata__ is not an object of strings")
    data_start = 8 + length
    data_size = size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        tensors[name] = _entry(path, name, info, data_start, data_size)
    spans = sorted((t.start, t.end, t.name) for t in tensors.values())
    position = data_start
    for start, end, name in spans:
        if start < position:
            raise PreshardError(f"{where}: tensor {name} overlaps the tensor before it; the file is corrupt")
        if start > position:
            raise PreshardError(f"{where}: {start - position} bytes before tensor {name} belong to no tensor")
        position = end
    if position != size:
        raise PreshardError(f"{where}: {size - position} trailing bytes belong to no tensor; the file is corrupt")
    return SafetensorsHeader(path, size, data_start, tensors, metadata)


def _entry(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    where = f"{path.name}: tensor {name}"
    if not isinstance(info, dict):
        raise PreshardError(f"{where} has no dtype/shape/data_offsets entry")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise PreshardError(f"{where} has unsupported dtype {info.get('dtype')!r}")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise PreshardError(f"{where} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise PreshardError(f"{where} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_size:
        raise PreshardError(
            f"{where} has data_offsets past the end of the file ({offsets[1]} > {data_size} data bytes); "
            "the file is truncated"
        )
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise PreshardError(
            f"{where} spans {offsets[1] - offsets[0]} bytes but shape {shape} of {info['dtype']} needs {expected}"
        )
    return TensorEntry(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def tensor_bytes(tensor: torch.Tensor):
    """A zero-copy byte view of a contiguous CPU tensor (for hashing and comparing)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def read_bytes_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill the uint8 tensor `out` with the file's bytes at `offset` (positional reads, no mmap)."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise PreshardError(f"unexpected end of file at byte {offset + done}; the file was truncated")
        done += n


def read_rows(fd: int, entry: TensorEntry, row_start: int, rows: int) -> torch.Tensor:
    """Rows `[row_start, row_start + rows)` along dim 0 of `entry`, in a tensor that owns its storage."""
    if not entry.shape:
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        read_bytes_into(fd, entry.start, buf)
        return buf.view(entry.dtype).reshape(())
    buf = torch.empty(rows * entry.row_bytes, dtype=torch.uint8)
    read_bytes_into(fd, entry.start + row_start * entry.row_bytes, buf)
    return buf.view(entry.dtype).reshape((rows, *entry.shape[1:]))
