"""LoRAs fused into the base weights while converting (`convert-checkpoint --lora FILE [--lora-scale S]`).

Reading: a LoRA file is read the way the model family's diffusers pipeline reads it, so every key format
diffusers' `load_lora_weights` accepts for that family is accepted here (the diffusers/PEFT format, kohya,
XLabs, the original Wan and MiniMax-H3 formats, ...): the family's LoRA loader (`FluxLoraLoaderMixin`,
`WanLoraLoaderMixin`, ...) converts the keys, and the model's own `load_lora_adapter`, run on the model built
on the meta device, decides every module's rank and scaling (alpha / rank, per-module alphas and ranks, the
file's adapter metadata) exactly as it would for a real model. Nothing of that logic is rewritten here; what
is checked here is that the LoRA fits the checkpoint: every module it names exists as a Linear weight with
matching shapes, in a floating dtype, and nothing in the file is left out (text-encoder weights, DoRA, LoKr
are refused rather than dropped).

Fusing: where the converter reads a band of a source tensor's rows (`FusedRows.finish_band`), the rows of
`W + sum_i scaling_i * B_i @ A_i` replace them, before the band is cut into shards: every sharding style gets
the fused weight, and memory stays the band's (plus the LoRA's factors, held once). The arithmetic, defined
so that the result does not depend on how the tensor is cut into bands: the base rows are taken to float32
(float64 stays float64), each LoRA's delta `(B[tile] @ A) * scaling` is computed in float32 over fixed tiles
of `TILE_ROWS` rows counted from row 0 and added in LoRA order, and the sum is cast once to the tensor's
dtype. That is PEFT's `merge` in float32 (`W += (B @ A) * scaling`, one adapter after another), so a float32
checkpoint equals diffusers' `fuse_lora` on the unsharded model; for bf16/fp16, PEFT rounds the delta to the
weight's dtype before adding it and then rounds the sum, where this rounds once: within one rounding of it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from preshard.errors import MismatchError, SourceError, UsageError
from preshard.format.dtypes import DType
from preshard.format.hub_names import check_repo_id, path_problem
from preshard.format.manifest import LoraModule, LoraRecord, Source
from preshard.sources import ConversionSource, SourceRows
from preshard.sources.safetensors_file import read_header
from preshard.sources.wrapped import Wrapped, WrappedRows

TILE_ROWS = 256  # the delta is computed over tiles of this many rows, counted from row 0, whatever the bands
FUSION_VERSION = 1  # part of a conversion's identity: another arithmetic is another conversion
ADAPTER = "preshard"  # the adapter name used on the meta-device model
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' name, for a Hub repo given without a file

# The diffusers LoRA loader (the pipeline mixin whose `lora_state_dict` converts the family's key formats) of
# each model class. A class not listed reads the diffusers/PEFT format only.
LORA_LOADERS = {
    "FluxTransformer2DModel": "FluxLoraLoaderMixin",
    "Flux2Transformer2DModel": "Flux2LoraLoaderMixin",
    "QwenImageTransformer2DModel": "QwenImageLoraLoaderMixin",
    "WanTransformer3DModel": "WanLoraLoaderMixin",
    "SkyReelsV2Transformer3DModel": "SkyReelsV2LoraLoaderMixin",
    "MiniMaxH3Transformer3DModel": "MiniMaxH3LoraLoaderMixin",
    "HunyuanVideoTransformer3DModel": "HunyuanVideoLoraLoaderMixin",
    "LTXVideoTransformer3DModel": "LTXVideoLoraLoaderMixin",
    "LTX2VideoTransformer3DModel": "LTX2LoraLoaderMixin",
    "CogVideoXTransformer3DModel": "CogVideoXLoraLoaderMixin",
    "MochiTransformer3DModel": "Mochi1LoraLoaderMixin",
    "SD3Transformer2DModel": "SD3LoraLoaderMixin",
    "SanaTransformer2DModel": "SanaLoraLoaderMixin",
    "HiDreamImageTransformer2DModel": "HiDreamImageLoraLoaderMixin",
    "Lumina2Transformer2DModel": "Lumina2LoraLoaderMixin",
    "CogView4Transformer2DModel": "CogView4LoraLoaderMixin",
}
PREFIX = "transformer"  # the key prefix of a pipeline's denoiser in a LoRA file
_FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias")


# ---------------------------------------------------------------------------------------------------------
# What the user asked for


@dataclass(frozen=True)
class LoraSpec:
    """One `--lora FILE [--lora-scale S]`: a local .safetensors file or a Hub repo id (`org/name[/file]`)."""

    path: str
    scale: float = 1.0


def lora_specs(loras: Iterable[Any] | None) -> tuple[LoraSpec, ...]:
    """`loras=[path, (path, scale), LoraSpec, ...]` as specs, checked.

    Raises:
        UsageError: an entry of another kind, or a scale that is not a finite number.
    """
    if loras is None:
        return ()
    if isinstance(loras, (str, Path, LoraSpec)) or not isinstance(loras, Iterable):
        raise UsageError(
            "loras must be a list of paths or (path, scale) pairs, e.g. loras=[('style.safetensors', 0.8)]"
        )
    specs = []
    for entry in loras:
        if isinstance(entry, LoraSpec):
            path, scale = entry.path, entry.scale
        elif isinstance(entry, (str, Path)):
            path, scale = entry, 1.0
        elif isinstance(entry, Sequence) and len(entry) == 2 and isinstance(entry[0], (str, Path)):
            path, scale = entry
        else:
            raise UsageError(f"loras entry {entry!r} is neither a path nor a (path, scale) pair")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise UsageError(f"the scale of LoRA {path} must be a finite number, not {scale!r}")
        specs.append(LoraSpec(str(path), float(scale)))
    return tuple(specs)


# ---------------------------------------------------------------------------------------------------------
# A LoRA, read and checked against the checkpoint


@dataclass(frozen=True)
class LoraFactor:
    """One LoRA's update of one Linear: `W += scaling * up @ down`, and `bias += scaling * up_bias`."""

    module: str
    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # B: [out, rank]
    up_bias: torch.Tensor | None
    scaling: float  # PEFT's scaling for this module times the user's scale

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class LoadedLora:
    """A LoRA file, read and checked: its factors by module, and what identifies it."""

    spec: LoraSpec
    file: Path
    size: int
    mtime_ns: int
    xxh3_128: str
    loader: str
    converted: bool
    factors: dict[str, LoraFactor]
    repo_id: str | None = None
    commit: str | None = None

    def record(self) -> LoraRecord:
        modules = {m: LoraModule(f.rank, f.scaling, f.up_bias is not None) for m, f in sorted(self.factors.items())}
        return LoraRecord(
            name=self.file.name, path=self.spec.path, size=self.size, xxh3_128=self.xxh3_128, scale=self.spec.scale,
            loader=self.loader, converted=self.converted, modules=modules, repo_id=self.repo_id, commit=self.commit,
        )  # fmt: skip


