"""Device selection and every device problem as one DeviceError line, on a CPU-only host.

What is absent here (CUDA, torch_xla, torch-neuronx) is simulated: a None entry in sys.modules makes an
import fail as if the package were not installed, and small fake modules stand in for torch_xla where
the test is about preshard's logic, not torch_xla's (tests/xla runs the real one).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from preshard.errors import DeviceError, PreshardError
from preshard.runtime import collectives as C
from preshard.runtime import devices
from preshard.runtime.devices import detect_kind, init_rank_device

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PJRT_DEVICE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No torchrun or PJRT variables from the outside, no GPU, and no process group."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not dist.is_initialized()


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, DeviceError) and isinstance(excinfo.value, PreshardError)
    assert "\n" not in message and message.strip() == message and message
    return message


def absent(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


class FakeXla:
    """A stand-in torch_xla: runtime sizes and platform as given, collectives recorded."""

    def __init__(self, monkeypatch, *, world_size: int = 1, platform: str = "CPU") -> None:
        self.world_size, self.platform = world_size, platform
        self.calls: list[tuple[str, tuple, dict]] = []
        root = types.ModuleType("torch_xla")
        root.device = lambda: torch.device("cpu")  # the tests only look at what preshard does around it
        runtime = types.ModuleType("torch_xla.runtime")
        runtime.world_size = lambda: self.world_size
        runtime.device_type = lambda: self.platform
        xm = types.ModuleType("torch_xla.core.xla_model")
        xm.REDUCE_SUM = "sum"
        for op in ("all_reduce", "all_gather", "all_to_all", "collective_permute"):
            setattr(xm, op, self._recorder(op))
        modules = {
            "torch_xla": root,
            "torch_xla.runtime": runtime,
            "torch_xla.core": types.ModuleType("torch_xla.core"),
            "torch_xla.core.xla_model": xm,
            "torch_xla.distributed": types.ModuleType("torch_xla.distributed"),
            "torch_xla.distributed.xla_backend": types.ModuleType("torch_xla.distributed.xla_backend"),
        }
        root.runtime, root.core, root.distributed = runtime, modules["torch_xla.core"], modules["torch_xla.distributed"]
        modules["torch_xla.core"].xla_model = xm
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)

    def _recorder(self, op: str):
        def record(*args, **kwargs):
            self.calls.append((op, args, kwargs))
            return args[1] if op == "all_reduce" else args[0]

        return record


class FakeGroup:
    """Patch torch.distributed so init_rank_device sees a process group of the given size and backend."""

    def __init__(self, monkeypatch, *, size: int | None, backend: str = "gloo", initialised: bool = False) -> None:
        self.size, self.backend, self.initialised = size, backend, initialised
        self.init_calls: list[dict] = []
        self.destroyed = False
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(dist, "init_process_group", self._init)
        monkeypatch.setattr(dist, "destroy_process_group", self._destroy)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: self.size)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: self.backend)

    def _init(self, backend=None, init_method=None, **kwargs):
        self.init_calls.append({"backend": backend, "init_method": init_method})
        self.initialised = True

    def _destroy(self, group=None):
        self.destroyed, self.initialised = True, False


# ---------------------------------------------------------------- selection


def test_cpu_is_the_default_without_accelerators():
    assert detect_kind() == "cpu"
    rd = init_rank_device(None)
    assert (rd.kind, rd.backend, rd.device, rd.world_size) == ("cpu", "gloo", torch.device("cpu"), 1)


def test_installed_torch_xla_with_pjrt_cpu_does_not_select_xla(monkeypatch):
    """Importing torch_xla (diffusers does) sets PJRT_DEVICE=CPU: that must not turn a CPU job into XLA."""
    FakeXla(monkeypatch)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert devices.installed("torch_xla")
    assert detect_kind() == "cpu"
    assert init_rank_device(None).backend == "gloo"


@pytest.mark.parametrize("platform", ["TPU", "CUDA", "GPU", "NEURON", "tpu"])
def test_pjrt_device_naming_an_accelerator_selects_xla(monkeypatch, platform):
    FakeXla(monkeypatch)
    absent(monkeypatch, "torch_neuronx")
    monkeypatch.setenv("PJRT_DEVICE", platform)
    assert detect_kind() == "xla"


def test_pjrt_neuron_with_torch_neuronx_selects_neuron(monkeypatch):
    FakeXla(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    assert detect_kind() == "neuron"


def test_explicit_xla_single_process(monkeypatch):
    FakeXla(monkeypatch, world_size=1)
    rd = init_rank_device("xla")
    assert (rd.kind, rd.backend, rd.uses_xla, rd.world_size) == ("xla", "xla", True, 1)


# ---------------------------------------------------------------- one line per problem


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", "", torch.device("meta"), 3])
def test_unknown_device(device):
    with pytest.raises(DeviceError) as e:
        init_rank_device(device)
    assert "is not supported; use one of cpu, cuda, xla, neuron" in one_line_error(e)


def test_cuda_requested_on_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError) as e:
        init_rank_device("cuda")
    assert "CPU-only build" in one_line_error(e) and "device='cpu'" in str(e.value)


def test_cuda_requested_with_no_gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError) as e:
        init_rank_device("cuda:0")
    assert "no GPU is visible (CUDA_VISIBLE_DEVICES='')" in one_line_error(e)


def test_fewer_gpus_than_local_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(DeviceError) as e:
        init_rank_device("cuda")
    message = one_line_error(e)
    assert "torchrun started 4 ranks on this host but only 2 GPUs are visible" in message
    assert "--nproc-per-node 2" in message


def test_explicit_gpu_index_out_of_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError) as e:
        init_rank_device(torch.device("cuda", 3))
    assert "asks for GPU 3 but only 2 are visible" in one_line_error(e)


def test_xla_without_torch_xla(monkeypatch):
    absent(monkeypatch, "torch_xla")
    with pytest.raises(DeviceError) as e:
        init_rank_device("xla")
    assert "needs torch_xla, which is not installed: pip install torch_xla" in one_line_error(e)


def test_pjrt_device_without_torch_xla(monkeypatch):
    absent(monkeypatch, "torch_xla", "torch_neuronx")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(DeviceError) as e:
        init_rank_device(None)
    message = one_line_error(e)
    assert "(PJRT_DEVICE=TPU selects xla): pip install torch_xla" in message and "unset PJRT_DEVICE" in message


@pytest.mark.parametrize("device", ["neuron", "neuron:1"])
def test_neuron_without_torch_neuronx(monkeypatch, device):
    absent(monkeypatch, "torch_neuronx")
    with pytest.raises(DeviceError) as e:
        init_rank_device(device)
    assert "needs torch_neuronx, which is not installed: pip install torch-neuronx" in one_line_error(e)


def test_process_group_smaller_than_torchrun_world(monkeypatch):
    FakeGroup(monkeypatch, size=2, initialised=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(DeviceError) as e:
        init_rank_device("cpu")
    assert "torchrun started 4 ranks (WORLD_SIZE) but the gloo process group has 2" in one_line_error(e)


def test_process_group_with_another_backend(monkeypatch):
    FakeGroup(monkeypatch, size=2, backend="nccl", initialised=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeviceError) as e:
        init_rank_device("cpu")
    assert "initialised with backend 'nccl' but this device needs 'gloo'" in one_line_error(e)


def test_world_size_not_a_number(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DeviceError) as e:
        init_rank_device("cpu")
    assert "WORLD_SIZE='two' is not a whole number" in one_line_error(e)


def test_xla_uses_xla_init_method_and_refuses_three_disagreeing_sizes(monkeypatch):
    """torchrun says 2, the group (xla:// on PJRT CPU) and torch_xla say 1: one line naming all three."""
    FakeXla(monkeypatch, world_size=1, platform="CPU")
    group = FakeGroup(monkeypatch, size=1, backend="xla")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeviceError) as e:
        init_rank_device("xla")
    assert group.init_calls == [{"backend": "xla", "init_method": "xla://"}]
    assert group.destroyed, "the group preshard created is destroyed when it refuses the launch"
    message = one_line_error(e)
    assert "torchrun started 2 ranks (WORLD_SIZE), the xla process group has 1, torch_xla sees 1" in message
    assert "device='cpu' (gloo)" in message


