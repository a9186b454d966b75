"""Joining the job: the ranks of a load meet, within a bounded time, and agree on what they were asked to do
before the process group exists.

Why: `init_process_group` waits for every rank for torch's default timeout (30 minutes), so a rank killed before
it joins, or one that raised before it got there (`device="cuda"` on a host without one), left the others
waiting that long; and ranks given different `dtype=` or meshes met only in a collective of mismatched sizes,
which gloo ends with an abort (`terminate called ... gloo::EnforceNotMet`), not an error. So `join_job` first
meets the other ranks in the job's store (the one torch's `env://` rendezvous would make: torchrun's agent's,
or one rank 0 serves) with the caller's `timeout`, each rank writing one record: what it was asked for (device kind,
dtype, mesh, checkpoint) or the error that stopped it. Every rank waits for all records, at most `timeout`
seconds, and decides from the same records: a rank that never came is a `JobTimeoutError` naming it, a rank's
error is raised on every rank (its class, naming the rank), different requests are one `MismatchError`. Only
then is the process group made, from the same store, so nothing waits in gloo for a rank that is gone.

`timeout` bounds the joining only: the process group keeps torch's default, because ranks can reach a later
collective minutes apart (a cold read of a large shard). A process group the caller made already (or XLA's
`xla://` rendezvous, which has its own store) is used as it is: then the requests are compared in the load's first
exchange over that group (`agreement.agree_on_checkpoint`), which adds no collective.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from preshard.errors import DeviceError, JobTimeoutError, PreshardError, UsageError
from preshard.runtime.agreement import compare_requests, raise_failures
from preshard.runtime.devices import RankDevice, device_kind_and_backend, init_rank_device

DEFAULT_TIMEOUT_S = 60.0
RECORD_BYTES = 4096
KEY = "preshard/join/{}"
ALL_READ = "preshard/join/all-read"
READ_COUNT = "preshard/join/read"
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(timeout: object) -> float:
    """`timeout=` as seconds: a finite number above 0.

    Raises:
        UsageError: anything else.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise UsageError(
            f"timeout={timeout!r} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]; pass e.g. timeout=60 "
            "(how long a rank waits for the others to join)"
        )
    return float(timeout)


def _launched() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1  # init_rank_device names the bad value


def _describe(error: BaseException) -> list[str]:
    name = type(error).__name__ if isinstance(error, PreshardError) else "PreshardError"
    text = str(error) if isinstance(error, PreshardError) else f"{type(error).__name__}: {error}"
    return [name, " ".join(text.split())[:1500]]


def join_job(
    device: str | torch.device | None,
    requests: dict[str, object],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    error: BaseException | None = None,
) -> RankDevice:
    """This rank's device, with the process group made (if the job has several ranks) once every rank has joined
    and agreed on `requests`.

    Args:
        device: as `load_sharded` takes it.
        requests: what must be the same on every rank (JSON-able values: dtype, mesh, checkpoint...).
        timeout: seconds to wait for the other ranks to join.
        error: what already stopped this rank (a bad argument): told to the others, then raised.

    Raises:
        JobTimeoutError: a rank did not join within `timeout` (the same line on every rank that waited).
        MismatchError: the ranks were asked for different things (device kind, dtype, mesh, checkpoint).
        DeviceError and the rest: this rank's own error, or the first other rank's, on every rank.
    """
    try:
        timeout = check_timeout(timeout)
    except UsageError as exc:
        error, timeout = error or exc, DEFAULT_TIMEOUT_S
    if _launched() <= 1 or dist.is_initialized():
        if error is not None:
            raise error
        return init_rank_device(device)  # the requests are compared in the checkpoint agreement (agreement.py)
    kind = backend = None
    try:
        kind, backend = device_kind_and_backend(device)
    except Exception as exc:  # told to the other ranks first, so that none waits for this one
        error = error or exc
    if backend == "xla" and error is None:  # xla:// is its own rendezvous: compared over the group once it exists
        return init_rank_device(device)  # the requests are compared in the checkpoint agreement (agreement.py)
    store, rank, world = _meet(timeout)
    record = {"error": _describe(error) if error else None, "requests": {"device": kind, **requests}}
    records = _exchange(store, rank, world, record, timeout)
    try:
        raise_failures(records, error, "before joining the job")
        compare_requests(records)
    except PreshardError:
        _leave(store, rank, world, timeout)
        raise
    _leave(store, rank, world, timeout)
    return init_rank_device(device, store=store)


def _meet(timeout: float) -> tuple[dist.Store, int, int]:
    """The job's store, as torch's `env://` rendezvous makes it (the torchrun agent's, or served by rank 0), except
    that rank 0 does not wait here for the others to connect: it waits for their records, and can name the absent."""
    env = {name: os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    where = f"{env['MASTER_ADDR'] or '?'}:{env['MASTER_PORT'] or '?'}"
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        if not env["MASTER_ADDR"] or not 0 <= port < 2**16:
            raise ValueError("MASTER_ADDR or MASTER_PORT")
    except ValueError:
        raise DeviceError(
            f"this rank cannot join the job: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are {env}; launch it with "
            "torchrun, which sets them"
        ) from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun's agent serves the store
    try:
        store = dist.TCPStore(
            env["MASTER_ADDR"], port, world, is_master=rank == 0 and not agent, timeout=timedelta(seconds=timeout),
            wait_for_workers=False, multi_tenant=not agent,
        )  # fmt: skip
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError, DistNetworkError
        raise JobTimeoutError(
            f"this rank could not reach the job's store at {where} within {timeout:g} s (rank 0 never started "
            f"it: killed, crashed or still starting; {' '.join(str(exc).split())[:160]}); check the other ranks' "
            "logs, or pass a larger timeout="
        ) from None
    return store, rank, world


def _exchange(store: dist.Store, rank: int, world: int, record: dict, timeout: float) -> list[dict]:
    store.set(KEY.format(rank), json.dumps(record)[:RECORD_BYTES])
    keys = [KEY.format(r) for r in range(world)]
    deadline = time.monotonic() + timeout
    while True:
        present = [r for r in range(world) if store.check([keys[r]])]
        if len(present) == world:
            break
        if time.monotonic() >= deadline:
            missing = [r for r in range(world) if r not in present]
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise JobTimeoutError(
                f"rank{'s' if len(missing) > 1 else ''} {shown} of {world} did not reach load_sharded within "
                f"{timeout:g} s (killed, crashed or still starting); nothing was loaded: check that rank's log, or "
                "pass a larger timeout= if it starts slowly"
            )
        time.sleep(0.05)
    out = []
    for key in keys:
        try:
            out.append(json.loads(store.get(key)))
        except ValueError:
            out.append({"error": ["PreshardError", "its record did not arrive whole"], "requests": {}})
    return out


def _leave(store: dist.Store, rank: int, world: int, timeout: float) -> None:
    """Rank 0 may be the store's server: it stays until every rank has read the records (at most `timeout`)."""
    if store.add(READ_COUNT, 1) == world:
        store.set(ALL_READ, "1")
    if rank == 0:
        try:
            store.wait([ALL_READ], timedelta(seconds=timeout))
        except RuntimeError:
            pass  # a rank that left cannot read; the others have their answer


__all__ = ["DEFAULT_TIMEOUT_S", "check_timeout", "join_job"]
