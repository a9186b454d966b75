"""What a converted pipeline folder records about its components: `preshard_pipeline.json` beside the index.

A converted pipeline is a diffusers pipeline folder again (its `model_index.json` or `modular_model_index.json`,
the components kept whole copied as they were), where each sharded component's subfolder holds a converted
checkpoint (its own manifest and plan). This record says which component is which, so that a loader need not
guess from the folders, and it is what marks the folder as preshard's output (what `--overwrite` may replace).

The index itself is diffusers' format; `read_pipeline_index` reads only what preshard needs of it: the pipeline
class and, per component, its library and class (`null` for a component the pipeline does without).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preshard.errors import CorruptCheckpointError, PreshardError, SourceError
from preshard.format.component_name import check_component_name
from preshard.format.jsonio import dumps_indented, parse_json_text, read_json

PIPELINE_RECORD_NAME = "preshard_pipeline.json"
PIPELINE_FORMAT = "preshard-pipeline"
PIPELINE_FORMAT_VERSION = 1
INDEX_NAMES = ("model_index.json", "modular_model_index.json")  # standard pipelines, modular ones
TREATMENTS = ("sharded", "whole", "skipped")


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "library": self.library,
            "class": self.class_name,
            "treatment": self.treatment,
            "tp": self.tp,
            "source_bytes": self.source_bytes,
            "left_out": None if self.left_out is None else self.left_out.to_dict(),
        }


@dataclass(frozen=True)
class PipelineRecord:
    """The converted pipeline: its index file, pipeline class, mesh converted for, and every component's record."""

    index_name: str
    pipeline_class: str
    mesh: dict[str, Any]
    components: dict[str, ComponentRecord]
    source: str
    created: str
    job: str = ""  # what the conversion was asked (source, mesh, choices): a re-run of the same job finds it

    def sharded(self) -> list[ComponentRecord]:
        return [c for c in self.components.values() if c.treatment == "sharded"]

    def to_dict(self) -> dict[str, Any]:
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
        }

    def to_json(self) -> str:
        return dumps_indented(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PipelineRecord:
        """Raises: CorruptCheckpointError for anything but a record this version wrote."""
        bad = CorruptCheckpointError(
            f"{where} is not a preshard pipeline record; convert the pipeline again (convert-checkpoint PIPELINE OUT)"
        )
        if not isinstance(data, dict) or data.get("format") != PIPELINE_FORMAT:
            raise bad
        if data.get("format_version") != PIPELINE_FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where} has pipeline format version {data.get('format_version')!r}, this preshard reads "
                f"{PIPELINE_FORMAT_VERSION}; convert the pipeline again with this version"
            )
        try:
            components = {
                name: ComponentRecord(
                    name,
                    str(c["library"]),
                    str(c["class"]),
                    c["treatment"],
                    c["tp"],
                    int(c["source_bytes"]),
                    None if c.get("left_out") is None else LeftOut.from_dict(c["left_out"]),
                )  # fmt: skip
                for name, c in data["components"].items()
            }
            record = cls(
                str(data["index"]), str(data["pipeline_class"]), dict(data["mesh"]), components,
                str(data["source"]), str(data["created"]), str(data.get("job", "")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError):
            raise bad from None
        if record.index_name not in INDEX_NAMES or any(
            c.treatment not in TREATMENTS or (c.treatment == "sharded") != isinstance(c.tp, int)
            for c in components.values()
        ):
            raise bad
        return record


def read_pipeline_record(folder: Path) -> PipelineRecord | None:
    """The record of a converted pipeline folder, or None where `folder` has none (not a converted pipeline).

    Raises:
        CorruptCheckpointError: a record that is there but unreadable.
    """
    path = folder / PIPELINE_RECORD_NAME
    if not path.is_file():
        return None
    fix = "convert the pipeline again"
    return PipelineRecord.from_dict(read_json(path, PIPELINE_RECORD_NAME, CorruptCheckpointError, fix), str(path))


def is_pipeline_record(folder: Path) -> bool:
    """Whether `folder` holds a readable pipeline record (what `--overwrite` may replace)."""
    try:
        return read_pipeline_record(folder) is not None
    except (PreshardError, OSError, json.JSONDecodeError):
        return False
