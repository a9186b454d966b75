"""Manifest JSON read/write. Reading is strict: a malformed manifest is a one-line error, never a crash."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

import torch

from preshard.errors import PreshardError
from preshard.manifests.schema import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, Manifest
from preshard.mesh import MeshSpec
from preshard.plans.styles import Style


def write_json_atomic(path: Path, data: Any) -> None:
    """Write, flush and fsync a sibling, then rename over `path`: readers see the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    write_json_atomic(path, manifest.to_dict())
    return path


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of a converted checkpoint directory (or of the manifest.json path itself)."""
    path = Path(checkpoint)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise PreshardError(
            f"{path.parent} is not a complete preshard checkpoint ({MANIFEST_NAME} is missing); "
            "convert it with convert-checkpoint, or re-run an interrupted conversion"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PreshardError(f"{path} is not valid JSON ({type(exc).__name__}); the checkpoint is damaged") from None
    return manifest_from_dict(data, str(path))


def manifest_from_dict(data: Any, origin: str = MANIFEST_NAME) -> Manifest:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise PreshardError(f"{origin} is not a preshard manifest (format is not {MANIFEST_FORMAT!r})")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise PreshardError(f"{origin}: version {version!r} is not a number")
    if version > MANIFEST_VERSION:
        raise PreshardError(
            f"{origin} has manifest version {version}, newer than the {MANIFEST_VERSION} this preshard reads; "
            "upgrade preshard"
        )
    if version < 1:
        raise PreshardError(f"{origin}: manifest version {version} is not valid")
    manifest = _build(Manifest, data, "manifest")
    _check_consistency(manifest, origin)
    return manifest


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, where: str) -> Any:
    """Construct dataclass `cls` from JSON data, type-checking every field."""
    if not isinstance(data, dict):
        raise PreshardError(f"manifest field {where} must be an object")
    hints = _type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PreshardError(f"manifest field {where}.{f.name} is missing")
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise PreshardError(f"manifest field {where} must be a list")
        return [_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise PreshardError(f"manifest field {where} must be an object")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise PreshardError(f"manifest field {where} must be a whole number")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise PreshardError(f"manifest field {where} must be a string")
        return value
    return value


def _check_consistency(m: Manifest, origin: str) -> None:
    def bad(msg: str) -> PreshardError:
        return PreshardError(f"{origin}: {msg}; the checkpoint is damaged, convert it again")

    for key in ("tp", "ring", "ulysses"):
        if not isinstance(m.mesh.get(key, 1), int) or m.mesh.get(key, 1) < 1:
            raise bad(f"mesh.{key} is not a whole number >= 1")
    try:
        mesh = MeshSpec.from_dict(m.mesh)
    except (PreshardError, KeyError, TypeError, ValueError):
        raise bad("mesh is not a valid tp/ring/ulysses mesh") from None
    tp = mesh.tp
    # One data file per TP rank and one entry per rank: this also bounds every loop over the mesh.
    if len(m.files) != tp or sorted(f.tp_rank for f in m.files) != list(range(tp)):
        raise bad(f"the data files are not one per tp rank 0..{tp - 1}")
    if len(m.ranks) != mesh.world_size or any(r.rank != i or r.coords != mesh.coords(i) for i, r in enumerate(m.ranks)):
        raise bad(f"the rank entries do not match the mesh {mesh.describe()}")
    for what, dtype in [("dtype", m.dtype)] + [
        (f"tensor {n}", d) for n, t in m.tensors.items() for d in (t.dtype, t.source_dtype)
    ]:
        if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise bad(f"{what} has unknown dtype {dtype!r}")
    if m.config is not None and Path(m.config).name != m.config:
        raise bad(f"config {m.config!r} is not a plain file name")
    files = {f.name for f in m.files}
    for f in m.files:
        if Path(f.name).name != f.name or f.name.startswith(".."):
            raise bad(f"data file name {f.name!r} is not a plain file name")
        if f.size < 0:
            raise bad(f"file {f.name} has a negative size")
    for name, tensor in m.tensors.items():
        if any(s < 0 for s in tensor.shape):
            raise bad(f"tensor {name} has a negative dimension")
        if tensor.name != name:
            raise bad(f"tensor {name} is recorded under the name {tensor.name!r}")
        if tensor.style not in {s.value for s in Style}:
            raise bad(f"tensor {name} has unknown style {tensor.style!r}")
        if tensor.shard_dim is not None and not 0 <= tensor.shard_dim < len(tensor.shape):
            raise bad(f"tensor {name} has shard dim {tensor.shard_dim}, which its shape {tensor.shape} lacks")
        for chunk in tensor.chunks:
            if chunk.file not in files:
                raise bad(f"tensor {name} has a chunk in {chunk.file}, which the manifest does not list")
            if chunk.tp_rank is not None and not 0 <= chunk.tp_rank < tp:
                raise bad(f"tensor {name} has a chunk of tp rank {chunk.tp_rank}, outside tp={tp}")
            if len(chunk.offsets) != len(tensor.shape) or len(chunk.sizes) != len(tensor.shape):
                raise bad(f"tensor {name} has a chunk whose rank differs from the tensor's")
            for o, s, dim in zip(chunk.offsets, chunk.sizes, tensor.shape):
                if o < 0 or s < 0 or o + s > dim:
                    raise bad(f"tensor {name} has a chunk outside its shape")
            if min(chunk.blob_offset, chunk.blob_length, chunk.data_offset, chunk.data_length) < 0:
                raise bad(f"tensor {name} has a chunk with a negative byte offset or length")
            if not (
                chunk.blob_offset
                <= chunk.data_offset
                <= chunk.data_offset + chunk.data_length
                <= chunk.blob_offset + chunk.blob_length
                <= m.file(chunk.file).size
            ):
                raise bad(f"tensor {name} has a chunk whose bytes lie outside its record or file")
