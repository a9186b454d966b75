"""The bytes `torch.save(tensor, f)` writes around a tensor's data, computed from (dtype, shape) alone.

Why: a DCP data file is a run of `torch.save` records, one per chunk. Calling `torch.save` for every chunk
costs CPU (pickling, a CRC32 over the data, then a zip re-parse to find where the raw bytes landed), and it
makes the framing something preshard has to trust. But everything in a record except the tensor's raw
bytes depends only on the dtype and shape. So a writer can emit `header + raw bytes + trailer` straight
from its buffers, knowing `data_offset` in advance, and a reader can locate or re-check the framing of a
record from (dtype, shape) without parsing the zip. Nothing here reads, copies or hashes tensor data.

What is reproduced: torch 2.13's `torch.save(tensor, file_object)` with
`torch.serialization.set_crc32_options(False)` and torch's default storage alignment of 64, for a contiguous
CPU tensor that owns exactly its storage, byte for byte, except the content of `.data/serialization_id`
(see below). Facts mirrored, read from torch's `serialization.py`, `caffe2/serialize/inline_container.cc`
and its bundled miniz writer, and checked against torch's own output by the tests:

- Zip entries, in this order, all stored (method 0), under the folder `archive/` (the name torch uses when
  writing to a file object, as DCP's FileSystemWriter does): `data.pkl`, `.format_version` (`1`),
  `.storage_alignment` (`64`), `byteorder` (`little`: preshard's data is little-endian on every host),
  `data/0` (the raw bytes), `version` (`3` and a newline), `.data/serialization_id` (40 ASCII digits).
- `data.pkl` is a protocol-2 pickle of `torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False,
  OrderedDict())` whose storage is the persistent id `('storage', torch.<Name>Storage, '0', 'cpu', numel)`;
  for dtypes without a legacy storage class (float8, uint16/32/64) it is `_rebuild_tensor_v3` with
  `torch.storage.UntypedStorage`, the storage size in bytes, and the dtype appended to the arguments.
  Strides are contiguous with zero-size dims counted as 1, as torch computes them.
- Every local header carries an extra field `FB` + 2-byte length + `Z` padding so that the entry's data
  starts at a multiple of 64 from the start of the record (torch's `.storage_alignment`). The alignment is
  relative to the record, not the file: `data_offset % 64 == 0` always.
- Local headers: version needed 0, flags 0x0808 (data descriptor follows, UTF-8 names) or 0x0800 for an
  empty entry (then no data descriptor either), time/date 0, CRC and sizes 0. CRC32 is 0 everywhere, as
  torch writes with crc32 off (torch.load does not check it; preshard hashes each chunk with xxh3_64).
- Zip64 (miniz always writes in zip64 mode): an entry whose size is >= 0xFFFFFFFF, or whose local header
  starts at >= 0xFFFFFFFF from the record start, gets a zip64 extra field (id 1) before `FB`: in the local
  header the size and a compressed size of 0, then the header offset, each only where it is >= 0xFFFFFFFF;
  in the central directory the size twice, then the offset, under the same rule, with 0xFFFFFFFF in the
  32-bit fields. Such entries get a 24-byte data descriptor (64-bit sizes), others a 16-byte one. So a
  chunk of >= 4 GiB - 1 bytes changes the header, and one of a little less than that can already change
  the trailer (the entries after the data then start past 4 GiB).
- End: central directory, then always a zip64 end-of-central-directory record (made by 0x031E, needs
  0x002D) and its locator, then the classic end record with 32-bit fields capped at 0xFFFFFFFF.
- `.data/serialization_id`: torch writes 20 digits of a combined C++ `std::hash` of the record names, then
  20 digits of a combined hash of the data descriptors' CRCs. With crc32 off the second half depends only
  on how many descriptors were written (one fewer for an empty tensor), and is computed here. The first
  half is the value libstdc++ builds of torch (Linux) write; other standard libraries hash differently, so
  tests compare everything but these 40 bytes, and byte identity of the id itself only on such builds.

Bump `RECORD_FRAMING_VERSION` whenever the bytes produced here change.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from dataclasses import dataclass
from typing import Any

from preshard.format.dtypes import DType, as_dtype

RECORD_FRAMING_VERSION = 1  # bump if the bytes produced ever change

STORAGE_ALIGNMENT = 64  # torch's default `torch.utils.serialization.config.save.storage_alignment`

_ARCHIVE = "archive/"
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_END = struct.Struct("<IHHHHIIH")  # 22 bytes

_FLAG_DESCRIPTOR = 0x0008
_FLAG_UTF8 = 0x0800

# dtypes torch pickles with a legacy typed storage class (torch.storage._dtype_to_storage_type_map), by name
_LEGACY_STORAGE: dict[str, str] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
# dtypes torch pickles as an UntypedStorage plus the dtype (torch.storage._new_dtypes)
_UNTYPED_STORAGE: frozenset[str] = frozenset({"float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"})

# First half of torch's serialization id: libstdc++'s combined std::hash of the seven record names.
_NAME_HASH_DIGITS = "15728199511854643026"


@dataclass(frozen=True)
class RecordFraming:
    """The bytes of one torch.save record around its tensor's raw bytes."""

    header: bytes  # everything before the tensor's raw bytes
    trailer: bytes  # everything after them, to the end of the record
    data_length: int  # numel * itemsize

    @property
    def data_offset(self) -> int:
        """Where the raw bytes start inside the record (a multiple of STORAGE_ALIGNMENT)."""
        return len(self.header)

    @property
    def length(self) -> int:
        """The whole record's length."""
        return len(self.header) + self.data_length + len(self.trailer)


