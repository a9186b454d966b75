"""Positional reads into buffers the caller owns.

Reading with `os.preadv` at explicit offsets (no mmap, no shared file position) keeps resident memory
bounded by the caller's buffers, lets several threads read one file, and reads a record's framing and
its tensor bytes in one system call into two different places.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from preshard.errors import CorruptCheckpointError

HASH_BLOCK = 8 << 20  # files and chunks are read back for hashing in blocks this large


def byte_view(buffer: np.ndarray | Any) -> memoryview:
    """A writable byte view of a contiguous CPU buffer: a numpy array (the tools' buffers) or a torch tensor (the
    runtime's), of any dtype."""
    if isinstance(buffer, np.ndarray):
        flat = buffer.dtype == np.uint8 and buffer.ndim == 1
        return memoryview(buffer if flat else buffer.reshape(-1).view(np.uint8))
    import torch  # a tensor: torch is imported already

    if buffer.dtype is torch.uint8 and buffer.dim() == 1:  # the common case, in a third of the time
        return memoryview(buffer.numpy())
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, offset: int, buffers: Sequence[memoryview | bytearray], where: str = "the file") -> None:
    """Fill every buffer, in order, from the file's bytes starting at `offset`.

    Raises:
        CorruptCheckpointError: the file ends before the buffers are full (it was truncated).
    """
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    position = offset
    while views:
        n = os.preadv(fd, views, position)
        if n <= 0:
            raise CorruptCheckpointError(
                f"{where} ends at byte {position}, before the data it should hold; it was truncated"
            )
        position += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def pread_bytes(fd: int, offset: int, length: int, where: str = "the file") -> bytes:
    buffer = bytearray(length)
    pread_into(fd, offset, [buffer], where)
    return bytes(buffer)
