"""A sharded model stays on the device load_sharded put it on; dtype casts pass, offloading is refused.

Pipelines move their components (`pipe.to("cuda")`, `enable_model_cpu_offload`'s hooks, accelerate). For a
sharded model a move to another device is always a mistake: its process groups and hooks are bound to the
rank's device, and on a multi-GPU host `"cuda:0"` is another rank's GPU. Every move funnels through
`nn.Module._apply`, so the model's own `_apply` is wrapped (on the instance, nowhere else): the conversion
is tried on an empty tensor on the rank's device first, and a different target device is refused in one line
before any parameter moves. Casts (`.to(torch.bfloat16)`, `.half()`) and moves to the same device pass.
accelerate's offloading hooks move parameters without `_apply` (sequential offloading replaces them on the
meta device), so a forward pre-hook refuses a model that carries them, before they run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from preshard.errors import DeviceError
from preshard.runtime.changes import ModelChanges


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, where a missing index matches any (as "cuda" means the current CUDA device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def attach_device_guard(model: nn.Module, device: torch.device, world_size: int) -> None:
    """Refuse any move of `model` off `device` (its `to`, `cuda`, `cpu`, `to_empty`, ... all call `_apply`).

    Args:
        model: the loaded, sharded model.
        device: the rank's device.
        world_size: the ranks the model is sharded over, for the message.
    """
    name = type(model).__name__

    def guard(original: Callable) -> Callable:
        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            try:
                target = fn(torch.empty(0, device=device))
            except Exception:  # noqa: BLE001 - a conversion an empty tensor cannot take: the real call decides
                target = None
            if isinstance(target, torch.Tensor) and not same_device(target.device, device):
                raise DeviceError(
                    f"{name} is sharded over {world_size} ranks and this rank's shard lives on {device}, so moving "
                    f"it to {target.device} is refused; choose the device with load_sharded(..., device=...) and "
                    "leave the sharded model out of offloading (enable_model_cpu_offload, device maps): each rank "
                    "already holds only its shard"
                )
            return original(fn, recurse)

        return _apply

    changes = ModelChanges.of(model)
    changes.wrap_method("_apply", "device guard: moves to another device refused", guard)

    def refuse_offload(module: nn.Module, args: tuple) -> None:
        # accelerate's hooks (enable_*_cpu_offload, device maps) set `_hf_hook`; sequential offloading moves the
        # parameters without `_apply`, so the first forward is where it shows.
        if getattr(module, "_hf_hook", None) is not None:
            raise DeviceError(
                f"{name} is sharded over {world_size} ranks, but accelerate hooks were attached to it "
                "(enable_model_cpu_offload, enable_sequential_cpu_offload or a device map), which move this rank's "
                f"shard off {device}; leave the sharded model out of offloading: each rank already holds only its "
                "shard"
            )

    changes.hook(
        "", "device guard: accelerate offloading refused", model.register_forward_pre_hook(refuse_offload, prepend=True)
    )
