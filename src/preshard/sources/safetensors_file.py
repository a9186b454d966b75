"""Strict reading of one safetensors file's header, and where each tensor's bytes lie.

The safetensors library maps the whole file, which makes every page it touches count towards the
process's resident memory and hides where each tensor's bytes lie. The converter needs both bounded
memory and byte offsets, so it validates the header itself, with a one-line error for each way a file
can be broken (and rejects what the safetensors library rejects: a bool in a shape, a non-string
`__metadata__` value), and reads byte ranges with positional reads into buffers it owns.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preshard.errors import SourceError
from preshard.format.dtypes import SAFETENSORS_DTYPES, DType
from preshard.format.folder import open_regular
from preshard.format.layout import fits_int64

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path
    dtype: DType
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
    text: str  # the header JSON exactly as stored (padding included)
    mtime_ns: int = 0  # when the header was read


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header.

    Raises:
        SourceError: one line naming the file and the fault.
    """
    path = Path(path)
    where = path.name
    try:
        fd = open_regular(path, where, SourceError, "pass a .safetensors file")  # a FIFO is refused, not waited on
        stat = os.fstat(fd)
        size = stat.st_size
        with open(fd, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SourceError(
                    f"{where} is truncated or not a safetensors file ({size} bytes, shorter than the 8-byte header)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise SourceError(
                    f"{where} has a bad header length ({length} bytes, file is {size} bytes): "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(length)
    except OSError as exc:
        raise SourceError(f"cannot read {where}: {exc.strerror or exc}") from None
    return parse_header(path, size, raw, stat.st_mtime_ns)


def parse_header(path: Path, size: int, raw: bytes, mtime_ns: int = 0) -> SafetensorsHeader:
    """Validate a header's JSON bytes `raw` for a file of `size` bytes (the file itself is not read)."""
    where = Path(path).name
    try:
        text = raw.decode("utf-8")
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise SourceError(f"{where}: header is not valid JSON; the file is corrupt or not safetensors") from None
    except ValueError:  # an integer of more digits than Python converts (4300 by default)
        raise SourceError(
            f"{where}: header holds a number too long to read; the file is corrupt or not safetensors"
        ) from None
    if not isinstance(header, dict):
        raise SourceError(f"{where}: header is not a JSON object; the file is corrupt or not safetensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SourceError(f"{where}: __metadata__ must map names to strings (the safetensors library rejects others)")
    data_start = 8 + len(raw)
    data_size = size - data_start
    path = Path(path)
    tensors = {name: _entry(path, name, info, data_start, data_size) for name, info in header.items()}
    spans = sorted((t.start, t.end, t.name) for t in tensors.values())
    position = data_start
    for start, end, name in spans:
        if start < position:
            raise SourceError(f"{where}: tensor {name} overlaps the tensor before it; the file is corrupt")
        if start > position:
            raise SourceError(f"{where}: {start - position} bytes before tensor {name} belong to no tensor")
        position = end
    if position != size:
        raise SourceError(f"{where}: {size - position} trailing bytes belong to no tensor; the file is corrupt")
    return SafetensorsHeader(path, size, data_start, tensors, metadata, text, mtime_ns)


def check_shape(shape: Any, dtype: DType, where: str) -> tuple[int, ...]:
    """A header's shape: whole numbers >= 0 whose strides and byte size fit int64 (checked before anything is
    allocated or iterated: a dimension of 2**63, even with no elements, is refused in one line).

    Raises:
        SourceError: naming `where` and the shape.
    """
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise SourceError(f"{where} has an invalid shape {shape!r}")
    if not fits_int64(shape, dtype.itemsize):
        raise SourceError(
            f"{where} has shape {shape}, larger than a 64-bit size can hold; the file is corrupt or not safetensors"
        )
    return tuple(shape)


def _entry(path: Path, name: str, info: Any, data_start: int, data_size: int) -> TensorEntry:
    where = f"{path.name}: tensor {name}"
    if not isinstance(info, dict) or not all(k in info for k in ("dtype", "shape", "data_offsets")):
        raise SourceError(f"{where} needs dtype, shape and data_offsets")
    dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise SourceError(f"{where} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    check_shape(shape, dtype, where)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise SourceError(f"{where} has invalid data_offsets {offsets!r}")
    if not 0 <= offsets[0] <= offsets[1]:
        raise SourceError(f"{where} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_size:
        raise SourceError(
            f"{where} has data_offsets past the end of the file ({offsets[1]} > {data_size} data bytes); "
            "the file is truncated"
        )
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise SourceError(
            f"{where} spans {offsets[1] - offsets[0]} bytes but shape {shape} of {info['dtype']} needs {expected}"
        )
    return TensorEntry(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
