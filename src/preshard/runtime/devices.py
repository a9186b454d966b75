"""The one place that decides a rank's device and process-group backend.

| kind   | device                          | backend | status                                   |
|--------|---------------------------------|---------|------------------------------------------|
| cpu    | cpu                             | gloo    | tested (every test runs here)            |
| cuda   | cuda:LOCAL_RANK                 | nccl    | written to torch's documented API        |
| xla    | torch_xla.device()              | xla     | single-device CPU run only (PJRT_DEVICE) |
| neuron | torch.neuron.current_device()   | neuron  | from Neuron's documentation; untested    |

Neuron's device index is only known once the process group exists, so the device is resolved after
`init_process_group`. Nothing else in preshard branches on the device kind.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from preshard.errors import PreshardError

KINDS = ("cpu", "cuda", "xla", "neuron")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xla": "xla", "neuron": "neuron"}


@dataclass(frozen=True)
class RankDevice:
    kind: str
    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int

    @property
    def pin_host_memory(self) -> bool:
        """Stage host reads in pinned memory where that makes the host-to-device copy asynchronous."""
        return self.kind == "cuda"


def detect_kind() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_neuronx") is not None:
        return "neuron"
    if importlib.util.find_spec("torch_xla") is not None and os.environ.get("PJRT_DEVICE"):
        return "xla"
    return "cpu"


def _kind_of(device: str | torch.device | None) -> str:
    if device is None:
        return detect_kind()
    kind = torch.device(device).type if not isinstance(device, str) or device not in KINDS else device
    if kind not in KINDS:
        raise PreshardError(f"device {device!r} is not supported; use one of {', '.join(KINDS)}")
    return kind


def init_rank_device(device: str | torch.device | None = None) -> RankDevice:
    """Initialise the process group from the torchrun environment if needed, then pick this rank's device."""
    kind = _kind_of(device)
    backend = BACKENDS[kind]
    if kind == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend
    if kind == "neuron":
        import torch_neuronx  # noqa: F401  registers the "neuron" device and backend
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group(backend=backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return RankDevice(kind, _device_for(kind, device, local_rank), backend, rank, world_size, local_rank)


def _device_for(kind: str, requested: str | torch.device | None, local_rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if isinstance(requested, torch.device) and requested.index is not None:
            index = requested.index
        else:
            index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if kind == "xla":
        import torch_xla

        return torch_xla.device()
    import torch_neuronx  # noqa: F401

    return torch.device("neuron", torch.neuron.current_device())