@dataclass
class LoraSet:
    """The LoRAs of one conversion, in the order given (= the order their deltas are added)."""

    loras: list[LoadedLora]
    terms: dict[str, list[tuple[LoraFactor, str]]] = field(default_factory=dict)  # tensor -> (factor, weight|bias)

    def __post_init__(self) -> None:
        for lora in self.loras:
            for module, factor in lora.factors.items():
                self.terms.setdefault(f"{module}.weight", []).append((factor, "weight"))
                if factor.up_bias is not None:
                    self.terms.setdefault(f"{module}.bias", []).append((factor, "bias"))

    def identity(self) -> str:
        """What makes two LoRA sets the same conversion: each file's content hash and scale, in order."""
        h = hashlib.sha256(f"fusion={FUSION_VERSION}:tile={TILE_ROWS}".encode())
        for lora in self.loras:
            h.update(f"|{lora.file.name}:{lora.size}:{lora.xxh3_128}:{lora.spec.scale!r}".encode())
        return h.hexdigest()

    def records(self) -> tuple[LoraRecord, ...]:
        return tuple(lora.record() for lora in self.loras)

    def input_paths(self) -> list[Path]:
        return [lora.file for lora in self.loras]

    def check_unchanged(self) -> None:
        """Raises SourceError when a LoRA file changed since it was read (its size or modification time)."""
        for lora in self.loras:
            try:
                stat = lora.file.stat()
                same = (stat.st_size, stat.st_mtime_ns) == (lora.size, lora.mtime_ns)
            except OSError:
                same = False
            if not same:
                raise SourceError(
                    f"LoRA file {lora.file.name} changed while the conversion ran; nothing was committed: re-run the "
                    "command once it is no longer being written"
                )

    def summary(self) -> list[dict[str, Any]]:
        """One entry per LoRA (what a dry run reports)."""
        return [
            {
                "path": lora.spec.path, "scale": lora.spec.scale, "loader": lora.loader, "converted": lora.converted,
                "modules": len(lora.factors), "ranks": sorted({f.rank for f in lora.factors.values()}),
                "bytes": sum(t.numel() * t.element_size() for f in lora.factors.values()
                             for t in (f.down, f.up, f.up_bias) if t is not None),
            }
            for lora in self.loras
        ]  # fmt: skip


