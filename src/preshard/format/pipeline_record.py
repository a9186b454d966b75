"""What a converted pipeline folder records about its components: `preshard_pipeline.json` beside the index.

A converted pipeline is a diffusers pipeline folder again (its `model_index.json` or `modular_model_index.json`,
the components kept whole copied as they were), where each sharded component's subfolder holds a converted
checkpoint (its own manifest and plan). This record says which component is which, so that a loader need not
guess from the folders, and it is what marks the folder as preshard's output (what `--overwrite` may replace).

The record is sealed like a manifest: `digest` is the xxh3_128 of the canonical JSON of everything else, so an
edit (a component's treatment changed to `skipped`, a file's hash) is refused on every read. It lists every file of
the folder that no sharded component's manifest covers, with its size and xxh3_128 (`format/pipeline_files.py`),
and each sharded component's manifest digest, so the whole converted pipeline is verifiable
(`load_pipeline`, `preshard verify OUT`). Format version 1 (before the seal) is refused in one line: convert again.

The index itself is diffusers' format; `read_pipeline_index` reads only what preshard needs of it: the pipeline
class and, per component, its library and class (`null` for a component the pipeline does without).

No code from data: a component's library is `diffusers` or `transformers` (a sharded one) or, for one kept whole,
also a module of diffusers' own `diffusers.pipelines` package (what diffusers itself imports for an index, e.g.
`["stable_diffusion", "StableDiffusionSafetyChecker"]`), and its class a plain identifier, looked up as an
attribute of that library, never imported by a module name the data chose (`check_component_library`, applied at
conversion and to every record read).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from preshard.errors import CorruptCheckpointError, PreshardError, SourceError
from preshard.format.component_name import check_component_name, component_name_problem
from preshard.format.jsonio import canonical_json, dumps_indented, parse_json_text, read_json
from preshard.format.pipeline_files import FILE_CHECKSUM, PipelineFile, is_relative_name

PIPELINE_RECORD_NAME = "preshard_pipeline.json"
PIPELINE_FORMAT = "preshard-pipeline"
PIPELINE_FORMAT_VERSION = 2  # 2: sealed (digest), with every file no manifest covers and each manifest's digest
INDEX_NAMES = ("model_index.json", "modular_model_index.json")  # standard pipelines, modular ones
TREATMENTS = ("sharded", "whole", "skipped")
LIBRARIES = ("diffusers", "transformers")  # the libraries a component's class is looked up in
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def is_class_name(name: object) -> bool:
    """A plain public identifier (`WanTransformer3DModel`): what may be looked up as an attribute of a library."""
    return isinstance(name, str) and name.isidentifier() and name.isascii() and not name.startswith("_")


def _is_diffusers_pipelines_module(name: str) -> bool:
    """Whether `name` is a module of diffusers' own `diffusers.pipelines` package (found on disk, nothing imported)."""
    if not is_class_name(name) or not name.islower():
        return False
    try:
        spec = importlib.util.find_spec("diffusers")
    except (ImportError, ValueError):
        return False
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        base = Path(location) / "pipelines"
        if (base / name / "__init__.py").is_file() or (base / f"{name}.py").is_file():
            return True
    return False


def library_problem(component: str, library: object, class_name: object, treatment: str) -> str | None:
    """Why component `component`'s `[library, class]` may not be loaded, or None when it may.

    Sharded components: `diffusers` or `transformers` and a plain class name. Whole ones (diffusers loads them):
    also a module of `diffusers.pipelines`, as diffusers allows; never a module the data names otherwise (importing
    it would run its code).
    """
    allowed = library in LIBRARIES or (
        treatment != "sharded" and isinstance(library, str) and _is_diffusers_pipelines_module(library)
    )
    if not allowed:
        also = "" if treatment == "sharded" else " (or, kept whole, a module of diffusers.pipelines)"
        return (
            f"component {component} names library {library!r}; preshard loads components from diffusers or "
            f"transformers only{also} and imports no module a pipeline's files name (importing it would run its code)"
        )
    if not is_class_name(class_name):
        return f"component {component} names class {class_name!r}, which is not a plain class name"
    return None


@dataclass(frozen=True)
class IndexComponent:
    """One component as the pipeline's index names it (its name checked: one plain path component)."""

    name: str
    library: str | None  # "diffusers", "transformers"; None for a component the pipeline does without
    class_name: str | None


