"""Checkpoint sources: one `.safetensors` file, or a folder of them described by an `*.index.json`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from preshard.converter.safetensors_file import SafetensorsHeader, TensorEntry, read_header, read_rows, tensor_bytes
from preshard.errors import PreshardError

PREFERRED_INDEXES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
HASH_BLOCK = 8 * 1024 * 1024


@dataclass
class CheckpointSource:
    kind: str  # "file" | "folder"
    path: Path
    files: list[SafetensorsHeader]
    tensors: dict[str, TensorEntry]
    config: dict[str, Any] | None
    config_path: Path | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def class_name(self) -> str | None:
        return (self.config or {}).get("_class_name")

    def in_file_order(self) -> list[TensorEntry]:
        """Tensors by (file, offset): each file is then read once, front to back."""
        order = {h.path: i for i, h in enumerate(self.files)}
        return sorted(self.tensors.values(), key=lambda t: (order[t.path], t.start))


def open_source(path: str | Path) -> CheckpointSource:
    path = Path(path)
    if not path.exists():
        raise PreshardError(f"source {path} does not exist; pass a .safetensors file or a folder holding them")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _from_index(path.parent, path)
        if not path.name.endswith(".safetensors"):
            raise PreshardError(f"source {path} is not a .safetensors file; pass a .safetensors file or a folder")
        header = read_header(path)
        config_path = path.parent / "config.json"
        return _source("file", path, [header], config_path)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    preferred = [path / name for name in PREFERRED_INDEXES if (path / name).exists()]
    if preferred:
        return _from_index(path, preferred[0])
    if len(indexes) == 1:
        return _from_index(path, indexes[0])
    if len(indexes) > 1:
        names = ", ".join(i.name for i in indexes)
        raise PreshardError(f"source {path} holds several index files ({names}); pass the one to use")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PreshardError(f"source folder {path} holds no .safetensors file; point at the model's weights folder")
    if len(files) > 1:
        raise PreshardError(
            f"source folder {path} holds {len(files)} .safetensors files but no *.safetensors.index.json; "
            "pass one file, or add the index that names them"
        )
    return _source("folder", path, [read_header(files[0])], path / "config.json")


def _from_index(folder: Path, index_path: Path) -> CheckpointSource:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise PreshardError(
            f"{index_path.name} is not a valid safetensors index (needs a 'weight_map' of tensor -> file)"
        ) from None
    headers = []
    for file_name in dict.fromkeys(weight_map.values()):
        file_path = folder / file_name
        if Path(file_name).name != file_name or not file_path.is_file():
            raise PreshardError(f"{index_path.name} names {file_name}, which is missing from {folder}")
        headers.append(read_header(file_path))
    source = _source("folder", folder, headers, folder / "config.json")
    for name, file_name in weight_map.items():
        entry = source.tensors.get(name)
        if entry is None or entry.path.name != file_name:
            raise PreshardError(f"{index_path.name} says {name} is in {file_name}, but that file does not hold it")
    extra = sorted(set(source.tensors) - set(weight_map))
    if extra:
        raise PreshardError(
            f"{extra[0]} is stored in {source.tensors[extra[0]].path.name} but not in {index_path.name}"
        )
    source.extra["index"] = index_path.name
    return source


def _source(kind: str, path: Path, headers: list[SafetensorsHeader], config_path: Path) -> CheckpointSource:
    tensors: dict[str, TensorEntry] = {}
    for header in headers:
        for name, entry in header.tensors.items():
            if name in tensors:
                raise PreshardError(
                    f"tensor {name} is stored twice, in {tensors[name].path.name} and {header.path.name}"
                )
            tensors[name] = entry
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise PreshardError(f"{config_path.name} next to the weights is not valid JSON; fix or remove it") from None
    return CheckpointSource(kind, path, headers, tensors, config, config_path if config is not None else None)


def hash_file(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class SourceReader:
    """Positional reads of a source's tensors that also hash each file on the way, when it is read front to back.

    The converter reads every byte of the source once, in file order, so the provenance hashes cost no second
    pass. A file read out of order (a resumed conversion skips what is done) is hashed separately at the end.
    """

    def __init__(self, source: CheckpointSource) -> None:
        self.files = {h.path: h for h in source.files}
        self.fds = {path: os.open(path, os.O_RDONLY) for path in self.files}
        self.digests = {path: xxhash.xxh3_128() for path in self.files}
        self.positions = {path: 0 for path in self.files}
        for path, header in self.files.items():
            self._feed(path, 0, os.pread(self.fds[path], header.header_bytes, 0))

    def rows(self, entry: TensorEntry, row_start: int, rows: int) -> torch.Tensor:
        tensor = read_rows(self.fds[entry.path], entry, row_start, rows)
        self._feed(entry.path, entry.start + row_start * entry.row_bytes, tensor_bytes(tensor))
        return tensor

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

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
