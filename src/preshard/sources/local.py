"""Local checkpoint sources: one `.safetensors` file, or a folder of them described by an `*.index.json`."""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preshard.errors import SourceError, SourceNotFoundError
from preshard.format.dtypes import DType
from preshard.format.folder import read_regular
from preshard.format.jsonio import parse_json_text, read_json
from preshard.sources.safetensors_file import SafetensorsHeader, TensorEntry, read_header

if TYPE_CHECKING:
    from preshard.format.manifest import Source
    from preshard.sources.reader import SourceReader

PREFERRED_INDEXES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
CONFIG_NAME = "config.json"


@dataclass
class CheckpointSource:
    """A source checkpoint's files, tensors and config, from headers only (no tensor data read)."""

    kind: str  # "file" | "folder" | "hub"
    path: Path  # the folder (or file) holding the weights
    files: list[SafetensorsHeader]
    tensors: dict[str, TensorEntry]
    config: dict[str, Any] | None
    config_path: Path | None
    index_name: str | None = None
    index_text: str | None = None
    hub: Any = None  # preshard.sources.hub.HubSnapshot for a Hub repo
    given: str = ""  # the source as the user spelled it
    extra: dict[str, Any] = field(default_factory=dict)
    config_raw: bytes | None = None  # config.json's bytes as parsed: what is committed is what was planned from

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def class_name(self) -> str | None:
        name = (self.config or {}).get("_class_name")
        return name if isinstance(name, str) else None

    def in_file_order(self) -> list[TensorEntry]:
        """Tensors by (file, offset): each file is then read once, front to back."""
        order = {h.path: i for i, h in enumerate(self.files)}
        return sorted(self.tensors.values(), key=lambda t: (order[t.path], t.start))

    # -- what the converter asks of any source (see preshard.sources.ConversionSource)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {name: (entry.shape, entry.dtype) for name, entry in self.tensors.items()}

    def read_order(self) -> list[str]:
        return [entry.name for entry in self.in_file_order()]

    def input_paths(self) -> list[Path]:
        """What the output must not overlap: the files, and a folder source's folder (no output inside it)."""
        return [h.path for h in self.files] + ([self.path] if self.kind == "folder" else [])

    def config_bytes(self) -> bytes | None:
        """config.json's bytes, read once when the source was opened (never again: a file edited or swapped for a
        FIFO after planning cannot reach the output)."""
        if self.config_raw is None and self.config_path is not None:
            self.config_raw = self.config_path.read_bytes()  # a source built by hand, without the bytes
        return self.config_raw

    def identity(self) -> str:
        """What must not change for a partial conversion of this source to be resumed (cheap: no data read)."""
        h = hashlib.sha256()
        for header in self.files:
            stat = header.path.stat()
            h.update(f"{header.path.name}:{stat.st_size}:{stat.st_mtime_ns}:{header.text}".encode())
        return h.hexdigest()

    def check_unchanged(self, identity: str) -> None:
        """Raises SourceError when a file changed (size, mtime or header) since `identity` was taken."""
        for header in self.files:
            try:
                stat = header.path.stat()
                same = (stat.st_size, stat.st_mtime_ns) == (header.size, header.mtime_ns) and _same_header(header)
            except (OSError, SourceError):
                same = False
            if not same:
                raise SourceError(
                    f"source file {header.path.name} changed while it was being converted; nothing was committed: "
                    "re-run the command once the source is no longer being written"
                )
        if self.identity() != identity:
            raise SourceError("the source changed while it was being converted; re-run the command")

    def open_reader(self) -> SourceReader:
        from preshard.sources.reader import SourceReader

        return SourceReader(self)

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        """The manifest's provenance of this source, with the file hashes computed while converting."""
        from preshard.format.manifest import Source, SourceFile

        hub = self.hub
        return Source(
            kind=self.kind,
            path=self.given or str(self.path),
            files=tuple(SourceFile(h.path.name, h.size, file_hashes[h.path.name], h.text) for h in self.files),
            index_name=self.index_name,
            index_text=self.index_text,
            repo_id=getattr(hub, "repo_id", None),
            subfolder=getattr(hub, "subfolder", None),
            revision=getattr(hub, "revision", None),
            commit=getattr(hub, "commit", None),
        )


def _same_header(header: SafetensorsHeader) -> bool:
    """Whether the file still starts with the header it had (its bytes compared, not parsed again: the header of
    100 000 tensors takes seconds to parse)."""
    raw = header.text.encode("utf-8")
    with open(header.path, "rb") as f:
        return f.read(8) == struct.pack("<Q", len(raw)) and f.read(len(raw)) == raw