def test_xla_group_initialised_by_the_user_with_env(monkeypatch):
    """The issue's reproduction: env:// gives a group of 2 while torch_xla sees 1 device (all-reduce a no-op)."""
    FakeXla(monkeypatch, world_size=1, platform="TPU")
    group = FakeGroup(monkeypatch, size=2, backend="xla", initialised=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeviceError) as e:
        init_rank_device("xla")
    assert not group.destroyed, "a group the user created is left alone"
    message = one_line_error(e)
    assert "the xla process group has 2, torch_xla sees 1" in message and "init_method='xla://'" in message


def test_xla_sizes_that_agree_pass(monkeypatch):
    FakeXla(monkeypatch, world_size=4, platform="TPU")
    FakeGroup(monkeypatch, size=4, backend="xla")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rd = init_rank_device("xla")
    assert (rd.backend, rd.world_size) == ("xla", 4)


# ---------------------------------------------------------------- backend refusals at attach time

MESH_TP2_U2 = {
    "tp": [[0, 2], [1, 3]],
    "ring": [[0], [1], [2], [3]],
    "ulysses": [[0, 1], [2, 3]],
    "cp": [[0, 1], [2, 3]],
}
MESH_U_STRIDED = {"tp": [[0, 1], [2, 3]], "ulysses": [[0, 2], [1, 3]]}


