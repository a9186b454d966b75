"""LoRA adapters on a sharded model: `model.load_lora_adapter(...)` and the pipelines' `load_lora_weights`.

diffusers and PEFT wrap each targeted `nn.Linear` in a LoRA layer that computes `base(x) + B(A(x)) * scaling`,
with A and B plain Linears sized by the base layer's `in_features` / `out_features`. On a sharded layer those
are local, the file's factors are not, and a row-parallel base's LoRA needs an all-reduce that PEFT does not
do, so loading is rewired here, per model (an instance attribute; no class or process-wide patching):

- while diffusers builds the adapters, every sharded layer reports its global in/out features, so the file
  loads as it would on the unsharded model;
- then each new adapter's factors are sliced by the base layer's style: the output side (B, and its bias) as
  the base's output (colwise: B's rows; packed colwise: B's rows within each block), the input side (A) as the
  base's input (rowwise and its variants: A's columns, with A switched to the same row-parallel forward, whose
  all-reduce sums the rank-r partial products before B). Whatever is split on one side is whole on the other.

So `B_r @ A_r` is exactly rank r's slice of `B @ A`: the forward equals the unsharded model's with the same
LoRA, and `fuse_lora` / `unfuse_lora` / `set_adapters` / `delete_adapters` / `unload_lora` work unchanged on
each rank. FluxPipeline's `load_lora_weights` resizes every Linear whose shape differs from the LoRA's (its
Control-LoRA support) before it hands the file to the model, which on a sharded layer would replace it with a
zero-padded full-size copy; such a replacement of a sharded layer is undone here before the adapter loads.
What cannot be made right is refused in one line that names `convert-checkpoint --lora`: hotswapping,
training new adapters (`add_adapter`), and LoRA variants (DoRA); `save_lora_adapter` is refused too (it would
write this rank's slices).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from preshard.errors import UsageError
from preshard.format.layout import TensorLayout
from preshard.format.manifest import Manifest
from preshard.format.styles import REPLICATE, Style
from preshard.runtime.changes import ModelChanges
from preshard.runtime.tp import ParallelLinear, parallelize_linear

STATE_ATTRIBUTE = "_preshard_lora"
FUSE_HINT = "or fuse the LoRA into the checkpoint: convert-checkpoint SRC OUT --lora FILE"


@dataclass
class ShardedLayer:
    """A sharded Linear as loaded: the module itself, its style, and its global [out, in]."""

    module: nn.Linear
    style: Style
    out_features: int
    in_features: int


class ShardedLora:
    """What LoRA loading on a sharded model needs: its sharded layers, the TP group and this rank's place in it."""

    def __init__(
        self,
        layers: dict[str, ShardedLayer],
        group: ProcessGroup | None,
        tp_rank: int,
        tp: int,
        report: Any,
    ) -> None:
        self.layers, self.group, self.tp_rank, self.tp, self.report = layers, group, tp_rank, tp, report

    @contextlib.contextmanager
    def global_features(self) -> Iterator[None]:
        """Every sharded layer reports its global in/out features (what PEFT sizes new adapters by)."""
        local = {name: (layer.module.in_features, layer.module.out_features) for name, layer in self.layers.items()}
        for layer in self.layers.values():
            layer.module.in_features, layer.module.out_features = layer.in_features, layer.out_features
        try:
            yield
        finally:
            for name, layer in self.layers.items():
                layer.module.in_features, layer.module.out_features = local[name]

    def restore_layers(self, model: nn.Module) -> list[str]:
        """Put back every sharded layer that something replaced by a plain full-size Linear since loading
        (FluxPipeline's `load_lora_weights` does, padding it with zeros); returns their names.

        Raises:
            UsageError: a sharded layer was replaced by something else.
        """
        restored = []
        for name, layer in self.layers.items():
            holder, attribute, current = _holder(model, name)
            if current is layer.module:
                continue
            if type(current) is nn.Linear and tuple(current.weight.shape) == (layer.out_features, layer.in_features):
                setattr(holder, attribute, layer.module)
                restored.append(name)
                continue
            raise UsageError(
                f"{name}, a layer preshard loaded sharded, was replaced by a {type(current).__name__} after loading; "
                f"load the model again and load the LoRA with model.load_lora_adapter(...), {FUSE_HINT}"
            )
        overwritten = getattr(model, "_overwritten_params", None)
        if restored and isinstance(overwritten, dict):  # what diffusers kept of the layers it replaced
            ours = {p.data_ptr() for layer in self.layers.values() for p in layer.module.parameters()}
            for key in [k for k, v in overwritten.items() if isinstance(v, torch.Tensor) and v.data_ptr() in ours]:
                del overwritten[key]
            if not overwritten:
                del model._overwritten_params
        return restored

    def shard_adapters(self, model: nn.Module) -> None:
        """Slice every adapter loaded since the last call by its base layer's style (see the module docstring).

        Raises:
            UsageError: a LoRA variant (DoRA) on a sharded layer (the adapter is deleted again first).
        """
        for name, layer in self.layers.items():
            wrapper = model.get_submodule(name)
            lora_a, lora_b = getattr(wrapper, "lora_A", None), getattr(wrapper, "lora_B", None)
            if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
                continue
            for adapter in list(lora_a.keys()):
                down, up = lora_a[adapter], lora_b[adapter]
                if getattr(down, "preshard_sharded", False):
                    continue
                if adapter in getattr(wrapper, "lora_variant", {}) or getattr(wrapper, "use_dora", {}).get(adapter):
                    model.delete_adapters(adapter)
                    raise UsageError(
                        f"adapter {adapter} is a DoRA (or another LoRA variant) on {name}, which preshard shards; "
                        f"it was removed again: use a plain LoRA, {FUSE_HINT}"
                    )
                self._shard(name, adapter, layer, down, up)

    def _shard(self, name: str, adapter: str, layer: ShardedLayer, down: nn.Module, up: nn.Module) -> None:
        if not isinstance(down, nn.Linear) or not isinstance(up, nn.Linear) or layer.style.weight_dim not in (0, 1):
            raise UsageError(f"cannot shard adapter {adapter} on {name} ({layer.style.name}); {FUSE_HINT}")
        rows = layer.style.weight_dim == 0  # the base splits its output: B's rows; else its input: A's columns
        down_style, up_style = (REPLICATE, layer.style) if rows else (layer.style, REPLICATE)
        _slice_param(down, "weight", f"{name}.lora_A.weight", down_style, self.tp, self.tp_rank)
        _slice_param(up, "weight", f"{name}.lora_B.weight", up_style, self.tp, self.tp_rank)
        if up.bias is not None:
            _slice_param(up, "bias", f"{name}.lora_B.bias", up_style, self.tp, self.tp_rank)
        for linear in (down, up):
            linear.out_features, linear.in_features = linear.weight.shape
            linear.preshard_sharded = True
        where = f"{name}.lora_A.{adapter}"
        described = parallelize_linear(down, down_style, self.group, self.tp_rank, self.tp)
        if described is not None and self.report is not None:
            self.report.add_hook(where, described)
        if self.report is not None:
            self.report.add_hook(f"{name}.lora_B.{adapter}", f"lora: {up_style.name} (B), {down_style.name} (A)")


