"""One rank of a job whose caller made the process group itself, with a long timeout, run as its own process
(`run_job` starts them, for tests/test_group_agreement.py and scripts/hostile_soak.py):
`python group_rank.py CHECKPOINT STEPS_JSON`, with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and TORCHELASTIC_RUN_ID in the environment, so that an uncaught PreshardError prints as `error: rank R: ...`.

It calls `dist.init_process_group("gloo", timeout=600 s)`, then runs the steps for its rank in order. A step is
`{"kill": true}` (the process ends at once with status 3, before load_sharded: as if killed), `{"catch": kwargs}`
(load_sharded(kwargs), its error printed as `caught: {"error": "Type: message"}` on stdout and the rank going on,
so that a rank that gave up stays alive in the group) or `{"load": kwargs}` (load_sharded(kwargs), uncaught: an
error ends the process as it would a user's script); a step's `"cwd"` is the folder it runs in (a relative
checkpoint found on one rank only). The group's timeout is far past the test's own, so a rank
left waiting for the group fails the test by its timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

GROUP_TIMEOUT_S = 600


def run_job(steps: list[list[dict]], checkpoint: Path) -> list[tuple[int, list[str], list[str]]]:
    """One process per rank (rank r runs `steps[r]`); each rank's (exit status, stdout lines, stderr lines), in rank
    order. No bound of its own: the caller's (pytest-timeout, the soak's watchdog) is what a hang meets; no process
    outlives the call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    try:
        for rank in range(len(steps)):
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(steps)), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(len(steps)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "group-rank",
            }  # fmt: skip
            command = [sys.executable, __file__, str(checkpoint), json.dumps(steps)]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        out = []
        for proc in procs:
            stdout, stderr = proc.communicate()
            out.append((proc.returncode, stdout.splitlines(), stderr.splitlines()))
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def caught(stdout: list[str]) -> list[str | None]:
    """The errors a rank's `catch` steps printed (None: that step loaded)."""
    return [json.loads(line.removeprefix("caught: "))["error"] for line in stdout if line.startswith("caught: ")]


def error_lines(rank: int, stderr: list[str]) -> list[str]:
    """The one-line errors rank `rank` printed as it ended (`error: rank R: ...`)."""
    return [line for line in stderr if line.startswith(f"error: rank {rank}: ")]


def main(checkpoint: str, steps: list[dict]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    print("joined", flush=True)
    for step in steps:
        if step.get("kill"):
            os._exit(3)
        from diffusers import MiniMaxH3Transformer3DModel

        from preshard.runtime.load import load_sharded

        if step.get("cwd"):
            os.chdir(step["cwd"])
        kwargs = {"checkpoint": checkpoint, **(step.get("catch") or step.get("load") or {})}
        if "load" in step:
            load_sharded(MiniMaxH3Transformer3DModel, **kwargs)
            print("loaded", flush=True)
            continue
        try:
            load_sharded(MiniMaxH3Transformer3DModel, **kwargs)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        print("caught: " + json.dumps({"error": error}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2])[int(os.environ["RANK"])])
