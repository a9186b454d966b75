"""Hostile soak, quantized edge files (issue 36): class `quantfiles`.

- a block-FP8 weight whose grid the shapes do not determine (17-row blocks: a [2, 2] grid over 32x32, which every
  block of 16 to 31 rows gives) with no `weight_block_size` in config.json: refused asking for it, nothing written;
  the control (16-blocks, stated) converts;
- a NaN, Inf or -Inf weight scale (per tensor, per channel, one block entry): refused at conversion naming the
  scale, nothing written; and at load (a tp=1 checkpoint converted with the conversion's check switched off, as an
  older preshard wrote it): refused naming the scale;
- `--quantize fp8|int8` of a source row holding NaN, Inf or -Inf: refused naming the tensor and the row, nothing
  written; the control converts;
- a weight scale (each spelling) beside a float Linear the plan keeps whole: refused naming it; the control (no
  scale) converts.

Run: `python scripts/hostile_soak.py --classes quantfiles`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from hostile_soak import Case, Soak, one_line, run_cli, run_library
from safetensors.torch import save_file

FP8_MAX = 448.0
TO_Q = "blocks.0.attn1.to_q"
WHOLE = "condition_embedder.time_proj"  # replicated by Wan's plan


def _wan() -> tuple[type, dict, dict[str, torch.Tensor]]:
    from tiny_diffusers import build

    model, _ = build("wan")
    config = {"_class_name": type(model).__name__, **{k: v for k, v in model.config.items() if not k.startswith("_")}}
    return type(model), config, {k: v.contiguous() for k, v in model.state_dict().items()}


def _save(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    g0, g1 = -(-rows // block), -(-cols // block)
    grid = torch.empty(g0, g1)
    for i in range(g0):
        for j in range(g1):
            grid[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max() / FP8_MAX
    full = grid.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), grid


def _stated(config: dict, block: int) -> dict:
    return {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [block, block]}}


def _scaled(state: dict[str, torch.Tensor], granularity: str, value: float) -> tuple[dict[str, torch.Tensor], str]:
    """`state` with to_q quantized at `granularity`, one scale entry set to `value`; and the scale's name."""
    w = state[f"{TO_Q}.weight"]
    if granularity == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1).clone()
        q, key, index = (w / scale).to(torch.float8_e4m3fn), "weight_scale", 0
    elif granularity == "channel":
        scale = w.abs().amax(dim=1) / 127
        q, key, index = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), "weight_scale", 3
    else:
        q, scale = _blocks(w, 16)
        key, index = "weight_scale_inv", 1
    scale.view(-1)[index] = value
    return {**state, f"{TO_Q}.weight": q, f"{TO_Q}.{key}": scale}, f"{TO_Q}.{key}"


def _converted(outcome, out: Path, *fragments: str) -> str | None:
    if not fragments:
        return None if outcome.status == 0 else f"did not convert: {outcome.stderr[-400:]}"
    return one_line(outcome, *fragments) or (f"{out} was written" if out.exists() else None)


