"""The one place that decides a rank's device and process-group backend.

| kind          | device                  | backend | init   | status                                        |
|---------------|-------------------------|---------|--------|-----------------------------------------------|
| cpu           | cpu                     | gloo    | env:// | tested (every test runs here)                 |
| cuda          | cuda:LOCAL_RANK         | nccl    | env:// | written to torch's documented API; untested   |
| xla           | torch_xla.device()      | xla     | xla:// | one process tested on PJRT CPU (tests/xla);   |
|               |                         |         |        | multi-process refused on PJRT CPU, untested   |
|               |                         |         |        | on TPU/GPU                                    |
| neuron (XLA)  | torch_xla.device()      | xla     | xla:// | torch-neuronx on torch_xla: the xla path and  |
|               |                         |         |        | its checks; from Neuron's docs, untested      |
| neuron        | neuron:current_device() | neuron  | env:// | native TorchNeuron (registers the "neuron"    |
| (native)      |                         |         |        | backend); from Neuron's docs, untested        |

`device=None` picks: xla when PJRT_DEVICE names an accelerator (TPU, CUDA/GPU, NEURON; NEURON with
torch-neuronx installed gives neuron), else cuda when a GPU is visible, else neuron when torch-neuronx is
installed, else cpu. Never xla merely because torch_xla is importable: importing it (diffusers does) sets
PJRT_DEVICE=CPU on a machine without an accelerator, and a multi-process XLA job on PJRT CPU has no
collectives between its processes.

Under torchrun the XLA process group is created with `init_method="xla://"`, torch_xla's rendezvous: with
the default `env://` torch_xla's runtime would see one device (`xr.world_size() == 1`) and its all-reduce
would silently return each rank's own partial sum. After init, torchrun's WORLD_SIZE, the process group's
size and `xr.world_size()` must agree, else a DeviceError names all three.

Every device problem is one `DeviceError` line (unknown device, CUDA without CUDA, fewer GPUs than local
ranks, xla/neuron without their packages, disagreeing world sizes). Native Neuron's device index is only
known once the process group exists, so devices are resolved after `init_process_group`. Nothing else in
preshard branches on the device kind.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from preshard.errors import DeviceError

KINDS = ("cpu", "cuda", "xla", "neuron")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xla": "xla", "neuron": "neuron"}
# The pip package each kind needs beyond torch, and how to install it.
PACKAGES = {
    "xla": ("torch_xla", "pip install torch_xla (the release matching torch's major.minor)"),
    "neuron": (
        "torch_neuronx",
        "pip install torch-neuronx --extra-index-url https://pip.repos.neuron.amazonaws.com",
    ),
}
# PJRT_DEVICE values that name an accelerator (torch_xla itself sets PJRT_DEVICE=CPU when it finds none).
PJRT_ACCELERATORS = ("TPU", "CUDA", "GPU", "NEURON")
XLA_INIT_METHOD = "xla://"


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

    @property
    def uses_xla(self) -> bool:
        """Collectives go through torch_xla (xla, and torch-neuronx's XLA flavour)."""
        return self.backend == "xla"


def installed(module: str) -> bool:
    """Whether `module` can be imported (a None entry in sys.modules counts as absent, as import does)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pjrt_device() -> str:
    """PJRT_DEVICE's platform, upper-case ('' when unset): torch_xla reads 'CUDA_...'-style values by prefix."""
    return os.environ.get("PJRT_DEVICE", "").strip().upper().split("_")[0]


def detect_kind() -> str:
    platform = pjrt_device()
    if platform in PJRT_ACCELERATORS:
        return "neuron" if platform == "NEURON" and installed("torch_neuronx") else "xla"
    if torch.cuda.is_available():
        return "cuda"
    if installed("torch_neuronx"):
        return "neuron"
    return "cpu"


def _kind_of(device: str | torch.device | None) -> str:
    if device is None:
        return detect_kind()
    kind = None
    if isinstance(device, str):
        base = device.split(":", 1)[0].strip().lower()
        # "neuron[:N]" is only a torch device type once torch-neuronx is imported: judge it by name.
        if base == "neuron" or (base in KINDS and _parses(device)):
            kind = base
    elif isinstance(device, torch.device):
        kind = device.type
    if kind not in KINDS:
        raise DeviceError(
            f"device {device!r} is not supported; use one of {', '.join(KINDS)} (or 'cuda:N'), or None to detect"
        )
    return kind


def _parses(device: str) -> bool:
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _require_package(kind: str, detected: bool) -> None:
    if kind not in PACKAGES:
        return
    module, install = PACKAGES[kind]
    if not installed(module):
        if detected and os.environ.get("PJRT_DEVICE"):
            why, other = f" (PJRT_DEVICE={os.environ['PJRT_DEVICE']} selects {kind})", "unset PJRT_DEVICE"
        else:
            why, other = "", "use device='cpu'"
        raise DeviceError(f"device {kind!r} needs {module}, which is not installed{why}: {install}, or {other}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DeviceError(f"{name}={value!r} is not a whole number; launch with torchrun, which sets it") from None


def _check_cuda(requested: str | torch.device | None) -> None:
    """CUDA must exist, and this host must have a GPU for every local rank (and for an explicit index)."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        raise DeviceError(
            f"device 'cuda' was requested but {why}; use device='cpu', or a CUDA build of torch on a GPU host"
        )
    count = torch.cuda.device_count()
    local_ranks = _env_int("LOCAL_WORLD_SIZE", 1)
    if local_ranks > count:
        raise DeviceError(
            f"torchrun started {local_ranks} ranks on this host but only {count} GPUs are visible; "
            f"launch with --nproc-per-node {count} or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    index = _requested_index(requested)
    if index is not None and index >= count:
        raise DeviceError(
            f"device {str(requested)!r} asks for GPU {index} but only {count} are visible (0..{count - 1})"
        )


def _requested_index(requested: str | torch.device | None) -> int | None:
    if requested is None or (isinstance(requested, str) and requested.strip().lower() in KINDS):
        return None
    return torch.device(requested).index


def _neuron_backend() -> str:
    """'neuron' for native TorchNeuron (it registers that backend), 'xla' for torch-neuronx on torch_xla.

    From Neuron's documentation; untested (torch-neuronx cannot be installed here).
    """
    import torch_neuronx  # noqa: F401  registers the "neuron" device and backend (native), or builds on torch_xla

    if "neuron" in getattr(dist.Backend, "backend_list", []):
        return "neuron"
    if installed("torch_xla"):
        return "xla"
    raise DeviceError(
        "torch-neuronx registered no 'neuron' process-group backend and torch_xla is not installed; "
        "reinstall torch-neuronx from the Neuron repository (https://pip.repos.neuron.amazonaws.com)"
    )


def device_kind_and_backend(device: str | torch.device | None = None) -> tuple[str, str]:
    """The device kind and process-group backend `device` asks for, checked before any process group exists.

    Raises:
        DeviceError: an unknown device, or one this host or this install cannot give.
    """
    kind = _kind_of(device)
    _require_package(kind, detected=device is None)
    if kind == "cuda":
        _check_cuda(device)
    return kind, _neuron_backend() if kind == "neuron" else BACKENDS[kind]


def init_rank_device(device: str | torch.device | None = None, *, store: dist.Store | None = None) -> RankDevice:
    """Initialise the process group from the torchrun environment if needed, then pick this rank's device.

    Args:
        store: the job's store, where the caller met the other ranks already (`preshard.runtime.rendezvous`).
    """
    kind, backend = device_kind_and_backend(device)
    if backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend and xla:// rendezvous

    launched = _env_int("WORLD_SIZE", 1)
    created = False
    if not dist.is_initialized() and launched > 1:
        if store is not None and backend != "xla":
            dist.init_process_group(backend=backend, store=store, rank=_env_int("RANK", 0), world_size=launched)
        else:
            dist.init_process_group(backend=backend, init_method=XLA_INIT_METHOD if backend == "xla" else None)
        created = True
    try:
        _check_process_group(backend, launched, created)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        local_rank = _env_int("LOCAL_RANK", rank)
        resolved = _device_for(kind, backend, device, local_rank)
    except DeviceError:
        if created:
            dist.destroy_process_group()
        raise
    return RankDevice(kind, resolved, backend, rank, world_size, local_rank)


def _check_process_group(backend: str, launched: int, created: bool) -> None:
    """The process group must carry this device's tensors, and every count of ranks must agree."""
    group_size = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized() and not _backend_fits(backend, str(dist.get_backend()).lower()):
        raise DeviceError(
            f"the process group was initialised with backend {str(dist.get_backend())!r} but this device needs "
            f"{backend!r}; call dist.init_process_group({backend!r}) or let preshard initialise it"
        )
    if "WORLD_SIZE" not in os.environ:
        launched = group_size  # not launched by torchrun: nothing to compare the group with
    if backend == "xla":
        _check_xla_world(launched, group_size, created)
    elif group_size != launched:
        raise DeviceError(
            f"torchrun started {launched} ranks (WORLD_SIZE) but the {backend} process group has {group_size}; "
            "initialise it from torchrun's environment (init_method='env://') or let preshard do it"
        )


def _backend_fits(backend: str, actual: str) -> bool:
    """Whether a group of backend `actual` can run collectives on tensors of a `backend` device."""
    if backend == "xla" or "xla" in actual:
        return backend == "xla" and "xla" in actual
    if backend == "gloo":  # CPU tensors: gloo or mpi, not nccl alone
        return "gloo" in actual or "mpi" in actual
    return True  # cuda runs on nccl or gloo; native Neuron on whatever the user chose


def _check_xla_world(launched: int, group_size: int, created: bool) -> None:
    import torch_xla.runtime as xr

    runtime_size = xr.world_size()
    if launched == group_size == runtime_size:
        return
    platform = xr.device_type() or pjrt_device() or "unset"
    if platform == "CPU":
        fix = (
            "PJRT_DEVICE=CPU gives each process its own single device with no collectives between processes, so "
            "run multi-rank CPU jobs with device='cpu' (gloo), and XLA jobs on TPU/GPU/Neuron"
        )
    elif not created and dist.is_initialized():
        fix = "initialise the process group with dist.init_process_group('xla', init_method='xla://') or let preshard"
    else:
        fix = "launch torchrun --nproc-per-node with one process per XLA device (PJRT_DEVICE=TPU/CUDA/NEURON)"
    raise DeviceError(
        f"xla world sizes disagree: torchrun started {launched} ranks (WORLD_SIZE), the xla process group has "
        f"{group_size}, torch_xla sees {runtime_size} (xr.world_size(), PJRT_DEVICE={platform}); {fix}"
    )


def _device_for(kind: str, backend: str, requested: str | torch.device | None, local_rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        index = _requested_index(requested)
        if index is None:
            index = local_rank
            if index >= torch.cuda.device_count():
                raise DeviceError(
                    f"LOCAL_RANK {local_rank} has no GPU: only {torch.cuda.device_count()} are visible; "
                    "launch with fewer ranks per host"
                )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if backend == "xla":
        import torch_xla

        if hasattr(torch_xla, "device"):
            return torch_xla.device()
        import torch_xla.core.xla_model as xm  # torch_xla < 2.5

        return xm.xla_device()
    # Native TorchNeuron: from Neuron's documentation, untested.
    return torch.device("neuron", torch.neuron.current_device())
