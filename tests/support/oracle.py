"""The hand-written slicing oracle and raw readers: what each TP rank must hold, computed from the styles'
definitions in docs/design.md (never with preshard's own slicing code), and every read of converted files through
torch or raw bytes."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

BLOCKS = r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+"
# The built-in minimax-h3 plan, restated from docs/design.md: (module regex, style, packed blocks).
TINY_RULES = [
    (BLOCKS + r"\.attn\.to_[qkv]", "colwise", None),
    (BLOCKS + r"\.attn\.to_out\.0", "rowwise", None),
    (BLOCKS + r"\.ff\.net\.0\.proj", "packed_colwise", 2),
    (BLOCKS + r"\.ff\.net\.2", "rowwise", None),
    (r"transformer_blocks\.\d+\.adaln_proj\.linear", "replicated_input_rowwise", None),
]
INPUT_SHARDED = ("rowwise", "replicated_input_rowwise", "packed_rowwise")


def rule_for(name: str, rules) -> tuple[str, object]:
    module = name.rpartition(".")[0]
    for pattern, style, blocks in rules:
        if re.fullmatch(pattern, module):
            return style, blocks
    return "replicate", None


def _block_sizes(size: int, blocks) -> list[int]:
    return [size // blocks] * blocks if isinstance(blocks, int) else list(blocks)


def hand_slices(w: torch.Tensor, style: str, param: str, blocks, tp: int, r: int):
    """[(offsets, slice)] that TP rank r keeps, or None for a tensor kept whole (stored once)."""
    if style == "replicate" or (param == "bias" and style in INPUT_SHARDED):
        return None
    if style in INPUT_SHARDED:  # W[:, r*in/T : (r+1)*in/T], within each block for packed_rowwise
        sizes = _block_sizes(w.shape[1], blocks) if style == "packed_rowwise" else [w.shape[1]]
        out, start = [], 0
        for size in sizes:
            n = size // tp
            out.append(((0, start + r * n), w[:, start + r * n : start + (r + 1) * n]))
            start += size
        return out
    rest = (0,) * (w.dim() - 1)
    # W[r*out/T : (r+1)*out/T], same slice of the bias (a norm's weight)
    if style in ("colwise", "tp_rms_norm", "tp_layer_norm"):
        n = w.shape[0] // tp
        return [((r * n, *rest), w[r * n : (r + 1) * n])]
    assert style == "packed_colwise"
    out, start = [], 0
    for size in _block_sizes(w.shape[0], blocks):  # rank r's slice of each block, at the block's real offset
        n = size // tp
        out.append(((start + r * n, *rest), w[start + r * n : start + (r + 1) * n]))
        start += size
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert raw_bytes(got) == raw_bytes(want), f"{what}: bytes differ"


def read_data_range(path: Path, offset: int, length: int, dtype: torch.dtype, sizes) -> torch.Tensor:
    """A chunk straight from its raw bytes: no unpickling, no preshard."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = bytearray(f.read(length))
    assert len(data) == length
    if not length:
        return torch.empty(tuple(sizes), dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(tuple(sizes))


def read_record(path: Path, offset: int, length: int) -> torch.Tensor:
    """A chunk as torch reads it: the torch.save record at [offset, offset + length)."""
    with open(path, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    assert len(blob) == length
    return torch.load(io.BytesIO(blob), weights_only=True)


def load_source(folder: Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    if folder.is_file():
        return load_file(str(folder))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    files = files or [p.name for p in folder.glob("*.safetensors")]
    state = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def reassemble(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """torch's own DCP -> torch.save conversion; nothing of preshard on the read side."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{out.name}.pt"
    dcp_to_torch_save(str(out), str(target))
    return torch.load(target, weights_only=True)