@dataclass(frozen=True)
class PipelineIndex:
    """The pipeline folder's index: which file, the pipeline class, the components in index order."""

    file_name: str
    pipeline_class: str
    components: tuple[IndexComponent, ...]
    data: dict[str, Any]

    @property
    def modular(self) -> bool:
        return self.file_name == "modular_model_index.json"


def find_index(folder: Path) -> Path | None:
    """The pipeline index in `folder` (the modular one first, as diffusers' modular loader reads it), or None."""
    for name in reversed(INDEX_NAMES):
        if (folder / name).is_file():
            return folder / name
    return None


def parse_pipeline_index(text: str | bytes, file_name: str, error: type[PreshardError] = SourceError) -> PipelineIndex:
    """Read a `model_index.json` / `modular_model_index.json` text.

    Raises:
        `error`: not a JSON object naming its pipeline class (`_class_name`), or a component whose name is not one
            plain path component (`format/component_name.py`: no `/`, `\\`, `.`, `..`, empty, leading `.`, NUL or
            control characters), checked here, before any path is made from it.
    """
    fix = "it must be a diffusers pipeline index: a JSON object with _class_name and its components"
    data = parse_json_text(text, file_name, error, fix)
    if not isinstance(data, dict) or not isinstance(data.get("_class_name"), str):
        raise error(f"{file_name} is not a pipeline index; {fix}")
    components = []
    for key, value in data.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) < 2:
            continue  # config values (e.g. a scheduler's), not components
        library, class_name = value[0], value[1]
        if not (library is None or isinstance(library, str)) or not (class_name is None or isinstance(class_name, str)):
            raise error(f"{file_name}: component {key!r} is {value!r}; {fix}")
        check_component_name(key, file_name, error)
        components.append(IndexComponent(key, library, class_name))
    return PipelineIndex(file_name, data["_class_name"], tuple(components), data)


def read_pipeline_index(folder: Path, error: type[PreshardError] = SourceError) -> PipelineIndex | None:
    """The index of the pipeline folder `folder`, or None when it has none."""
    path = find_index(folder)
    if path is None:
        return None
    return parse_pipeline_index(path.read_bytes(), path.name, error)


@dataclass(frozen=True)
class LeftOut:
    """What a component's conversion left out (`--keep-layers`): decoder layers from `keep_layers` on, the head."""

    keep_layers: int  # decoder layers kept: hidden_states[0 .. keep_layers - 1] equal the whole model's
    layers: int  # decoder layers the source has
    tensors: int
    bytes: int
    names: tuple[str, ...]  # the top-level modules left out whole (e.g. lm_head)

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep_layers": self.keep_layers, "layers": self.layers, "tensors": self.tensors, "bytes": self.bytes,
            "modules": list(self.names),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeftOut:
        return cls(
            int(data["keep_layers"]), int(data["layers"]), int(data["tensors"]), int(data["bytes"]),
            tuple(data["modules"]),
        )  # fmt: skip


@dataclass(frozen=True)
class ComponentRecord:
    """One component of a converted pipeline: how it was treated and, if sharded, at which TP degree."""

    name: str
    library: str
    class_name: str
    treatment: str  # one of TREATMENTS
    tp: int | None = None  # sharded: the TP degree of its checkpoint
    source_bytes: int = 0  # the component's weights in the source
    left_out: LeftOut | None = None
    manifest_digest: str | None = None  # sharded: the digest of its checkpoint's manifest

    def to_dict(self) -> dict[str, Any]:
        return {
            "library": self.library,
            "class": self.class_name,
            "treatment": self.treatment,
            "tp": self.tp,
            "source_bytes": self.source_bytes,
            "left_out": None if self.left_out is None else self.left_out.to_dict(),
            "manifest_digest": self.manifest_digest,
        }


