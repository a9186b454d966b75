"""MiniMax-H3 checkpoints at the real width, written without materialising a single weight.

Benchmarks of the converter and the loader only mean something on the real model's shapes: the
largest tensor (adaln_proj.linear, 96768 x 2688 bf16 = 496 MiB) bounds the converter's memory, the
mix of float32 and bfloat16 sets the byte layout, and row/column slicing costs depend on the real
row lengths. Building those weights with torch would need the memory of the whole model and minutes
of random number generation, for values that no benchmark looks at. So:

* `minimax_h3_tensors` (and `model_tensors` for any diffusers class) builds the model on the meta device
  (no storage) and returns every persistent tensor's safetensors dtype code and shape in state-dict order,
  with the config dict; dtypes mix float32 and bfloat16 the way the published checkpoint does.
* `write_safetensors_checkpoint` writes diffusers' layout (config.json, one safetensors file or a
  numbered set with its index) with real safetensors headers, streaming the data from one repeated
  random buffer, or as a hole (`os.truncate`), so the full 66 GB model costs no disk and no time
  when only the headers matter.
* `many_tiny_tensors` and `MANY_TENSORS_PLAN`: a source of any number of tiny tensors and its plan, for what
  must cost time linear in the tensor count (tests/test_tensor_count.py, benchmarks/bench_tensor_count.py).

diffusers is imported lazily (through `examples.minimax_h3`): it is optional and slow to import.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from preshard.errors import UsageError
from preshard.examples.minimax_h3 import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, keeps_fp32, model_class

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]

# Bytes per element of the safetensors dtype codes this module writes or accepts.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
# The order of the safetensors library's Dtype enum: it lays a file's data out by dtype, highest first
# (so every tensor stays aligned to its element size), then by name. Written files follow it, as the
# published checkpoint's do.
_DTYPE_RANK = {code: i for i, code in enumerate(
    ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
)}  # fmt: skip
_TORCH_CODES = {torch.float32: "F32", torch.bfloat16: "BF16"}

BUFFER_BYTES = 64 * 1024 * 1024  # the repeated random block of data="random"


def minimax_h3_tensors(
    num_layers: int | None = None, num_refiner_layers: int | None = None, **config_overrides: Any
) -> tuple[TensorSpecs, dict[str, Any]]:
    """Every persistent tensor of MiniMax-H3 as {name: (safetensors dtype code, shape)}, and the config.

    The config is the class's defaults (the real model: hidden 5376, 56 heads, ffn 14336, 50 layers, 2
    refiner layers) with `num_layers`, `num_refiner_layers` and `config_overrides` (constructor
    arguments) applied. Tensors come in state-dict order; the modules the class lists in
    `_keep_in_fp32_modules` are F32 (matched on whole dotted components, as diffusers does), the rest
    BF16. The config dict is what config.json holds, `_class_name` included.
    """
    overrides = dict(config_overrides)
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    if num_refiner_layers is not None:
        overrides["num_refiner_layers"] = num_refiner_layers
    return model_tensors(model_class(), **overrides)


def model_tensors(cls: type, **config: Any) -> tuple[TensorSpecs, dict[str, Any]]:
    """Every persistent tensor of the diffusers model class `cls` built from `config` (constructor arguments;
    the rest take the class defaults) as {name: (safetensors dtype code, shape)}, and its config.json dict.

    Built on the meta device: no memory, whatever the size. Tensors come in state-dict order, BF16 except the
    modules the class lists in `_keep_in_fp32_modules` (F32), as a bf16 load of the model holds them.

    Raises:
        PreshardError: a config key the class does not take, or a state entry that is not floating point.
    """
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(config) - (set(params) - {"self"}))
    if unknown:
        raise UsageError(f"unknown {cls.__name__} config keys {unknown}")
    with torch.device("meta"):
        model = cls(**config)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    tensors: TensorSpecs = {}
    for name, t in model.state_dict().items():
        code = "F32" if keeps_fp32(name, keep) else "BF16"
        if t.dtype not in _TORCH_CODES:  # a non-float state entry would keep its own dtype
            raise UsageError(f"{name}: unexpected dtype {t.dtype} in {cls.__name__}")
        tensors[name] = (code, tuple(t.shape))
    out: dict[str, Any] = {"_class_name": cls.__name__}
    for key, value in model.config.items():
        if not key.startswith("_"):
            out[key] = list(value) if isinstance(value, tuple) else value
    return tensors, out


MANY_TENSORS_PLAN: dict[str, Any] = {
    "format": 1,
    "name": "many-tensors",
    "linear": [{"match": "blocks.*.proj", "style": "colwise"}, {"match": "blocks.*.out", "style": "rowwise"}],
}


def many_tiny_tensors(count: int) -> TensorSpecs:
    """`count`/4 blocks of four tiny tensors: a colwise bf16 weight and its bias, a rowwise fp32 weight, a norm."""
    tensors: TensorSpecs = {}
    for i in range(count // 4):
        tensors[f"blocks.{i}.proj.weight"] = ("BF16", (8, 4))
        tensors[f"blocks.{i}.proj.bias"] = ("BF16", (8,))
        tensors[f"blocks.{i}.out.weight"] = ("F32", (4, 8))
        tensors[f"blocks.{i}.norm.weight"] = ("F32", (4,))
    return tensors


def tensor_nbytes(spec: tuple[str, tuple[int, ...]]) -> int:
    """Bytes of one (dtype code, shape) entry."""
    code, shape = spec
    return ITEMSIZE[code] * math.prod(shape)


def total_nbytes(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> int:
    """Data bytes of all tensors (what an index's metadata.total_size holds; headers excluded)."""
    return sum(tensor_nbytes(s) for s in tensors.values())


def _shards(tensors: Mapping[str, tuple[str, tuple[int, ...]]], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy split in the given order; a shard exceeds the limit only when one tensor alone does."""
    names = list(tensors)
    if max_shard_bytes is None or max_shard_bytes >= total_nbytes(tensors):
        return [names]
    if max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = tensor_nbytes(tensors[name])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def safetensors_header(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The 8-byte length plus the JSON header of a file holding `tensors`, and its data size.

    As the safetensors library writes it: `__metadata__` {"format": "pt"} first, data ordered by dtype
    (widest first) then name, compact JSON padded with spaces to a multiple of 8 bytes.
    """
    for name, (code, _) in tensors.items():
        if code not in ITEMSIZE:
            raise UsageError(f"{name}: unsupported safetensors dtype {code!r}")
    order = sorted(tensors, key=lambda n: (-_DTYPE_RANK[tensors[n][0]], n))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        code, shape = tensors[name]
        n = tensor_nbytes(tensors[name])
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offset


def random_buffer(nbytes: int, seed: int = 0) -> bytes:
    """`nbytes` seeded pseudo-random bytes (any bit pattern: bf16/f32 NaNs included)."""
    return random.Random(seed).randbytes(nbytes)


def _write_file(path: Path, header: bytes, data_bytes: int, buffer: bytes | None) -> None:
    with open(path, "wb") as f:
        f.write(header)
        if buffer is None:  # a hole: the file system stores no data blocks for it
            os.truncate(f.fileno(), len(header) + data_bytes)
            return
        view = memoryview(buffer)
        left = data_bytes
        while left:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n


def write_safetensors_checkpoint(
    folder: str | Path,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    config: Mapping[str, Any],
    *,
    data: Literal["random", "hole"],
    max_shard_bytes: int | None = None,
    seed: int = 0,
) -> list[Path]:
    """Write `tensors` in diffusers' layout into `folder`; returns the safetensors files written.

    One `diffusion_pytorch_model.safetensors`, or (when the data exceed `max_shard_bytes`) numbered
    `diffusion_pytorch_model-0000i-of-0000n.safetensors` files with an index (`weight_map`,
    `metadata.total_size`), plus `config.json`. data="random" fills every tensor from one repeated
    block of seeded random bytes (at most 64 MiB held in memory); data="hole" writes only the headers
    and truncates each file to its full size (sparse: no data blocks, reads return zeros).
    """
    if data not in ("random", "hole"):
        raise UsageError(f"data must be 'random' or 'hole', got {data!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    total = total_nbytes(tensors)
    buffer = random_buffer(max(1, min(BUFFER_BYTES, total)), seed) if data == "random" else None
    shards = _shards(tensors, max_shard_bytes)
    paths: list[Path] = []
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        stem = WEIGHTS_NAME.removesuffix(".safetensors")
        names = [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        header, data_bytes = safetensors_header({n: tensors[n] for n in shard})
        _write_file(folder / file_name, header, data_bytes, buffer)
        paths.append(folder / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths
