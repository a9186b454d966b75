"""torch DCP's `.metadata`: written so torch's own `dcp.load` / `dcp_to_torch_save` read a preshard
checkpoint with no preshard installed, and read back only by a restricted unpickler.

The metadata describes the true global tensors: each chunk at its real offsets, each record's byte
range in its data file. preshard's own readers never need it (the manifest says the same); `verify`
reads it with an unpickler that can name nothing but torch's DCP metadata classes, so opening a
hostile checkpoint never runs code.

The converter writes it without importing torch (over 3 s of a small conversion's wall time, and
`torch.distributed.checkpoint` another CPU second). It pickles stand-ins instead (`_dcp_metadata_classes`,
`_dcp_filesystem_classes`, `_torch_names`, `_torch_serialization`: the same names, attributes and state as
torch's classes, dtypes and `Size`), then writes torch's module names in place of theirs. Each stand-in module
name occurs in the pickle where torch's does (a global's first use; later ones refer to it by memo), so it is
`pickle.dumps` of torch's own objects (`dcp_metadata`), byte for byte apart from where the pickle's 64 KiB frames
end (each frame's length is measured again); should a tensor or file name contain one of those names, the pickle
is made from torch's classes instead.

Fidelity: the bytes depend on the pickle protocol (4, as `dcp.save` writes on Python 3.8 to 3.13) and on torch's
classes keeping their fields; `tests/unit/test_dcp_metadata.py` compares with torch's own pickle, so a torch that
changes them fails there, not silently.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preshard.format import _dcp_filesystem_classes, _dcp_metadata_classes, _torch_names, _torch_serialization
from preshard.format.dtypes import DType, dtype_from_name
from preshard.format.manifest import DCP_METADATA_NAME, Manifest

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

PICKLE_PROTOCOL = 4  # what torch's dcp.save writes (pickle's default protocol since Python 3.8)
_STAND_INS = (_dcp_metadata_classes, _dcp_filesystem_classes, _torch_names, _torch_serialization)
_FRAME = 0x95  # pickle's FRAME opcode, then the frame's length (8 bytes, little-endian)
_SHORT_BINUNICODE = 0x8C  # then a 1-byte length and the string
_UNFRAMED = {ord("X"): 4, 0x8D: 8}  # BINUNICODE, BINUNICODE8: the bytes of their length, then the string


def dcp_metadata(manifest: Manifest, *, stand_ins: bool = False) -> Metadata:
    """torch DCP's global metadata for every tensor and every chunk's record: torch's own objects, or with
    `stand_ins` their stand-ins (which pickle to the same bytes, module names aside, without torch's DCP)."""
    if stand_ins:
        md, fs = _dcp_metadata_classes, _dcp_filesystem_classes
        make_size, torch_dtype = _torch_names.Size, lambda d: d
    else:
        import torch
        import torch.distributed.checkpoint.filesystem as fs
        import torch.distributed.checkpoint.metadata as md

        make_size, torch_dtype = torch.Size, lambda d: d.torch

    # Equal sizes, offsets, properties and file names are one object each: the pickle then writes each once and
    # refers back to it (a memo reference), a fraction of the time and bytes for many tensors of a few shapes.
    sizes: dict[tuple[int, ...], tuple[int, ...]] = {}
    properties: dict[DType, Any] = {}
    files: dict[str, str] = {}

    def size(dims: tuple[int, ...]) -> tuple[int, ...]:
        found = sizes.get(dims)
        if found is None:
            found = sizes[dims] = make_size(dims)
        return found

    state_dict_metadata = {}
    storage_data = {}
    for name, record in manifest.tensors.items():
        chunks = []
        for index, chunk in enumerate(record.chunks):
            offsets = size(chunk.offsets)
            chunks.append(md.ChunkStorageMetadata(offsets=offsets, sizes=size(chunk.sizes)))
            key = md.MetadataIndex(fqn=name, offset=offsets, index=index)
            file = files.setdefault(chunk.file, chunk.file)
            storage_data[key] = fs._StorageInfo(file, chunk.offset, chunk.framing.length)
        dtype = record.layout.dtype
        if dtype not in properties:
            properties[dtype] = md.TensorProperties(dtype=torch_dtype(dtype))
        state_dict_metadata[name] = md.TensorStorageMetadata(
            properties=properties[dtype], size=size(record.layout.shape), chunks=chunks
        )
    return md.Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={name: (name,) for name in manifest.tensors},
        storage_data=storage_data,
    )