def open_local(path: str | Path) -> CheckpointSource:
    """A local `.safetensors` file, index file, or weights folder.

    Raises:
        SourceError: the path does not exist or does not hold a consistent safetensors checkpoint.
    """
    given = str(path)
    path = Path(path)
    if not path.exists():
        raise SourceNotFoundError(f"source {path} does not exist; pass a .safetensors file or a folder holding them")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _from_index(path.parent, path, given)
        if not path.name.endswith(".safetensors"):
            raise SourceError(f"source {path} is not a .safetensors file; pass a .safetensors file or a folder")
        return _source("file", path, [read_header(path)], path.parent / CONFIG_NAME, given)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    preferred = [path / name for name in PREFERRED_INDEXES if (path / name).exists()]
    if preferred:
        return _from_index(path, preferred[0], given)
    if len(indexes) == 1:
        return _from_index(path, indexes[0], given)
    if len(indexes) > 1:
        names = ", ".join(i.name for i in indexes)
        raise SourceError(f"source {path} holds several index files ({names}); pass the one to use")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        components = _weight_subfolders(path)
        if components:  # a diffusers pipeline folder (Wan 2.2 A14B: transformer and transformer_2, one expert each)
            each = " and ".join(f"--subfolder {name}" for name in components)
            raise SourceError(
                f"source folder {path} is a pipeline folder, not one model's weights; convert each model you need "
                f"separately, into its own output: {each}"
            )
        raise SourceError(f"source folder {path} holds no .safetensors file; point at the model's weights folder")
    if len(files) > 1:
        raise SourceError(
            f"source folder {path} holds {len(files)} .safetensors files but no *.safetensors.index.json; "
            "pass one file, or add the index that names them"
        )
    return _source("folder", path, [read_header(files[0])], path / CONFIG_NAME, given)


def _weight_subfolders(folder: Path) -> list[str]:
    """The subfolders of a diffusers pipeline folder (it has model_index.json) holding a model's weights and config."""
    if not (folder / "model_index.json").is_file():
        return []
    return sorted(
        sub.name
        for sub in folder.iterdir()
        if sub.is_dir() and (sub / CONFIG_NAME).is_file() and any(sub.glob("*.safetensors*"))
    )


def _from_index(folder: Path, index_path: Path, given: str) -> CheckpointSource:
    fix = "it needs a 'weight_map' of tensor -> file"
    raw = _read_once(index_path, index_path.name, fix)  # its bytes are committed as read, never re-read
    index = parse_json_text(raw, index_path.name, SourceError, fix)
    if not isinstance(index, dict):
        raise SourceError(f"{index_path.name} must hold a JSON object; {fix}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{index_path.name} is not a valid safetensors index; {fix}")
    if not weight_map:
        raise SourceError(f"{index_path.name} names no tensor (an empty weight_map): there is nothing to convert")
    headers = []
    for file_name in dict.fromkeys(weight_map.values()):
        file_path = folder / file_name
        if Path(file_name).name != file_name or not file_path.is_file():
            raise SourceNotFoundError(f"{index_path.name} names {file_name}, which is missing from {folder}")
        headers.append(read_header(file_path))
    source = _source("folder", folder, headers, folder / CONFIG_NAME, given)
    for name, file_name in weight_map.items():
        entry = source.tensors.get(name)
        if entry is None or entry.path.name != file_name:
            raise SourceError(f"{index_path.name} says {name} is in {file_name}, but that file does not hold it")
    extra = sorted(set(source.tensors) - set(weight_map))
    if extra:
        raise SourceError(f"{extra[0]} is stored in {source.tensors[extra[0]].path.name} but not in {index_path.name}")
    source.index_name = index_path.name
    try:
        source.index_text = raw.decode("utf-8")  # as is: read_text would turn CRLF into LF
    except UnicodeDecodeError:
        raise SourceError(f"{index_path.name} is not UTF-8 text; {fix}") from None
    return source


def read_config(config_path: Path) -> dict[str, Any]:
    """A model config.json: a JSON object whose `_class_name`, if present, is a string."""
    fix = "fix or remove it"
    config = read_json(config_path, f"{config_path.name} next to the weights", SourceError, fix)
    return _checked_config(config, config_path)


def config_from_bytes(raw: bytes, config_path: Path) -> dict[str, Any]:
    """`read_config` of bytes already read."""
    fix = "fix or remove it"
    config = parse_json_text(raw, f"{config_path.name} next to the weights", SourceError, fix)
    if not isinstance(config, dict):
        raise SourceError(f"{config_path.name} next to the weights must hold a JSON object; {fix}")
    return _checked_config(config, config_path)


def _checked_config(config: dict[str, Any], config_path: Path) -> dict[str, Any]:
    fix = "fix or remove it"
    if "_class_name" in config and not isinstance(config["_class_name"], str):
        raise SourceError(f"{config_path.name}: _class_name must be a string naming the model class; {fix}")
    return config


def _source(kind: str, path: Path, headers: list[SafetensorsHeader], config_path: Path, given: str) -> CheckpointSource:
    tensors: dict[str, TensorEntry] = {}
    for header in headers:
        for name, entry in header.tensors.items():
            if name in tensors:
                raise SourceError(f"tensor {name} is stored twice, in {tensors[name].path.name} and {header.path.name}")
            tensors[name] = entry
    if not tensors:
        raise SourceError(f"source {path} holds no tensor: there is nothing to convert")
    raw = config = None
    if config_path.is_symlink() and not config_path.exists():
        raise SourceError(
            f"{config_path.name} next to the weights is a link to {os.readlink(config_path)}, which does not exist; "
            "fix or remove the link"
        )
    if config_path.exists():  # a FIFO or folder there: one line, before anything waits on it
        raw = _read_once(config_path, f"{config_path.name} next to the weights", "fix or remove it")
        config = config_from_bytes(raw, config_path)
    return CheckpointSource(
        kind, path, headers, tensors, config, config_path if config is not None else None, given=given, config_raw=raw
    )


def _read_once(path: Path, where: str, fix: str) -> bytes:
    try:
        return read_regular(path, where, SourceError, fix)  # a FIFO or device is refused before it is opened
    except FileNotFoundError:
        raise SourceError(f"{where} does not exist; {fix}") from None
    except OSError as exc:
        raise SourceError(f"{where} cannot be read ({exc.strerror or exc}); {fix}") from None
