"""Tiny random instances of every diffusers transformer class, from the configs and inputs diffusers' own model
tests use (tiny_zoo.json, written by scripts/make_tiny_zoo.py from a diffusers checkout), and configs written here
for classes diffusers' tests give none that runs on CPU, or for a config value their test config lacks (every other
tiny_zoo_*.json beside it, same format; tiny_zoo_variants.json: `CLASS#2` keys, e.g. CogView3Plus with a position
table wide enough for the CP probe, PixArt with its micro-conditions).

`build(key, seed)` gives the model (seeded weights, float32, eval mode) and its forward inputs; a float tensor the
JSON keeps by shape only is drawn from a generator seeded by `seed`, the same on every rank. An entry with
`"redraw_zeros": true` has every all-zero parameter drawn again (after the seeded init, so the same on every rank):
a zero-initialised modulation would gate the attention off and let any sharding of it pass. `"redraw": [PART, ...]`
draws every parameter whose name holds a PART from N(0, 1/in) (`[..., in, out]`), for parameters the class leaves
uninitialised (`torch.empty`: NucleusMoE's experts), which would differ from process to process. `{"object":
"diffusers.x.y.Class", "args": [...]}` is an instance of that diffusers class (Wan-Animate 2's KV cache).
"""

from __future__ import annotations

import importlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

ZOO = Path(__file__).with_name("tiny_zoo.json")


@cache
def zoo() -> dict[str, Any]:
    entries = json.loads(ZOO.read_text())
    for extra in sorted(ZOO.parent.glob("tiny_zoo_*.json")):
        entries |= json.loads(extra.read_text())
    return entries


def _decode(value: Any, gen: torch.Generator) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        dtype = getattr(torch, value["dtype"])
        if "values" in value:
            return torch.tensor(value["values"], dtype=dtype).reshape(value["tensor"])
        return torch.randn(value["tensor"], generator=gen).to(dtype)
    if isinstance(value, dict) and "object" in value:  # a diffusers helper the forward takes (a KV cache to fill)
        module, _, name = value["object"].rpartition(".")
        if not module.startswith("diffusers."):
            raise ValueError(f"tiny zoo objects come from diffusers only, not {value['object']}")
        return getattr(importlib.import_module(module), name)(*[_decode(v, gen) for v in value.get("args", [])])
    if isinstance(value, dict) and "int_keys" in value:
        return {int(k): _decode(v, gen) for k, v in value["int_keys"].items()}
    if isinstance(value, dict) and "dict" in value:
        return {k: _decode(v, gen) for k, v in value["dict"].items()}
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_decode(v, gen) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode(v, gen) for v in value]
    return value


def model_class(key: str) -> type:
    import diffusers

    return getattr(diffusers, zoo()[key]["class"])


def config(key: str) -> dict[str, Any]:
    """The class's config.json as `save_pretrained` writes it (with `_class_name`)."""
    return {"_class_name": zoo()[key]["class"], **zoo()[key]["init"]}


def build(key: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    return build_entry(zoo()[key], seed)


def build_entry(entry: dict[str, Any], seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, entry["class"])(**entry["init"]).eval().float()
    if entry.get("redraw_zeros"):  # zero-initialised gates (Kandinsky's modulation) would hide what TP does
        with torch.no_grad():
            for param in model.parameters():
                if not param.any():
                    param.normal_(0.0, 0.5)
    redraw = tuple(entry.get("redraw", ()))
    if redraw:  # parameters the class leaves uninitialised (torch.empty: NucleusMoE's experts)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(part in name for part in redraw):
                    param.normal_(0.0, param.shape[-2] ** -0.5)  # [..., in, out]: as a Linear of `in` inputs
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {k: _decode(v, gen) for k, v in entry["inputs"]["dict"].items()}
    return model, inputs