def dcp_metadata_bytes(manifest: Manifest) -> bytes:
    """`pickle.dumps(dcp_metadata(manifest))` (torch's objects), made from the stand-ins (see the module docstring)."""
    ours = [module.__name__ for module in _STAND_INS]
    named = {c.file for r in manifest.tensors.values() for c in r.chunks} | set(manifest.tensors)
    if any(stand_in in name for name in named for stand_in in ours):  # no telling which occurrence to replace
        return pickle.dumps(dcp_metadata(manifest), protocol=PICKLE_PROTOCOL)
    data = pickle.dumps(dcp_metadata(manifest, stand_ins=True), protocol=PICKLE_PROTOCOL)
    renamed = _renamed(data, {module.__name__: module.TORCH_MODULE for module in _STAND_INS})
    if renamed is None:  # never (see above); rather than guess, torch's own classes
        return pickle.dumps(dcp_metadata(manifest), protocol=PICKLE_PROTOCOL)
    return renamed


def _short_string(text: str) -> bytes:
    raw = text.encode()
    return bytes((_SHORT_BINUNICODE, len(raw))) + raw


def _renamed(data: bytes, names: dict[str, str]) -> bytes | None:
    """A protocol-4 pickle with each module name in `names` (a SHORT_BINUNICODE string, as a global's module is
    written) written as its value; each frame's length is measured again. None when the pickle is not laid out so
    (bytes outside frames, a string across frames)."""
    strings = {_short_string(ours): _short_string(theirs) for ours, theirs in names.items()}
    used = [ours for ours in strings if ours in data]
    if data[:2] != bytes((pickle.PROTO[0], PICKLE_PROTOCOL)):
        return None
    out, at = bytearray(data[:2]), 2
    while at < len(data):
        if data[at] in _UNFRAMED:  # a string too large for a frame (a hostile tensor name), written outside them
            width = _UNFRAMED[data[at]]
            end = at + 1 + width + int.from_bytes(data[at + 1 : at + 1 + width], "little")
            out += data[at:end]
            at = end
            continue
        if data[at] != _FRAME:
            return None
        length = int.from_bytes(data[at + 1 : at + 9], "little")
        frame = data[at + 9 : at + 9 + length]
        for ours in used:
            frame = frame.replace(ours, strings[ours])
        out += bytes((_FRAME,)) + len(frame).to_bytes(8, "little") + frame
        at += 9 + length
    if any(ours in out for ours in used):  # an opcode across frames, which the pickler does not write
        return None
    return bytes(out)


def write_dcp_metadata(directory: Path, manifest: Manifest, data: bytes | None = None) -> bytes:
    """Write `.metadata` (flushed and fsynced) for `manifest` (`data`: its `dcp_metadata_bytes`, when made
    already); returns its bytes, for the manifest's record of it."""
    if data is None:
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
    """Unpickles torch DCP metadata and nothing else: no other global can be named, so no code runs. torch's DCP
    classes, dtypes and sizes come back as their stand-ins (the same attributes), so reading needs no torch."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            for stand_in in _STAND_INS:
                if module == stand_in.TORCH_MODULE:
                    return getattr(stand_in, name)
            return super().find_class(module, name)  # collections.OrderedDict
        if module == _torch_names.TORCH_MODULE and dtype_from_name(name) is not None:
            return dtype_from_name(name)
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