@dataclass(frozen=True)
class PipelineRecord:
    """The converted pipeline: its index file, pipeline class, mesh converted for, every component's record, and the
    files no manifest covers; sealed by `digest`."""

    index_name: str
    pipeline_class: str
    mesh: dict[str, Any]
    components: dict[str, ComponentRecord]
    source: str
    created: str
    job: str = ""  # what the conversion was asked (source, mesh, choices): a re-run of the same job finds it
    files: tuple[PipelineFile, ...] = field(default=())
    digest: str = ""

    def sharded(self) -> list[ComponentRecord]:
        return [c for c in self.components.values() if c.treatment == "sharded"]

    def whole(self) -> list[ComponentRecord]:
        return [c for c in self.components.values() if c.treatment == "whole"]

    def body(self) -> dict[str, Any]:
        """Everything but the digest, as plain JSON data."""
        return {
            "format": PIPELINE_FORMAT,
            "format_version": PIPELINE_FORMAT_VERSION,
            "index": self.index_name,
            "pipeline_class": self.pipeline_class,
            "mesh": self.mesh,
            "source": self.source,
            "created": self.created,
            "job": self.job,
            "components": {name: c.to_dict() for name, c in self.components.items()},
            "checksums": FILE_CHECKSUM,
            "files": [f.to_dict() for f in self.files],
        }

    def compute_digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(canonical_json(self.body()))

    def sealed(self) -> PipelineRecord:
        return replace(self, digest=self.compute_digest())

    def to_dict(self) -> dict[str, Any]:
        return {**self.body(), "digest": self.digest or self.compute_digest()}

    def to_json(self) -> str:
        return dumps_indented(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PipelineRecord:
        """Raises: CorruptCheckpointError for anything but a sealed record this version wrote, intact."""
        return _RecordParser(where).record(data)


_TOP_KEYS = {
    "format", "format_version", "index", "pipeline_class", "mesh", "source", "created", "job", "components",
    "checksums", "files", "digest",
}  # fmt: skip
_COMPONENT_KEYS = {"library", "class", "treatment", "tp", "source_bytes", "left_out", "manifest_digest"}


class _RecordParser:
    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where} is not a valid preshard pipeline record ({what}); copy the converted pipeline again from "
            "a good copy, or convert the pipeline again (convert-checkpoint PIPELINE OUT)"
        )

    def record(self, data: Any) -> PipelineRecord:
        if not isinstance(data, dict) or data.get("format") != PIPELINE_FORMAT:
            raise self.bad(f"its format is not {PIPELINE_FORMAT!r}")
        version = data.get("format_version")
        if version != PIPELINE_FORMAT_VERSION:
            older = isinstance(version, int) and not isinstance(version, bool) and version < PIPELINE_FORMAT_VERSION
            why = "; it was written before records were sealed, so its copied files cannot be verified" if older else ""
            raise CorruptCheckpointError(
                f"{self.where} has pipeline format version {version!r}, this preshard reads "
                f"{PIPELINE_FORMAT_VERSION}{why}; convert the pipeline again with this version "
                "(convert-checkpoint PIPELINE OUT --overwrite)"
            )
        digest = data.get("digest")
        if not isinstance(digest, str) or not _HEX32.match(digest):
            raise self.bad("its digest is missing or not 32 hex digits")
        body = {k: v for k, v in data.items() if k != "digest"}
        if xxhash.xxh3_128_hexdigest(canonical_json(body)) != digest:
            raise CorruptCheckpointError(
                f"{self.where} does not match its digest: it was edited or damaged after conversion; copy the "
                "converted pipeline again from a good copy, or convert the pipeline again"
            )
        unknown = sorted(set(data) - _TOP_KEYS)
        missing = sorted(_TOP_KEYS - set(data))
        if unknown or missing:
            raise self.bad(f"unknown field {unknown[0]!r}" if unknown else f"no {missing[0]!r}")
        if data["index"] not in INDEX_NAMES:
            raise self.bad(f"index must be one of {', '.join(INDEX_NAMES)}")
        if data["checksums"] != FILE_CHECKSUM:
            raise self.bad(f"checksums must be {FILE_CHECKSUM}")
        for key in ("pipeline_class", "source", "created", "job"):
            if not isinstance(data[key], str):
                raise self.bad(f"{key} must be text")
        if not is_class_name(data["pipeline_class"]):
            raise self.bad(f"pipeline_class {data['pipeline_class']!r} is not a plain class name")
        mesh = data["mesh"]
        if not isinstance(mesh, dict) or not _positive_int(mesh.get("tp")):
            raise self.bad("mesh must be an object with a tp degree")
        if not isinstance(data["components"], dict):
            raise self.bad("components must be an object")
        components = {name: self.component(name, c) for name, c in data["components"].items()}
        files = self.files(data["files"])
        return PipelineRecord(
            data["index"], data["pipeline_class"], dict(mesh), components, data["source"], data["created"],
            data["job"], files, digest,
        )  # fmt: skip

    def component(self, name: Any, c: Any) -> ComponentRecord:
        problem = component_name_problem(name)
        if problem is not None:  # the same rule as the index's names: one plain path component
            raise self.bad(f"component name {name!r} {problem}")
        if not isinstance(c, dict) or set(c) != _COMPONENT_KEYS:
            raise self.bad(f"component {name} must have exactly {', '.join(sorted(_COMPONENT_KEYS))}")
        treatment = c["treatment"]
        if treatment not in TREATMENTS:
            raise self.bad(f"component {name}'s treatment must be one of {', '.join(TREATMENTS)}")
        problem = library_problem(name, c["library"], c["class"], treatment)
        if problem is not None:
            raise CorruptCheckpointError(f"{self.where}: {problem}; convert the pipeline again")
        sharded = treatment == "sharded"
        if sharded != _positive_int(c["tp"]) or (not sharded and c["tp"] is not None):
            raise self.bad(f"component {name}: tp must be a degree of 1 or more exactly where it is sharded")
        digest = c["manifest_digest"]
        if sharded != (isinstance(digest, str) and bool(_HEX32.match(digest))) or (not sharded and digest is not None):
            raise self.bad(f"component {name}: manifest_digest must be 32 hex digits exactly where it is sharded")
        if not _whole_number(c["source_bytes"]):
            raise self.bad(f"component {name}: source_bytes must be a whole number")
        try:
            left = None if c["left_out"] is None else LeftOut.from_dict(c["left_out"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise self.bad(f"component {name}: left_out is malformed") from None
        return ComponentRecord(name, c["library"], c["class"], treatment, c["tp"], c["source_bytes"], left, digest)

    def files(self, value: Any) -> tuple[PipelineFile, ...]:
        if not isinstance(value, list):
            raise self.bad("files must be a list")
        out: list[PipelineFile] = []
        seen: set[str] = set()
        for i, f in enumerate(value):
            if not isinstance(f, dict) or set(f) != {"name", "size", "xxh3_128"}:
                raise self.bad(f"file {i} must have exactly name, size and xxh3_128")
            if not is_relative_name(f["name"]) or f["name"] == PIPELINE_RECORD_NAME or f["name"] in seen:
                raise self.bad(f"file {i}'s name {f['name']!r} is not a relative path inside the folder, or repeats")
            if not _whole_number(f["size"]):
                raise self.bad(f"file {f['name']}: size must be a whole number")
            if not isinstance(f["xxh3_128"], str) or not _HEX32.match(f["xxh3_128"]):
                raise self.bad(f"file {f['name']}: xxh3_128 must be 32 hex digits")
            seen.add(f["name"])
            out.append(PipelineFile(f["name"], f["size"], f["xxh3_128"]))
        return tuple(out)


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_int(value: Any) -> bool:
    return _whole_number(value) and value >= 1


def parse_pipeline_record(raw: bytes, where: str) -> PipelineRecord:
    """A record from its bytes (as read once, e.g. to hash nothing twice).

    Raises:
        CorruptCheckpointError: not a sealed record of this version, intact.
    """
    fix = "copy the converted pipeline again from a good copy, or convert the pipeline again"
    data = parse_json_text(raw, where, CorruptCheckpointError, fix)
    return PipelineRecord.from_dict(data, where)


def read_pipeline_record(folder: Path) -> PipelineRecord | None:
    """The record of a converted pipeline folder, or None where `folder` has none (not a converted pipeline).

    Raises:
        CorruptCheckpointError: a record that is there but unreadable, edited (its digest), or of another version.
    """
    path = folder / PIPELINE_RECORD_NAME
    if not path.is_file():
        return None
    fix = "convert the pipeline again"
    return PipelineRecord.from_dict(read_json(path, PIPELINE_RECORD_NAME, CorruptCheckpointError, fix), str(path))


def is_pipeline_record(folder: Path) -> bool:
    """Whether `folder` holds a pipeline record preshard wrote, of any version, intact or not (what `--overwrite` may
    replace: an earlier version's output, or one whose files were damaged, is converted again)."""
    path = folder / PIPELINE_RECORD_NAME
    try:
        data = read_json(path, PIPELINE_RECORD_NAME, CorruptCheckpointError, "") if path.is_file() else None
    except (PreshardError, OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("format") == PIPELINE_FORMAT
