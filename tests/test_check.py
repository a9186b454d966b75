"""`preshard check OUT --source SRC`: the command launches torchrun with the checkpoint's world size, loads the
sharded model and the unsharded source on the same seeded inputs built from the forward (or an inputs file), prints
the max difference per output and exits 0 within tolerance; a shard converted from the source with one weight
changed (everything else intact: checksums, sealed manifest) exits 1 naming the output beyond tolerance. Tested on
tiny Wan and Flux transformers and a T5 text encoder at tp=2, and, run as a rank of one's own torchrun job, on Flux.
Only rank 0 reports; rank 1 prints nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiproc import free_port
from safetensors.torch import load_file, save_file
from tiny_diffusers import build, save

from preshard.converter.convert import convert_checkpoint
from preshard.errors import UsageError
from preshard.tools.check import build_inputs, compare, load_inputs

SRC = str(Path(__file__).resolve().parents[1] / "src")
CHANGED = "transformer_blocks.0.attn.to_q.weight"  # a column-split weight of Flux, one element changed


def _env() -> dict[str, str]:
    path = os.pathsep.join([SRC, str(Path(__file__).parent / "support"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "preshard", "check", *args]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout)


def _t5_source(root: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = tf.T5EncoderModel(config).eval()
    model.save_pretrained(root / "src-t5")
    return root / "src-t5"


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("check")
    out = {}
    for name in ("wan", "flux"):
        source = save(build(name)[0], root / f"src-{name}")
        convert_checkpoint(source, root / name, tp=2, progress=False)
        out[name] = (root / name, source)
    source = _t5_source(root)
    convert_checkpoint(source, root / "t5", tp=2, progress=False)
    out["t5"] = (root / "t5", source)
    flux = out["flux"][1]  # the same source with one weight changed, converted: only the numbers differ
    changed = root / "src-flux-changed"
    changed.mkdir()
    (changed / "config.json").write_bytes((flux / "config.json").read_bytes())
    weights = load_file(str(flux / "diffusion_pytorch_model.safetensors"))
    weights[CHANGED] = weights[CHANGED].clone()
    weights[CHANGED][3, 5] += 0.5
    save_file(weights, str(changed / "diffusion_pytorch_model.safetensors"))
    convert_checkpoint(changed, root / "flux-changed", tp=2, progress=False)
    out["flux-changed"] = (root / "flux-changed", flux)
    return out


@pytest.mark.parametrize("name", ["wan", "flux", "t5"])
def test_check_passes_on_a_conversion_and_prints_each_outputs_difference(conversions, name):
    checkpoint, source = conversions[name]
    done = _check(str(checkpoint), "--source", str(source), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    assert data["ok"] and data["world_size"] == 2 and data["outputs"], data
    assert all(o["max_abs_diff"] <= 1e-4 * max(1.0, o["max_abs"]) and o["max_abs"] > 0 for o in data["outputs"])
    assert "Traceback" not in done.stderr


def test_check_fails_with_exit_1_on_a_shard_with_one_weight_changed(conversions):
    checkpoint, source = conversions["flux-changed"]
    done = _check(str(checkpoint), "--source", str(source))
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any("BEYOND TOLERANCE" in line for line in lines), done.stdout
    assert "does NOT match" in lines[-1], done.stdout


def test_check_takes_an_inputs_file(conversions, tmp_path):
    checkpoint, source = conversions["flux"]
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(source)
    inputs = {k: v for k, v in build_inputs(model, dict(model.config), seed=7).items() if isinstance(v, torch.Tensor)}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    done = _check(str(checkpoint), "--source", str(source), "--inputs", str(tmp_path / "inputs.safetensors"), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["inputs"] == {k: list(v.shape) for k, v in inputs.items()}


def test_check_runs_as_the_ranks_of_ones_own_torchrun_job(conversions, tmp_path):
    checkpoint, source = conversions["flux"]
    logs = tmp_path / "logs"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
        "127.0.0.1", "--master-port", str(free_port()), "--log-dir", str(logs), "--redirects", "3", "-m", "preshard",
        "check", str(checkpoint), "--source", str(source),
    ]  # fmt: skip
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = {p.parent.name: p.read_text() for p in logs.rglob("stdout.log")}
    assert len(out) == 2, out
    rank0, rank1 = (out[k] for k in sorted(out))
    assert "matches the unsharded FluxTransformer2DModel" in rank0 and rank1 == "", out


@pytest.mark.quick
def test_a_pipeline_folder_or_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "pipeline.json").write_text("{}")
    from preshard.tools.check import check_conversion

    with pytest.raises(UsageError, match="check one component at a time"):
        check_conversion(tmp_path / "pipe", tmp_path / "src")
    with pytest.raises(UsageError, match="does not exist"):
        load_inputs(tmp_path / "missing.safetensors")
    torch.save({"x": 1}, tmp_path / "bad.pt")
    with pytest.raises(UsageError, match="not a dict of tensors"):
        load_inputs(tmp_path / "bad.pt")


@pytest.mark.quick
def test_compare_flags_a_difference_and_a_nan_and_refuses_other_shapes():
    want = (torch.ones(2, 3), torch.zeros(4))
    assert all(d.within for d in compare(want, want, 1e-4))
    off = compare((torch.ones(2, 3) + 1e-3, torch.zeros(4)), want, 1e-4)
    assert [d.within for d in off] == [False, True] and off[0].max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    nan = compare((torch.full((2, 3), float("nan")), torch.zeros(4)), want, 1e-4)
    assert not nan[0].within
    with pytest.raises(Exception, match="returns"):
        compare((torch.ones(3, 2),), want, 1e-4)
