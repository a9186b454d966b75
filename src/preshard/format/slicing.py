"""Cutting one source tensor into its chunks, band by band, in bounded memory.

A tensor is read in bands of whole rows (dim 0), in file order, so every source byte is read once, front
to back. `band_plan` says which bands to read for a set of chunks (only the rows those chunks need, or
every row when the whole tensor must be read, e.g. to hash its file) and which chunks each band feeds;
`cut_band` cuts a band into byte views, one per chunk it intersects, without copying: a row-split chunk
(colwise, packed colwise, replicated) takes a run of the band's rows, which is contiguous; a column-split
chunk (rowwise and its variants) takes a strided view of every row, which the writer gathers into its
staging buffer at the speed of a plain copy. Memory is the band (plus a cast copy when the stored dtype
differs), whatever the tensor's size; buffers are reused from band to band.

Pieces reach each data file in that file's record order: a rank's chunks of a tensor are ordered by
their offsets, and so are the records. For a column split with several packed blocks that takes more than
one band, every band would feed every block, so the bands are read once per block (block-major); the
re-read is of rows just read, and the source hash is unaffected (`SourceReader` skips re-reads).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from preshard.format.dtypes import DType
from preshard.format.fileio import direct_io_array
from preshard.format.layout import ChunkRecord, TensorLayout
from preshard.format.quant import quantize_rows

BAND_BYTES = 32 << 20


@dataclass(frozen=True)
class Piece:
    """A run of a chunk's bytes, following the chunk's earlier pieces.

    From `cut_band`: a uint8 numpy view (1-D, or 2-D with contiguous rows, to be read row after row). From
    `tensor_pieces`: the piece's bytes, contiguous (flat uint8).
    """

    chunk: ChunkRecord
    data: np.ndarray
    first: bool
    last: bool


@dataclass(frozen=True)
class Band:
    """Rows `[start, start + count)` of a tensor, and the chunks cut from them, in canonical (= file) order."""

    start: int
    count: int
    chunks: tuple[ChunkRecord, ...]


class BufferPool:
    """Reusable flat byte buffers, so that first-touching fresh memory does not cost more than the copies.

    Thread-safe: the converter takes buffers on its reader and slicing threads and gives them back from its
    writers. `keep` free buffers (the largest) are kept; new ones get at least `minimum` bytes so that they
    fit any later band, in huge pages where the kernel has them (`DirectIOBuffer`: an O_DIRECT read into 4 KiB
    pages reaches the device in requests as small as 512 KiB, at half the speed of reading into huge pages).
    """

    def __init__(self, keep: int = 3, minimum: int = 0) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._minimum = minimum
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.size >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return direct_io_array(max(nbytes, self._minimum, 1))[:nbytes]  # the source reader reads into it directly

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if isinstance(buf.base, np.ndarray) else buf  # a view names the array it was cut from
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: b.size)
            del self._free[: -self._keep]  # keep the few largest


def band_rows(layout: TensorLayout, band_bytes: int = BAND_BYTES) -> int:
    """Rows per band: at least one row, at most about `band_bytes` of source data."""
    if not layout.shape:
        return 1
    row = math.prod(layout.shape[1:]) * max(layout.source_dtype.itemsize, layout.dtype.itemsize)
    return max(1, band_bytes // max(1, row))


def source_row_bytes(layout: TensorLayout) -> int:
    """Bytes of one source row (the whole tensor for a 0-dim one)."""
    return math.prod(layout.shape[1:]) * layout.source_dtype.itemsize


def _extent(layout: TensorLayout, chunk: ChunkRecord) -> tuple[int, int]:
    """The rows a chunk needs: its own rows for a row split or a replica, every row for a column split."""
    if not layout.shape:
        return 0, 1
    if layout.shard_dim == 1:
        return 0, layout.shape[0]
    return chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]


def band_plan(
    layout: TensorLayout, chunks: list[ChunkRecord], *, whole: bool = False, band_bytes: int = BAND_BYTES
) -> list[Band]:
    """The bands to read to produce `chunks` (some or all of a tensor's chunks, canonical order), in order.

    With `whole`, every row of the tensor is read (in file order, for hashing the source file), also rows
    no chunk needs: those bands feed fewer chunks, or none.
    """
    chunks = list(chunks)
    if layout.shape and not math.prod(layout.shape):  # no elements: records of framing alone, whatever the row count
        return [Band(0, 0, tuple(chunks))] if chunks else []
    empty = [c for c in chunks if _extent(layout, c)[0] == _extent(layout, c)[1]]
    bands = [Band(0, 0, tuple(empty))] if empty else []  # no rows: the record is framing alone
    chunks = [c for c in chunks if c not in empty]
    if not layout.shape:
        return bands + ([Band(0, 1, tuple(chunks))] if chunks or whole else [])
    rows, per = layout.shape[0], band_rows(layout, band_bytes)
    if layout.shard_dim == 1:
        passes = [chunks]
        if rows > per and len(layout.blocks or ()) > 1:  # block-major, so each file gets its records in order
            edges = [sum(layout.blocks[:i]) for i in range(len(layout.blocks) + 1)]
            passes = [[c for c in chunks if lo <= c.offsets[1] < hi] for lo, hi in zip(edges, edges[1:])]
            passes = [p for p in passes if p] or [[]]
        if not chunks and not whole:
            return bands
        for group in passes:
            bands += [Band(s, min(per, rows - s), tuple(group)) for s in range(0, rows, per)]
        return bands
    spans = [(0, rows)] if whole else sorted(_extent(layout, c) for c in chunks)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    for lo, hi in merged:
        for s in range(lo, hi, per):
            count = min(per, hi - s)
            fed = tuple(c for c in chunks if _extent(layout, c)[0] < s + count and _extent(layout, c)[1] > s)
            bands.append(Band(s, count, fed))
    return bands


SMALL_BAND_BYTES = 256 << 10


def cut_band(layout: TensorLayout, band: Band, data: np.ndarray, *, small: bool = False) -> list[Piece]:
    """Cut a band into its chunks' pieces: byte views of `data` (the band's rows, flat uint8, stored dtype).

    With `small` (a band of at most `SMALL_BAND_BYTES`, as most bands of a checkpoint of many small tensors are),
    every piece is contiguous (a column split is copied out): one write each, rather than a gather of tiny rows.
    """
    pieces = []
    item = layout.dtype.itemsize
    row_bytes = math.prod(layout.shape[1:]) * item if layout.shape else len(data)
    end = band.start + band.count
    for c in band.chunks:
        lo, hi = _extent(layout, c)
        if lo == hi or not c.data_length:
            pieces.append(Piece(c, data[:0], True, True))
            continue
        first, last = band.start <= lo, end >= hi
        if not layout.shape:
            view = data
        elif layout.shard_dim == 1:
            col = c.offsets[1] * item
            view = data.reshape(band.count, row_bytes)[:, col : col + c.sizes[1] * item]
            if small:
                view = view.copy().reshape(-1)
        else:
            a, b = max(lo, band.start) - band.start, min(hi, end) - band.start
            view = data[a * row_bytes : b * row_bytes]
        pieces.append(Piece(c, view, first, last))
    return pieces


def cast_band(
    layout: TensorLayout, raw: np.ndarray, count: int, pool: BufferPool | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The band's bytes in the stored dtype: `raw` itself, or a cast copy (returned second, from `pool`; without a
    pool, a buffer of exactly its size). A cast computes with torch (its rounding, bfloat16 included), imported
    then: only conversions with `--dtype` pay for it."""
    if layout.dtype is layout.source_dtype:
        return raw, None
    numel = math.prod((count, *layout.shape[1:]) if layout.shape else ())
    nbytes = numel * layout.dtype.itemsize
    out = pool.take(nbytes) if pool is not None else np.empty(nbytes, np.uint8)
    if numel:
        if raw.ctypes.data % layout.source_dtype.itemsize:  # a source tensor not aligned to its dtype
            raw = raw.copy()
        source = _as_torch(raw, layout.source_dtype)
        if layout.quantizes:  # --quantize: each row by its own scale (format/quant.py), whole rows in every band
            source = source[:numel].reshape(count, -1)
            _as_torch(out, layout.dtype).copy_(quantize_rows(source, layout.dtype.name)[0].reshape(-1))
        else:
            _as_torch(out, layout.dtype).copy_(source)
    return out, out


