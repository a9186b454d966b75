"""Read one TP rank's chunks straight onto its device, from the raw bytes the manifest locates.

No pickle is read (neither `.metadata` nor the torch.save records): each chunk's record framing and raw
bytes come in with positional reads, the framing into a small buffer and the bytes, on the CPU, into the
parameter itself. The framing is compared with the one the manifest's dtype and shape imply, always: a
manifest that disagrees with the files about a chunk's dtype, shape or position fails here by name instead
of loading wrong weights. `verify=True` (load_sharded's default) also checks each chunk's xxh3_64: on the CPU each
large chunk's pieces are hashed on `chunk_hashing`'s threads while the next pieces are read, on the staged path by
the reader thread while the previous buffer is copied to the device.

For an accelerator the bytes go through a small pool of reusable host buffers (pinned on CUDA): a reader
thread fills the next buffer while the copy of the previous one to the device runs (asynchronously, on a
side stream, on CUDA), and the kernel is asked to read ahead (`posix_fadvise(WILLNEED)`) the byte ranges
coming next, so disk reads, host-to-device copies and hashing overlap; one synchronisation at the end.
Chunks are read in file order, so each file is read front to back.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from preshard.errors import CheckpointFileMissingError, ChecksumMismatch, CorruptCheckpointError
from preshard.format.fileio import byte_view, pread_into
from preshard.format.folder import CheckpointFolder
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import Manifest
from preshard.runtime.chunk_hashing import INLINE_BYTES, PIECE_BYTES, ChunkHasher

STAGING_BYTES = 32 << 20  # one host buffer
STAGING_DEPTH = 3  # buffers in flight
READ_AHEAD_BYTES = 256 << 20


@dataclass
class ReadStats:
    bytes_read: int = 0
    chunks: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def open_data_files(folder: CheckpointFolder, manifest: Manifest, names: list[str]) -> dict[str, int]:
    """Open each data file this rank needs, inside the checkpoint folder and only if it is a regular file of the
    recorded size (a missing or short file would leave rows unset). The caller closes the descriptors.

    Raises:
        CorruptCheckpointError: a file missing, of the wrong size, out of the folder or not a regular file.
    """
    fds: dict[str, int] = {}
    try:
        for name in names:
            path = folder.path / name
            try:
                fds[name] = folder.open(name)
            except FileNotFoundError:
                raise CheckpointFileMissingError(
                    f"data file {path} is missing; copy the whole checkpoint folder again"
                ) from None
            size = os.fstat(fds[name]).st_size
            record = manifest.file(name)
            if size != record.size:
                raise CorruptCheckpointError(
                    f"data file {path} is {size} bytes, the manifest says {record.size}: it is truncated or "
                    "damaged; copy it again"
                )
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


@dataclass(frozen=True)
class _Piece:
    """Rows [row, row + rows) of a chunk, staged in `host` (None: the chunk's last piece was read directly)."""

    chunk: ChunkRecord
    target: torch.Tensor  # the chunk's region of its local tensor
    row: int
    rows: int
    host: torch.Tensor | None
    slot: int


class _Transfers:
    """Host-to-device copies: on a side stream with events on CUDA, plain synchronous copies elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, target: torch.Tensor, host: torch.Tensor) -> object:
        if not self.cuda:
            target.copy_(host)
            return None
        with torch.cuda.stream(self.stream):
            target.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        target.record_stream(self.stream)
        return event

    @staticmethod
    def wait(event: object) -> None:
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream.synchronize()


class ShardReader:
    """Reads one TP rank's tensors from the files it needs; use as a context manager.

    Args:
        fds: the data files, already opened (and held) by the caller (`preshard.runtime.held`), who closes them;
            by default they are opened here (`open_data_files`) and closed on exit.
    """

    def __init__(
        self,
        checkpoint: Path,
        manifest: Manifest,
        tp_rank: int,
        *,
        verify: bool,
        pin: bool,
        fds: dict[str, int] | None = None,
    ) -> None:
        self.checkpoint = Path(checkpoint)
        self.manifest = manifest
        self.chunks = manifest.chunks_for_tp_rank(tp_rank)
        self.verify = verify
        self.pin = pin
        self.stats = ReadStats(files=manifest.files_for_tp_rank(tp_rank))
        self._owned = fds is None
        if fds is None:
            fds = open_data_files(CheckpointFolder(self.checkpoint), manifest, self.stats.files)
        self.fds: dict[str, int] = {name: fds[name] for name in self.stats.files}

    def __enter__(self) -> ShardReader:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            for fd in self.fds.values():
                os.close(fd)
        self.stats.seconds = time.perf_counter() - self._start

    def read(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (the local tensor of `name`, on the rank's device) from this rank's chunks."""
        self.read_all({name: out})

    def read_all(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill every local tensor in `targets` from this rank's chunks, reading each file front to back."""
        jobs = sorted(
            ((c, self._region(name, c, out)) for name, out in targets.items() for c in self.chunks[name]),
            key=lambda job: (job[0].file, job[0].offset),
        )
        direct: list[tuple[ChunkRecord, torch.Tensor]] = []
        staged: list[tuple[ChunkRecord, torch.Tensor]] = []
        for job in jobs:
            if not job[0].data_length:  # framing alone, however many rows of nothing (never iterate over them)
                self._read_empty(job[0])
                continue
            (direct if self._direct(*job) else staged).append(job)
        if self.verify and any(c.data_length >= INLINE_BYTES for c, _ in direct):
            with ChunkHasher() as hasher:  # each large chunk hashed beside the read of the next pieces
                for chunk, target in direct:
                    self._read_direct(chunk, target, hasher)
                hasher.finish()
        else:
            for chunk, target in direct:
                self._read_direct(chunk, target)
        if staged:
            self._read_staged(staged)

    # -- where each chunk goes

    def _region(self, name: str, chunk: ChunkRecord, out: torch.Tensor) -> torch.Tensor:
        layout = self.manifest.tensors[name].layout
        d = layout.shard_dim
        if d is None:
            return out
        return out.narrow(d, layout.local_start(chunk.box, self.manifest.tp), chunk.sizes[d])

    def _dtype(self, chunk: ChunkRecord) -> torch.dtype:
        return self.manifest.tensors[chunk.tensor].layout.dtype.torch

    def _direct(self, chunk: ChunkRecord, target: torch.Tensor) -> bool:
        """On the CPU, a contiguous region of the stored dtype takes the bytes itself, with no staging copy."""
        return target.device.type == "cpu" and target.is_contiguous() and target.dtype == self._dtype(chunk)

    # -- checks

    def _where(self, chunk: ChunkRecord) -> Path:
        return self.checkpoint / chunk.file

    def _check_framing(self, chunk: ChunkRecord, header: bytes | bytearray) -> None:
        if header != chunk.framing.header:
            raise CorruptCheckpointError(
                f"{self._where(chunk)}: the record of {chunk.tensor} at byte {chunk.offset} does not frame a "
                f"{str(self._dtype(chunk)).removeprefix('torch.')} chunk of shape {list(chunk.sizes)} as the "
                "manifest says; the checkpoint is damaged or its manifest edited: convert it again"
            )

    def _check_digest(self, chunk: ChunkRecord, digest: str) -> None:
        if digest != chunk.xxh3_64:
            raise ChecksumMismatch(
                f"checksum mismatch in {self._where(chunk)} for {chunk.tensor} "
                f"(bytes {chunk.data_offset}..{chunk.data_offset + chunk.data_length}); the file is damaged"
            )

    def _count(self, chunk: ChunkRecord) -> None:
        self.stats.bytes_read += chunk.load_bytes
        self.stats.chunks += 1

    # -- CPU: straight into the parameter

    def _read_direct(self, chunk: ChunkRecord, target: torch.Tensor, hasher: ChunkHasher | None = None) -> None:
        header = bytearray(len(chunk.framing.header))
        data = byte_view(target)
        fd, where = self.fds[chunk.file], str(self._where(chunk))
        if hasher is None or len(data) < INLINE_BYTES:
            pread_into(fd, chunk.offset, [header, data], where)
            self._check_framing(chunk, header)
            if self.verify:
                self._check_digest(chunk, xxhash.xxh3_64_hexdigest(data))
        else:  # in pieces, each hashed on the hasher's thread while the next one is read
            key = hasher.begin()
            first = data[:PIECE_BYTES]
            pread_into(fd, chunk.offset, [header, first], where)
            self._check_framing(chunk, header)
            hasher.update(key, first)
            for start in range(PIECE_BYTES, len(data), PIECE_BYTES):
                piece = data[start : start + PIECE_BYTES]
                pread_into(fd, chunk.data_offset + start, [piece], where)
                hasher.update(key, piece)
            hasher.end(key, lambda digest, chunk=chunk: self._check_digest(chunk, digest))
        self._count(chunk)

    def _read_empty(self, chunk: ChunkRecord) -> None:
        header = bytearray(len(chunk.framing.header))
        pread_into(self.fds[chunk.file], chunk.offset, [header], str(self._where(chunk)))
        self._check_framing(chunk, header)
        if self.verify:
            self._check_digest(chunk, xxhash.xxh3_64_hexdigest(b""))
        self._count(chunk)

    # -- through host buffers: a reader thread ahead of the copies

    def _pieces(self, jobs: list[tuple[ChunkRecord, torch.Tensor]], slots: queue.Queue) -> Iterator[_Piece]:
        """Read every chunk in pieces of whole rows into free host buffers (runs on the reader thread)."""
        advised = 0
        for index, (chunk, target) in enumerate(jobs):
            advised = self._advise(jobs, index, advised)
            fd, where = self.fds[chunk.file], str(self._where(chunk))
            header = bytearray(len(chunk.framing.header))
            pread_into(fd, chunk.offset, [header], where)
            self._check_framing(chunk, header)
            dtype = self._dtype(chunk)
            rows_total = chunk.sizes[0] if chunk.sizes else 1
            row_bytes = chunk.data_length // max(rows_total, 1) if chunk.data_length else 0
            per_piece = max(1, STAGING_BYTES // max(row_bytes, 1))
            digest = xxhash.xxh3_64()
            for row in range(0, max(rows_total, 1), per_piece):
                rows = min(per_piece, rows_total - row) if chunk.sizes else 1
                slot, host, copying = slots.get()
                _Transfers.wait(copying)  # the buffer's previous copy to the device must be done
                view = host[: rows * row_bytes] if chunk.sizes else host[: chunk.data_length]
                pread_into(fd, chunk.data_offset + row * row_bytes, [byte_view(view)], where)
                if self.verify:
                    digest.update(byte_view(view))
                shape = (rows, *chunk.sizes[1:]) if chunk.sizes else ()
                yield _Piece(chunk, target, row, rows, view.view(dtype).view(shape), slot)
            if self.verify:
                self._check_digest(chunk, digest.hexdigest())

    def _advise(self, jobs: list[tuple[ChunkRecord, torch.Tensor]], index: int, advised: int) -> int:
        """Ask the kernel to read ahead the byte ranges of the next chunks (up to READ_AHEAD_BYTES ahead)."""
        if not hasattr(os, "posix_fadvise"):
            return advised
        ahead = sum(c.framing.length for c, _ in jobs[index:advised])
        while advised < len(jobs) and ahead < READ_AHEAD_BYTES:
            chunk = jobs[advised][0]
            try:
                os.posix_fadvise(self.fds[chunk.file], chunk.offset, chunk.framing.length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            ahead += chunk.framing.length
            advised += 1
        return max(advised, index + 1)

    def _read_staged(self, jobs: list[tuple[ChunkRecord, torch.Tensor]]) -> None:
        device = jobs[0][1].device
        largest = max(c.data_length for c, _ in jobs)
        size = max(1, min(STAGING_BYTES, largest))
        buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for _ in range(STAGING_DEPTH)]
        slots: queue.Queue = queue.Queue()  # (slot, buffer, the event of its last copy)
        for slot, buf in enumerate(buffers):
            slots.put((slot, buf, None))
        pieces: queue.Queue = queue.Queue(maxsize=STAGING_DEPTH)
        stop = threading.Event()
        transfers = _Transfers(device)

        def produce() -> None:
            try:
                for piece in self._pieces(jobs, slots):
                    if stop.is_set():
                        return
                    pieces.put(piece)
                pieces.put(None)
            except BaseException as exc:  # handed to the consumer, which raises it
                pieces.put(exc)

        reader = threading.Thread(target=produce, name="preshard-shard-reader", daemon=True)
        reader.start()
        done: dict[int, int] = {}
        try:
            while True:
                item = pieces.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                region = item.target.narrow(0, item.row, item.rows) if item.chunk.sizes else item.target
                slots.put((item.slot, buffers[item.slot], transfers.copy(region, item.host)))
                done[id(item.chunk)] = done.get(id(item.chunk), 0) + item.rows
                rows_total = item.chunk.sizes[0] if item.chunk.sizes else 1
                if done[id(item.chunk)] >= rows_total:
                    self._count(item.chunk)
            transfers.finish()
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for a slot or for room in the queue
                for slot, buf in enumerate(buffers):
                    slots.put((slot, buf, None))
                try:
                    pieces.get_nowait()
                except queue.Empty:
                    pass
                reader.join(0.05)