def test_gloo_accepts_any_mesh():
    C.check_backend_supports("gloo", MESH_U_STRIDED, 4)


def test_neuron_refuses_strided_all_to_all_groups():
    with pytest.raises(DeviceError) as e:
        C.check_backend_supports("neuron", MESH_U_STRIDED, 4, neuron=True)
    assert "contiguous ascending rank groups but the ulysses groups include [0, 2]" in one_line_error(e)
    C.check_backend_supports("neuron", MESH_TP2_U2, 4, neuron=True)


def test_xla_on_pjrt_cpu_refuses_a_multi_rank_mesh(monkeypatch):
    FakeXla(monkeypatch, world_size=4, platform="CPU")
    with pytest.raises(DeviceError) as e:
        C.check_backend_supports("xla", MESH_TP2_U2, 4)
    assert "PJRT_DEVICE=CPU cannot run collectives between processes" in one_line_error(e)
    C.check_backend_supports("xla", {"tp": [[0]], "ring": [[0]]}, 1)  # one rank needs no collective


def test_xla_refuses_when_torch_xla_sees_another_world(monkeypatch):
    FakeXla(monkeypatch, world_size=1, platform="TPU")
    with pytest.raises(DeviceError) as e:
        C.check_backend_supports("xla", MESH_TP2_U2, 4)
    assert "torch_xla sees 1 devices (xr.world_size()) but the job has 4 ranks" in one_line_error(e)


def test_xla_refuses_groups_that_do_not_partition_the_world(monkeypatch):
    FakeXla(monkeypatch, world_size=4, platform="TPU")
    with pytest.raises(DeviceError) as e:
        C.check_backend_supports("xla", {"tp": [[0, 1], [2]]}, 4)
    assert "must split ranks 0..3 into equal groups" in one_line_error(e)


# ---------------------------------------------------------------- the xla collectives, with a fake torch_xla