def open_loras(
    loras: Iterable[Any] | None, source: ConversionSource, *, token: str | bool | None = None
) -> LoraSet | None:
    """Read and check the LoRAs to fuse into `source` (None when there are none).

    Raises:
        UsageError: a malformed `loras` argument. SourceError: a LoRA file that is missing, not safetensors,
            or that diffusers cannot read. MismatchError: a LoRA that does not fit the checkpoint (a module it
            lacks, other shapes, another model class, weights for other components, a variant such as DoRA).
    """
    specs = lora_specs(loras)
    if not specs:
        return None
    config = source.config or {}
    class_name = config.get("_class_name")
    if not isinstance(class_name, str):
        raise MismatchError(
            "--lora needs the checkpoint's config.json naming its diffusers model class (_class_name): LoRAs are "
            "read and scaled as diffusers does for that class"
        )
    model_class = _import_diffusers(class_name)
    from preshard.plans.from_model import build_on_meta

    meta_model = build_on_meta(model_class, config)
    shapes = source.shapes()
    loaded = []
    for index, spec in enumerate(specs):
        file, repo_id, commit = _local_file(spec.path, token)
        loaded.append(_load(spec, file, repo_id, commit, class_name, meta_model, shapes, f"{ADAPTER}{index}"))
    return LoraSet(loaded)


def _import_diffusers(class_name: str) -> type:
    try:
        import diffusers  # noqa: F401
        import peft  # noqa: F401
    except ImportError:
        raise UsageError("--lora reads LoRAs with diffusers and peft: pip install 'preshard[lora]'") from None
    from preshard.plans.model_class import import_model_class

    return import_model_class(class_name)


_HUB_FILE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/.+)?$")


def _local_file(given: str, token: str | bool | None) -> tuple[Path, str | None, str | None]:
    """The LoRA's local file: the path as given, or (no such path) a Hub file `org/name[/path/in/repo]`."""
    path = Path(given).expanduser()
    if path.exists():
        if path.is_dir():
            raise SourceError(f"LoRA {given} is a folder; pass the .safetensors file in it")
        return path, None, None
    if given.startswith((".", "/", "~")) or not _HUB_FILE.match(given):
        raise SourceError(
            f"LoRA file {given} does not exist; pass a .safetensors file or a Hub repo id org/name[/file]"
        )
    parts = given.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or DEFAULT_WEIGHT_NAME
    if not filename.endswith(".safetensors"):
        raise SourceError(f"LoRA {given} names {filename}, not a .safetensors file; diffusers LoRAs are safetensors")
    check_repo_id(repo_id, "LoRA repo id")
    if path_problem(filename) is not None:
        raise SourceError(f"LoRA {given} names {filename!r}, which {path_problem(filename)}; name a file in the repo")
    try:
        from huggingface_hub import hf_hub_download

        local = Path(hf_hub_download(repo_id, filename, token=token))
    except Exception as exc:  # huggingface_hub raises many kinds (not found, gated, offline)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(f"LoRA {given}: no local file of that name, and the Hub download failed: {first}") from None
    # hf_hub_download returns <cache>/snapshots/<commit>/<filename>
    commit = local.parts[-(len(Path(filename).parts) + 1)]
    return local, repo_id, commit


