"""Positional reads of a source's tensors that also hash each file on the way, when read front to back.

The converter reads every byte of the source once, in file order, so the provenance hashes cost no
second pass. A file read out of order (a resumed conversion skips what is done) is hashed separately.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash

from preshard.format.fileio import byte_view, pread_into
from preshard.sources.local import CheckpointSource
from preshard.sources.safetensors_file import TensorEntry

HASH_BLOCK = 8 << 20


def hash_file(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class SourceReader:
    """Reads row ranges of source tensors into caller buffers, hashing files read in order."""

    def __init__(self, source: CheckpointSource) -> None:
        self.tensors = source.tensors
        self.files = {h.path: h for h in source.files}
        self.fds = {path: os.open(path, os.O_RDONLY) for path in self.files}
        self.digests = {path: xxhash.xxh3_128() for path in self.files}
        self.positions = {path: 0 for path in self.files}
        for path, header in self.files.items():
            self._feed(path, 0, os.pread(self.fds[path], header.header_bytes, 0))

    def read_rows(self, name: str, start: int, count: int, out: torch.Tensor) -> None:
        """Fill the flat uint8 `out` with rows `[start, start + count)` along dim 0 of tensor `name`."""
        entry = self.tensors[name]
        self.read_into(entry, entry.start + start * entry.row_bytes, out)

    def read_into(self, entry: TensorEntry, offset: int, out: torch.Tensor) -> None:
        """Fill the flat uint8 `out` with `entry`'s file bytes at absolute `offset`."""
        view = byte_view(out)
        pread_into(self.fds[entry.path], offset, [view], entry.path.name)
        self._feed(entry.path, offset, view)

    def _feed(self, path: Path, offset: int, data) -> None:
        if self.positions[path] == offset:
            self.digests[path].update(data)
            self.positions[path] += len(data)
        else:
            self.positions[path] = -1  # out of order: hash the file separately

    def file_hash(self, path: Path) -> str:
        if self.positions[path] == self.files[path].size:
            return self.digests[path].hexdigest()
        return hash_file(path)

    def file_hashes(self) -> dict[str, str]:
        """Each source file's xxh3_128 (from the in-order read where there was one, else a separate pass)."""
        return {path.name: self.file_hash(path) for path in self.files}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
