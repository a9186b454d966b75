"""Writing one data file: torch.save records at the offsets the layout decided, hashed as they go out.

Each record is the framing header, the chunk's raw bytes (streamed in pieces), then the framing trailer,
so torch's own DCP reader can read it; no `torch.save` runs and nothing is re-parsed.

Bytes go through a staging buffer in huge pages (`DirectIOBuffer`: from 4 KiB pages a direct write reaches the
device in requests an eighth as large) and out with large positional writes, with `O_DIRECT` where the file
system takes it: the converter never reads its output back, and putting it through the
page cache costs more CPU than everything else the converter does (allocating and dirtying cache pages,
then writing them back; measured on a virtual machine: 4.3 GB in 5.5 s and 8.5 CPU s buffered, 2.3 s and
0.8 CPU s direct). A file system that refuses `O_DIRECT` (at open or at the first write) gets the same
stage written through the page cache. Pieces may be strided (a rank's columns of a band of rows): they
are gathered into the stage row by row, which is as fast as a plain copy and needs no other buffer.

The writer hashes what it stages, the very bytes it writes (the file's xxh3_128 and each chunk's
xxh3_64), so the checksums in the manifest describe what this process wrote, never what a later read of
the disk happens to find.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from preshard.errors import CorruptCheckpointError
from preshard.format.fileio import HASH_BLOCK, HUGE_PAGE, DirectIOBuffer, direct_io_enabled, pread_into
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import file_digest

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory: every block size in use is a divisor
STAGE_BYTES = 8 << 20  # per writer; `stage_bytes` lowers it when many files are written at once


def stage_bytes(files: int, total: int = 64 << 20) -> int:
    """Staging per writer when `files` are written at once: `total` shared, 2 to 8 MiB each, in whole huge pages
    (a stage of 4 KiB pages reaches the device in requests an eighth as large: see `DirectIOBuffer`)."""
    each = max(HUGE_PAGE, min(STAGE_BYTES, total // max(1, files)))
    return each - each % HUGE_PAGE


class RecordFileWriter:
    """Appends the records of one data file, in file order (one thread at a time)."""

    def __init__(self, path: Path, *, direct: bool | None = None, stage: int = STAGE_BYTES) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self.direct_fd = -1
        if direct_io_enabled() if direct is None else direct:  # PRESHARD_DIRECT_IO=0: through the page cache
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECT", 0))
            except OSError:
                self.direct_fd = -1
            if not hasattr(os, "O_DIRECT") and self.direct_fd >= 0:
                os.close(self.direct_fd)
                self.direct_fd = -1
        self.digest = file_digest()
        self.position = 0  # the file offset of the next byte
        self._capacity = max(ALIGN, stage - stage % ALIGN)
        self._buffer: DirectIOBuffer | None = None
        self._stage: np.ndarray | None = None  # uint8 view of _buffer
        self._view: memoryview | None = None
        self._base = 0  # the file offset of _stage[0] (a multiple of ALIGN)
        self._fill = 0  # bytes staged
        self._chunk: ChunkRecord | None = None
        self._chunk_digest = None
        self._in_data = False  # whether staged bytes belong to the current chunk's data

    @property
    def direct(self) -> bool:
        return self.direct_fd >= 0

    def resize_stage(self, capacity: int) -> None:
        """Use a stage of `capacity` bytes (rounded down to ALIGN), keeping what is staged."""
        capacity = max(ALIGN, capacity - capacity % ALIGN, self._fill + ALIGN - self._fill % ALIGN)
        if capacity == self._capacity:
            return
        staged = bytes(self._view[: self._fill]) if self._buffer is not None else b""
        self._release_stage()
        self._capacity = capacity
        if staged:
            self._ensure_stage()
            self._view[: len(staged)] = staged

    def _ensure_stage(self) -> None:
        if self._buffer is None:
            self._buffer = DirectIOBuffer(self._capacity)  # aligned, as O_DIRECT needs
            self._view = self._buffer.view
            self._stage = self._buffer.array

    def keep(self, records: list[ChunkRecord], check_stop: Callable[[], None] | None = None) -> None:
        """Adopt a prefix written by an earlier run: re-check every kept record, framing and data, while hashing.

        Args:
            check_stop: called before each record; raises to stop (a signal during a long re-check).

        Raises:
            CorruptCheckpointError: a kept record does not match; the caller redoes from there.
        """
        buffer = bytearray(HASH_BLOCK)
        for record in records:
            if check_stop is not None:
                check_stop()
            if record.offset != self.position:
                raise CorruptCheckpointError(f"{self.path.name}: kept records are not contiguous at {self.position}")
            framing = record.framing
            header = bytearray(len(framing.header))
            pread_into(self.fd, record.offset, [header], self.path.name)
            if bytes(header) != framing.header:
                raise CorruptCheckpointError(f"{self.path.name}: the framing of {record.tensor} is damaged")
            self.digest.update(header)
            chunk = xxhash.xxh3_64()
            position, remaining = record.data_offset, framing.data_length
            while remaining:
                view = memoryview(buffer)[: min(remaining, HASH_BLOCK)]
                pread_into(self.fd, position, [view], self.path.name)
                chunk.update(view)
                self.digest.update(view)
                position += len(view)
                remaining -= len(view)
            if chunk.hexdigest() != record.xxh3_64:
                raise CorruptCheckpointError(f"{self.path.name}: the data of {record.tensor} is damaged")
            trailer = bytearray(len(framing.trailer))
            pread_into(self.fd, position, [trailer], self.path.name)
            if bytes(trailer) != framing.trailer:
                raise CorruptCheckpointError(f"{self.path.name}: the framing of {record.tensor} is damaged")
            self.digest.update(trailer)
            self.position = record.end
        os.ftruncate(self.fd, self.position)
        # The stage starts at the block holding the next byte: the bytes of that block already in the file
        # come first, so that every write out of the stage covers whole blocks.
        self._base = self.position - self.position % ALIGN
        self._fill = self.position - self._base
        if self._fill:
            self._ensure_stage()
            pread_into(self.fd, self._base, [self._view[: self._fill]], self.path.name)

    def _write(self, data) -> None:
        """Stage `data` (bytes, or a uint8 numpy array: 1-D, or 2-D with contiguous rows), hashing it, and write out
        every full stage."""
        self._ensure_stage()
        if isinstance(data, np.ndarray) and data.ndim > 1:
            self._put_rows(data)
        else:
            self._put_bytes(memoryview(data).cast("B"))

    def _put_bytes(self, view: memoryview) -> None:
        while len(view):
            n = min(len(view), self._capacity - self._fill)
            staged = self._view[self._fill : self._fill + n]
            staged[:] = view[:n]
            self._staged(staged)
            view = view[n:]

    def _put_rows(self, data: np.ndarray) -> None:
        """Gather `data` (uint8, 1-D, or 2-D with contiguous rows) into the stage with numpy copies: single-threaded
        and releasing the GIL. (torch's copy of the same strided view, parallelised over torch's intra-op threads
        while every writer thread copies too, took 3 to 4 times the CPU on 2 cores.)"""
        if data.ndim == 1 or data.flags.c_contiguous:
            data = data.reshape(1, -1)
        rows, row_bytes = data.shape
        if not rows or not row_bytes:
            return
        r = within = 0  # the next row, and how much of it is already staged
        while r < rows:
            space = self._capacity - self._fill
            if not within and space >= row_bytes:  # whole rows: one strided copy
                k = min(rows - r, space // row_bytes)
                np.copyto(self._stage[self._fill : self._fill + k * row_bytes].reshape(k, row_bytes), data[r : r + k])
                n = k * row_bytes
                r += k
            else:  # a row larger than what is left of the stage
                n = min(row_bytes - within, space)
                np.copyto(self._stage[self._fill : self._fill + n], data[r, within : within + n])
                within += n
                if within == row_bytes:
                    r, within = r + 1, 0
            self._staged(self._view[self._fill : self._fill + n])

    def _staged(self, staged: memoryview) -> None:
        """`staged` was just copied into the stage at _fill: hash it, and write the stage out once full."""
        self.digest.update(staged)
        if self._in_data:
            self._chunk_digest.update(staged)
        self._fill += len(staged)
        self.position += len(staged)
        if self._fill == self._capacity:
            self._flush(self._capacity)
            self._base += self._capacity
            self._fill = 0

    def _flush(self, length: int) -> None:
        """Write the first `length` bytes of the stage (a multiple of ALIGN) at _base."""
        view = self._view[:length]
        offset = self._base
        while len(view):
            fd = self.direct_fd if self.direct_fd >= 0 else self.fd
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self.direct_fd < 0:
                    raise
                os.close(self.direct_fd)  # this file system takes O_DIRECT at open but not at write
                self.direct_fd = -1
                continue
            view, offset = view[n:], offset + n

    def _flush_all(self) -> None:
        """Write everything staged; the partial last block is padded (the file is cut to size at close) and
        stays staged, so that the next write out of the stage covers it whole again."""
        if not self._fill:
            return
        tail = self._fill % ALIGN
        length = self._fill + (ALIGN - tail if tail else 0)
        if tail:
            self._view[self._fill : length] = bytes(length - self._fill)
        self._flush(length)
        keep_from = self._fill - tail
        if tail:
            self._view[:tail] = self._view[keep_from : self._fill]
        self._base += keep_from
        self._fill = tail

    def append(self, data) -> None:
        """Append bytes that belong to no record (as `write` takes them): a plain file, such as the safetensors files
        `unshard` rebuilds, written and hashed the same way as the records."""
        self._write(data)

    def begin(self, chunk: ChunkRecord) -> None:
        if chunk.offset != self.position:
            raise RuntimeError(
                f"{self.path.name}: record of {chunk.tensor} planned at {chunk.offset}, file at {self.position}"
            )
        self._chunk, self._chunk_digest, self._in_data = chunk, xxhash.xxh3_64(), False
        self._write(chunk.framing.header)
        self._in_data = True

    def write(self, data) -> None:
        """Append a piece of the current chunk's raw bytes (bytes, or a uint8 tensor as `_write` takes)."""
        self._write(data)

    def end(self) -> ChunkRecord:
        """Finish the current record; returns its chunk with the data checksum filled in."""
        chunk, digest = self._chunk, self._chunk_digest
        self._in_data = False
        self._write(chunk.framing.trailer)
        if self.position != chunk.end:
            raise RuntimeError(f"{self.path.name}: record of {chunk.tensor} ended at {self.position}, not {chunk.end}")
        self._chunk = self._chunk_digest = None
        return ChunkRecord(
            chunk.tensor, chunk.owner, chunk.box, chunk.file, chunk.offset, chunk.framing, digest.hexdigest()
        )

    def sync(self) -> None:
        """Make everything written so far durable."""
        self._flush_all()
        os.fsync(self.fd)

    def close(self) -> str:
        """Write out, cut to size, fsync and close; returns the file's xxh3_128."""
        self._flush_all()
        os.ftruncate(self.fd, self.position)
        os.fsync(self.fd)
        self.abandon()
        return self.digest.hexdigest()

    def abandon(self) -> None:
        """Close without writing out what is staged (after a failure, or for a file another process writes)."""
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        self._release_stage()

    def _release_stage(self) -> None:
        if self._buffer is not None:
            self._stage = self._view = None
            self._buffer.close()
            self._buffer = None
