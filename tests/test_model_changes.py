"""One record of what load_sharded changed on a model (runtime/changes.py), on the real diffusers MiniMax-H3 on 2
gloo ranks: the report lists every change (TP's classes, CP's hooks and routed attention, the input check, the
saving hooks, the device guard, the LoRA loader wrapped once in a fixed order), and undoing it gives back the
plain module: its classes, attributes and hooks exactly as before load_sharded (the negative control: not so
before the undo), and at tp=1 its forward equal to the unsharded model's without any collective."""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config

SEQ_LEN = 37


def _shape(net: torch.nn.Module) -> dict[str, tuple]:
    """Per module: its class, its instance attributes, and how many entries each of its dicts (hooks, parameters,
    buffers, submodules) holds."""
    return {
        name: (type(m), sorted(vars(m)), {k: len(v) for k, v in vars(m).items() if isinstance(v, dict)})
        for name, m in net.named_modules()
    }


def _rank(rank: int, world: int, tp2: str, tp1: str) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.examples.minimax_h3 import build_model
    from preshard.runtime.changes import METHOD_LAYERS, undo_sharding
    from preshard.runtime.cp import is_routed
    from preshard.runtime.load import load_sharded

    res: dict = {}
    plain = H3(**tiny_config())  # an instance, so its state before load_sharded is known
    before = _shape(plain)
    net = load_sharded(plain, tp2, device="cpu")
    report = net.preshard_report
    res["listed"] = report.list_changes()

    res["in_dict"] = report.to_dict()["changes"] == res["listed"]
    res["layers"] = net.preshard_changes.method_layers("load_lora_adapter")
    res["want_layers"] = list(METHOD_LAYERS["load_lora_adapter"])
    res["differs_before_undo"] = _shape(net) != before
    try:
        net.to("meta")
        res["moved_before_undo"] = True
    except Exception:  # noqa: BLE001 - the device guard
        res["moved_before_undo"] = False
    assert undo_sharding(net) is net
    after = _shape(net)
    res["same_after_undo"] = after == before
    res["left"] = sorted(
        f"{n}: {a}" for n, (_, attrs, _) in after.items() for a in attrs if "preshard" in a or a.startswith("tp_")
    )
    res["leftover_diff"] = [n for n in before if before[n] != after.get(n)][:5]

    # tp=1, ulysses=2: after the undo, the plain module computes the unsharded model's function by itself.
    inputs = make_inputs(tiny_config(), SEQ_LEN)
    want = reference_forward(build_model(dtype="float32", seed=0), inputs)
    net = load_sharded(H3, tp1, ulysses=2, device="cpu")
    sharded = reference_forward(net, inputs)
    res["sharded_diff"] = max((g - w).abs().max().item() for g, w in zip(sharded, want, strict=True))
    res["routed"] = [sum(is_routed(m) for m in net.modules())]
    undo_sharding(net)
    res["routed"].append(sum(is_routed(m) for m in net.modules()))
    res["changes_left"] = hasattr(net, "preshard_changes") or hasattr(net, "preshard_report")
    torch.distributed.destroy_process_group()  # no collective is left to take part in
    got = reference_forward(net, inputs)
    res["undone_diff"] = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    return res


@pytest.fixture(scope="module")
def runs(converted):
    return run_ranks(_rank, 2, str(converted("float32", 2)), str(converted("float32", 1)), timeout=300)


def test_the_report_lists_every_kind_of_change(runs):
    for run in runs:
        listed = run["listed"]
        assert run["in_dict"]
        for expected in (
            ": class: Linear -> ParallelLinear",  # TP's rowwise layers
            "(model): hook: input check: check",
            "(model): method: _apply: device guard",
            "(model): method: save_pretrained: saving",
            "hook: state_dict: gathered",
            "(model): attribute: preshard_report",
        ):
            assert any(expected in line for line in listed), expected


def test_load_lora_adapter_is_wrapped_once_in_a_fixed_order(runs):
    for run in runs:
        assert run["layers"] == run["want_layers"]
        assert sum(line.startswith("(model): method: load_lora_adapter") for line in run["listed"]) == 1


def test_undo_gives_back_the_plain_module(runs):
    for run in runs:
        assert run["differs_before_undo"] and not run["moved_before_undo"]  # the negative control
        assert run["same_after_undo"], run["leftover_diff"]
        assert run["left"] == []
        assert not run["changes_left"]


def test_after_undo_the_forward_is_the_unsharded_models(runs):
    for run in runs:
        assert run["routed"][0] > 0 and run["routed"][1] == 0  # CP was in place, then gone
        assert run["sharded_diff"] < 1e-5
        assert run["undone_diff"] < 1e-5
