"""Writing DCP data files and `.metadata` for every TP rank from one process, with no process group.

Each chunk is one `torch.save` record, as torch's FileSystemWriter writes it, so `dcp.load` and
`dcp_to_torch_save` read the output with no preshard installed. While writing, the file checksum
is computed on the fly and the position of each record's raw tensor bytes is noted for the runtime.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from preshard.converter.safetensors_file import dtype_from_name, tensor_bytes
from preshard.manifests.schema import DCP_METADATA_NAME, ChunkRecord, TensorRecord


class RankFileWriter:
    """Appends torch.save records to one data file, hashing every byte that goes out."""

    def __init__(self, path: Path, tp_rank: int, resume_from: int = 0) -> None:
        self.path = path
        self.tp_rank = tp_rank
        self.digest = xxhash.xxh3_128()
        mode = "r+b" if resume_from else "wb"
        self.file = open(path, mode)
        if resume_from:
            self.file.truncate(resume_from)
            self._rehash_prefix(resume_from)
            self.file.seek(resume_from)
        self.position = resume_from
        self.error: OSError | None = None

    def _rehash_prefix(self, length: int) -> None:
        self.file.seek(0)
        remaining = length
        while remaining:
            block = self.file.read(min(remaining, 8 << 20))
            self.digest.update(block)
            remaining -= len(block)

    def write(self, data) -> int:
        try:
            self.file.write(data)
        except OSError as exc:  # torch.save's C++ writer would replace it with an opaque RuntimeError
            self.error = exc
            raise
        self.digest.update(data)
        self.position += len(data)
        return len(data)

    def flush(self) -> None:
        self.file.flush()

    def write_chunk(self, tensor: torch.Tensor, offsets: tuple[int, ...], tp_rank: int | None) -> ChunkRecord:
        """One record; `tensor` must own exactly its storage (torch.save writes the whole storage)."""
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        blob_offset = self.position
        try:
            torch.save(tensor, self)
        except RuntimeError:
            if self.error is not None:  # e.g. ENOSPC: surface the OSError itself (the CLI names a full disk)
                raise self.error from None
            raise
        self.file.flush()
        blob_length = self.position - blob_offset
        data_offset = blob_offset + _data_record_offset(self.path, blob_offset, blob_length)
        return ChunkRecord(
            offsets=list(offsets),
            sizes=list(tensor.shape),
            file=self.path.name,
            tp_rank=tp_rank,
            blob_offset=blob_offset,
            blob_length=blob_length,
            data_offset=data_offset,
            data_length=tensor.numel() * tensor.element_size(),
            xxh3_64=xxhash.xxh3_64_hexdigest(tensor_bytes(tensor)),
        )

    def close(self) -> str:
        """Flush, fsync and close; returns the file's checksum."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.digest.hexdigest()


class _Window:
    """A read-only, seekable view of `length` bytes of a file starting at `start` (for zipfile)."""

    def __init__(self, f, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


def _data_record_offset(path: Path, blob_offset: int, blob_length: int) -> int:
    """Offset, inside a torch.save record, of the stored (uncompressed) bytes of its single storage."""
    with open(path, "rb") as f:
        window = _Window(f, blob_offset, blob_length)
        with zipfile.ZipFile(window) as archive:
            infos = [i for i in archive.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")]
            if len(infos) != 1 or infos[0].compress_type != zipfile.ZIP_STORED:
                raise RuntimeError("torch.save wrote an unexpected record layout")
            window.seek(infos[0].header_offset)
            local = window.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            return infos[0].header_offset + 30 + name_len + extra_len


def dcp_metadata(tensors: dict[str, TensorRecord]) -> Metadata:
    """torch DCP's global metadata for the true global tensors and every chunk's record."""
    state_dict_metadata = {}
    storage_data = {}
    for name, tensor in tensors.items():
        chunks = []
        for index, chunk in enumerate(tensor.chunks):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)))
            key = MetadataIndex(fqn=name, offset=torch.Size(chunk.offsets), index=index)
            storage_data[key] = _StorageInfo(chunk.file, chunk.blob_offset, chunk.blob_length)
        state_dict_metadata[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(tensor.dtype)),
            size=torch.Size(tensor.shape),
            chunks=chunks,
        )
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={name: (name,) for name in tensors},
        storage_data=storage_data,
    )


def write_dcp_metadata(directory: Path, tensors: dict[str, TensorRecord]) -> None:
    path = directory / DCP_METADATA_NAME
    with open(path, "wb") as f:
        pickle.dump(dcp_metadata(tensors), f)
        f.flush()
        os.fsync(f.fileno())
