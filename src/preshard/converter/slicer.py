"""Streaming slicer: each TP rank's chunks of one source tensor, reading only the bytes needed, in order.

Memory: a row-sliced chunk (colwise, packed) is read straight from its byte range, 1/T of the tensor
at a time. A column-sliced tensor (rowwise) is read in bands of rows that are scattered into the T
rank buffers, so the peak is the tensor itself plus one band. Every source byte is read once, front
to back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from preshard.converter.safetensors_file import TensorEntry
from preshard.converter.sources import SourceReader
from preshard.plans.resolve import TensorPlan

BAND_BYTES = 32 * 1024 * 1024


def cast_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """`--dtype` casts 16/32/64-bit floating tensors; integers and float8 (quantised data) are kept."""
    if requested is None or not source.is_floating_point or source.itemsize == 1:
        return source
    return requested


def iter_rank_chunks(
    reader: SourceReader, entry: TensorEntry, plan: TensorPlan, tp: int, dtype: torch.dtype
) -> Iterator[tuple[int | None, tuple[int, ...], torch.Tensor]]:
    """Yield `(tp_rank or None for replicated, global offsets, chunk)` for one tensor."""
    if plan.shard_dim is None:
        yield (
            None,
            (0,) * len(entry.shape),
            _cast(reader.rows(entry, 0, entry.shape[0] if entry.shape else 1), dtype),
        )
    elif plan.shard_dim == 0:
        # Block-major, then rank: byte ranges come in file order.
        chunks = sorted(((chunk, r) for r in range(tp) for chunk in plan.chunks(tp, r)), key=lambda item: item[0][0][0])
        for (offsets, sizes), r in chunks:
            yield r, offsets, _cast(reader.rows(entry, offsets[0], sizes[0]), dtype)
    elif plan.shard_dim == 1:
        yield from _column_chunks(reader, entry, plan, tp, dtype)
    else:
        raise ValueError(f"shard dim {plan.shard_dim} is not supported")


def _column_chunks(reader: SourceReader, entry: TensorEntry, plan: TensorPlan, tp: int, dtype: torch.dtype):
    rows, cols = entry.shape
    width = cols // tp
    outputs = [torch.empty((rows, width), dtype=dtype) for _ in range(tp)]
    band = max(1, BAND_BYTES // max(1, entry.row_bytes))
    for start in range(0, rows, band):
        block = reader.rows(entry, start, min(band, rows - start))
        for r, out in enumerate(outputs):
            out[start : start + block.shape[0]].copy_(block[:, r * width : (r + 1) * width])
        del block
    for r in range(tp):
        chunk = outputs[r]
        outputs[r] = None  # let each buffer go as soon as it is written
        yield r, (0, r * width), chunk
        del chunk


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