def _holder(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module]:
    """(the module holding layer `name`, the attribute, what is there now), looking through a LoRA wrapper."""
    parent_name, _, attribute = name.rpartition(".")
    holder = model.get_submodule(parent_name) if parent_name else model
    current = getattr(holder, attribute)
    while hasattr(current, "base_layer") and isinstance(current.base_layer, nn.Module):
        holder, attribute, current = current, "base_layer", current.base_layer
    return holder, attribute, current


def _slice_param(linear: nn.Linear, leaf: str, name: str, style: Style, tp: int, tp_rank: int) -> None:
    param = linear._parameters[leaf]
    layout = TensorLayout.make(name, style, tuple(param.shape), param.dtype, param.dtype)
    if layout.shard_dim is None:
        return
    d = layout.shard_dim
    pieces = [param.data.narrow(d, offsets[d], sizes[d]) for offsets, sizes in layout.boxes(tp, tp_rank)]
    local = torch.cat(pieces, dim=d).contiguous() if len(pieces) > 1 else pieces[0].contiguous()
    linear._parameters[leaf] = nn.Parameter(local, requires_grad=param.requires_grad)


def _keys(source: Any) -> list[str]:
    """The keys of a LoRA given as a state dict or a local safetensors file (else none: diffusers resolves it)."""
    if isinstance(source, dict):
        return [k for k in source if isinstance(k, str)]
    if isinstance(source, (str, Path)) and str(source).endswith(".safetensors") and Path(source).is_file():
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            return list(f.keys())
    return []


