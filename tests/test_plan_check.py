"""`preshard plan SRC --check --tp N`: one block of SRC's config.json with random weights, converted at tp=N and run
on N gloo ranks against the unsharded model. Exits 0 on a diffusers class (tiny Flux, its single-stream stack cut
from 2 blocks to 1) and on a custom-code model inference keeps correct (`--model-class`); exits 1 naming the output
beyond tolerance when a plan file splits a feed-forward whose forward (a softmax over its hidden width) must stay
whole — the same model converted by inference passes, so the difference is the plan's. Usage errors (no --tp, --tp
without --check, a config.json naming no class, no config.json) are one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import custom_models
import pytest
from clitools import assert_one_line, cli_runner
from tiny_diffusers import build, save

from preshard.cli import main
from preshard.tools.plan_check import randomize_, reduced_config

SRC = str(Path(__file__).resolve().parents[1] / "src")
SOFTMAX_FF = "custom_models:CustomFfSoftmaxModel"
CORRECT = "custom_models:CustomProcessorCustomButCorrectModel"


def _env() -> dict[str, str]:
    path = os.pathsep.join([SRC, str(Path(__file__).parent / "support"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _plan(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "preshard", "plan", *args, "--json"]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-check")
    out = {"flux": save(build("flux")[0], root / "flux")}
    for key in ("ff-softmax", "processor-custom-but-correct"):
        model, _ = custom_models.build(key)
        model.save_pretrained(root / key)
        out[key] = root / key
    return out


def test_diffusers_class_passes_on_one_block(sources):
    done = _plan(str(sources["flux"]), "--check", "--tp", "2")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] and data["reduced"] == {"num_single_layers": 2}
    assert data["check"]["world_size"] == 2 and data["check"]["model_class"] == "FluxTransformer2DModel"
    (output,) = data["check"]["outputs"]
    assert output["within"] and output["max_abs"] > 0.5  # random weights that reach the output, not a zero model


def test_custom_model_inference_keeps_correct_passes(sources):
    done = _plan(str(sources["processor-custom-but-correct"]), "--check", "--tp", "2", "--model-class", CORRECT)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] and data["reduced"] == {} and "whole model" in data["built"]
    assert data["plan"].startswith("inferred")


def test_plan_splitting_a_whole_module_fails(sources, tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(
        json.dumps({
            "format": 1, "name": "splits-softmax-ff", "description": "splits a feed-forward that must stay whole",
            "model_classes": ["CustomFfSoftmaxModel"],
            "linear": [
                {"match": "blocks.*.ff.net.0.proj", "style": "colwise"},
                {"match": "blocks.*.ff.net.2", "style": "rowwise"},
            ],
        })
    )  # fmt: skip
    done = _plan(str(sources["ff-softmax"]), "--check", "--tp", "2", "--model-class", SOFTMAX_FF, "--plan", str(wrong))
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert not data["ok"] and data["plan"] == "splits-softmax-ff"
    assert data["check"]["outputs"][0]["max_abs_diff"] > 1e-2
    # control: the same model by the plan inference builds (the softmax feed-forward left whole) passes
    done = _plan(str(sources["ff-softmax"]), "--check", "--tp", "2", "--model-class", SOFTMAX_FF)
    assert done.returncode == 0, done.stderr


@pytest.mark.quick
def test_check_needs_tp(sources):
    result = cli_runner().invoke(main, ["plan", str(sources["flux"]), "--check"])
    assert_one_line(result.exit_code, result.stderr, 2, "--check needs the TP degree", "--tp N")


@pytest.mark.quick
def test_tp_without_check_is_refused(sources):
    result = cli_runner().invoke(main, ["plan", str(sources["flux"]), "--tp", "2"])
    assert_one_line(result.exit_code, result.stderr, 2, "go with --check")


@pytest.mark.quick
def test_config_without_class_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dim": 32}))
    result = cli_runner().invoke(main, ["plan", str(tmp_path), "--check", "--tp", "2"])
    assert_one_line(result.exit_code, result.stderr, 2, "names no model class", "--model-class module:Class")


@pytest.mark.quick
def test_folder_without_config_is_one_line(tmp_path):
    result = cli_runner().invoke(main, ["plan", str(tmp_path), "--check", "--tp", "2"])
    assert_one_line(result.exit_code, result.stderr, 2, "has no config.json")


@pytest.mark.quick
def test_reduced_config_cuts_every_stack_to_one():
    config = {"num_layers": 40, "num_single_layers": 38, "num_refiner_layers": 2, "num_attention_heads": 24,
              "num_hidden_layers": 1, "depth": True, "hidden_size": 3072}  # fmt: skip
    small, changed = reduced_config(config)
    assert changed == {"num_layers": 40, "num_single_layers": 38, "num_refiner_layers": 2}
    assert small["num_layers"] == small["num_single_layers"] == small["num_refiner_layers"] == 1
    assert small["num_attention_heads"] == 24 and small["depth"] is True and small["hidden_size"] == 3072


@pytest.mark.quick
def test_randomize_leaves_no_norm_at_one_and_no_zero_layer():
    model, _ = custom_models.build("ff-softmax")
    for p in model.parameters():
        p.data.zero_()
    randomize_(model, seed=0)
    for name, p in model.named_parameters():
        assert p.abs().max().item() > 0, name
        assert not bool((p == 1).all()), name