@pytest.fixture
def xla_world(monkeypatch):
    """4 ranks on a fake TPU; this rank is global rank `me` of whatever group `group_ranks` returns."""
    fake = FakeXla(monkeypatch, world_size=4, platform="TPU")
    monkeypatch.setattr(C, "_is_xla", lambda tensor: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    C.check_backend_supports(
        "xla", {"tp": [[0, 2], [1, 3]], "ring": [[0, 1], [2, 3]], "ulysses": [[0], [1], [2], [3]]}, 4
    )
    return fake


def _as(monkeypatch, ranks: list[int]) -> None:
    monkeypatch.setattr(C, "group_ranks", lambda group: list(ranks))


def test_xla_all_reduce_uses_every_tp_group(monkeypatch, xla_world):
    _as(monkeypatch, [1, 3])
    t = torch.ones(2)
    assert C.all_reduce_sum(t, None) is t
    op, args, kwargs = xla_world.calls[-1]
    assert (op, args[0], kwargs) == ("all_reduce", "sum", {"groups": [[0, 2], [1, 3]], "pin_layout": False})
    assert args[1] == [t]  # the list form: reduced in place


def test_xla_all_gather_and_all_to_all_pass_the_whole_axis(monkeypatch, xla_world):
    _as(monkeypatch, [2, 3])
    C.all_gather_cat(torch.ones(2, 3), None, dim=1)
    C.all_to_all_equal(torch.ones(4, 1), None)
    (g_op, _, g_kw), (a_op, a_args, a_kw) = xla_world.calls[-2:]
    assert (g_op, g_kw["groups"], g_kw["dim"]) == ("all_gather", [[0, 1], [2, 3]], 0)
    assert (a_op, a_args[1:], a_kw["groups"]) == ("all_to_all", (0, 0, 2), [[0, 1], [2, 3]])


def test_xla_ring_pass_is_one_permute_with_the_same_pairs_on_every_rank(monkeypatch, xla_world):
    pairs = []
    for ranks in ([0, 1], [2, 3]):
        _as(monkeypatch, ranks)
        C.ring_pass(torch.ones(3), None)
        op, _, kwargs = xla_world.calls[-1]
        assert op == "collective_permute"
        pairs.append(kwargs["pairs"])
    assert pairs[0] == pairs[1] == [[0, 1], [1, 0], [2, 3], [3, 2]]


def test_xla_cp_gather_finds_its_groups_for_any_axis_order(monkeypatch):
    """With ring the faster axis, a cp group is [0, 2, 1, 3] in mesh order, but the process group (and so the
    collective) knows its ranks sorted: the replica groups are derived sorted, and agree with the mesh's."""
    from preshard.format.mesh import MeshSpec

    fake = FakeXla(monkeypatch, world_size=8, platform="TPU")
    monkeypatch.setattr(C, "_is_xla", lambda tensor: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    mesh = MeshSpec.build(tp=2, ring=2, ulysses=2, order="tp,ulysses,ring")
    assert mesh.groups("cp") == [[0, 2, 1, 3], [4, 6, 5, 7]]
    C.check_backend_supports("xla", {axis: mesh.groups(axis) for axis in ("tp", "ring", "ulysses", "cp")}, 8)
    _as(monkeypatch, [4, 5, 6, 7])
    C.all_gather_cat(torch.ones(2, 3), None, dim=1)
    op, _, kwargs = fake.calls[-1]
    assert (op, kwargs["groups"]) == ("all_gather", [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_xla_collective_over_a_group_of_no_mesh_axis_raises(monkeypatch, xla_world):
    _as(monkeypatch, [0, 3])
    with pytest.raises(C.CollectiveRuleViolation, match="no group of a mesh axis"):
        C.all_reduce_sum(torch.ones(1), None)
    assert not xla_world.calls


def test_xla_collective_refuses_when_torch_xla_sees_one_device(monkeypatch, xla_world):
    """torch_xla's all-reduce silently returns its input when it sees one device: never reach it."""
    xla_world.world_size = 1
    _as(monkeypatch, [0, 2])
    with pytest.raises(DeviceError, match="torch_xla sees 1 devices"):
        C.all_reduce_sum(torch.ones(1), None)
    assert not xla_world.calls


def test_xla_device_with_a_gloo_group(monkeypatch):
    FakeXla(monkeypatch, world_size=1, platform="TPU")
    FakeGroup(monkeypatch, size=2, backend="gloo", initialised=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeviceError) as e:
        init_rank_device("xla")
    assert "initialised with backend 'gloo' but this device needs 'xla'" in one_line_error(e)


def test_group_created_without_torchrun_is_not_compared_with_world_size(monkeypatch):
    FakeGroup(monkeypatch, size=3, backend="cpu:gloo,cuda:nccl", initialised=True)
    rd = init_rank_device("cpu")
    assert (rd.backend, rd.world_size) == ("gloo", 3)
