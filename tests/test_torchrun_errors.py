"""A preshard error in a torchrun job is one line per failing rank, not a traceback on every rank: a wrong world
size under `python -m torch.distributed.run --nproc-per-node 2` (gloo) prints `error: rank R: ...` once per rank,
and the job exits non-zero. The same script run without torchrun keeps Python's traceback (the hook is torchrun's
only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

RANK_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch

    from preshard import load_sharded

    load_sharded(torch.nn.Module, sys.argv[1])  # a tp=1 checkpoint needs 1 rank; the job has 2
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("torchrun") / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


def test_a_wrong_world_size_under_torchrun_is_one_line_per_rank(converted, rank_script):
    checkpoint = converted("float32", 1)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), str(rank_script), str(checkpoint),
    ]  # fmt: skip
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert sorted(line.split(":")[1] for line in lines) == [" rank 0", " rank 1"], done.stderr
    assert all("needs 1 rank but the job has 2 ranks" in line for line in lines), lines
    # No rank printed a traceback: only torchrun's launcher has one (its own ChildFailedError, out of our hands).
    assert "MismatchError" not in done.stderr and "runtime/load.py" not in done.stderr, done.stderr


def test_the_error_outside_torchrun_keeps_its_traceback(converted, rank_script):
    """The negative control: outside torchrun nothing is installed, so the same kind of error (a tp=2 checkpoint in
    a process that runs alone) is Python's own traceback, naming the class."""
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    command = [sys.executable, str(rank_script), str(converted("float32", 2))]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "MismatchError" in done.stderr and "this process runs alone" in done.stderr
    assert not any(line.startswith("error: rank") for line in done.stderr.splitlines()), done.stderr


def test_the_one_line_is_one_write_so_ranks_sharing_a_pipe_cannot_run_together(monkeypatch, tmp_path):
    """CI once read `...on 2 rankserror: rank 0: ...`: print wrote the message and its newline separately, and the
    other rank's line landed between them. The hook now hands the whole line, newline included, to one os.write."""
    from preshard import process
    from preshard.errors import MismatchError

    writes: list[bytes] = []
    monkeypatch.setattr(process.os, "write", lambda fd, data: writes.append(data) or len(data))
    monkeypatch.setenv("RANK", "3")
    with open(tmp_path / "stderr", "w") as stderr:
        monkeypatch.setattr(process.sys, "stderr", stderr)
        process._OneLineErrors(lambda *a: None)(MismatchError, MismatchError("the job has 2 ranks"), None)
    assert writes == [b"error: rank 3: the job has 2 ranks\n"]
