"""Leaving out of a text encoder the decoder layers and the head its pipeline never runs.

MiniMax-H3 conditions on `hidden_states[50]` of its Qwen3-VL conditioner's 64 decoder layers, read off
`text_encoder.model` (diffusers' `get_qwen3vl_prompt_embeds`, which also demands more than 50 layers, since the
last hidden state of a stack of exactly 50 is post-norm): layers 51-63 and the language-model head never run.
`--keep-layers NAME:K` keeps decoder layers 0..K-1 of a component (the final norm too, which the model builds
anyway) and leaves out the later layers and the `lm_head`; by default it applies where the pipeline documents what
it reads (`DOCUMENTED`, with the pipeline index's own `text_encoder_layer` where it sets one).

The component is written whole, as a transformers folder again: each safetensors file rewritten with the kept
tensors only (their bytes copied as they are, with `os.copy_file_range` where the kernel has it: safetensors'
own API reads whole tensors into memory, 62 GiB here), the index (if any) and `config.json`'s layer count
updated. What was left out is recorded in the pipeline record; the runtime refuses what would need it
(`runtime/left_out.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from preshard.errors import SourceError, UsageError
from preshard.format.component_name import check_component_name
from preshard.format.jsonio import read_json
from preshard.format.manifest import Source
from preshard.format.pipeline_record import LeftOut
from preshard.sources.safetensors_file import read_header
from preshard.sources.wrapped import Wrapped

# (pipeline class, component) -> (the config key of the hidden state it reads, its default): documented by the
# pipeline (diffusers 0.42.1's MiniMax-H3 encoder reads hidden_states[text_encoder_layer], default 50).
DOCUMENTED: dict[tuple[str, str], tuple[str, int]] = {
    ("MiniMaxH3ModularPipeline", "text_encoder"): ("text_encoder_layer", 50),
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HEADS = ("lm_head.",)


def parse_keep_layers(text: str) -> tuple[str, int | None]:
    """`NAME:K` (keep K decoder layers) or `NAME:all` (leave nothing out) -> (name, K or None).

    Raises:
        UsageError: anything else.
    """
    name, sep, value = text.partition(":")
    if sep and name:
        check_component_name(name, "--keep-layers")
    if sep and name and value == "all":
        return name, None
    if not sep or not name or not (value.isascii() and value.isdigit()) or len(value) > 9 or int(value) < 1:
        raise UsageError(f"--keep-layers {text!r} is not NAME:K (keep K decoder layers) or NAME:all")  # ASCII K only
    return name, int(value)


def parse_keep_layers_all(texts: Iterable[str]) -> dict[str, int | None]:
    """Every `--keep-layers` given -> {name: K or None}; the same one given twice is one.

    Raises:
        UsageError: one `parse_keep_layers` refuses, or two different counts for one component.
    """
    keeps: dict[str, int | None] = {}
    given: dict[str, str] = {}
    for text in texts:
        name, keep = parse_keep_layers(text)
        if name in keeps and keeps[name] != keep:
            raise UsageError(
                f"--keep-layers {given[name]} and --keep-layers {text} differ for {name}; give one per component"
            )
        keeps[name], given[name] = keep, text
    return keeps


def documented_keep(pipeline_class: str, component: str, index_data: dict[str, Any]) -> int | None:
    """The layers to keep where the pipeline documents the hidden state it reads, else None."""
    documented = DOCUMENTED.get((pipeline_class, component))
    if documented is None:
        return None
    key, default = documented
    value = index_data.get(key, default)
    return (value if isinstance(value, int) and not isinstance(value, bool) else default) + 1


def _text_layers(config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    text = config.get("text_config")
    section: dict[str, Any] = text if isinstance(text, dict) else config
    layers = section.get("num_hidden_layers")
    if not isinstance(layers, int):
        raise UsageError(
            "--keep-layers: the component's config.json has no num_hidden_layers; it has no layers to keep"
        )
    return section, layers


def _left_out(name: str, keep: int) -> bool:
    match = _LAYER.search(name)
    if match is not None and "visual" not in name.split("."):
        return int(match.group(1)) >= keep
    return name.startswith(_HEADS)


def is_left_out(name: str, keep: int) -> bool:
    """Whether tensor `name` is left out when `keep` decoder layers are kept (a later layer, or the head)."""
    return _left_out(name, keep)


def _write_kept(source: Path, target: Path, names: list[str]) -> None:
    """A safetensors file of the named tensors of `source`, their bytes copied as they are."""
    header = read_header(source)
    entries = [header.tensors[n] for n in names]
    meta: dict[str, Any] = {"__metadata__": header.metadata} if header.metadata else {}
    offset = 0
    for e in entries:
        meta[e.name] = {"dtype": e.dtype.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            _copy_range(src, dst, e.start, e.nbytes)


def _copy_range(src: Any, dst: Any, start: int, length: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src.fileno(), dst.fileno(), length - done, start + done)
        except (AttributeError, OSError):
            src.seek(start + done)
            chunk = src.read(min(length - done, 64 << 20))
            dst.write(chunk)
            n = len(chunk)
        if n == 0:
            raise OSError(f"{src.name} ended while copying its tensors")
        done += n


def copy_keeping_layers(source: Path, target: Path, keep: int) -> LeftOut | None:
    """Copy the component folder `source` to `target` without its decoder layers from `keep` on and its head.

    Returns:
        What was left out, or None where nothing is (the source has at most `keep` layers and no head).

    Raises:
        UsageError: a config without a layer count, or `keep` above it.
    """
    config = read_json(source / "config.json", f"{source.name}/config.json", SourceError, "fix the component's config")
    section, layers = _text_layers(config)
    if keep > layers:
        raise UsageError(
            f"--keep-layers {source.name}:{keep}: the model has {layers} decoder layers; keep at most {layers}"
        )
    files = sorted(source.glob("*.safetensors"))
    headers = {f.name: read_header(f) for f in files}
    dropped = {n: e for h in headers.values() for n, e in h.tensors.items() if _left_out(n, keep)}
    if not dropped:
        return None
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, target / f.name)
    weight_map = {}
    for f in files:
        kept = [n for n in headers[f.name].tensors if n not in dropped]
        _write_kept(f, target / f.name, kept)
        weight_map.update(dict.fromkeys(kept, f.name))
    for index in source.glob("*.safetensors.index.json"):
        data = read_json(index, f"{source.name}/{index.name}", SourceError, "fix the component's index")
        data["weight_map"] = {n: weight_map[n] for n in data.get("weight_map", {}) if n in weight_map}
        data.setdefault("metadata", {})["total_size"] = sum(
            e.nbytes for h in headers.values() for n, e in h.tensors.items() if n not in dropped
        )
        (target / index.name).write_text(json.dumps(data, indent=2))
    section["num_hidden_layers"] = keep
    for key in ("layer_types",):
        if isinstance(section.get(key), list):
            section[key] = section[key][:keep]
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    modules = sorted({n.split(".")[0] for n in dropped if n.startswith(_HEADS)})
    return LeftOut(keep, layers, len(dropped), sum(e.nbytes for e in dropped.values()), tuple(modules))


class KeptLayersSource(Wrapped):
    """A text encoder's kept layers (the copy `copy_keeping_layers` wrote) as a conversion source that records, in
    the manifest, the source it came from and what was left out (`source.left_out`): a sharded text encoder
    refuses what it lacks as a whole one does (`runtime/left_out.py`). Everything else is the copy's."""

    def __init__(self, base: Any, left: LeftOut, origin: str) -> None:
        self.base, self.left, self.origin = base, left, origin

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        from dataclasses import replace

        return replace(self.base.source_record(file_hashes), path=self.origin, left_out=self.left)