def _load(
    spec: LoraSpec,
    file: Path,
    repo_id: str | None,
    commit: str | None,
    class_name: str,
    meta_model: torch.nn.Module,
    shapes: dict[str, tuple[tuple[int, ...], DType]],
    adapter: str,
) -> LoadedLora:
    from preshard.sources.reader import hash_file

    name = file.name
    if not name.endswith(".safetensors"):
        raise SourceError(
            f"LoRA {spec.path} is not a .safetensors file; preshard fuses safetensors LoRAs only (load a .bin or "
            ".pt file with torch and save it with safetensors.torch.save_file)"
        )
    header = read_header(file)  # a one-line error for anything that is not safetensors
    raw_keys = [k for k in header.tensors]
    digest = hash_file(file)
    state, alphas, metadata, loader = _read_as_diffusers(file, class_name)
    ours, alphas = _transformer_part(state, alphas, name, class_name)
    converted = not all(k.endswith((*_FACTOR_SUFFIXES, ".alpha")) for k in raw_keys)
    factors = _factors(ours, name, class_name, shapes)
    scalings = _scalings(meta_model, ours, alphas, metadata, adapter, name)
    missing = sorted(set(factors) - set(scalings))
    if missing:
        raise MismatchError(f"diffusers did not apply LoRA {name} to {missing[0]} (and {len(missing) - 1} more)")
    for module, (rank, scaling) in scalings.items():
        factor = factors.get(module)
        if factor is None or factor.rank != rank:
            raise MismatchError(f"LoRA {name}: diffusers applied it to {module} differently than its factors say")
        factors[module] = replace(factor, scaling=scaling * spec.scale)
        check_finite_factor(factors[module], name)
    stat = file.stat()
    if stat.st_size != header.size or stat.st_mtime_ns != header.mtime_ns:
        raise SourceError(f"LoRA file {name} changed while it was being read; re-run once it is complete")
    return LoadedLora(spec, file, header.size, header.mtime_ns, digest, loader, converted, factors, repo_id, commit)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_as_diffusers(file: Path, class_name: str) -> tuple[dict, dict | None, dict | None, str]:
    """(state dict, network alphas, adapter metadata, loader name), as the family's pipeline reads the file."""
    loader_name = LORA_LOADERS.get(class_name)
    if loader_name is None:
        from safetensors.torch import load_file

        return load_file(str(file)), None, None, "safetensors"
    import diffusers.loaders.lora_pipeline as pipelines

    loader = getattr(pipelines, loader_name)
    kwargs: dict[str, Any] = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(loader.lora_state_dict).parameters:
        kwargs["return_alphas"] = True
    try:
        out = loader.lora_state_dict(str(file), **kwargs)
    except Exception as exc:  # a converter meeting keys it does not know fails in arbitrary ways
        raise SourceError(
            f"diffusers' {loader_name} cannot read LoRA {file.name} ({_first_line(exc)}); is it a LoRA for "
            f"{class_name}?"
        ) from None
    if kwargs.get("return_alphas"):
        state, alphas, metadata = out
    else:
        (state, metadata), alphas = out, None
    return dict(state), dict(alphas or {}), metadata, f"diffusers {loader_name}"


def _transformer_part(state: dict, alphas: dict | None, name: str, class_name: str) -> tuple[dict, dict]:
    """The denoiser's keys (prefix stripped) and alphas; keys for any other component are refused, not dropped."""
    prefixed = [k for k in state if k.startswith(f"{PREFIX}.")]
    if not prefixed:  # an unprefixed diffusers/PEFT dump: every key is the model's
        ours = dict(state)
    else:
        others = [k for k in state if not k.startswith(f"{PREFIX}.")]
        if others:
            component = others[0].split(".")[0]
            count = sum(k.split(".")[0] == component for k in others)
            raise MismatchError(
                f"LoRA {name} also holds {count} tensors for {component} (e.g. {others[0]}), which a {class_name} "
                f"checkpoint does not have; fuse a file holding the {PREFIX}'s weights only (keys '{PREFIX}.*')"
            )
        ours = {k[len(PREFIX) + 1 :]: v for k, v in state.items()}
    network = {k.removeprefix(f"{PREFIX}."): v for k, v in (alphas or {}).items()}
    for key in [k for k in ours if k.endswith(".alpha")]:
        network[key] = ours.pop(key)
    if not ours:
        raise MismatchError(f"LoRA {name} holds no weights for the {PREFIX} (no lora_A/lora_B keys)")
    if not any(".lora_A." in k or ".lora_B." in k for k in ours):
        from diffusers.utils import convert_unet_state_dict_to_peft

        ours = convert_unet_state_dict_to_peft(ours)  # older diffusers naming, as load_lora_adapter does
    return ours, network


