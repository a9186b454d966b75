"""A sharded model stays on its rank's device: a move elsewhere is refused in one line before any parameter moves,
casts and same-device moves work, and accelerate's offloading hooks are refused at the first forward (one rank,
tp=1, in this process: the guard does not depend on the mesh)."""

from __future__ import annotations

import pytest
import torch

from preshard.errors import DeviceError
from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it


@pytest.fixture()
def net(converted):
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    return load_sharded(MiniMaxH3Transformer3DModel, converted("float32", 1), device="cpu")


def _storage(net) -> dict[str, tuple]:
    return {n: (p.device, p.data_ptr()) for n, p in net.named_parameters()}


@pytest.mark.parametrize("move", ["to_meta", "to_device_kw", "to_empty"])
def test_a_move_to_another_device_is_refused_before_anything_moves(net, move, tiny_models):
    before = _storage(net)
    calls = {
        "to_meta": lambda: net.to("meta"),
        "to_device_kw": lambda: net.to(device=torch.device("meta"), dtype=torch.float64),
        "to_empty": lambda: net.to_empty(device="meta"),
    }
    with pytest.raises(DeviceError) as info:
        calls[move]()
    message = str(info.value)
    assert "\n" not in message and "moving it to meta is refused" in message and "load_sharded(..., device=" in message
    assert _storage(net) == before  # nothing moved, nothing cast
    inputs = make_inputs(tiny_config(), 21)
    with torch.no_grad():
        got = net(**inputs, return_dict=False)
    want = reference_forward(tiny_models("float32"), inputs)
    assert all((g - w).abs().max() <= 1e-5 for g, w in zip(got, want, strict=True))


def test_casts_and_same_device_moves_work(net):
    assert net.to("cpu") is net and net.cpu() is net
    net.to(torch.float64)
    assert {p.dtype for p in net.parameters()} == {torch.float64}
    net.half()
    assert net.dtype == torch.float16 and net.device.type == "cpu"


@pytest.mark.parametrize("offload", ["model", "sequential"])
def test_accelerate_offloading_is_refused_at_the_first_forward(net, offload):
    import accelerate

    if offload == "model":
        accelerate.cpu_offload_with_hook(net, execution_device="cpu")
    else:
        accelerate.cpu_offload(net, execution_device="cpu")
    with pytest.raises(DeviceError, match="accelerate hooks were attached") as info, torch.no_grad():
        net(**make_inputs(tiny_config(), 21), return_dict=False)
    assert "\n" not in str(info.value)
