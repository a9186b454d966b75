"""Every diffusers transformer class in tiny_zoo.json (the configs and inputs of diffusers' own model tests)
converts with no --plan (a built-in plan, the class's `_tp_plan`, or else the plan inferred from its modules) or
is refused in one line naming the module; each converted one, loaded on 2 gloo ranks, computes the unsharded
model's function within 1e-5 (fp32), and at tp2 x ulysses2 / tp2 x ring2 where its plan has CP. One set of ranks
runs every class in turn (converted once, in the parent); the results are written for scripts/models_table.py.

Negative control: a class assembled here from diffusers' blocks (no diffusers class, no plan) converts and
matches; without the all-reduce of its row-split layers its output is wrong.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import assembled_model
import diffusers
import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save
from tiny_zoo import build, zoo

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest

TOL = 1e-5
# Classes that convert but do not load as they should, each with why (strict: fixing one fails the test until it
# is taken off the list).
KNOWN_FAILURES: dict[str, str] = {}
ASSEMBLED = assembled_model.AssembledTransformer2DModel.__name__
RESULTS_ENV = "PRESHARD_ZOO_RESULTS"  # where to write the run's results for scripts/models_table.py


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    flat: list[torch.Tensor] = []
    for item in out if isinstance(out, (list, tuple)) else [out]:
        flat += _outputs(item) if not isinstance(item, torch.Tensor) else [item]
    return flat


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if [g.shape for g in got] != [w.shape for w in want]:
        return float("inf")
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in zip(got, want))


def _rank_all(rank: int, world: int, cases: list[tuple[str, str, int, int]]) -> dict:
    from multiproc import init_gloo
    from tiny_zoo import build

    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import ParallelLinear

    init_gloo()
    warnings.filterwarnings("ignore")
    results = {}
    for key, folder, ulysses, ring in cases:
        model, inputs = assembled_model.build() if key == ASSEMBLED else build(key)
        try:
            with torch.no_grad():
                reference = _outputs(model(**inputs))
                net = load_sharded(type(model), folder, ulysses=ulysses, ring=ring)
                got = _outputs(net(**inputs))
            results[f"{key}|u{ulysses}r{ring}"] = {"rel": _rel(got, reference), "error": None}
        except Exception as exc:  # noqa: BLE001 - reported to the parent test
            results[f"{key}|u{ulysses}r{ring}"] = {"rel": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        if key == ASSEMBLED:  # negative control: the row-split layers without their all-reduce
            rowwise = [m for m in net.modules() if isinstance(m, ParallelLinear)]
            for m in rowwise:
                m.tp_group = None
            with torch.no_grad():
                results["no-reduce"] = {"rel": _rel(_outputs(net(**inputs)), reference), "layers": len(rowwise)}
    return results


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zoo")
    warnings.filterwarnings("ignore")
    converted, refused, plans = {}, {}, {}
    for key in zoo():
        model, _ = build(key)
        source = save(model, root / f"src-{key}")
        try:
            convert_checkpoint(source, root / key, tp=2, progress=False)
        except PlanError as exc:
            refused[key] = str(exc)
            continue
        converted[key] = str(root / key)
        plan = read_manifest(root / key).plan
        try:  # a config the CP plan is not made for (HunyuanVideo's token-replace I2V) runs at tp2 only
            plan.check_cp_config(model.config)
            cp = bool(plan.cp_plan)
        except PlanError:
            cp = False
        plans[key] = {"name": plan.name, "cp": cp}
    with pytest.MonkeyPatch.context() as patch:  # as a class a later diffusers adds: found by its config's name
        patch.setattr(diffusers, ASSEMBLED, assembled_model.AssembledTransformer2DModel, raising=False)
        source = save(assembled_model.build()[0], root / "src-assembled")
        convert_checkpoint(source, root / ASSEMBLED, tp=2, progress=False)
    converted[ASSEMBLED] = str(root / ASSEMBLED)
    plans[ASSEMBLED] = {"name": read_manifest(root / ASSEMBLED).plan.name, "cp": False}
    tp_cases = [(key, folder, 1, 1) for key, folder in converted.items()]
    meshes = ((2, 1), (1, 2))  # ulysses2, ring2
    cp_cases = [(key, folder, u, r) for key, folder in converted.items() if plans[key]["cp"] for u, r in meshes]
    results = run_ranks(_rank_all, 2, tp_cases, timeout=600)[0]
    if cp_cases:
        results |= run_ranks(_rank_all, 4, cp_cases, timeout=600)[0]
    run = {"converted": converted, "refused": refused, "plans": plans, "results": results}
    if os.environ.get(RESULTS_ENV):
        Path(os.environ[RESULTS_ENV]).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return run


@pytest.mark.parametrize(
    "key",
    [pytest.param(k, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[k], strict=True)) if k in KNOWN_FAILURES else k
     for k in sorted(zoo())],
)  # fmt: skip
def test_class_converts_and_matches_or_is_refused(zoo_run, key):
    if key in zoo_run["refused"]:
        message = zoo_run["refused"][key]
        assert "\n" not in message, message
        # names the module (or the config value) that blocks it, or the class whose plan is inferred
        assert zoo()[key]["class"] in message or "does not divide" in message or "config" in message, message
        return
    runs = {k: v for k, v in zoo_run["results"].items() if k.split("|")[0] == key}
    assert runs, key
    for mesh, result in runs.items():
        assert result["error"] is None and result["rel"] <= TOL, (mesh, result)


def test_a_class_assembled_from_diffusers_blocks_converts_with_no_change_and_matches(zoo_run):
    assert zoo_run["plans"][ASSEMBLED]["name"] == f"inferred-{ASSEMBLED}"
    result = zoo_run["results"][f"{ASSEMBLED}|u1r1"]
    assert result["error"] is None and result["rel"] <= TOL, result
    control = zoo_run["results"]["no-reduce"]  # without the all-reduce: wrong, so the match above is the TP's
    assert control["layers"] >= 10 and control["rel"] > 1e-2, control