def _as_torch(buf: np.ndarray, dtype: DType):
    """A flat uint8 buffer (aligned to the dtype) as a 1-D torch tensor of `dtype` over the same memory."""
    import torch

    return torch.from_numpy(buf).view(dtype.torch)


def tensor_pieces(
    layout: TensorLayout,
    chunks: list[ChunkRecord],
    read_rows: Callable[[int, int, np.ndarray], None],
    pool: BufferPool,
    band_bytes: int = BAND_BYTES,
) -> Iterator[list[Piece]]:
    """Yield, band after band, the pieces of `chunks` (this tensor's chunks, canonical order), each contiguous
    bytes in the stored dtype (for readers that compare or keep them; the converter streams `cut_band`'s views).

    `read_rows(start, count, out)` fills the flat uint8 `out` with source rows `[start, start + count)` (for a
    0-dim tensor: its one element). Each list is valid only until the next is requested (buffers are reused).
    """
    row = source_row_bytes(layout) if layout.shape else layout.source_dtype.itemsize
    for band in band_plan(layout, chunks, band_bytes=band_bytes):
        count = band.count if layout.shape else 1
        raw = pool.take(count * row if band.count else 0)
        if band.count:
            read_rows(band.start, band.count, raw)
        data, cast = cast_band(layout, raw, count, pool)
        staging = pool.take(data.size) if layout.shard_dim == 1 else None
        pieces, at = [], 0
        for p in cut_band(layout, band, data):
            view = p.data
            if staging is not None and view.size:  # gather the strided columns, one after another
                target = staging[at : at + view.size]
                np.copyto(target.reshape(view.shape), view)
                view, at = target, at + view.size
            pieces.append(Piece(p.chunk, view.reshape(-1), p.first, p.last))
        yield pieces
        for buf in (raw, cast, staging):
            if buf is not None:
                pool.give(buf)
