"""The manifest: the contract between converter and runtime, as dataclasses that map 1:1 to JSON.

Chunk coordinates follow torch DCP (`offsets`/`sizes` in the global tensor). Each chunk is stored in a
data file as one `torch.save` record (`blob_*`, what torch's DCP reader reads) whose tensor bytes
lie uncompressed at `data_*` (what preshard's runtime reads directly, with no unpickling).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_FORMAT = "preshard-manifest"
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.json"
DCP_METADATA_NAME = ".metadata"
FILE_CHECKSUM = "xxh3_128"
CHUNK_CHECKSUM = "xxh3_64"


def data_file_name(tp_rank: int) -> str:
    """torch DCP's own naming (`__<rank>_<index>.distcp`), one file per TP rank."""
    return f"__{tp_rank}_0.distcp"


@dataclass
class ChunkRecord:
    offsets: list[int]
    sizes: list[int]
    file: str
    tp_rank: int | None  # None: a replicated tensor, stored once and read by every TP rank
    blob_offset: int
    blob_length: int
    data_offset: int
    data_length: int
    xxh3_64: str


@dataclass
class TensorRecord:
    name: str
    style: str
    shard_dim: int | None
    blocks: list[int] | None
    shape: list[int]
    dtype: str
    source_dtype: str
    chunks: list[ChunkRecord] = field(default_factory=list)


@dataclass
class FileRecord:
    name: str
    tp_rank: int
    size: int
    xxh3_128: str


@dataclass
class SourceFileRecord:
    name: str
    size: int
    xxh3_128: str


@dataclass
class SourceRecord:
    kind: str
    path: str
    files: list[SourceFileRecord]
    index: str | None = None
    repo_id: str | None = None
    revision: str | None = None


@dataclass
class RankRecord:
    rank: int
    coords: dict[str, int]
    files: list[str]


@dataclass
class Manifest:
    source: SourceRecord
    mesh: dict[str, Any]
    plan: dict[str, Any]
    tensors: dict[str, TensorRecord]
    files: list[FileRecord]
    ranks: list[RankRecord]
    config: str | None = CONFIG_NAME
    dtype: str | None = None  # the --dtype cast applied to floating tensors, if any
    preshard_version: str = ""
    created: str = ""
    checksums: dict[str, str] = field(default_factory=lambda: {"files": FILE_CHECKSUM, "chunks": CHUNK_CHECKSUM})
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION

    @property
    def tp(self) -> int:
        return int(self.mesh["tp"])

    def chunks_for_tp_rank(self, tp_rank: int) -> dict[str, list[ChunkRecord]]:
        """What one TP rank reads: its own slices plus every replicated tensor."""
        return {
            name: [c for c in tensor.chunks if c.tp_rank in (None, tp_rank)] for name, tensor in self.tensors.items()
        }

    def files_for_tp_rank(self, tp_rank: int) -> list[str]:
        names = {c.file for chunks in self.chunks_for_tp_rank(tp_rank).values() for c in chunks}
        return [f.name for f in self.files if f.name in names]

    def file(self, name: str) -> FileRecord:
        return next(f for f in self.files if f.name == name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        ordered = {"format": data.pop("format"), "version": data.pop("version")}
        ordered.update(data)
        return ordered
