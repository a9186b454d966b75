"""The manifest: the contract between converter, runtime and tools, parsed and validated in one place.

`manifest.json` is plain JSON; in memory it is a `Manifest` of typed, frozen records. Every reader goes
through `read_manifest` / `Manifest.from_dict`, which trusts no field alone:

- a digest (xxh3_128 of the canonical JSON of everything else) catches any edit or damage at once;
- independently of it, every fact that follows from another is re-derived and compared: the plan is
  resolved again against the recorded tensor names and shapes and must give the recorded style, shard
  dim and blocks; a style gives the exact chunk boxes each TP rank owns; a chunk's box gives its owner and
  so its file; dtype and shape give each torch.save record's length, and the records must tile each data
  file exactly; the mesh gives the rank table; the cast gives each tensor's stored dtype.

So a manifest that parses describes a checkpoint in which every rank's local tensors are covered exactly
once. What it cannot show (that the files hold those bytes) the runtime checks cheaply at every load (file
sizes, each record's framing, config.json's hash) and with `verify=True` per chunk (xxh3_64).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

from preshard.errors import (
    CheckpointFileMissingError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestVersionError,
    PlanError,
    UsageError,
)
from preshard.format.dtypes import (
    CAST_TARGETS,
    FLOAT32,
    SAFETENSORS_DTYPES,
    DType,
    cast_dtype,
    dtype_from_name,
    dtype_name,
)
from preshard.format.folder import CheckpointFolder
from preshard.format.jsonio import canonical_json, parse_json_text
from preshard.format.layout import INT64_MAX, ChunkRecord, TensorLayout, data_file_name, fits_int64
from preshard.format.mesh import MeshSpec
from preshard.format.pipeline_record import LeftOut
from preshard.format.plan import Plan, resolve_plan
from preshard.format.quant import QUANTIZE_FORMATS, QUANTIZE_SCALE
from preshard.format.styles import make_style
from preshard.format.torch_record import RECORD_FRAMING_VERSION, record_framing

MANIFEST_FORMAT = "preshard-manifest"
MANIFEST_VERSION = 2
MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.json"
DCP_METADATA_NAME = ".metadata"
FILE_CHECKSUM = "xxh3_128"
CHUNK_CHECKSUM = "xxh3_64"
SOURCE_KINDS = ("file", "folder", "hub")
QUANTIZED_AT_CONVERSION = tuple(name for name, _ in QUANTIZE_FORMATS.values())
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def created_now() -> str:
    """UTC now, or SOURCE_DATE_EPOCH (the reproducible-builds convention) so that two conversions of the same
    source are byte-identical."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        if epoch and epoch.isdigit()
        else datetime.datetime.now(datetime.UTC)
    )
    return when.isoformat(timespec="seconds")


def file_digest() -> xxhash.xxh3_128:
    """The whole-file checksum (data files, config.json, source files)."""
    return xxhash.xxh3_128()


def chunk_digest(data) -> str:
    """The per-chunk checksum of a chunk's raw bytes."""
    return xxhash.xxh3_64_hexdigest(data)


# ---------------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class TensorRecord:
    layout: TensorLayout
    chunks: tuple[ChunkRecord, ...]

    @property
    def name(self) -> str:
        return self.layout.name

    def to_dict(self) -> dict[str, Any]:
        layout = self.layout
        return {
            **layout.style.to_dict(),
            "shard_dim": layout.shard_dim,
            "split_blocks": list(layout.blocks) if layout.blocks is not None else None,
            "shape": list(layout.shape),
            "dtype": dtype_name(layout.dtype),
            "source_dtype": dtype_name(layout.source_dtype),
            "chunks": [
                {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
                 "xxh3_64": c.xxh3_64}
                for c in self.chunks
            ],
        }  # fmt: skip


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    xxh3_128: str

    @classmethod
    def of(cls, name: str, data: bytes) -> FileRecord:
        """The record of a small file held in memory (config.json)."""
        return cls(name, len(data), xxhash.xxh3_128_hexdigest(data))

    def matches(self, data: bytes) -> bool:
        """`data` is the file this records: same size and xxh3_128."""
        return len(data) == self.size and xxhash.xxh3_128_hexdigest(data) == self.xxh3_128


@dataclass(frozen=True)
class SourceFile:
    """A source safetensors file: its size, hash, and raw header text (so `unshard` can rebuild it bit for bit)."""

    name: str
    size: int
    xxh3_128: str
    header: str


@dataclass(frozen=True)
class LoraModule:
    """What one LoRA changed in one Linear: `W += scaling * B @ A` with A of `rank` rows (and its bias by `scaling *
    B.bias` when `bias`). `scaling` is PEFT's (alpha / rank, or what the file's adapter config says) times the
    user's scale."""

    rank: int
    scaling: float
    bias: bool = False


