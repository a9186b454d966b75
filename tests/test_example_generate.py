"""examples/minimax_h3_generate.py under torchrun, as a user runs it: --tiny on 4 gloo ranks (tp=2 x ulysses=2)
converts the tiny transformer, loads it sharded into MiniMaxH3ModularPipeline, generates, and every rank's latents
equal the unsharded pipeline's; rank 0 writes them. Without --tiny it needs a converted checkpoint and the
diffusers repo (not available offline: that path is not run here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "minimax_h3_generate.py"


def _torchrun(nproc: int, *args: str, timeout: float = 800) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT)]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_generation_on_tp2_ulysses2(tmp_path):
    out = tmp_path / "out"
    result = _torchrun(
        4, "--tiny", "--tp", "2", "--ulysses", "2", "--workdir", str(tmp_path / "w"), "--output", str(out)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    diffs = {
        int(r): float(d)
        for r, d in re.findall(r"\[rank (\d)\] max abs diff to the unsharded pipeline: (\S+)", result.stdout)
    }
    assert sorted(diffs) == [0, 1, 2, 3], result.stdout
    assert max(diffs.values()) <= 1e-5, diffs
    summaries = re.findall(r"\[rank (\d)\] rank \d/4 \{'tp': (\d), 'ring': 0, 'ulysses': (\d)\}", result.stdout)
    assert sorted(summaries) == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    saved = torch.load(out / "latents.pt", weights_only=True)
    assert saved["latents"].shape == (1, 24, 37, 2, 2) and saved["audio_latents"].shape == (2, 32, 207)
    assert f"wrote {out / 'latents.pt'}" in result.stdout


def test_without_tiny_it_asks_for_a_checkpoint_and_a_pipeline(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "give --converted OUT, or --checkpoint and --pipeline, or --tiny" in result.stderr
