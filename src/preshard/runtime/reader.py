"""Read one TP rank's chunks straight onto its device, from the raw bytes the manifest locates.

No pickle is read (neither `.metadata` nor the torch.save records): each chunk's bytes are read with
positional reads into a host buffer (pinned where the device benefits), optionally hashed, and
copied into the rank's parameter; one chunk is in host memory at a time. On the CPU the bytes land in
the parameter itself with no staging copy.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from preshard.converter.safetensors_file import dtype_from_name, read_bytes_into
from preshard.errors import ChecksumMismatch, PreshardError
from preshard.manifests.schema import ChunkRecord, Manifest, TensorRecord


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
            raise PreshardError(f"data file {path} is missing; copy the whole checkpoint folder again")
        size = path.stat().st_size
        if size != record.size:
            raise PreshardError(
                f"data file {path} is {size} bytes, the manifest says {record.size}: it is truncated or "
                "damaged; copy it again"
            )


def local_offset(tensor: TensorRecord, chunks: list[ChunkRecord], chunk: ChunkRecord) -> int:
    """Where `chunk` starts along the shard dim of the local tensor: this rank's chunks, in global order."""
    if tensor.shard_dim is None:
        return 0
    d = tensor.shard_dim
    return sum(c.sizes[d] for c in chunks if c.offsets[d] < chunk.offsets[d])


def read_tensor(
    fds: dict[str, int],
    checkpoint: Path,
    tensor: TensorRecord,
    chunks: list[ChunkRecord],
    out: torch.Tensor,
    stats: ReadStats,
    *,
    verify: bool,
    pin: bool,
) -> None:
    """Fill `out` (the local tensor on the rank's device) from this rank's chunks of `tensor`."""
    dtype = dtype_from_name(tensor.dtype)
    for chunk in chunks:
        start = local_offset(tensor, chunks, chunk)
        target = out if tensor.shard_dim is None else out.narrow(tensor.shard_dim, start, chunk.sizes[tensor.shard_dim])
        direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype
        if direct:
            host = target.reshape(-1).view(torch.uint8)
        else:
            host = torch.empty(chunk.data_length, dtype=torch.uint8, pin_memory=pin)
        if host.numel() != chunk.data_length:
            raise PreshardError(f"{tensor.name}: a chunk holds {chunk.data_length} bytes, expected {host.numel()}")
        read_bytes_into(fds[chunk.file], chunk.data_offset, host)
        if verify and xxhash.xxh3_64_hexdigest(host.numpy()) != chunk.xxh3_64:
            raise ChecksumMismatch(
                f"checksum mismatch in {checkpoint / chunk.file} for {tensor.name} "
                f"(bytes {chunk.data_offset}..{chunk.data_offset + chunk.data_length}); the file is damaged"
            )
        if not direct:
            target.copy_(host.view(dtype).reshape(chunk.sizes), non_blocking=pin)
        stats.bytes_read += chunk.data_length
        stats.chunks += 1


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
        if verify:  # the chunks must tile this rank's tensors, or part of a parameter would stay unset
            from preshard.manifests.verify import check_rank_layout

            check_rank_layout(manifest, tp_rank)
        self.fds: dict[str, int] = {}

    def __enter__(self) -> ShardReader:
        self._start = time.perf_counter()
        for name in self.stats.files:
            self.fds[name] = os.open(self.checkpoint / name, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.stats.seconds = time.perf_counter() - self._start

    def read(self, name: str, out: torch.Tensor) -> None:
        read_tensor(
            self.fds, self.checkpoint, self.manifest.tensors[name], self.chunks[name], out, self.stats,
            verify=self.verify, pin=self.pin,
        )  # fmt: skip
