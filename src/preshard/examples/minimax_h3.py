"""A tiny, seeded MiniMax-H3 model, its checkpoint and a packed input.

The real model is 33 B parameters; everything the tool does to it (slicing, packing, head counts,
mixed precision, the packed-sequence CP split) can be exercised on a model a few hundred KB in size
if every sharded dimension keeps the real model's structure. This module builds that model with
weights that all matter (no zero or identity-like parameters), writes it in the diffusers layout,
and makes valid packed inputs of any length, so that a wrong slice anywhere changes the output.

diffusers is imported lazily: it is an optional dependency and slow to import.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from preshard.errors import PreshardError, UsageError

if TYPE_CHECKING:
    from diffusers import MiniMaxH3Transformer3DModel

# Every dimension a TP rule shards divides by 1, 2 and 4: heads 12 (tp=4 gives 3 heads per rank, which a
# Ulysses degree of 2 or 4 does not divide), attention inner dim 12*16=192, ffn 64, time_embed_dim 32.
# attention_head_dim must be >= 2 * 3 * rope_freq_dim (12 of the 16 channels are rotated).
_TINY_CONFIG: dict[str, Any] = {
    "num_attention_heads": 12,
    "attention_head_dim": 16,
    "hidden_size": 48,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 64,
    "in_channels": 4,
    "audio_in_channels": 8,
    "patch_size": [1, 2, 2],
    "text_dim": 40,
    "freq_dim": 16,
    "time_embed_hidden_dim": 48,
    "time_embed_dim": 32,
    "rope_freq_dim": 2,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "qk_norm_eps": 1e-5,
    "final_norm_eps": 1e-5,
}

_DTYPES = ("float32", "bfloat16", "mixed")

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def model_class() -> type[MiniMaxH3Transformer3DModel]:
    try:
        from diffusers import MiniMaxH3Transformer3DModel
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PreshardError(
            "the MiniMax-H3 example needs diffusers with MiniMaxH3Transformer3DModel: pip install 'preshard[diffusers]'"
        ) from exc
    return MiniMaxH3Transformer3DModel


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small MiniMax-H3 config with the real model's structure; overrides must be constructor args."""
    allowed = set(inspect.signature(model_class().__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise UsageError(f"unknown MiniMaxH3Transformer3DModel config keys {unknown}; valid: {sorted(allowed)}")
    config = {k: (list(v) if isinstance(v, list | tuple) else v) for k, v in _TINY_CONFIG.items()}
    config.update(overrides)
    return config


def _constructor_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Drop the bookkeeping keys (`_class_name`, `_diffusers_version`, ...) a saved config carries."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def keeps_fp32(name: str, keep_in_fp32: list[str]) -> bool:
    # The same test diffusers applies when loading: a keep-entry must equal one dotted component.
    parts = name.split(".")
    return any(m in parts for m in keep_in_fp32)


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded values so that each one visibly affects the output.

    PyTorch's default init leaves every RMSNorm weight at exactly 1, so a norm weight sliced or
    permuted wrongly would go unnoticed; here norms get 1 + 0.1*randn and all Linears random
    weights of scale 1/sqrt(fan_in) with small random biases.
    """
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        shape = tuple(param.shape)
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm) and leaf == "weight":
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif isinstance(module, torch.nn.Linear) and leaf == "weight":
            value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        elif leaf == "bias":
            value = 0.05 * torch.randn(shape, generator=gen)
        else:  # any other parameter a future diffusers adds: still random, still seeded
            value = 0.1 * torch.randn(shape, generator=gen)
        param.copy_(value.to(param.dtype))


def build_model(
    config: dict[str, Any] | None = None, seed: int = 0, dtype: str = "mixed"
) -> MiniMaxH3Transformer3DModel:
    """A MiniMax-H3 model with seeded random weights in fp32, bf16, or the real checkpoint's mix.

    "mixed" keeps in float32 the modules the class lists in `_keep_in_fp32_modules` and makes the
    rest bfloat16, as the published checkpoint does. The `rope.inv_freq` buffer (computed, never
    stored) stays float32 in every mode.
    """
    if dtype not in _DTYPES:
        raise UsageError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    cls = model_class()
    model = cls(**_constructor_kwargs(config if config is not None else tiny_config()))
    _reinit_(model, seed)
    keep_in_fp32 = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        if dtype == "float32" or (dtype == "mixed" and keeps_fp32(name, keep_in_fp32)):
            target = torch.float32
        else:
            target = torch.bfloat16
        param.data = param.data.to(target)
    return model.eval()


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def save_checkpoint(model: torch.nn.Module, directory: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write `model` in the diffusers layout: config.json plus one safetensors file or an indexed set.

    Shards are filled greedily in state-dict order; a shard exceeds `max_shard_bytes` only when a
    single tensor does. Dtypes are written as they are (a mixed model stays mixed).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_config(directory)  # config.json, with _class_name and _diffusers_version

    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    total = sum(_tensor_nbytes(t) for t in state.values())
    metadata = {"format": "pt"}

    if max_shard_bytes is None or max_shard_bytes >= total:
        save_file(state, str(directory / WEIGHTS_NAME), metadata=metadata)
        return directory
    if max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = _tensor_nbytes(tensor)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes

    weight_map: dict[str, str] = {}
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    for i, shard in enumerate(shards, start=1):
        filename = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def _packed_layout(seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """Positions of the text, video and audio rows: text first, then video with audio rows spread among it."""
    n_text = max(1, seq_len // 6)
    rest = seq_len - n_text
    n_audio = max(1, rest // 4)
    audio_slots = {(k + 1) * rest // (n_audio + 1) for k in range(n_audio)}
    # (k+1)*rest//(n_audio+1) is strictly increasing since rest >= n_audio + 1, so the slots are distinct.
    text = list(range(n_text))
    audio = [n_text + s for s in sorted(audio_slots)]
    video = [n_text + s for s in range(rest) if s not in audio_slots]
    return text, video, audio


def make_inputs(
    config: dict[str, Any],
    seq_len: int,
    seed: int = 0,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A valid packed MiniMax-H3 input of any length >= 3, with modalities interleaved and two timesteps.

    Layout: text rows first, then video rows with audio rows spread among them. Text and the first
    quarter of the video rows are conditioning rows (timestep index 0), the rest are targets (index 1).
    position_ids hold integer-valued (t, h, w) coordinates (float32, as the pipeline passes floats).
    """
    if seq_len < 3:
        raise UsageError(f"seq_len must be >= 3 (one text, one video and one audio row), got {seq_len}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    patch = config.get("patch_size", _TINY_CONFIG["patch_size"])
    video_dim = int(config["in_channels"]) * math.prod(int(p) for p in patch)
    audio_dim = int(config["audio_in_channels"])
    text_dim = int(config["text_dim"])

    text, video, audio = _packed_layout(seq_len)
    n_cond_video = len(video) // 4

    token_tags = torch.empty(seq_len, dtype=torch.long)
    token_tags[text] = 1
    token_tags[video] = 0
    token_tags[audio] = 2

    timestep_indices = torch.ones(seq_len, dtype=torch.long)
    timestep_indices[text] = 0
    timestep_indices[video[:n_cond_video]] = 0

    # Coordinates: text along t from 0; video on a (frame, 2, 3) grid after the text; audio one row
    # per t step from the video's first frame, w alternating 0/1.
    position_ids = torch.zeros(seq_len, 3, dtype=torch.float32)
    position_ids[text, 0] = torch.arange(len(text), dtype=torch.float32)
    grid_h, grid_w = 2, 3
    j = torch.arange(len(video))
    position_ids[video, 0] = (len(text) + j // (grid_h * grid_w)).float()
    position_ids[video, 1] = ((j // grid_w) % grid_h).float()
    position_ids[video, 2] = (j % grid_w).float()
    k = torch.arange(len(audio))
    position_ids[audio, 0] = (len(text) + k).float()
    position_ids[audio, 2] = (k % 2).float()

    target_t = 0.2 + 0.7 * torch.rand((), generator=gen).item()
    timestep = torch.tensor([0.0, target_t], dtype=torch.float32)

    def rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(batch_size, n, width, generator=gen).to(dtype)

    return {
        "hidden_states": rows(len(video), video_dim),
        "audio_hidden_states": rows(len(audio), audio_dim),
        "encoder_hidden_states": rows(len(text), text_dim),
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": torch.tensor(video, dtype=torch.long),
        "audio_indices": torch.tensor(audio, dtype=torch.long),
        "text_indices": torch.tensor(text, dtype=torch.long),
    }


def reference_forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded model's (video, audio) output, the baseline every sharded run is compared with."""
    with torch.no_grad():
        video, audio = model(**inputs, return_dict=False)
    return video, audio
