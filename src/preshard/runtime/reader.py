"""Read one TP rank's chunks straight onto its device, from the raw bytes the manifest locates.

No pickle is read (neither `.metadata` nor the torch.save records): each chunk's record framing and raw
bytes come in with one positional read, the framing into a small buffer and the bytes into the
parameter itself on the CPU (or a host buffer, pinned where the device benefits). The framing is
compared with the one the manifest's dtype and shape imply, always: a manifest that disagrees with the
files about a chunk's dtype, shape or position fails here by name instead of loading wrong weights.
`verify=True` also checks each chunk's xxh3_64.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preshard.errors import ChecksumMismatch, CorruptCheckpointError
from preshard.format.fileio import byte_view, pread_into
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import Manifest, TensorRecord, chunk_digest


@dataclass
class ReadStats:
    bytes_read: int = 0
    chunks: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    verified: bool = False


def check_files(checkpoint: Path, manifest: Manifest, names: list[str]) -> None:
    """Each data file this rank needs exists with the recorded size (a missing file would leave rows unset)."""
    for name in names:
        path = checkpoint / name
        record = manifest.file(name)
        if not path.is_file():
            raise CorruptCheckpointError(f"data file {path} is missing; copy the whole checkpoint folder again")
        size = path.stat().st_size
        if size != record.size:
            raise CorruptCheckpointError(
                f"data file {path} is {size} bytes, the manifest says {record.size}: it is truncated or "
                "damaged; copy it again"
            )


class ShardReader:
    """Opens the files one TP rank needs and reads its tensors; use as a context manager."""

    def __init__(self, checkpoint: Path, manifest: Manifest, tp_rank: int, *, verify: bool, pin: bool) -> None:
        self.checkpoint = checkpoint
        self.manifest = manifest
        self.chunks = manifest.chunks_for_tp_rank(tp_rank)
        self.verify = verify
        self.pin = pin
        self.stats = ReadStats(files=manifest.files_for_tp_rank(tp_rank), verified=verify)
        check_files(checkpoint, manifest, self.stats.files)
        self.fds: dict[str, int] = {}

    def __enter__(self) -> ShardReader:
        self._start = time.perf_counter()
        for name in self.stats.files:
            self.fds[name] = os.open(self.checkpoint / name, os.O_RDONLY)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.stats.seconds = time.perf_counter() - self._start

    def read(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (the local tensor on the rank's device) from this rank's chunks of `name`."""
        record = self.manifest.tensors[name]
        for chunk in self.chunks[name]:
            self._read_chunk(record, chunk, out)

    def _read_chunk(self, record: TensorRecord, chunk: ChunkRecord, out: torch.Tensor) -> None:
        layout = record.layout
        d = layout.shard_dim
        target = out if d is None else out.narrow(d, layout.local_start(chunk.box, self.manifest.tp), chunk.sizes[d])
        direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == layout.dtype
        if direct:
            host = target
        else:
            host = torch.empty(chunk.sizes, dtype=layout.dtype, pin_memory=self.pin)
        data = byte_view(host)
        header = bytearray(len(chunk.framing.header))
        path = self.checkpoint / chunk.file
        pread_into(self.fds[chunk.file], chunk.offset, [header, data], str(path))
        if header != chunk.framing.header:
            raise CorruptCheckpointError(
                f"{path}: the record of {layout.name} at byte {chunk.offset} does not frame a "
                f"{str(layout.dtype).removeprefix('torch.')} chunk of shape {list(chunk.sizes)} as the manifest says; "
                "the checkpoint is damaged or its manifest edited: convert it again"
            )
        if self.verify and chunk_digest(data) != chunk.xxh3_64:
            raise ChecksumMismatch(
                f"checksum mismatch in {path} for {layout.name} "
                f"(bytes {chunk.data_offset}..{chunk.data_offset + chunk.data_length}); the file is damaged"
            )
        if not direct:
            target.copy_(host, non_blocking=self.pin)
        self.stats.bytes_read += chunk.data_length
        self.stats.chunks += 1
