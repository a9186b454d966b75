"""Run a function on N local ranks over real gloo process groups, for multi-rank tests.

`run_ranks(fn, world_size, *args)` starts one process per rank with the environment torchrun would
give it (the parent's current environment plus torchrun's variables), calls `fn(rank, world_size, *args)`
there and returns the per-rank results in rank order. A rank that raises fails the call with that rank's
traceback; a rank that hangs is killed at the timeout and named. No child outlives the call, whatever
happens.

`fn` must be a top-level function of an importable module (a test module is fine: the child puts
the directory of `fn`'s module on sys.path before unpickling it). Inside `fn`, call `init_gloo()`
to join the process group; the worker destroys it afterwards.

Ranks are forked from a forkserver that has imported torch, diffusers and preshard once: a rank that
imported them itself ("spawn") spent about 7 CPU s doing so, most of a small multi-rank test's cost on a
2-core machine. What a forked rank would inherit rather than read itself is the state those modules built
at import from the environment (huggingface_hub's cache paths, torch's and XLA's settings); so a call whose
import-time variables differ from the forkserver's (a test pointing HF_HUB_CACHE elsewhere, say) starts
spawned ranks instead. PRESHARD_TEST_START=spawn spawns every rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any

import torch
import torch.distributed as dist

# Modules the forkserver imports once for every rank it forks.
_PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors", "diffusers", "preshard", "preshard.runtime.load"]
# Environment variables these modules (or what they import) read when imported.
_IMPORT_TIME_PREFIXES = (
    "HF_", "HUGGINGFACE_", "DIFFUSERS_", "TRANSFORMERS_", "TORCH", "PJRT_", "XLA_", "TPU_", "CUDA_", "OMP_",
    "MKL_", "KMP_", "PYTHON", "PRESHARD_",
)  # fmt: skip
_forkserver_env: dict[str, str] | None = None  # the import-time variables the forkserver started with


def _import_time_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


def _start_context(environ: dict[str, str]):
    """The forkserver when it imported under the same import-time environment as this call's, else spawn."""
    global _forkserver_env
    wanted = _import_time_env(environ)
    if os.environ.get("PRESHARD_TEST_START") == "spawn":
        return get_context("spawn")
    if wanted == _forkserver_env:
        return get_context("forkserver")
    if wanted != _import_time_env(dict(os.environ)):
        return get_context("spawn")  # a call of its own environment: the server's imports would not fit it
    if _forkserver_env is not None:
        # This process's own import-time environment changed since the server started (importing diffusers
        # sets PJRT_DEVICE where torch_xla is installed): restart the server under it rather than spawn every
        # rank from here on. multiprocessing has no public way to stop its forkserver; `_stop` is what its own
        # tests use, and the next rank started restarts it with this process's environment.
        from multiprocessing import forkserver

        forkserver._forkserver._stop()
    # Started at its first use, by this process, with this process's environment.
    _forkserver_env = wanted
    get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return get_context("forkserver")


# After the first rank fails, wait this long for the others' reports before killing them: a second
# traceback can help, but ranks blocked in a collective on the failed rank would never report.
_GRACE_AFTER_FAILURE_S = 1.0


class RankFailure(RuntimeError):
    """One or more ranks raised; the message carries each failed rank's traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(timeout_s: float = 60.0) -> None:
    """Join the gloo process group described by the torchrun-style environment `run_ranks` sets."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def error_of(fn: Callable[[], Any]) -> str | None:
    """Call `fn` in a rank; what it raised as "Type: message" (picklable, for the parent test), else None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent test
        return f"{type(exc).__name__}: {exc}"
    return None


def _worker(
    rank: int,
    world_size: int,
    environ: dict[str, str],
    extra_paths: list[str],
    payload: bytes,
    conn: connection.Connection,
) -> None:
    os.environ.clear()  # exactly the parent's environment, as a spawned rank would have it
    os.environ.update(environ)
    for path in reversed(extra_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(payload)
        message: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        message = ("error", traceback.format_exc())
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                message = ("error", traceback.format_exc())
    # Plain pickle, not the multiprocessing pickler: tensors travel by value, not as shared memory
    # that would vanish when this process exits.
    try:
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        failure = ("error", f"rank {rank}'s return value could not be sent back:\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(failure))
    conn.close()


def _module_dirs(fn: Callable[..., Any]) -> list[str]:
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    return [os.path.dirname(os.path.abspath(path))] if path else []


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned processes; return results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    name = getattr(fn, "__qualname__", repr(fn))
    payload = pickle.dumps((fn, args))  # fails here, in the parent, if fn or args cannot be pickled
    extra_paths = _module_dirs(fn) + [os.path.dirname(os.path.abspath(__file__))]
    base = dict(os.environ)
    base.update({k: str(v) for k, v in (env or {}).items()})
    ctx = _start_context(base)
    port = free_port()

    procs = []
    readers: dict[connection.Connection, int] = {}
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            environ = {
                **base,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                **{k: str(v) for k, v in (env or {}).items()},
            }
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, environ, extra_paths, payload, writer),
                name=f"{name}-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only write end, so its death reads as EOF here
            procs.append(proc)
            readers[reader] = rank

        deadline = time.monotonic() + timeout
        while readers:
            now = time.monotonic()
            if now >= deadline:
                break
            for conn in connection.wait(list(readers), timeout=deadline - now):
                rank = readers.pop(conn)
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    kind = "error"
                    value = f"rank {rank} exited with code {procs[rank].exitcode} without reporting a result"
                conn.close()
                if kind == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)

        if errors:
            # In order of arrival: the first rank to fail is usually the cause, the rest its echo.
            parts = [f"rank {r} of {world_size} failed in {name}:\n{tb}" for r, tb in errors.items()]
            if readers:
                parts.append(f"ranks {sorted(readers.values())} were still running and have been killed")
            raise RankFailure("\n".join(parts))
        if readers:
            raise TimeoutError(
                f"{name}: ranks {sorted(readers.values())} of {world_size} did not finish within "
                f"{timeout:g} s and were killed (ranks {sorted(results)} finished)"
            )
        return [results[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        for conn in readers:
            conn.close()
