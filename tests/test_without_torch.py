"""The tools that only move bytes never import torch (over 3 s of a small conversion's wall time on this project's
2-core host): convert with a built-in plan, its dry run, plan, inspect, verify (also against the source), reshard
(a new TP degree, and a CP-only relink), unshard.

Each command runs as a program in a fresh process where `import torch` fails (`sys.modules["torch"] = None`), so a
command that reaches for torch exits non-zero instead of quietly paying for it. The negative control: a `--dtype`
cast computes with torch, and fails there while it succeeds where torch can be imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = (
    "import sys\n"
    "sys.modules['torch'] = None  # import torch now raises ImportError\n"
    "from preshard.cli import main\n"
    "sys.argv[0] = 'preshard'\n"
    "main()\n"
)


def _run(*args: str | Path, torch: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    code = NO_TORCH.replace("sys.modules['torch'] = None", "pass") if torch else NO_TORCH
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_every_byte_moving_command_runs_where_torch_cannot_be_imported(tiny_sources, tmp_path):
    source = tiny_sources("mixed")
    out = tmp_path / "tp2cp2"
    _ok(_run("plan", source, "--devices", "4"))
    _ok(_run("convert", source, tmp_path / "dry", "--tp", "2", "--cp", "2", "--dry-run", "--no-progress"))
    _ok(_run("convert", source, out, "--tp", "2", "--cp", "2", "--no-progress"))
    assert (out / "manifest.json").is_file() and (out / ".metadata").is_file()
    _ok(_run("inspect", out))
    _ok(_run("verify", out, "--no-progress"))
    _ok(_run("verify", out, "--source", source, "--no-progress"))
    _ok(_run("reshard", out, tmp_path / "tp1", "--tp", "1", "--no-progress"))
    _ok(_run("reshard", out, tmp_path / "cp4", "--tp", "2", "--cp", "4", "--no-progress"))
    _ok(_run("unshard", out, tmp_path / "back", "--no-progress"))
    for f in source.glob("*.safetensors"):
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()
    _ok(_run("verify", tmp_path / "tp1", "--source", source, "--no-progress"))


def test_a_cast_needs_torch_and_the_blocker_shows_it(tiny_sources, tmp_path):
    source = tiny_sources("mixed")
    blocked = _run("convert", source, tmp_path / "a", "--tp", "2", "--dtype", "bf16", "--no-progress")
    assert blocked.returncode != 0 and "torch" in blocked.stderr, blocked.stderr[-2000:]
    assert not (tmp_path / "a").exists()
    _ok(_run("convert", source, tmp_path / "b", "--tp", "2", "--dtype", "bf16", "--no-progress", torch=True))
