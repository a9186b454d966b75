"""The multi-rank launcher works under pytest: results, failures, hangs, no orphans, the parent's environment."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import RankFailure, init_gloo, run_ranks


def _all_reduce(rank: int, world_size: int, scale: float) -> dict:
    init_gloo()
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PRESHARD_TEST_FLAG")
    return {
        "sum": t.item(),
        "env": {k: os.environ.get(k) for k in keys},
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    init_gloo()
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(600)  # the launcher must not wait for rank 0 once rank 1 has failed


def _hang_on_rank_1(rank: int, world_size: int, pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return rank


def _noop(rank: int, world_size: int) -> None:
    return None


def _environment(rank: int, world_size: int, key: str) -> tuple[str | None, int]:
    return os.environ.get(key), os.getppid()


def _hub_cache(rank: int, world_size: int) -> tuple[str, int]:
    import huggingface_hub.constants

    return huggingface_hub.constants.HF_HUB_CACHE, os.getppid()


def _server_pid() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def _assert_gone(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_all_reduce_on_two_ranks():
    out = run_ranks(_all_reduce, 2, 2.0, env={"PRESHARD_TEST_FLAG": "on"})
    assert [o["sum"] for o in out] == [6.0, 6.0]
    for rank, o in enumerate(out):
        assert o["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "PRESHARD_TEST_FLAG": "on",
        }
        assert o["threads"] == 1
    _assert_gone([o["pid"] for o in out])


def test_a_rank_has_the_parents_current_environment_and_forks_from_the_server_unless_imports_would_differ(
    monkeypatch,
):
    if os.environ.get("PRESHARD_TEST_START") == "spawn":
        pytest.skip("PRESHARD_TEST_START=spawn: every rank is spawned")
    monkeypatch.setenv("SOME_TEST_VALUE", "set after the server started")
    run_ranks(_noop, 1)  # the forkserver is running from here on
    monkeypatch.setenv("SOME_TEST_VALUE", "changed since")
    [(value, parent)] = run_ranks(_environment, 1, "SOME_TEST_VALUE")
    assert value == "changed since"  # the parent's environment now, not the server's at its start
    assert parent != os.getpid()  # forked by the forkserver
    # A variable huggingface_hub reads at import, set for one call only: the server's import would be stale for
    # it, so the rank is spawned.
    [(cache, parent)] = run_ranks(_hub_cache, 1, env={"HF_HUB_CACHE": "/nonexistent/for-one-call"})
    assert cache == "/nonexistent/for-one-call" and parent == os.getpid()
    # The same variable changed in this process's own environment (as importing diffusers sets PJRT_DEVICE where
    # torch_xla is installed): the server restarts under it, and ranks fork again, importing with the new value.
    server = _server_pid()
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent/elsewhere")
    [(cache, parent)] = run_ranks(_hub_cache, 1)
    assert cache == "/nonexistent/elsewhere" and parent != os.getpid()
    assert _server_pid() != server
    [(cache, again)] = run_ranks(_hub_cache, 1)
    assert cache == "/nonexistent/elsewhere" and again == parent  # one restart, then the same server


def test_a_failing_rank_surfaces_its_traceback():
    # rank 0 sleeps 600 s, as long as the call's timeout: only the grace after rank 1's failure ends the call within
    # this test's pytest timeout (300 s), which is the evidence, not a clock.
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=600)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed in _raise_on_rank_1:")
    assert "Traceback" in message and "ValueError: boom from rank 1" in message
    assert "ranks [0] were still running" in message  # killed after the grace, not waited for: no clock needed
    assert multiprocessing.active_children() == []


def test_a_hanging_rank_is_killed_at_the_timeout(tmp_path):
    # 8 s: the ranks fork from the running forkserver (started by the call before), with nothing to import.
    run_ranks(_noop, 1)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 8 s"):
        run_ranks(_hang_on_rank_1, 2, str(tmp_path), timeout=8)
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    _assert_gone(pids)