def _factors(
    ours: dict, name: str, class_name: str, shapes: dict[str, tuple[tuple[int, ...], DType]]
) -> dict[str, LoraFactor]:
    """Each module's factors, checked against the checkpoint's tensors."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in ours.items():
        if "lora_magnitude_vector" in key or "dora_scale" in key:
            raise MismatchError(f"LoRA {name} is a DoRA ({key}); preshard fuses plain LoRAs only")
        if ".lokr_" in key or ".hada_" in key:
            raise MismatchError(f"LoRA {name} has {key}, a LoRA variant preshard does not fuse; use a plain LoRA")
        suffix = next((s for s in _FACTOR_SUFFIXES if key.endswith(s)), None)
        if suffix is None or not isinstance(value, torch.Tensor):
            raise MismatchError(f"LoRA {name}: {key} is not a LoRA factor (lora_A.weight, lora_B.weight, lora_B.bias)")
        parts.setdefault(key[: -len(suffix)], {})[suffix] = value
    absent = sorted(m for m in parts if f"{m}.weight" not in shapes)
    if 2 * len(absent) > len(parts):  # most of it: not this model's LoRA at all
        which = "none" if len(absent) == len(parts) else f"{len(parts) - len(absent)} only"
        raise MismatchError(
            f"LoRA {name} is not for this {class_name} checkpoint: {which} of its {len(parts)} modules exist in it "
            f"({absent[0]} does not, ...); pass a LoRA trained for {class_name}"
        )
    if absent:
        raise MismatchError(
            f"LoRA {name} names {absent[0]} (and {len(absent) - 1} more modules), which this {class_name} "
            "checkpoint does not have; pass a LoRA trained for this model"
        )
    factors = {}
    for module, got in sorted(parts.items()):
        down, up = got.get(".lora_A.weight"), got.get(".lora_B.weight")
        if down is None or up is None:
            raise MismatchError(f"LoRA {name}: {module} has only one of lora_A and lora_B; the file is incomplete")
        shape, dtype = shapes[f"{module}.weight"]
        if len(shape) != 2:
            raise MismatchError(
                f"LoRA {name} targets {module}.weight of shape {list(shape)}, not a Linear weight [out, in]; "
                "preshard fuses LoRAs into Linear layers only"
            )
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise MismatchError(
                f"LoRA {name} targets {module}.weight, stored as {str(dtype).removeprefix('torch.')}: a LoRA cannot be "
                "fused into quantised or integer weights; convert a floating-point checkpoint"
            )
        out, inp = shape
        if (
            down.dim() != 2
            or up.dim() != 2
            or down.shape[1] != inp
            or up.shape[0] != out
            or up.shape[1] != down.shape[0]
        ):
            raise MismatchError(
                f"LoRA {name}: {module}'s factors A {list(down.shape)} and B {list(up.shape)} do not fit its weight "
                f"[{out}, {inp}] (A must be [rank, {inp}], B [{out}, rank]); is it a LoRA for another size of model?"
            )
        bias = got.get(".lora_B.bias")
        if bias is not None and (shapes.get(f"{module}.bias", ((),))[0] != (out,) or bias.shape != (out,)):
            raise MismatchError(f"LoRA {name}: {module} has a lora_B.bias but the checkpoint has no bias [{out}] there")
        for what, t in (("A", down), ("B", up), ("B bias", bias)):
            if t is not None and (not t.dtype.is_floating_point or t.dtype.itemsize < 2):
                raise MismatchError(f"LoRA {name}: {module}'s {what} is {t.dtype}, not a float tensor")
        factors[module] = LoraFactor(module, down, up, bias, 0.0)
    return factors


def _scalings(
    meta_model: torch.nn.Module, ours: dict, alphas: dict, metadata: dict | None, adapter: str, name: str
) -> dict[str, tuple[int, float]]:
    """Each module's (rank, scaling), decided by the model's own `load_lora_adapter` on the meta-device model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    state = {f"{PREFIX}.{k}": v for k, v in ours.items()}
    network = {f"{PREFIX}.{k}": v for k, v in alphas.items()} or None
    try:
        with warnings.catch_warnings():  # PEFT warns of a second adapter on one model: here that is the point
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            meta_model.load_lora_adapter(
                state, prefix=PREFIX, network_alphas=network, metadata=metadata, adapter_name=adapter,
                low_cpu_mem_usage=True,
            )  # fmt: skip
    except Exception as exc:
        raise MismatchError(f"diffusers cannot load LoRA {name} into the model: {_first_line(exc)}") from None
    scalings = {}
    for module_name, module in meta_model.named_modules():
        if not isinstance(module, BaseTunerLayer) or adapter not in getattr(module, "scaling", {}):
            continue
        base = module.get_base_layer()
        if not isinstance(base, torch.nn.Linear) or getattr(module, "fan_in_fan_out", False):
            raise MismatchError(
                f"LoRA {name} targets {module_name}, a {type(base).__name__}; preshard fuses LoRAs into Linear layers"
            )
        if adapter in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(adapter):
            raise MismatchError(
                f"LoRA {name} is a DoRA or another LoRA variant at {module_name}; preshard fuses plain LoRAs"
            )
        scaling = module.scaling[adapter]
        scalings[module_name] = (int(module.r[adapter]), float(scaling))
    return scalings


