"""Where a conversion's source checkpoint comes from: a local file or folder, or a Hugging Face Hub repo."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from preshard.errors import SourceError, SourceNotFoundError, UsageError
from preshard.format.locate import is_url, local_path
from preshard.sources.local import CheckpointSource, open_local

if TYPE_CHECKING:
    import numpy as np

    from preshard.format.dtypes import DType
    from preshard.format.manifest import Source
    from preshard.sources.hub import HubSnapshot


class SourceRows(Protocol):
    """An open source: rows of its tensors, the file each tensor is in, the file hashes it saw, and proofs of what
    each tensor read came from (journalled, so that a resume keeps only what the source still holds)."""

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None: ...
    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> Any: ...
    def finish_band(self, band: Any) -> np.ndarray: ...
    def file_of(self, name: str) -> str: ...
    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]: ...
    def take_proofs(self) -> dict[str, str]: ...
    def prove(self, kept: list[tuple[str, str | None]], check_stop: Any = None) -> int: ...
    def close(self) -> None: ...


class ConversionSource(Protocol):
    """What the converter needs of a source: a safetensors checkpoint (`CheckpointSource`) or, to reshard, a
    converted checkpoint. Tensors are read in bands of whole rows (dim 0), in `read_order()`."""

    config: dict[str, Any] | None

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]: ...
    def read_order(self) -> list[str]: ...
    def input_paths(self) -> list[Path]: ...
    def config_bytes(self) -> bytes | None: ...
    def identity(self) -> str: ...
    def check_unchanged(self, identity: str) -> None: ...
    def open_reader(self) -> SourceRows: ...
    def source_record(self, file_hashes: dict[str, str]) -> Source: ...


def _missing(source: str | Path) -> SourceError:
    return SourceNotFoundError(
        f"source {source} does not exist; pass a .safetensors file, a folder holding them, or a Hub repo id (org/name)"
    )


def _is_hub(source: str | Path) -> bool:
    from preshard.sources import hub

    return isinstance(source, str) and hub.is_repo_id(source)


def open_source(
    source: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> CheckpointSource:
    """A source checkpoint from a local path or, when no such path exists, a Hub repo id.

    A local path always wins over a repo id of the same spelling. `subfolder`, `revision` and `token` apply
    to Hub repos only (`subfolder` also to a local folder). A Hub repo's weights are downloaded (only what the
    conversion reads) into the HF cache, and only the files that download named are opened: the cache's
    snapshot folder may hold other files of the same commit (an fp16 variant diffusers fetched, another index).

    Raises:
        SourceError: the source does not exist, cannot be downloaded, or is not a consistent checkpoint.
    """
    path = local_path(source, subfolder, revision)
    if path is not None:
        return open_local(path)
    if is_url(source):
        return _open_object_source(str(source), subfolder, revision)
    if not _is_hub(source):
        raise _missing(source)
    from preshard.sources import hub

    snapshot = hub.download_source(str(source), subfolder=subfolder, revision=revision, token=token)
    indexes = [name for name in snapshot.files if name.endswith(hub.INDEX_SUFFIX)]
    weights = [name for name in snapshot.files if name.endswith(".safetensors")]
    opened = open_local(snapshot.folder / (indexes[0] if indexes else weights[0]))
    opened.kind, opened.path, opened.hub, opened.given = "hub", snapshot.folder, snapshot, str(source)
    return opened


def _open_object_source(url: str, subfolder: str | None, revision: str | None) -> CheckpointSource:
    """A source in object storage: what the conversion reads fetched once (`sources/object_source.py`), then opened
    as a local source whose recorded path is the URL."""
    from preshard.format.object_store import shown
    from preshard.sources.object_source import fetch_source

    if revision is not None:
        raise UsageError(f"--revision applies to Hub repos, but {shown(url)} is an object-storage URL; drop --revision")
    opened = open_local(fetch_source(url, subfolder))
    opened.given = shown(url.rstrip("/") + (f"/{subfolder.strip('/')}" if subfolder else ""))
    return opened


@dataclass
class HeaderSource:
    """A Hub source known from its safetensors headers alone: enough to plan a conversion, not to run one.

    Why: the headers come with ranged requests (no weights downloaded), so `preshard plan` and
    `convert-checkpoint --dry-run` size a 66 GB conversion before anything large is fetched. Tensors are in
    the order a conversion reads them (the index's file order, then by offset), so planned file layouts are
    the ones a real conversion writes.
    """

    given: str
    hub: HubSnapshot
    tensors: dict[str, tuple[tuple[int, ...], DType]]
    config: dict[str, Any] | None
    raw_config: bytes | None
    kind: str = "hub"

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.tensors.values())

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return dict(self.tensors)

    def read_order(self) -> list[str]:
        return list(self.tensors)

    def input_paths(self) -> list[Path]:
        return []

    def config_bytes(self) -> bytes | None:
        return self.raw_config

    def _headers_only(self, *_: Any) -> Any:
        raise SourceError(
            f"{self.given} was opened from its safetensors headers only; open it with open_source to convert it"
        )

    identity = check_unchanged = open_reader = source_record = _headers_only


def _nbytes(shape: tuple[int, ...], dtype: DType) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def open_source_headers(
    source: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> CheckpointSource | HeaderSource:
    """A source's tensor names, shapes, dtypes and config without reading or downloading any weight.

    A local path is opened as by `open_source` (which reads headers only); a Hub repo's headers are read with
    ranged requests (`preshard.sources.hub.source_headers`), or from the HF cache.

    Raises:
        SourceError: as `open_source`.
    """
    path = local_path(source, subfolder, revision)
    if path is not None:
        return open_local(path)
    if is_url(source):  # (fetched as for a conversion: headers by ranged reads are not built for object storage)
        return _open_object_source(str(source), subfolder, revision)
    if not _is_hub(source):
        raise _missing(source)
    from huggingface_hub import try_to_load_from_cache

    from preshard.format.dtypes import SAFETENSORS_DTYPES
    from preshard.sources import hub
    from preshard.sources.safetensors_file import check_shape

    headers, config, commit = hub.source_headers(str(source), subfolder=subfolder, revision=revision, token=token)
    clean = hub.clean_subfolder(subfolder)
    snapshot = hub.HubSnapshot(str(source), clean, revision, commit, Path(), tuple(headers))
    tensors: dict[str, tuple[tuple[int, ...], DType]] = {}
    for file_name, header in headers.items():
        entries = sorted(
            ((name, info) for name, info in header.items() if name != "__metadata__"),
            key=lambda item: item[1]["data_offsets"][0],
        )
        for name, info in entries:
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise SourceError(f"{file_name}: tensor {name} has unsupported dtype {info['dtype']!r}")
            if name in tensors:
                raise SourceError(f"tensor {name} is stored twice in {source}; fix the repo's safetensors files")
            tensors[name] = (check_shape(list(info["shape"]), dtype, f"{file_name}: tensor {name}"), dtype)
    raw_config = None
    if config is not None:
        cached = try_to_load_from_cache(str(source), hub.join_path(clean, "config.json"), revision=commit)
        raw_config = Path(cached).read_bytes() if isinstance(cached, str) else None
    return HeaderSource(str(source), snapshot, tensors, config, raw_config)


__all__ = [
    "CheckpointSource",
    "ConversionSource",
    "HeaderSource",
    "SourceRows",
    "open_source",
    "open_source_headers",
]