def _load_lora_adapter(model: nn.Module, inner: Any, *args: Any, **kwargs: Any) -> Any:
    """`load_lora_adapter` on a sharded model: `inner` (the model's own), around which the adapters are sliced."""
    state: ShardedLora = getattr(model, STATE_ATTRIBUTE)
    if kwargs.get("hotswap"):
        raise UsageError(f"hotswap=True is not supported on a sharded model; load the adapter without it, {FUSE_HINT}")
    given = args[0] if args else kwargs.get("pretrained_model_name_or_path_or_dict")
    dora = next((k for k in _keys(given) if "lora_magnitude_vector" in k or "dora_scale" in k), None)
    if dora is not None:
        raise UsageError(f"this LoRA is a DoRA ({dora}), which preshard cannot shard; use a plain LoRA, {FUSE_HINT}")
    state.restore_layers(model)
    try:
        with state.global_features():
            return inner(*args, **kwargs)
    finally:
        state.shard_adapters(model)  # also what a failed load left behind, so no adapter stays unsliced


def _add_adapter(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    raise UsageError(
        "add_adapter (a new, untrained adapter) is not supported on a sharded model: train on the unsharded model, "
        f"then load the LoRA with load_lora_adapter / load_lora_weights, {FUSE_HINT}"
    )


def _save_lora_adapter(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    raise UsageError(
        "save_lora_adapter on a sharded model would write this rank's slices of the adapters under their full names; "
        "save the LoRA from the unsharded model, or keep the file you loaded"
    )


def attach_lora_loading(
    model: nn.Module,
    sharded: dict[str, nn.Linear],
    manifest: Manifest,
    group: ProcessGroup | None,
    tp_rank: int,
    report: Any = None,
) -> bool:
    """Make `model.load_lora_adapter` (which every diffusers pipeline's `load_lora_weights` calls) shard what it
    loads, and refuse `add_adapter` and `save_lora_adapter`; returns whether anything was attached (not for a model
    without sharded layers or without diffusers' adapter methods)."""
    if not sharded or not callable(getattr(model, "load_lora_adapter", None)):
        return False
    layers = {}
    for name, module in sharded.items():
        layout = manifest.tensors[f"{name}.weight"].layout
        layers[name] = ShardedLayer(module, layout.style, *layout.shape)
    changes = ModelChanges.of(model)
    changes.set_attribute(model, "", STATE_ATTRIBUTE, ShardedLora(layers, group, tp_rank, manifest.tp, report))
    layer = "lora: load the adapters sliced"
    changes.wrap_method("load_lora_adapter", layer, lambda inner: functools.partial(_load_lora_adapter, model, inner))
    for name, refuse in (("add_adapter", _add_adapter), ("save_lora_adapter", _save_lora_adapter)):
        if callable(getattr(model, name, None)):
            changes.wrap_method(name, "lora: refused", lambda own, refuse=refuse: functools.partial(refuse, model))
    return True


__all__ = ["ParallelLinear", "ShardedLora", "attach_lora_loading"]