# ---------------------------------------------------------------------------------------------------------
# The arithmetic


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_finite_factor(factor: LoraFactor, lora: str) -> None:
    """A factor, its bias and its scaling (alpha / rank times the user's scale) are finite numbers in float32, the
    dtype they are fused in: a NaN or an Inf would be fused and committed as weights that are not numbers.

    Raises:
        SourceError: naming the LoRA, the module and the factor.
    """
    if not (math.isfinite(factor.scaling) and abs(factor.scaling) <= FLOAT32_MAX):
        raise SourceError(
            f"LoRA {lora}: the scaling of {factor.module} (its alpha / rank times --lora-scale) is {factor.scaling!r}, "
            "not a finite float32; fix the LoRA's alpha or the scale"
        )
    parts = (("lora_A", factor.down), ("lora_B", factor.up), ("lora_B bias", factor.up_bias))
    for what, tensor in parts:
        if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SourceError(
                f"LoRA {lora}: the {what} factor of {factor.module} holds NaN or Inf; nothing was written: use a "
                "LoRA whose factors are numbers"
            )


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fuse_rows(rows: torch.Tensor, start: int, terms: list[tuple[LoraFactor, str]], total_rows: int) -> None:
    """Add the LoRA deltas to `rows` (rows `[start, start + len(rows))` of a base tensor of `total_rows` rows, in
    its own dtype), in place: in float32 over fixed tiles, in term order, cast once (see the module docstring)."""
    count = rows.shape[0]
    if not count or not terms:
        return
    acc = rows.to(_accumulator(rows.dtype))
    was_finite = bool(torch.isfinite(rows).all())  # to tell an overflow of the update from the source's own values
    end = start + count
    for factor, kind in terms:
        if kind == "bias":
            acc += factor.up_bias[start:end].to(torch.float32) * factor.scaling
            continue
        down = factor.down.to(torch.float32)
        for tile in range(start - start % TILE_ROWS, end, TILE_ROWS):
            tile_end = min(tile + TILE_ROWS, total_rows)
            delta = (factor.up[tile:tile_end].to(torch.float32) @ down) * factor.scaling
            lo, hi = max(tile, start), min(tile_end, end)
            acc[lo - start : hi - start] += delta[lo - tile : hi - tile]
    if acc is not rows:
        rows.copy_(acc)
    if not bool(torch.isfinite(rows).all()):  # the product overflowed (float32, or the weight's own dtype)
        if was_finite:
            module = terms[0][0].module
            raise SourceError(
                f"the LoRA fused into {module} makes its weight not finite (the update overflows "
                f"{str(rows.dtype).removeprefix('torch.')}); nothing was committed: lower --lora-scale or check the "
                "LoRA's factors"
            )