@dataclass(frozen=True)
class LoraRecord:
    """A LoRA fused into the weights at conversion (`convert-checkpoint --lora`): which file, with what scale, read
    how, and what it changed. Why: the checkpoint's weights are no longer the source's, and the record says by what."""

    name: str  # the file name
    path: str  # as given (for a Hub LoRA: repo id / file)
    size: int
    xxh3_128: str
    scale: float  # --lora-scale
    loader: str  # what read the file's keys (a diffusers LoRA loader, or safetensors for the diffusers/PEFT format)
    converted: bool  # its keys were in another format (kohya, ...) and converted by `loader`
    modules: dict[str, LoraModule]
    repo_id: str | None = None
    commit: str | None = None

    def tensors(self) -> set[str]:
        """The checkpoint tensors this LoRA changed."""
        touched = {f"{m}.weight" for m in self.modules}
        return touched | {f"{m}.bias" for m, info in self.modules.items() if info.bias}

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in vars(self).items() if k != "modules"}
        data["modules"] = {m: vars(info).copy() for m, info in sorted(self.modules.items())}
        return data


@dataclass(frozen=True)
class Source:
    kind: str  # file | folder | hub
    path: str  # as given (a repo id for the Hub)
    files: tuple[SourceFile, ...]
    index_name: str | None = None
    index_text: str | None = None
    repo_id: str | None = None
    subfolder: str | None = None
    revision: str | None = None  # as requested
    commit: str | None = None  # as resolved
    loras: tuple[LoraRecord, ...] = ()  # fused at conversion, in the order applied; absent from the JSON when none
    left_out: LeftOut | None = None  # decoder layers and head left out before sharding (--keep-layers); absent: none

    def lora_tensors(self) -> set[str]:
        """The tensors a fused LoRA changed: they no longer equal the source's."""
        return set().union(*(lora.tensors() for lora in self.loras)) if self.loras else set()


def _is_class_spec(value: Any) -> bool:
    """`module:Class` (Python identifiers, the module dotted; at most 300 characters): what `model_class` records."""
    if not isinstance(value, str) or len(value) > 300:
        return False
    module, colon, name = value.partition(":")
    return bool(colon) and all(part.isidentifier() for part in [*module.split("."), *name.split(".")])


@dataclass(frozen=True)
class Provenance:
    """Where a resharded checkpoint came from."""

    kind: str  # reshard
    checkpoint: str
    mesh: dict[str, Any]
    digest: str


