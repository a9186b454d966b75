"""Positional reads of a source's tensors that also hash each file on the way, when read front to back.

The converter reads every byte of the source once, in file order, so the provenance hashes cost no
second pass. Reading again bytes already hashed (a packed column split read once per block) leaves the
hash alone; a file read with gaps (a resumed conversion skips what is done; a parallel worker reads only
what its files need) is hashed separately, if its hash is asked for.
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
        if hasattr(os, "posix_fadvise"):  # front to back: let the kernel read further ahead
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
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

    def file_of(self, name: str) -> str:
        """The name of the source file holding tensor `name`."""
        return self.tensors[name].path.name

    def _feed(self, path: Path, offset: int, data) -> None:
        position = self.positions[path]
        if position == offset:
            self.digests[path].update(data)
            self.positions[path] += len(data)
        elif position < 0 or offset + len(data) > position:
            self.positions[path] = -1  # a gap: hash the file separately

    def file_hash(self, path: Path) -> str:
        if self.positions[path] == self.files[path].size:
            return self.digests[path].hexdigest()
        return hash_file(path)

    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]:
        """Each source file's xxh3_128 (from the in-order read where there was one, else a separate pass); with
        `names`, only those files'."""
        return {path.name: self.file_hash(path) for path in self.files if names is None or path.name in names}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
