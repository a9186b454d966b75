"""Quantized Linear weights at load: kept quantized in device memory, dequantized at each forward.

A checkpoint's quantized weights (`format/quant.py`: float8/int8 with per-tensor, per-channel or block scales)
are loaded as they are stored; each scale becomes a buffer of its Linear under its own name (so `state_dict` and
`save_pretrained` give back the tensors the source stored, scales included) and the Linear computes
`x @ (weight.to(dtype) * scale)ᵀ` at the compute dtype: `load_sharded(dtype=...)`, else the dtype of the model's
other floating weights. The forward is `format.style_forwards.linear_forward`, which the row-parallel forwards call
too: it dequantizes a tile of rows at a time into one reused buffer (no full-precision copy of the weight exists at
any moment) and scales the output, so it composes with every TP style, CP, and `torch.compile` (plain tensor ops,
no graph break).

Why not torchao's or diffusers' quantized tensors: diffusers' quantizers quantize a model as it loads from a
safetensors checkpoint, not a rank's slice, and torchao's tensor subclasses would have to pass through the TP
slicing, preshard's reader and the functional collectives, none of which is tested with them; a few lines of
weight-only dequantization are. On CUDA a scaled matmul (`torch._scaled_mm`) would skip the dequantized copy; it
is not used (untested without a GPU): every device dequantizes.

A float8 weight is held as its bytes (an int8 view, `preshard_weight_format` naming its dtype): model code asks a
Linear's first floating parameter for the dtype to cast its input to (diffusers' `get_parameter_dtype`, MiniMax-H3's
AdaLN, Wan's time embedder), and a float8 weight would have the activations cast to float8 before the layer
sees them; int8, because model code that casts to the weight dtype already excepts int8 (Wan's time embedder).
PEFT likewise casts new LoRA factors to a floating base weight's dtype. `state_dict` and
`load_state_dict` see the float8 dtype again (`attach_state_views`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from preshard.errors import CorruptCheckpointError
from preshard.format.manifest import Manifest
from preshard.format.quant import QuantSpec, check_finite_scale, is_companion, recognise
from preshard.format.style_forwards import linear_forward

MARKERS = ("scaled_fp8",)  # ComfyUI's empty marker tensor at the root


class QuantizedLinearMixin(nn.Module):
    """Put in front of a Linear's class: the forward dequantizes the weight first (state on the module)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x, self.bias)


@functools.cache
def _quantized_class(cls: type) -> type:
    """`QuantizedLinearMixin` in front of `cls`, so `isinstance(m, cls)` still holds (one class per Linear class)."""
    return type(f"Quantized{cls.__name__}", (QuantizedLinearMixin, cls), {"__module__": __name__})


def quantized_weights(manifest: Manifest, config: Mapping[str, Any] | None) -> dict[str, QuantSpec]:
    """Every quantized Linear weight of the checkpoint, by weight name (`format.quant.recognise`)."""
    shapes = {name: (record.layout.shape, record.layout.dtype) for name, record in manifest.tensors.items()}
    return recognise(shapes, config)


def prepare(net: nn.Module, manifest: Manifest, specs: Mapping[str, QuantSpec]) -> None:
    """Before the model is checked against the manifest: each quantized weight takes its stored dtype and each
    scale (and ComfyUI's marker) a buffer of its own, on the meta device, so names, shapes and dtypes agree."""
    expected = {name for name, _ in net.named_parameters()} | {name for name, _ in net.named_buffers()}
    for name, record in manifest.tensors.items():
        layout = record.layout
        module_name, _, leaf = name.rpartition(".")
        if name in specs:
            module = net.get_submodule(module_name)
            if isinstance(module, nn.Linear) and leaf in module._parameters:
                meta = torch.empty(layout.shape, dtype=layout.dtype.torch, device="meta")
                module._parameters[leaf] = nn.Parameter(meta, requires_grad=False)
        elif name not in expected and (is_companion(name) or name in MARKERS):
            try:
                module = net.get_submodule(module_name)
            except AttributeError:
                continue  # the model lacks the module: check_against_manifest names the tensor
            module.register_buffer(leaf, torch.empty(layout.shape, dtype=layout.dtype.torch, device="meta"))


def check_scales(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, QuantSpec]) -> None:
    """Every weight scale this rank read is finite (a NaN or Inf one makes its weight's rows NaN/Inf at every
    forward).

    Raises:
        CorruptCheckpointError: naming the scale.
    """
    for spec in specs.values():
        if spec.scale is not None and spec.scale in tensors:
            check_finite_scale(
                spec.scale, tensors[spec.scale], CorruptCheckpointError,
                "the checkpoint cannot compute its weight: convert a source whose scales are numbers",
            )  # fmt: skip


def compute_dtype(net: nn.Module, requested: torch.dtype | None) -> torch.dtype:
    """The dtype quantized weights are dequantized to: the requested cast, else the other floating weights'."""
    if requested is not None:
        return requested
    for param in net.parameters():
        if param.dtype.is_floating_point and param.dtype.itemsize > 1:
            return param.dtype
    return torch.float32


def attach(net: nn.Module, specs: Mapping[str, QuantSpec], dtype: torch.dtype) -> dict[str, str]:
    """After the weights are in place and TP has rewired its modules: every quantized Linear dequantizes at its
    forward (a row-parallel one through its style's forward, the others through `QuantizedLinearMixin`).

    Returns:
        The description of each quantized Linear, by module name, for the model's report.
    """
    described: dict[str, str] = {}
    for name, spec in specs.items():
        module_name = name.rpartition(".")[0]
        module = net.get_submodule(module_name)
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if weight.dtype.is_floating_point:  # float8: held as its bytes (see the module docstring)
            setattr(module, "preshard_weight_format", weight.dtype)  # noqa: B010
            module._parameters["weight"] = nn.Parameter(weight.view(torch.int8), requires_grad=False)
        setattr(module, "preshard_compute_dtype", dtype)  # noqa: B010 (module attributes torch.compile reads)
        setattr(module, "preshard_scale_name", spec.scale.rpartition(".")[2] if spec.scale else None)  # noqa: B010
        setattr(module, "preshard_block", spec.block)  # noqa: B010
        if getattr(module, "preshard_forward", None) is None:  # not row-parallel: its own forward goes first
            module.__class__ = _quantized_class(cast(Any, type(module)))
        scale = f", {spec.granularity} scale {spec.scale_dtype}" if spec.scale else ", no scale"
        described[module_name] = f"quant: {spec.format}{scale}, dequantized to {str(dtype).removeprefix('torch.')}"
    return described


def _as_stored_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is not None and value.dtype == torch.int8:
        state_dict[key] = value.view(module.preshard_weight_format)


def _as_held_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is not None and value.dtype == module.preshard_weight_format:
        state_dict[key] = value.view(torch.int8)


def attach_state_views(net: nn.Module, specs: Mapping[str, QuantSpec]) -> None:
    """`state_dict` gives a float8 weight back in its own dtype, and `load_state_dict` takes it so: registered
    after the saving hooks, so the bytes are gathered (and sliced) as bytes first."""
    for name in specs:
        module = net.get_submodule(name.rpartition(".")[0])
        if getattr(module, "preshard_weight_format", None) is not None:
            module.register_state_dict_post_hook(_as_stored_hook)
            module.register_load_state_dict_pre_hook(_as_held_hook)
