"""What every benchmark here shares: the working tree's package in the environment of the processes it times,
the page cache dropped where that is permitted, and whole commands timed as process groups (wall time to exit,
CPU and peak RSS of the whole tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

GB, GIB, MIB = 10**9, 2**30, 2**20
DROP_CACHES = "/proc/sys/vm/drop_caches"
REPO_SRC = Path(__file__).resolve().parent.parent / "src"


def bench_env(**extra: str) -> dict[str, str]:
    """This process's environment with the working tree's package first on PYTHONPATH (console scripts too)."""
    env = {**os.environ, **extra}
    if (REPO_SRC / "preshard").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_SRC), os.environ.get("PYTHONPATH")) if p)
    return env


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def cold_possible() -> tuple[bool, str]:
    """Whether the page cache can be dropped here: open the file for writing (writing nothing drops nothing)."""
    try:
        with open(DROP_CACHES, "w"):
            pass
    except OSError as exc:
        return False, f"{DROP_CACHES} not writable ({exc.strerror or exc})"
    return True, f"{DROP_CACHES} writable"


def drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def timed(cmd: str, env: dict[str, str], log: Path, timeout: float) -> dict:
    """Run `cmd` under bash in a new process group; wall time to exit, CPU and peak RSS of the whole tree."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            ["bash", "-c", cmd], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"step failed (status {code}): {cmd}\n{log.read_text(errors='replace')[-3000:]}")
    return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "maxrss_kib": usage.ru_maxrss}
