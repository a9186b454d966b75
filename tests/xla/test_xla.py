"""The XLA tier: real torch_xla on PJRT CPU (run by .ci/xla in a torch 2.9 + torch_xla 2.9 venv).

Skipped where torch_xla is not installed. Every check runs in fresh processes (torch_xla's runtime is per
process, and importing it sets PJRT_DEVICE), so this pytest process never imports torch_xla itself.

- one XLA device (tp=1) loads on xla:0 and computes the unsharded CPU model's function;
- device=None picks cpu/gloo even though importing diffusers imports torch_xla (PJRT_DEVICE=CPU);
- a 2-rank XLA torchrun job on PJRT CPU, where processes share no collectives, is refused with one line and a
  nonzero exit instead of returning each rank's partial sums (the issue's reproduction), both when preshard
  creates the process group (xla://) and when the user created it with env://.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("torch_xla") is None:
    pytest.skip("torch_xla is not installed (the XLA tier runs in .ci/xla's venv)", allow_module_level=True)

JOB = Path(__file__).with_name("_xla_job.py")
SRC = Path(__file__).resolve().parents[2] / "src"
# Measured on PJRT CPU: ~1e-6 (XLA fuses and reorders float32 arithmetic); 1e-4 still catches any wrong weight.
TOL = 1e-4


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PJRT_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT ") :])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("xla")
    _result(_run([sys.executable, str(JOB), "prepare", str(root)], _env(PJRT_DEVICE="CPU")))
    return root


def test_tp1_loads_on_xla_and_matches_cpu(checkpoints):
    result = _result(_run([sys.executable, str(JOB), "load-tp1", str(checkpoints)], _env(PJRT_DEVICE="CPU")))
    assert result["device"] == "xla:0" and result["backend"] == "xla"
    assert result["shapes_match"]
    assert result["max_abs_diff"] <= TOL


def test_device_none_picks_cpu_although_torch_xla_is_imported():
    result = _result(_run([sys.executable, str(JOB), "detect"], _env()))
    assert result["torch_xla_imported"] and result["pjrt_device"] == "CPU", "the premise: diffusers pulled torch_xla in"
    assert (result["kind"], result["backend"], result["device"]) == ("cpu", "gloo", "cpu")


@pytest.mark.parametrize("command", ["load", "load-env"])
def test_two_xla_ranks_on_pjrt_cpu_are_refused_in_one_line(checkpoints, command):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    proc = _run([*torchrun, str(JOB), command, str(checkpoints / "tp2")], _env(PJRT_DEVICE="CPU"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "RESULT" not in proc.stdout, f"a rank loaded and would have returned partial sums:\n{output}"
    errors = sorted({line for line in output.splitlines() if line.startswith("error: ")})
    assert len(errors) == 1, output  # each rank prints the same single line
    group = "1" if command == "load" else "2"
    assert f"torchrun started 2 ranks (WORLD_SIZE), the xla process group has {group}, torch_xla sees 1" in errors[0]