def quantfiles_cases(soak: Soak) -> list[Case]:
    cls, config, state = _wan()

    def convert(make: Callable[[], tuple[dict, dict[str, torch.Tensor]]], *fragments: str, quantize: str = ""):
        def run(folder: Path) -> str | None:
            cfg, tensors = make()
            source = _save(folder / "src", cfg, tensors)
            out = folder / "out"
            extra = ("--quantize", quantize) if quantize else ()
            return _converted(run_cli("convert", source, out, "--tp", "2", *extra, "--no-progress"), out, *fragments)

        return run

    def ambiguous() -> tuple[dict, dict[str, torch.Tensor]]:
        q, grid = _blocks(state[f"{TO_Q}.weight"], 17)
        return config, {**state, f"{TO_Q}.weight": q, f"{TO_Q}.weight_scale_inv": grid}

    def stated() -> tuple[dict, dict[str, torch.Tensor]]:
        q, grid = _blocks(state[f"{TO_Q}.weight"], 16)
        return _stated(config, 16), {**state, f"{TO_Q}.weight": q, f"{TO_Q}.weight_scale_inv": grid}

    def bad_scale(granularity: str, value: float) -> Callable[[], tuple[dict, dict[str, torch.Tensor]]]:
        return lambda: (_stated(config, 16), _scaled(state, granularity, value)[0])

    def load(granularity: str, value: float) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            from preshard.converter import convert as convert_module
            from preshard.converter import quantize as quantize_module
            from preshard.runtime.load import load_sharded

            tensors, scale = _scaled(state, granularity, value)
            source = _save(folder / "src", _stated(config, 16), tensors)
            original = quantize_module.with_scale_checks
            quantize_module.with_scale_checks = lambda src: src  # an older preshard: no check at conversion
            try:
                convert_module.convert_checkpoint(source, folder / "out", tp=1, progress=False)
            finally:
                quantize_module.with_scale_checks = original
            outcome = run_library(lambda: load_sharded(cls, folder / "out", device="cpu"))
            return one_line(outcome, scale, "NaN or Inf")

        return run

    def bad_row(value: float) -> Callable[[], tuple[dict, dict[str, torch.Tensor]]]:
        def make() -> tuple[dict, dict[str, torch.Tensor]]:
            weight = state["blocks.0.ffn.net.0.proj.weight"].clone()
            weight[5, 3] = value
            return config, {**state, "blocks.0.ffn.net.0.proj.weight": weight}

        return make

    def beside_float(key: str | None) -> Callable[[], tuple[dict, dict[str, torch.Tensor]]]:
        extra = {} if key is None else {f"{WHOLE}.{key}": torch.full((2, 2) if key.endswith("inv") else (1,), 0.5)}
        return lambda: (config, {**state, **extra})

    values = (("NaN", math.nan), ("Inf", math.inf), ("-Inf", -math.inf))
    cases = [
        Case("quantfiles", "block grid the shapes do not determine, no weight_block_size",
             convert(ambiguous, f"{TO_Q}.weight_scale_inv", "weight_block_size")),
        Case("quantfiles", "the control: 16-blocks, weight_block_size stated", convert(stated)),
        Case("quantfiles", "the control: --quantize fp8 of finite rows", convert(bad_row(1.0), quantize="fp8")),
        Case("quantfiles", "the control: no scale beside the kept-whole Linear", convert(beside_float(None))),
    ]  # fmt: skip
    for granularity in ("tensor", "channel", "block"):
        control = convert(bad_scale(granularity, 0.01))
        cases.append(Case("quantfiles", f"the control: finite {granularity} scales", control))
        for label, value in values:
            scale = _scaled(state, granularity, value)[1]
            cases.append(Case("quantfiles", f"{label} {granularity} scale at conversion",
                              convert(bad_scale(granularity, value), scale, "NaN or Inf")))  # fmt: skip
    for granularity, (label, value) in zip(("channel", "tensor", "block"), values, strict=True):
        cases.append(Case("quantfiles", f"{label} {granularity} scale at load", load(granularity, value)))
    for fmt in ("fp8", "int8"):
        for label, value in values:
            cases.append(Case("quantfiles", f"--quantize {fmt} of a row holding {label}",
                              convert(bad_row(value), "row 5 of blocks.0.ffn.net.0.proj.weight", "NaN or Inf",
                                      quantize=fmt)))  # fmt: skip
    for key in ("weight_scale", "scale_weight", "weight_scale_inv"):
        refused = convert(beside_float(key), f"{WHOLE}.{key} is a weight scale", "float32 weight")
        cases.append(Case("quantfiles", f"{key} beside a float Linear kept whole", refused))
    return cases


CASES: dict[str, Callable[[Soak], list[Case]]] = {"quantfiles": quantfiles_cases}
