"""torch DCP's `.metadata`: written so torch's own `dcp.load` / `dcp_to_torch_save` read a preshard
checkpoint with no preshard installed, and read back only by a restricted unpickler.

The metadata describes the true global tensors: each chunk at its real offsets, each record's byte
range in its data file. preshard's own readers never need it (the manifest says the same); `verify`
reads it with an unpickler that can name nothing but torch's DCP metadata classes, so opening a
hostile checkpoint never runs code.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from preshard.format.manifest import DCP_METADATA_NAME, Manifest


def dcp_metadata(manifest: Manifest) -> Metadata:
    """torch DCP's global metadata for every tensor and every chunk's record."""
    state_dict_metadata = {}
    storage_data = {}
    for name, record in manifest.tensors.items():
        chunks = []
        for index, chunk in enumerate(record.chunks):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)))
            key = MetadataIndex(fqn=name, offset=torch.Size(chunk.offsets), index=index)
            storage_data[key] = _StorageInfo(chunk.file, chunk.offset, chunk.framing.length)
        state_dict_metadata[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=record.layout.dtype),
            size=torch.Size(record.layout.shape),
            chunks=chunks,
        )
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={name: (name,) for name in manifest.tensors},
        storage_data=storage_data,
    )


def dcp_metadata_bytes(manifest: Manifest) -> bytes:
    return pickle.dumps(dcp_metadata(manifest))


def write_dcp_metadata(directory: Path, manifest: Manifest) -> bytes:
    """Write `.metadata` (flushed and fsynced); returns its bytes, for the manifest's record of it."""
    data = dcp_metadata_bytes(manifest)
    with open(Path(directory) / DCP_METADATA_NAME, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _DcpUnpickler(pickle.Unpickler):
    """Unpickles torch DCP metadata and nothing else: no other global can be named, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch's DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a `.metadata` file with the restricted unpickler (may raise anything a damaged pickle raises)."""
    with open(path, "rb") as f:
        return _DcpUnpickler(f).load()


def dcp_metadata_problems(raw: bytes | None, manifest: Manifest) -> list[str]:
    """How `.metadata` (its bytes; None when it is missing) disagrees with the manifest (empty: it describes the
    same chunks at the same bytes, and has the size and hash the manifest records, where it records them)."""
    if raw is None:
        return [f"{DCP_METADATA_NAME} is missing (torch's dcp.load and dcp_to_torch_save need it)"]
    problems = []
    record = manifest.metadata
    if record is not None and not record.matches(raw):  # and what is wrong with it, below (read restricted)
        problems.append(f"{DCP_METADATA_NAME} differs from the one written with the checkpoint (size or xxh3_128)")
    try:
        meta = _DcpUnpickler(io.BytesIO(raw)).load()
        tensors = dict(meta.state_dict_metadata)
        storage = {(k.fqn, tuple(k.offset), k.index): v for k, v in meta.storage_data.items()}
    except Exception as exc:  # a damaged pickle fails in many ways; all mean the same here
        return [*problems, f"{DCP_METADATA_NAME} cannot be read ({type(exc).__name__}); torch's dcp.load would fail"]
    missing = sorted(set(manifest.tensors) - set(tensors))
    extra = sorted(set(tensors) - set(manifest.tensors))
    if missing:
        problems.append(f"{DCP_METADATA_NAME} lacks {len(missing)} of the manifest's tensors, e.g. {missing[0]}")
    if extra:
        problems.append(f"{DCP_METADATA_NAME} names {len(extra)} more tensors than the manifest, e.g. {extra[0]}")
    for name, record in manifest.tensors.items():
        if name not in tensors:
            continue
        try:
            md = tensors[name]
            same = (
                tuple(md.size) == record.layout.shape
                and md.properties.dtype == record.layout.dtype
                and [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [c.box for c in record.chunks]
            )
            for index, c in enumerate(record.chunks):
                info = storage.get((name, c.offsets, index))
                same = same and info is not None
                same = same and (info.relative_path, info.offset, info.length) == (c.file, c.offset, c.framing.length)
        except Exception:
            same = False
        if not same:
            problems.append(f"{DCP_METADATA_NAME} disagrees with the manifest about tensor {name}")
    return problems
