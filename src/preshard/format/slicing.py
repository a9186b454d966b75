"""Cutting one source tensor into its chunks, band by band, in bounded memory.

A tensor is read in bands of whole rows (dim 0), in file order, so every source byte is read once, front
to back. Each band is cut into the pieces of the chunks it intersects: a row-split chunk (colwise, packed
colwise, replicated) takes a run of the band's rows, which is already contiguous (no copy unless a cast
is needed); a column-split chunk (rowwise and its variants) takes a strided slice of every row, so each
block of the band goes through one cache-friendly pass `view(rows, T, w) -> (T, rows, w)` into a staging
buffer, after which each rank's piece is contiguous. Memory is one band plus its staging copy, whatever
the tensor's size, and the buffers are reused from band to band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from preshard.format.layout import ChunkRecord, TensorLayout

BAND_BYTES = 32 << 20


@dataclass(frozen=True)
class Piece:
    """A run of a chunk's bytes: `data` (contiguous, in the stored dtype) follows the chunk's earlier pieces."""

    chunk: ChunkRecord
    data: torch.Tensor
    first: bool
    last: bool


class BufferPool:
    """Reusable flat byte buffers, so that first-touching fresh memory does not cost more than the copies."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        self._free.append(base)
        self._free.sort(key=lambda b: b.numel())
        del self._free[:-3]  # keep the few largest


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return buf.view(dtype).view(shape) if math.prod(shape) else torch.empty(shape, dtype=dtype)


def band_rows(layout: TensorLayout, band_bytes: int = BAND_BYTES) -> int:
    """Rows per band: at least one row, at most about `band_bytes` of source data."""
    if not layout.shape:
        return 1
    row = math.prod(layout.shape[1:]) * max(layout.source_dtype.itemsize, layout.dtype.itemsize)
    return max(1, band_bytes // max(1, row))


def tensor_pieces(
    layout: TensorLayout,
    chunks: list[ChunkRecord],
    read_rows: Callable[[int, int, torch.Tensor], None],
    pool: BufferPool,
    band_bytes: int = BAND_BYTES,
) -> Iterator[list[Piece]]:
    """Yield, band after band, the pieces of `chunks` (this tensor's chunks, canonical order).

    `read_rows(start, count, out)` fills the flat uint8 `out` with source rows `[start, start + count)` (for a
    0-dim tensor: its one element). Each list is valid only until the next is requested (buffers are reused).
    """
    shape, scalar = layout.shape, not layout.shape
    rows_total = 1 if scalar else shape[0]
    row_elems = math.prod(shape[1:]) if shape else 1
    by_rows = layout.shard_dim != 1
    extent = {
        id(c): (c.offsets[0], c.offsets[0] + c.sizes[0]) if by_rows and not scalar else (0, rows_total) for c in chunks
    }
    empty = [c for c in chunks if extent[id(c)][0] == extent[id(c)][1]]
    if empty:  # no rows (a zero-size tensor): the record is framing alone
        yield [Piece(c, torch.empty(c.sizes, dtype=layout.dtype), True, True) for c in empty]
    rows_per_band = band_rows(layout, band_bytes)
    for start in range(0, rows_total, rows_per_band):
        count = min(rows_per_band, rows_total - start)
        raw = pool.take(count * row_elems * layout.source_dtype.itemsize)
        read_rows(start, count, raw)
        band = _typed(raw, layout.source_dtype, () if scalar else (count, *shape[1:]))
        staging: list[torch.Tensor] = []
        if by_rows:
            band = _cast(band, layout.dtype, pool, staging)
            cut = []
            for c in chunks:
                lo, hi = max(extent[id(c)][0], start), min(extent[id(c)][1], start + count)
                if hi > lo:
                    cut.append((c, band if scalar else band[lo - start : hi - start]))
        else:
            cut = _column_pieces(layout, chunks, band, pool, staging)
        pieces = []
        for c, data in cut:
            first_row, end_row = extent[id(c)]
            pieces.append(Piece(c, data, max(first_row, start) == first_row, min(end_row, start + count) == end_row))
        yield pieces
        pool.give(raw)
        for buf in staging:
            pool.give(buf)


def _cast(band: torch.Tensor, dtype: torch.dtype, pool: BufferPool, staging: list[torch.Tensor]) -> torch.Tensor:
    if band.dtype == dtype:
        return band
    buf = pool.take(band.numel() * dtype.itemsize)
    staging.append(buf)
    out = _typed(buf, dtype, tuple(band.shape))
    out.copy_(band)
    return out


def _column_pieces(
    layout: TensorLayout, chunks: list[ChunkRecord], band: torch.Tensor, pool: BufferPool, staging: list[torch.Tensor]
) -> list[tuple[ChunkRecord, torch.Tensor]]:
    """Each block's columns transposed rank-major in one pass; rank r's piece of a block is then contiguous."""
    rows = band.shape[0]
    tp = len(chunks) // len(layout.blocks or (1,))
    by_start = {c.offsets[1]: c for c in chunks}
    pieces = []
    col = 0
    for block in layout.blocks or ():
        width = block // tp
        buf = pool.take(rows * block * layout.dtype.itemsize)
        staging.append(buf)
        out = _typed(buf, layout.dtype, (tp, rows, width))
        out.copy_(band[:, col : col + block].unflatten(1, (tp, width)).permute(1, 0, 2))
        for r in range(tp):
            pieces.append((by_start[col + r * width], out[r]))
        col += block
    pieces.sort(key=lambda p: p[0].offsets)
    return pieces
