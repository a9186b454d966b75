"""Positional reads into buffers the caller owns.

Reading with `os.preadv` at explicit offsets (no mmap, no shared file position) keeps resident memory
bounded by the caller's buffers, lets several threads read one file, and reads a record's framing and
its tensor bytes in one system call into two different places.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from preshard.errors import CorruptCheckpointError

HASH_BLOCK = 8 << 20  # files and chunks are read back for hashing in blocks this large
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels


class DirectIOBuffer:
    """Anonymous memory for `O_DIRECT` transfers: aligned to HUGE_PAGE and, where the kernel has transparent huge
    pages, backed by them.

    Why: a direct transfer reaches the device in requests of as many physically contiguous bytes as one bio's
    page segments hold, up to the queue's limit. From 4 KiB pages that is 512 KiB once physical memory is
    fragmented (as on the development VM after a few conversions); from 2 MiB pages it is the limit (4 MiB on the
    development VM's virtio disk). Measured there with `benchmarks/bench_io.py --size-gib 3 --reps 3`: a cold
    O_DIRECT read at 1.3-1.8 s into huge pages, 2.9-4.2 s into 4 KiB ones; writes 7.3-8.6 s against 8.4-10.1 s
    (and `cp` + `sync` 12.6-14.1 s), up to twice as fast where the 4 KiB pages were fragmented. Python's
    `mmap.mmap(-1, n)` is shared memory (shmem), which gets no huge pages unless the machine's shmem setting
    allows them; this mapping is private. Where huge pages are not to be had, it is page-aligned memory as before.
    """

    def __init__(self, nbytes: int) -> None:
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        kwargs = {"flags": flags} if flags else {}
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, **kwargs)  # room to start at a huge page boundary
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:  # the whole mapping: the slack around the buffer is never touched, so it costs nothing
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: 4 KiB pages it is
                pass
        start = -np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data % HUGE_PAGE
        self.view: memoryview | None = memoryview(self._map)[start : start + nbytes]
        self.array: np.ndarray | None = np.frombuffer(self.view, dtype=np.uint8)

    def close(self) -> None:
        """Unmap, unless a view is still exported (then the mapping goes with its last reference)."""
        if self.view is None:
            return
        view, self.array, self.view = self.view, None, None
        try:
            view.release()
            self._map.close()
        except BufferError:  # still exported (an array over it): unmapped when the last one goes
            pass


def direct_io_enabled() -> bool:
    """Whether readers and writers use O_DIRECT by default: yes, unless `PRESHARD_DIRECT_IO=0` (then everything goes
    through the page cache, as on a file system without O_DIRECT). Read when a reader or writer is made, never at
    import, so a caller may set it at any time; a `direct=` argument overrides it."""
    return os.environ.get("PRESHARD_DIRECT_IO", "1") != "0"


def direct_io_array(nbytes: int) -> np.ndarray:
    """A flat uint8 array of `nbytes` in a `DirectIOBuffer` (unmapped with the array's last view)."""
    return DirectIOBuffer(nbytes).array


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
