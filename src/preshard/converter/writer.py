"""Writing one data file: torch.save records at the offsets the layout decided, hashed as they go out.

Each record is the framing header, the chunk's raw bytes (streamed in pieces), then the framing trailer,
so torch's own DCP reader can read it; no `torch.save` runs and nothing is re-parsed. The writer hashes
every byte it writes (the file's xxh3_128) and each chunk's data (its xxh3_64), so the checksums in the
manifest describe what this process wrote, never what a later read of the disk happens to find.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from preshard.errors import CorruptCheckpointError
from preshard.format.fileio import pread_into
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import file_digest

HASH_BLOCK = 8 << 20


class RecordFileWriter:
    """Appends the records of one data file, in file order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self.digest = file_digest()
        self.position = 0
        self._chunk: ChunkRecord | None = None
        self._chunk_digest = None

    def keep(self, records: list[ChunkRecord]) -> None:
        """Adopt a prefix written by an earlier run: re-check every kept record, framing and data, while hashing.

        Raises:
            CorruptCheckpointError: a kept record does not match; the caller redoes from there.
        """
        buffer = bytearray(HASH_BLOCK)
        for record in records:
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

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self.fd, view, self.position)
            self.digest.update(view[:n])
            self.position += n
            view = view[n:]

    def begin(self, chunk: ChunkRecord) -> None:
        if chunk.offset != self.position:
            raise RuntimeError(
                f"{self.path.name}: record of {chunk.tensor} planned at {chunk.offset}, file at {self.position}"
            )
        self._chunk, self._chunk_digest = chunk, xxhash.xxh3_64()
        self._write(chunk.framing.header)

    def write(self, data) -> None:
        self._chunk_digest.update(data)
        self._write(data)

    def end(self) -> ChunkRecord:
        """Finish the current record; returns its chunk with the data checksum filled in."""
        chunk, digest = self._chunk, self._chunk_digest
        self._write(chunk.framing.trailer)
        if self.position != chunk.end:
            raise RuntimeError(f"{self.path.name}: record of {chunk.tensor} ended at {self.position}, not {chunk.end}")
        self._chunk = None
        return ChunkRecord(
            chunk.tensor, chunk.owner, chunk.box, chunk.file, chunk.offset, chunk.framing, digest.hexdigest()
        )

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> str:
        """fsync and close; returns the file's xxh3_128."""
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return self.digest.hexdigest()

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