@functools.lru_cache(maxsize=8192)
def record_framing(dtype: DType | Any, shape: tuple[int, ...]) -> RecordFraming:
    """Header and trailer of `torch.save` of a contiguous tensor of `dtype` (a `DType` or torch's) and `shape`.

    Cached (functools.lru_cache): many chunks share dtype and shape. `shape` must be hashable (a tuple or
    torch.Size). Raises ValueError for a dtype preshard does not handle or a negative dimension.
    """
    shape = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    dtype = as_dtype(dtype)
    if dtype.name not in _LEGACY_STORAGE and dtype.name not in _UNTYPED_STORAGE:
        raise ValueError(f"no torch.save framing for dtype {dtype}")
    numel = math.prod(shape)
    data_length = numel * dtype.itemsize
    if data_length >= 1 << 64:
        raise ValueError(f"a tensor of shape {shape} and dtype {dtype} is too large for a zip64 entry")

    pickle = _tensor_pickle(dtype, shape, numel, data_length)
    zip_ = _ZipBuilder()
    for name, content in (
        ("data.pkl", pickle),
        (".format_version", b"1"),
        (".storage_alignment", str(STORAGE_ALIGNMENT).encode()),
        ("byteorder", b"little"),
    ):
        zip_.add(name, content)
    zip_.begin("data/0", data_length)
    header = zip_.take()
    zip_.skip(data_length)  # the raw bytes, written by the caller
    zip_.end(data_length)
    zip_.add("version", b"3\n")
    zip_.add(".data/serialization_id", _serialization_id(zip_.descriptors))
    zip_.finish()
    return RecordFraming(header=header, trailer=zip_.take(), data_length=data_length)


def framing_matches(header_bytes: bytes, dtype: DType, shape: tuple[int, ...]) -> bool:
    """Whether `header_bytes` (a record's first bytes, up to its data) are the header expected for (dtype, shape)."""
    expected = record_framing(dtype, shape).header
    return len(header_bytes) == len(expected) and header_bytes == expected


# --- data.pkl -------------------------------------------------------------------------------------------


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides as torch computes them: zero-size dims count as 1."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class _Pickle:
    """Protocol-2 opcodes, memoised the way pickle.Pickler memoises them for this object graph."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.memo = 0

    def put(self) -> None:  # BINPUT
        self.out += b"q" + bytes((self.memo,))
        self.memo += 1

    def raw(self, opcodes: bytes) -> None:
        self.out += opcodes

    def global_(self, module: str, name: str) -> None:  # GLOBAL
        self.out += b"c" + f"{module}\n{name}\n".encode("ascii")
        self.put()

    def string(self, text: str) -> None:  # BINUNICODE
        data = text.encode()
        self.out += b"X" + struct.pack("<I", len(data)) + data
        self.put()

    def int_(self, value: int) -> None:
        if 0 <= value <= 0xFF:
            self.out += b"K" + bytes((value,))  # BININT1
        elif 0 <= value <= 0xFFFF:
            self.out += b"M" + struct.pack("<H", value)  # BININT2
        elif -(1 << 31) <= value < 1 << 31:
            self.out += b"J" + struct.pack("<i", value)  # BININT
        else:  # LONG1: minimal little-endian two's complement (values here are positive)
            data = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
            self.out += b"\x8a" + bytes((len(data),)) + data

    def int_tuple(self, values: tuple[int, ...]) -> None:
        if not values:
            self.out += b")"  # EMPTY_TUPLE, not memoised
            return
        if len(values) > 3:
            self.out += b"("  # MARK
        for v in values:
            self.int_(v)
        self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(values), b"t")  # TUPLE1/2/3 or TUPLE
        self.put()


def _tensor_pickle(dtype: DType, shape: tuple[int, ...], numel: int, data_length: int) -> bytes:
    untyped = dtype.name in _UNTYPED_STORAGE
    p = _Pickle()
    p.global_("torch._utils", "_rebuild_tensor_v3" if untyped else "_rebuild_tensor_v2")
    p.raw(b"(")  # MARK: the rebuild function's arguments
    p.raw(b"(")  # MARK: the storage's persistent id
    p.string("storage")
    if untyped:
        p.global_("torch.storage", "UntypedStorage")
    else:
        p.global_("torch", _LEGACY_STORAGE[dtype.name])
    p.string("0")  # storage key, also the zip entry data/0
    p.string("cpu")
    p.int_(data_length if untyped else numel)
    p.raw(b"t")  # TUPLE
    p.put()
    p.raw(b"Q")  # BINPERSID
    p.int_(0)  # storage offset
    p.int_tuple(shape)
    p.int_tuple(_contiguous_strides(shape))
    p.raw(b"\x89")  # NEWFALSE: requires_grad
    p.global_("collections", "OrderedDict")
    p.raw(b")R")  # EMPTY_TUPLE, REDUCE: the (empty) backward hooks
    p.put()
    if untyped:
        p.global_("torch", dtype.name)
    p.raw(b"t")  # TUPLE
    p.put()
    p.raw(b"R")  # REDUCE
    p.put()
    p.raw(b".")  # STOP
    return bytes(p.out)


# --- zip ------------------------------------------------------------------------------------------------


def _serialization_id(descriptors: int) -> bytes:
    """torch's id with crc32 off: name-hash digits, then hash_combine of one zero CRC per data descriptor."""
    mask = (1 << 64) - 1
    combined = 0
    for _ in range(descriptors):
        combined ^= (0x9E3779B9 + (combined << 6) + (combined >> 2)) & mask
    return f"{_NAME_HASH_DIGITS}{combined:020d}".encode("ascii")


