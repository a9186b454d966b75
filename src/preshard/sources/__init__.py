"""Where a conversion's source checkpoint comes from: a local file or folder, or a Hugging Face Hub repo."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from preshard.errors import SourceError
from preshard.sources.local import CheckpointSource, open_local

if TYPE_CHECKING:
    import torch

    from preshard.format.manifest import Source


class SourceRows(Protocol):
    """An open source: rows of its tensors, the file each tensor is in, and the file hashes it saw."""

    def read_rows(self, name: str, start: int, count: int, out: torch.Tensor) -> None: ...
    def start_band(self, name: str, start: int, count: int, buffer: torch.Tensor) -> Any: ...
    def finish_band(self, band: Any) -> torch.Tensor: ...
    def file_of(self, name: str) -> str: ...
    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]: ...
    def close(self) -> None: ...


class ConversionSource(Protocol):
    """What the converter needs of a source: a safetensors checkpoint (`CheckpointSource`) or, to reshard, a
    converted checkpoint. Tensors are read in bands of whole rows (dim 0), in `read_order()`."""

    config: dict[str, Any] | None

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...
    def read_order(self) -> list[str]: ...
    def input_paths(self) -> list[Path]: ...
    def config_bytes(self) -> bytes | None: ...
    def identity(self) -> str: ...
    def check_unchanged(self, identity: str) -> None: ...
    def open_reader(self) -> SourceRows: ...
    def source_record(self, file_hashes: dict[str, str]) -> Source: ...


def open_source(
    source: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> CheckpointSource:
    """A source checkpoint from a local path or, when no such path exists, a Hub repo id.

    A local path always wins over a repo id of the same spelling. `subfolder`, `revision` and `token` apply
    to Hub repos only (`subfolder` also to a local folder).

    Raises:
        SourceError: the source does not exist, cannot be downloaded, or is not a consistent checkpoint.
    """
    path = Path(source)
    if subfolder and path.is_dir():
        path = path / subfolder
    if path.exists():
        if revision is not None:
            raise SourceError(f"--revision applies to Hub repos, but {source} is a local path; drop --revision")
        return open_local(path)
    from preshard.sources import hub

    if isinstance(source, str) and hub.is_repo_id(source):
        snapshot = hub.download_source(source, subfolder=subfolder, revision=revision, token=token)
        opened = open_local(snapshot.folder)
        opened.kind, opened.hub, opened.given = "hub", snapshot, source
        return opened
    raise SourceError(
        f"source {source} does not exist; pass a .safetensors file, a folder holding them, or a Hub repo id (org/name)"
    )


__all__ = ["CheckpointSource", "ConversionSource", "SourceRows", "open_source"]