def fuse_state_dict(state: dict[str, torch.Tensor], loras: LoraSet) -> dict[str, torch.Tensor]:
    """The whole tensors with the LoRAs fused (new tensors; the others as they are): what a conversion with these
    LoRAs equals, bit for bit, once converted without them."""
    out = dict(state)
    for name, terms in loras.terms.items():
        fused = state[name].clone()
        fuse_rows(fused, 0, terms, fused.shape[0])
        out[name] = fused
    return out


# ---------------------------------------------------------------------------------------------------------
# The source the converter reads


class FusedRows(WrappedRows):
    """A source's rows with the LoRAs fused into the tensors they touch (the base reader hashes the raw bytes)."""

    def __init__(self, base: SourceRows, loras: LoraSet, shapes: dict[str, tuple[tuple[int, ...], DType]]):
        self.base, self.loras, self.shapes = base, loras, shapes

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None:
        self.base.read_rows(name, start, count, out)
        self._fuse(name, start, count, out)

    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> Any:
        return name, start, count, self.base.start_band(name, start, count, buffer)

    def finish_band(self, band: Any) -> np.ndarray:
        name, start, count, inner = band
        view = self.base.finish_band(inner)
        self._fuse(name, start, count, view)
        return view

    def _fuse(self, name: str, start: int, count: int, data: np.ndarray) -> None:
        terms = self.loras.terms.get(name)
        if not terms or not count:
            return
        shape, dtype = self.shapes[name]
        raw = data[: count * math.prod(shape[1:]) * dtype.itemsize]
        work = raw if raw.ctypes.data % dtype.itemsize == 0 else raw.copy()
        fuse_rows(torch.from_numpy(work).view(dtype.torch).view(count, *shape[1:]), start, terms, shape[0])
        if work is not raw:
            raw[:] = work


class FusedSource(Wrapped):
    """A conversion source whose weights are the base's with the LoRAs fused: `plan_conversion`'s one hook.

    Everything else is the base's; the identity (what a resume must match) adds the LoRAs' content hashes and
    scales, the files the output must not overlap add the LoRA files, and the provenance adds their records.
    """

    def __init__(self, base: ConversionSource, loras: LoraSet) -> None:
        self.base, self.loras = base, loras

    @property
    def config(self) -> dict[str, Any] | None:
        return self.base.config

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return self.base.shapes()

    def read_order(self) -> list[str]:
        return self.base.read_order()

    def input_paths(self) -> list[Path]:
        return [*self.base.input_paths(), *self.loras.input_paths()]

    def config_bytes(self) -> bytes | None:
        return self.base.config_bytes()

    def identity(self) -> str:
        return f"{self.base.identity()}+lora:{self.loras.identity()}"

    def check_unchanged(self, identity: str) -> None:
        base, _, loras = identity.rpartition("+lora:")
        self.base.check_unchanged(base)
        self.loras.check_unchanged()
        if loras != self.loras.identity():
            raise SourceError("the LoRAs changed while the conversion ran; re-run the command")

    def open_reader(self) -> FusedRows:
        return FusedRows(self.base.open_reader(), self.loras, self.shapes())

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        return replace(self.base.source_record(file_hashes), loras=self.loras.records())


def with_loras(
    source: ConversionSource, loras: Iterable[Any] | None, *, token: str | bool | None = None
) -> ConversionSource:
    """`source` with `loras` fused (the source itself when there are none).

    Raises:
        As `open_loras`.
    """
    opened = open_loras(loras, source, token=token)
    return source if opened is None else FusedSource(source, opened)


__all__ = [
    "FusedRows",
    "FusedSource",
    "LoraFactor",
    "LoraSet",
    "LoraSpec",
    "TILE_ROWS",
    "fuse_rows",
    "fuse_state_dict",
    "lora_specs",
    "open_loras",
    "with_loras",
]