def _zip64_extra(fields: list[int]) -> bytes:
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields)


class _ZipBuilder:
    """Writes zip entries as torch's miniz-based writer does; `take()` hands over the bytes so far."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.cursor = 0  # offset from the start of the record
        self.central = bytearray()
        self.entries = 0
        self.descriptors = 0
        self._open: tuple[int, int] | None = None  # (local header offset, size) of the entry being written

    def take(self) -> bytes:
        data = bytes(self.out)
        self.cursor += len(data)
        self.out.clear()
        return data

    def skip(self, size: int) -> None:
        """Account for `size` bytes the caller writes between `take()`s."""
        self.cursor += size

    def add(self, name: str, content: bytes) -> None:
        self.begin(name, len(content))
        self.out += content
        self.end(len(content))

    def begin(self, name: str, size: int) -> None:
        """Local header of an entry whose `size` bytes follow."""
        offset = self.cursor + len(self.out)
        full_name = (_ARCHIVE + name).encode()
        local_fields = ([size, 0] if size >= _U32_MAX else []) + ([offset] if offset >= _U32_MAX else [])
        zip64_extra = _zip64_extra(local_fields)
        data_start = offset + _LOCAL_HEADER.size + len(full_name) + len(zip64_extra) + 4
        padding = -data_start % STORAGE_ALIGNMENT
        extra = zip64_extra + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if size else 0)
        self.out += _LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full_name), len(extra))
        self.out += full_name + extra

        central_fields = ([size, size] if size >= _U32_MAX else []) + ([offset] if offset >= _U32_MAX else [])
        central_extra = _zip64_extra(central_fields)
        small_size = min(size, _U32_MAX)
        self.central += _CENTRAL_HEADER.pack(
            0x02014B50, 0, 0, flags, 0, 0, 0, 0, small_size, small_size,
            len(full_name), len(central_extra), 0, 0, 0, 0, min(offset, _U32_MAX),
        )  # fmt: skip
        self.central += full_name + central_extra
        self.entries += 1
        self._open = (offset, size)

    def end(self, size: int) -> None:
        """Data descriptor after an entry's bytes (none for an empty entry)."""
        assert self._open is not None and self._open[1] == size
        offset, _ = self._open
        self._open = None
        if not size:
            return
        if size >= _U32_MAX or offset >= _U32_MAX:  # the entry has a zip64 extra field
            self.out += _DESCRIPTOR64.pack(0x08074B50, 0, size, size)
        else:
            self.out += _DESCRIPTOR32.pack(0x08074B50, 0, size, size)
        self.descriptors += 1

    def finish(self) -> None:
        """Central directory, zip64 end record and locator, end record."""
        central_offset = self.cursor + len(self.out)
        self.out += self.central
        zip64_end_offset = central_offset + len(self.central)
        n = self.entries
        self.out += _ZIP64_END.pack(0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, len(self.central), central_offset)
        self.out += _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_offset, 1)
        self.out += _END.pack(
            0x06054B50, 0, 0, min(n, _U16_MAX), min(n, _U16_MAX),
            min(len(self.central), _U32_MAX), min(central_offset, _U32_MAX), 0,
        )  # fmt: skip