@dataclass(frozen=True)
class Manifest:
    source: Source
    mesh: MeshSpec
    plan: Plan
    tensors: dict[str, TensorRecord]
    files: tuple[FileRecord, ...]
    config: FileRecord | None = None
    dtype: DType | None = None  # the cast applied to floating tensors, if any
    derived_from: Provenance | None = None
    preshard_version: str = ""
    created: str = ""
    digest: str = ""
    metadata: FileRecord | None = None  # `.metadata`'s size and hash (absent from manifests written before it)
    quantize: str | None = None  # `--quantize`: the stored dtype of the weights quantized at conversion, if any
    # `--model-class`: the user's own class the conversion was planned with, as `module:Class`; a record for people
    # and tools, never imported from (`load_sharded` takes the class from its caller).
    model_class: str | None = None

    def quantized_at_conversion(self) -> dict[str, str]:
        """Weight -> the per-output-channel scale computed for it at conversion (`--quantize`; empty without)."""
        if self.quantize is None:
            return {}
        return {
            name: f"{name.rpartition('.')[0]}.{QUANTIZE_SCALE}"
            for name, record in self.tensors.items() if record.layout.quantizes
        }  # fmt: skip

    @property
    def tp(self) -> int:
        return self.mesh.tp

    def chunks_for_tp_rank(self, tp_rank: int) -> dict[str, list[ChunkRecord]]:
        """What one TP rank reads: its own chunks plus every replicated tensor."""
        return {name: [c for c in record.chunks if c.owner in (None, tp_rank)] for name, record in self.tensors.items()}

    def read_bytes(self, tp_rank: int) -> int:
        """The bytes this TP rank reads at load (`ChunkRecord.load_bytes` of each record it reads)."""
        return sum(c.load_bytes for chunks in self.chunks_for_tp_rank(tp_rank).values() for c in chunks)

    def files_for_tp_rank(self, tp_rank: int) -> list[str]:
        names = {c.file for chunks in self.chunks_for_tp_rank(tp_rank).values() for c in chunks}
        return [f.name for f in self.files if f.name in names]

    def file(self, name: str) -> FileRecord:
        return next(f for f in self.files if f.name == name)

    def rank_table(self) -> list[dict[str, Any]]:
        """rank -> coordinates -> the data files it reads, for every rank of the converted mesh."""
        replicated: set[str] = set()  # one pass over the chunks for every TP rank (not one per rank)
        owned: list[set[str]] = [set() for _ in range(self.tp)]
        for record in self.tensors.values():
            for c in record.chunks:
                (replicated if c.owner is None else owned[c.owner]).add(c.file)
        files = {r: [f.name for f in self.files if f.name in replicated or f.name in owned[r]] for r in range(self.tp)}
        table = []
        for rank in range(self.mesh.world_size):
            coords = self.mesh.coords(rank)
            table.append({"rank": rank, "coords": coords, "files": files[coords["tp"]]})
        return table

    def with_mesh(self, mesh: MeshSpec, derived_from: Provenance | None = None, **fields: Any) -> Manifest:
        """The same weights described for another CP layout (tp must not change), with any other `fields`
        replaced; digest recomputed."""
        if mesh.tp != self.tp:
            raise UsageError(f"a manifest for tp={self.tp} cannot describe tp={mesh.tp} without resharding")
        return replace(self, mesh=mesh, derived_from=derived_from or self.derived_from, **fields).sealed()

    def body(self) -> dict[str, Any]:
        """Everything but the digest, as plain JSON data."""
        source = self.source
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "preshard_version": self.preshard_version,
            "created": self.created,
            "source": {
                "kind": source.kind, "path": source.path, "index_name": source.index_name,
                "index_text": source.index_text, "repo_id": source.repo_id, "subfolder": source.subfolder,
                "revision": source.revision, "commit": source.commit,
                "files": [vars(f).copy() for f in source.files],
                **({"loras": [lora.to_dict() for lora in source.loras]} if source.loras else {}),
                **({"left_out": source.left_out.to_dict()} if source.left_out is not None else {}),
            },
            "derived_from": vars(self.derived_from).copy() if self.derived_from else None,
            "mesh": self.mesh.to_dict(),
            "plan": self.plan.to_dict(),
            "dtype": dtype_name(self.dtype) if self.dtype is not None else None,
            "config": vars(self.config).copy() if self.config else None,
            "records": {"framing": "torch.save", "version": RECORD_FRAMING_VERSION},
            "checksums": {"files": FILE_CHECKSUM, "chunks": CHUNK_CHECKSUM},
            "tensors": {name: self.tensors[name].to_dict() for name in sorted(self.tensors)},
            "files": [vars(f).copy() for f in self.files],
            "ranks": self.rank_table(),
            # Only when recorded, so that a manifest written before the field existed keeps its digest.
            **({"metadata": vars(self.metadata).copy()} if self.metadata is not None else {}),
            **({"quantize": self.quantize} if self.quantize is not None else {}),
            **({"model_class": self.model_class} if self.model_class is not None else {}),
        }  # fmt: skip

    def compute_digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(canonical_json(self.body()))

    def sealed(self) -> Manifest:
        return replace(self, digest=self.compute_digest())

    def sealed_dict(self) -> tuple[Manifest, dict[str, Any]]:
        """`sealed()` and its `to_dict()`, building the body once (most of a large manifest's cost)."""
        body = self.body()
        digest = xxhash.xxh3_128_hexdigest(canonical_json(body))
        return replace(self, digest=digest), {**body, "digest": digest}

    def to_dict(self) -> dict[str, Any]:
        return {**self.body(), "digest": self.digest or self.compute_digest()}

    @classmethod
    def from_dict(cls, data: Any, origin: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate plain JSON data (see the module docstring for what is checked).

        Raises:
            CorruptCheckpointError: one line naming the field or tensor at fault, or a manifest of another format
                version (past or future: the message says which to convert again or upgrade).
        """
        return _Parser(origin).manifest(data)


def manifest_folder(checkpoint: str | Path) -> Path:
    """The checkpoint folder `checkpoint` names: the folder itself, or the folder of a `manifest.json` path.

    Raises:
        CheckpointNotFoundError: no such folder. CorruptCheckpointError: a file that is not a manifest.json.
    """
    path = Path(checkpoint)
    if path.is_dir():
        return path
    if path.name == MANIFEST_NAME and path.parent.is_dir():
        return path.parent
    if path.exists():
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint} is a file, not a checkpoint folder; pass the folder convert-checkpoint wrote"
        )
    raise CheckpointNotFoundError(f"checkpoint {checkpoint} does not exist; pass the folder convert-checkpoint wrote")


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of a converted checkpoint folder (or of the `manifest.json` path itself).

    Read through `CheckpointFolder`: a manifest that is a link out of the folder, or not a regular file, is refused.

    Raises:
        CorruptCheckpointError: no manifest (an incomplete conversion), or one that is damaged or edited.
    """
    folder = CheckpointFolder(manifest_folder(checkpoint))
    try:
        raw = folder.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        raise missing_manifest(folder.path) from None
    manifest = manifest_from_bytes(raw, folder.where(MANIFEST_NAME))
    if manifest.config is None and os.path.lexists(folder.path / CONFIG_NAME):
        # A conversion writes config.json exactly when it records it: a config the manifest does not vouch for
        # (its record nulled, the digest re-sealed) would be used to build the model unchecked.
        raise CorruptCheckpointError(
            f"{folder.where(MANIFEST_NAME)} records no {CONFIG_NAME}, but the folder holds one: the manifest was "
            f"edited or the file added after conversion; remove {CONFIG_NAME} or convert the checkpoint again"
        )
    return manifest


def missing_manifest(folder: Path) -> CheckpointFileMissingError:
    return CheckpointFileMissingError(
        f"{folder} is not a complete preshard checkpoint ({MANIFEST_NAME} is missing); "
        "convert it with convert-checkpoint, or re-run an interrupted conversion"
    )


def manifest_from_bytes(raw: bytes, origin: str) -> Manifest:
    """Parse and validate a manifest's bytes (as read from `origin`).

    Raises:
        CorruptCheckpointError: not a JSON object, or a damaged or edited manifest.
    """
    data = parse_json_text(raw, origin, CorruptCheckpointError, "the checkpoint is damaged; convert it again")
    if not isinstance(data, dict):
        raise CorruptCheckpointError(
            f"{origin} must hold a JSON object, not {type(data).__name__}; the checkpoint is damaged; convert it again"
        )
    return Manifest.from_dict(data, origin)


# ---------------------------------------------------------------------------------------------------------
# Parsing


class _Parser:
    """Strict field-by-field reading; every problem is one line naming `origin` and where."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def bad(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.origin}: {message}; the checkpoint is damaged or edited, convert it again"
        )

    def obj(self, value: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:
        if type(value) is dict and value.keys() == required:  # the common case, at once
            return value
        if not isinstance(value, dict):
            raise self.bad(f"{where} must be an object")
        missing = sorted(required - set(value))
        if missing:
            raise self.bad(f"{where} lacks {missing[0]!r}")
        unknown = sorted(set(value) - required - set(optional))
        if unknown:
            raise self.bad(f"{where} has unknown field {unknown[0]!r}")
        return value

    def int(self, value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.bad(f"{where} must be a whole number >= 0")
        if value > INT64_MAX:
            raise self.bad(f"{where} is {value}, more than a 64-bit size can hold")
        return value

    def str(self, value: Any, where: str, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.bad(f"{where} must be a string")
        return value

    def hex(self, value: Any, where: str, pattern: re.Pattern) -> str:
        if not isinstance(value, str) or not pattern.match(value):
            raise self.bad(f"{where} must be a lowercase hex checksum")
        return value

    def plain_name(self, value: Any, where: str) -> str:
        if (
            not isinstance(value, str)
            or not value
            or Path(value).name != value
            or value in (".", "..")
            or "\0" in value
            or "\\" in value
        ):
            raise self.bad(f"{where} {value!r} is not a plain file name")
        return value

    def shape(self, value: Any, where: str, dtype: DType) -> tuple[int, ...]:
        """A shape whose contiguous strides and byte size fit int64 (what torch can allocate and address)."""
        shape = self.ints(value, f"{where} shape")
        if not fits_int64(shape, dtype.itemsize):
            raise self.bad(f"{where} shape {list(shape)} of {dtype_name(dtype)} is larger than a 64-bit size holds")
        return shape

    def ints(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.bad(f"{where} must be a list of whole numbers")
        return tuple(self.int(v, where) for v in value)

    def dtype(self, value: Any, where: str) -> DType:
        dtype = dtype_from_name(value)
        if dtype is None:
            raise self.bad(f"{where} has unknown dtype {value!r}")
        return dtype

    def file_record(self, value: Any, where: str) -> FileRecord:
        f = self.obj(value, where, {"name", "size", "xxh3_128"})
        return FileRecord(
            self.plain_name(f["name"], f"{where}.name"),
            self.int(f["size"], f"{where}.size"),
            self.hex(f["xxh3_128"], f"{where}.xxh3_128", _HEX32),
        )

    # -- the whole manifest

    def manifest(self, data: Any) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(
                f"{self.origin} is not a preshard manifest (format is not {MANIFEST_FORMAT!r})"
            )
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise self.bad(f"version {version!r} is not valid")
        if version > MANIFEST_VERSION:
            raise ManifestVersionError(
                f"{self.origin} has manifest version {version}, newer than the {MANIFEST_VERSION} this preshard "
                "reads; upgrade preshard"
            )
        if version < MANIFEST_VERSION:
            raise ManifestVersionError(
                f"{self.origin} has manifest version {version}, which this preshard no longer loads; "
                "convert the source checkpoint again with this version"
            )
        top = {
            "format", "version", "preshard_version", "created", "source", "derived_from", "mesh", "plan", "dtype",
            "config", "records", "checksums", "tensors", "files", "ranks", "digest",
        }  # fmt: skip
        self.obj(data, "manifest", top, {"metadata", "quantize", "model_class"})
        digest = self.hex(data["digest"], "digest", _HEX32)
        body = {k: v for k, v in data.items() if k != "digest"}
        if xxhash.xxh3_128_hexdigest(canonical_json(body)) != digest:
            raise CorruptCheckpointError(
                f"{self.origin} does not match its digest: it was edited or damaged after conversion; "
                "restore it from the original, or convert the checkpoint again"
            )
        records = self.obj(data["records"], "records", {"framing", "version"})
        if records != {"framing": "torch.save", "version": RECORD_FRAMING_VERSION}:
            raise self.bad(f"records {records} is not a record framing this preshard writes")
        if data["checksums"] != {"files": FILE_CHECKSUM, "chunks": CHUNK_CHECKSUM}:
            raise self.bad("checksums must be xxh3_128 for files and xxh3_64 for chunks")
        try:
            mesh = MeshSpec.from_dict(data["mesh"])
        except UsageError as exc:
            raise self.bad(f"mesh: {exc}") from None
        # The rank table is rebuilt below from the mesh: bound it by the table the file holds before building it.
        if not isinstance(data["ranks"], list) or len(data["ranks"]) != mesh.world_size:
            raise self.bad(
                f"the rank table lists {len(data['ranks']) if isinstance(data['ranks'], list) else 'no'} ranks, "
                f"but the mesh {mesh.describe()} has {mesh.world_size}"
            )
        try:
            plan = Plan.from_dict(data["plan"], origin="plan")
        except PlanError as exc:
            raise self.bad(str(exc)) from None
        cast = None
        if data["dtype"] is not None:
            cast = self.dtype(data["dtype"], "dtype")
            if cast not in CAST_TARGETS:
                raise self.bad(f"dtype {data['dtype']!r} is not a cast preshard applies")
        quantize = data.get("quantize")
        if quantize is not None and quantize not in QUANTIZED_AT_CONVERSION:
            raise self.bad(f"quantize {quantize!r} is not a format preshard quantizes to")
        model_class = data.get("model_class")
        if model_class is not None and not _is_class_spec(model_class):
            raise self.bad(f"model_class {str(model_class)[:80]!r} is not module:Class")
        files = self.files(data["files"], mesh.tp)
        tensors = self.tensors(data["tensors"], mesh.tp, cast, {f.name for f in files}, quantize)
        self.check_plan(plan, tensors, mesh.tp, cast)
        self.check_tiling(tensors, files)
        source = self.source(data["source"])
        self.check_source_dtypes(source, tensors)
        manifest = Manifest(
            source=source,
            mesh=mesh,
            plan=plan,
            tensors=tensors,
            files=files,
            config=self.file_record(data["config"], "config") if data["config"] is not None else None,
            metadata=self.metadata_record(data.get("metadata")),
            dtype=cast,
            derived_from=self.provenance(data["derived_from"]),
            preshard_version=self.str(data["preshard_version"], "preshard_version"),
            created=self.str(data["created"], "created"),
            digest=digest,
            quantize=quantize,
            model_class=model_class,
        )
        if data["ranks"] != manifest.rank_table():
            raise self.bad(f"the rank table does not match the mesh {mesh.describe()} and the chunks each rank reads")
        return manifest

    def files(self, value: Any, tp: int) -> tuple[FileRecord, ...]:
        if not isinstance(value, list) or len(value) != tp:
            raise self.bad(f"files must list one data file per tp rank 0..{tp - 1}")
        files = tuple(self.file_record(f, f"files[{i}]") for i, f in enumerate(value))
        for r, f in enumerate(files):
            if f.name != data_file_name(r):
                raise self.bad(f"files[{r}] is {f.name!r}; the data file of tp rank {r} is {data_file_name(r)}")
        return files

    def tensors(
        self, value: Any, tp: int, cast: DType | None, files: set[str], quantize: str | None = None
    ) -> dict[str, TensorRecord]:
        if not isinstance(value, dict):
            raise self.bad("tensors must be an object")
        keys = {"style", "blocks", "shard_dim", "split_blocks", "shape", "dtype", "source_dtype", "chunks"}
        required = keys - {"blocks"}
        out = {}
        for name, raw in value.items():
            where = f"tensor {name}"
            t = self.obj(raw, where, required, {"blocks"})
            try:
                style = make_style(t["style"], t.get("blocks"), where)
            except PlanError as exc:
                raise self.bad(str(exc)) from None
            dtype = self.dtype(t["dtype"], where)
            source_dtype = self.dtype(t["source_dtype"], where)
            shape = self.shape(t["shape"], where, max(dtype, source_dtype, key=lambda d: d.itemsize))
            leaf = name.rpartition(".")[2]
            made = quantize is not None and (
                (
                    leaf == "weight"
                    and dtype.name == quantize
                    and source_dtype.is_floating_point
                    and source_dtype.itemsize > 1
                )
                or (leaf == QUANTIZE_SCALE and dtype == source_dtype == FLOAT32)
            )  # --quantize: a weight quantized at conversion, or the float32 scale computed for it
            if dtype != cast_dtype(source_dtype, cast) and not made:
                raise self.bad(
                    f"{where} is stored as {dtype_name(dtype)}, but {dtype_name(source_dtype)} under the "
                    f"checkpoint's cast ({dtype_name(cast) if cast else 'none'}) is stored as "
                    f"{dtype_name(cast_dtype(source_dtype, cast))}"
                )
            try:
                layout = TensorLayout.make(name, style, shape, dtype, source_dtype)
            except PlanError as exc:
                raise self.bad(str(exc)) from None
            recorded_blocks = t["split_blocks"]
            if t["shard_dim"] != layout.shard_dim or recorded_blocks != (
                list(layout.blocks) if layout.blocks is not None else None
            ):
                raise self.bad(
                    f"{where}: a {style.name} {name.rpartition('.')[2]} of shape {list(shape)} is split on dim "
                    f"{layout.shard_dim} in blocks {list(layout.blocks or ())}, not as recorded "
                    f"(dim {t['shard_dim']}, blocks {recorded_blocks})"
                )
            if layout.sharded:
                for what, size in layout.split_sizes():
                    if size % tp:
                        raise self.bad(f"{what} (size {size}) does not split into tp={tp} equal parts")
            out[name] = TensorRecord(layout, self.chunks(t["chunks"], layout, tp, files))
        return out

    def chunks(self, value: Any, layout: TensorLayout, tp: int, files: set[str]) -> tuple[ChunkRecord, ...]:
        where = f"tensor {layout.name}"
        expected = layout.all_boxes(tp)
        if not isinstance(value, list) or len(value) != len(expected):
            raise self.bad(f"{where} must have {len(expected)} chunks for its {layout.style.name} split at tp={tp}")
        chunks = []
        for i, ((owner, box), raw) in enumerate(zip(expected, value)):
            if _chunk_ok(raw, box, owner, files):  # checked at once; else one by one below, for the message
                framing = record_framing(layout.dtype, box[1])
                chunks.append(ChunkRecord(layout.name, owner, box, raw["file"], raw["offset"], framing, raw["xxh3_64"]))
                continue
            c = self.obj(raw, f"{where} chunk {i}", _CHUNK_KEYS)
            got = (self.ints(c["offsets"], f"{where} chunk {i} offsets"), self.ints(c["sizes"], f"{where} chunk {i}"))
            if got != box:
                raise self.bad(
                    f"{where} chunk {i} is offsets {list(got[0])} sizes {list(got[1])}; its "
                    f"{layout.style.name} split at tp={tp} gives offsets {list(box[0])} sizes {list(box[1])}"
                )
            file = self.plain_name(c["file"], f"{where} chunk {i} file")
            if file not in files or (owner is not None and file != data_file_name(owner)):
                owner_file = data_file_name(owner) if owner is not None else "a data file of the checkpoint"
                raise self.bad(f"{where} chunk {i} (tp rank {owner}) is recorded in {file}; it belongs in {owner_file}")
            chunks.append(
                ChunkRecord(
                    layout.name, owner, box, file, self.int(c["offset"], f"{where} chunk {i} offset"),
                    record_framing(layout.dtype, box[1]), self.hex(c["xxh3_64"], f"{where} chunk {i} xxh3_64", _HEX16),
                )
            )  # fmt: skip
        return tuple(chunks)

    def check_plan(self, plan: Plan, tensors: dict[str, TensorRecord], tp: int, cast: DType | None) -> None:
        """The embedded plan, resolved again, gives every tensor exactly its recorded style."""
        # (a weight quantized at conversion is resolved as stored, so that its scale is seen as a scale)
        shapes = {
            name: (r.layout.shape, r.layout.dtype if r.layout.quantizes else r.layout.source_dtype)
            for name, r in tensors.items()
        }
        try:
            resolved = resolve_plan(plan, shapes, tp, cast=cast, derive_blocks=True)  # (no config.json here)
        except PlanError as exc:
            raise self.bad(f"the embedded plan does not fit the tensors: {exc}") from None
        for name, record in tensors.items():
            if resolved[name].style != record.layout.style:
                raise self.bad(
                    f"tensor {name} is recorded as {record.layout.style.name}, but the plan gives it "
                    f"{resolved[name].style.name}"
                )

    def check_source_dtypes(self, source: Source, tensors: dict[str, TensorRecord]) -> None:
        """Each tensor's source dtype is the one the recorded source header gives a tensor of its name and shape.

        Why: an int32 where the source held float32 (same size, the digest re-sealed) tiles the data files as well,
        and would be read as integers; the manifest carries the source's own header to tell.
        """
        for f in source.files:
            try:
                header = json.loads(f.header)
            except ValueError:
                continue  # (a header is kept as text for unshard; its own checks are the source's)
            if not isinstance(header, dict):
                continue
            for name, entry in header.items():
                record = tensors.get(name)
                if record is None or not isinstance(entry, dict) or entry.get("shape") != list(record.layout.shape):
                    continue  # not this tensor (renamed, left out, or another tensor of that name)
                recorded = SAFETENSORS_DTYPES.get(entry.get("dtype"))
                if recorded is not None and recorded != record.layout.source_dtype:
                    raise self.bad(
                        f"tensor {name} is recorded as {dtype_name(record.layout.source_dtype)} in the source, but "
                        f"the source header of {f.name} gives it {dtype_name(recorded)}"
                    )

    def check_tiling(self, tensors: dict[str, TensorRecord], files: tuple[FileRecord, ...]) -> None:
        """Each data file is exactly its records, back to back: no gap, no overlap, no trailing bytes."""
        by_file: dict[str, list[ChunkRecord]] = {f.name: [] for f in files}
        for record in tensors.values():
            for c in record.chunks:
                by_file[c.file].append(c)
        for f in files:
            position = 0
            for c in sorted(by_file[f.name], key=lambda c: c.offset):
                if c.offset != position:
                    what = "overlaps the record before it" if c.offset < position else f"leaves a gap at {position}"
                    raise self.bad(f"{f.name}: the record of tensor {c.tensor} at byte {c.offset} {what}")
                position = c.offset + c.framing.length
            if position != f.size:
                raise self.bad(f"{f.name}: its records end at byte {position}, but the file is recorded as {f.size}")

    def source(self, value: Any) -> Source:
        keys = {"kind", "path", "files", "index_name", "index_text", "repo_id", "subfolder", "revision", "commit"}
        s = self.obj(value, "source", keys, {"loras", "left_out"})
        if s["kind"] not in SOURCE_KINDS:
            raise self.bad(f"source kind {s['kind']!r} is not one of {', '.join(SOURCE_KINDS)}")
        if not isinstance(s["files"], list):
            raise self.bad("source files must be a list")
        files = []
        for i, f in enumerate(s["files"]):
            f = self.obj(f, f"source file {i}", {"name", "size", "xxh3_128", "header"})
            files.append(
                SourceFile(
                    self.plain_name(f["name"], f"source file {i} name"),
                    self.int(f["size"], f"source file {i} size"),
                    self.hex(f["xxh3_128"], f"source file {i} xxh3_128", _HEX32),
                    self.str(f["header"], f"source file {i} header"),
                )
            )
        optional = {k: self.str(s[k], f"source {k}", optional=True) for k in keys - {"kind", "path", "files"}}
        if optional["index_name"] is not None:
            self.plain_name(optional["index_name"], "source index_name")
        loras = self.loras(s["loras"]) if "loras" in s else ()
        left_out = self.left_out(s["left_out"]) if "left_out" in s else None
        return Source(
            kind=s["kind"], path=self.str(s["path"], "source path"), files=tuple(files), loras=loras,
            left_out=left_out, **optional,
        )  # fmt: skip

    def left_out(self, value: Any) -> LeftOut:
        keys = {"keep_layers", "layers", "tensors", "bytes", "modules"}
        v = self.obj(value, "source left_out", keys)
        counts = {k: self.int(v[k], f"source left_out {k}") for k in ("keep_layers", "layers", "tensors", "bytes")}
        if not 1 <= counts["keep_layers"] <= counts["layers"]:
            raise self.bad("source left_out keep_layers must be between 1 and layers")
        modules = v["modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise self.bad("source left_out modules must be a list of module names")
        return LeftOut(counts["keep_layers"], counts["layers"], counts["tensors"], counts["bytes"], tuple(modules))

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(f"{where} must be a finite number")
        return float(value)

    def loras(self, value: Any) -> tuple[LoraRecord, ...]:
        if not isinstance(value, list) or not value:
            raise self.bad("source loras must be a non-empty list")
        records = []
        for i, raw in enumerate(value):
            where = f"source lora {i}"
            keys = {"name", "path", "size", "xxh3_128", "scale", "loader", "converted", "modules", "repo_id", "commit"}
            r = self.obj(raw, where, keys)
            if not isinstance(r["modules"], dict) or not r["modules"] or not isinstance(r["converted"], bool):
                raise self.bad(f"{where} needs 'modules' (an object) and 'converted' (true or false)")
            modules = {}
            for module, info in r["modules"].items():
                m = self.obj(info, f"{where} module {module}", {"rank", "scaling", "bias"})
                if not isinstance(m["bias"], bool) or not self.int(m["rank"], f"{where} module {module} rank"):
                    raise self.bad(f"{where} module {module} needs a rank >= 1 and bias true or false")
                modules[self.str(module, f"{where} module")] = LoraModule(
                    m["rank"], self.number(m["scaling"], f"{where} module {module} scaling"), m["bias"]
                )
            records.append(
                LoraRecord(
                    name=self.str(r["name"], f"{where} name"),
                    path=self.str(r["path"], f"{where} path"),
                    size=self.int(r["size"], f"{where} size"),
                    xxh3_128=self.hex(r["xxh3_128"], f"{where} xxh3_128", _HEX32),
                    scale=self.number(r["scale"], f"{where} scale"),
                    loader=self.str(r["loader"], f"{where} loader"),
                    converted=r["converted"],
                    modules=modules,
                    repo_id=self.str(r["repo_id"], f"{where} repo_id", optional=True),
                    commit=self.str(r["commit"], f"{where} commit", optional=True),
                )
            )
        return tuple(records)

    def metadata_record(self, value: Any) -> FileRecord | None:
        if value is None:
            return None
        record = self.file_record(value, "metadata")
        if record.name != DCP_METADATA_NAME:
            raise self.bad(f"metadata names {record.name!r}; the DCP metadata file is {DCP_METADATA_NAME}")
        return record

    def provenance(self, value: Any) -> Provenance | None:
        if value is None:
            return None
        p = self.obj(value, "derived_from", {"kind", "checkpoint", "mesh", "digest"})
        if not isinstance(p["mesh"], dict):
            raise self.bad("derived_from mesh must be an object")
        return Provenance(
            self.str(p["kind"], "derived_from kind"),
            self.str(p["checkpoint"], "derived_from checkpoint"),
            p["mesh"],
            self.hex(p["digest"], "derived_from digest", _HEX32),
        )


_CHUNK_KEYS = frozenset({"offsets", "sizes", "file", "offset", "xxh3_64"})


def _same_ints(value: Any, expected: tuple[int, ...]) -> bool:
    """A JSON list of exactly these whole numbers (no bools)."""
    if type(value) is not list or len(value) != len(expected):
        return False
    for v, e in zip(value, expected):
        if type(v) is not int or v != e:
            return False
    return True


def _chunk_ok(raw: Any, box: Any, owner: int | None, files: set[str]) -> bool:
    """Whether a recorded chunk passes every check `_Parser.chunks` makes (what most chunks do), cheaply: the
    parser then builds it at once; otherwise it checks field by field to name what is wrong."""
    if type(raw) is not dict or raw.keys() != _CHUNK_KEYS:
        return False
    file, offset, checksum = raw["file"], raw["offset"], raw["xxh3_64"]
    return (
        _same_ints(raw["offsets"], box[0])
        and _same_ints(raw["sizes"], box[1])
        and type(file) is str
        and file in files
        and (owner is None or file == data_file_name(owner))
        and type(offset) is int
        and offset >= 0
        and type(checksum) is str
        and _HEX16.match(checksum) is not None
    )


def describe_chunk(chunk: ChunkRecord) -> str:
    return f"chunk at offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"


__all__ = [
    "CONFIG_NAME",
    "DCP_METADATA_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "ChunkRecord",
    "FileRecord",
    "LoraModule",
    "LoraRecord",
    "Manifest",
    "Provenance",
    "Source",
    "SourceFile",
    "TensorRecord",
    "chunk_digest",
    "data_file_name",
    "describe_chunk",
    "file_digest",
    "manifest_folder",
    "manifest_from_bytes",
    "read_manifest",
]
