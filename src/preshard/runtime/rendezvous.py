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
collective minutes apart (a cold read of a large shard). A process group that exists already (the caller made it,
or an earlier load did) is used as it is, but its ranks still meet first in that group's store (`agree_in_group`),
with the same records and the same bounded wait, and not in a collective: a collective waits for the group's own
timeout (torch's 30 minutes, or the caller's) for a rank that raised before it or died, and gloo turns a dead peer
into a raw error. The records of each call sit under a key of its own: rank r's n-th load meets the others' n-th.
XLA's `xla://` rendezvous, whose group exposes no such store, keeps comparing the requests in the load's first
exchange over the group (`agreement.agree_on_checkpoint`).
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
JOIN_PREFIX = "preshard/join/"  # a job joining before its group exists: its store is fresh
CALLS = "preshard/load/calls/{}"  # rank r's count of loads that met in the group's store
CALL_PREFIX = "preshard/load/{}/"  # the records of the job's n-th such load
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
    call: str = "load_sharded",
) -> RankDevice:
    """This rank's device, with the process group made (if the job has several ranks) once every rank has joined
    and agreed on `requests`; in a process group that exists already, once its ranks agreed (`agree_in_group`).

    Args:
        device: as `load_sharded` takes it.
        requests: what must be the same on every rank (JSON-able values: dtype, mesh, checkpoint...).
        timeout: seconds to wait for the other ranks to join.
        error: what already stopped this rank (a bad argument): told to the others, then raised.
        call: what the ranks called ("load_pipeline"), for the messages.

    Raises:
        JobTimeoutError: a rank did not join within `timeout` (the same line on every rank that waited).
        MismatchError: the ranks were asked for different things (device kind, dtype, mesh, checkpoint).
        DeviceError and the rest: this rank's own error, or the first other rank's, on every rank.
    """
    try:
        timeout = check_timeout(timeout)
    except UsageError as exc:
        error, timeout = error or exc, DEFAULT_TIMEOUT_S
    if dist.is_initialized():
        return agree_in_group(device, requests, timeout=timeout, error=error, call=call)
    if _launched() <= 1:
        if error is not None:
            raise error
        return init_rank_device(device)
    kind = backend = None
    try:
        kind, backend = device_kind_and_backend(device)
    except Exception as exc:  # told to the other ranks first, so that none waits for this one
        error = error or exc
    if backend == "xla" and error is None:  # xla:// is its own rendezvous: compared over the group once it exists
        return init_rank_device(device)  # the requests are compared in the checkpoint agreement (agreement.py)
    store, rank, world = _meet(timeout)
    record = {"error": _describe(error) if error else None, "requests": {"device": kind, **requests}}
    _agree(store, JOIN_PREFIX, rank, world, record, error, timeout, call=call)
    return init_rank_device(device, store=store)


def agree_in_group(
    device: str | torch.device | None,
    requests: dict[str, object],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    error: BaseException | None = None,
    call: str = "load_sharded",
) -> RankDevice:
    """This rank's device in the process group that exists already, once every rank of it has agreed on `requests`
    in the group's store, within `timeout` seconds (not the group's own timeout).

    Args:
        device, requests, error: as `join_job` takes them.
        timeout: seconds to wait for the other ranks' records.

    Raises:
        JobTimeoutError: a rank did not reach load_sharded within `timeout`, or the store went away (its server,
            rank 0 usually, exited).
        MismatchError: the ranks were asked for different things.
        DeviceError and the rest: this rank's own error (its device refused by the group...), or the first other
            rank's, on every rank.
    """
    rank_device: RankDevice | None = None
    kind = None
    try:
        rank_device = init_rank_device(device)  # the device, and the group's backend fitting it
        kind = rank_device.kind
    except Exception as exc:  # told to the other ranks first, so that none waits for this one
        error = error or exc
        try:
            kind = device_kind_and_backend(device)[0]
        except Exception:  # noqa: BLE001 - the error above is what this rank reports
            kind = None
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _group_store() if world > 1 else None
    if store is None:  # one rank, or XLA's rendezvous: the checkpoint agreement compares the requests
        if error is not None:
            raise error
        assert rank_device is not None
        return rank_device
    record = {"error": _describe(error) if error else None, "requests": {"device": kind, **requests}}
    where = "the process group's store"
    number = _store_call(lambda: store.add(CALLS.format(rank), 1), where)
    _agree(store, CALL_PREFIX.format(number), rank, world, record, error, timeout, where=where, call=call)
    assert rank_device is not None  # its error was raised by _agree otherwise
    return rank_device


def _group_store() -> dist.Store | None:
    """The default process group's store: torchrun's agent store, or the one `env://` or `tcp://` made. torch keeps
    it beside the group, with no public accessor; None where there is none to use (XLA's rendezvous)."""
    from torch.distributed import distributed_c10d

    if dist.get_backend() == "xla":
        return None
    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, KeyError, ValueError, RuntimeError):
        return None


def _agree(
    store: dist.Store,
    prefix: str,
    rank: int,
    world: int,
    record: dict,
    error: BaseException | None,
    timeout: float,
    where: str = "the job's store",
    call: str = "load_sharded",
) -> None:
    """Write this rank's record under `prefix`, wait for every rank's, and raise as every rank does."""
    records = _exchange(store, prefix, rank, world, record, timeout, where)
    try:
        raise_failures(records, error, "before joining the job")
        compare_requests(records, call)
    finally:
        _leave(store, prefix, rank, world, timeout)


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


def _store_call(call, where: str):
    """A store operation, its failure one line: the store's server (rank 0, or torchrun's agent) has gone."""
    try:
        return call()
    except (RuntimeError, TimeoutError, OSError) as exc:  # DistNetworkError, DistStoreError
        raise JobTimeoutError(
            f"this rank lost {where} while waiting for the other ranks to reach load_sharded (its server, rank 0 or "
            f"torchrun's agent, was killed or crashed: {' '.join(str(exc).split())[:160]}); nothing was loaded: check "
            "rank 0's log"
        ) from None


def _exchange(
    store: dist.Store, prefix: str, rank: int, world: int, record: dict, timeout: float, where: str
) -> list[dict]:
    _store_call(lambda: store.set(f"{prefix}{rank}", json.dumps(record)[:RECORD_BYTES]), where)
    keys = [f"{prefix}{r}" for r in range(world)]
    deadline = time.monotonic() + timeout
    while True:
        present = [r for r in range(world) if _store_call(lambda r=r: store.check([keys[r]]), where)]
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
            out.append(json.loads(_store_call(lambda key=key: store.get(key), where)))
        except ValueError:
            out.append({"error": ["PreshardError", "its record did not arrive whole"], "requests": {}})
    return out


def _leave(store: dist.Store, prefix: str, rank: int, world: int, timeout: float) -> None:
    """Rank 0 may be the store's server: it stays until every rank has read the records (at most `timeout`), then
    removes them. A store that went away meanwhile changes nothing: every rank has its answer."""
    try:
        if store.add(f"{prefix}read", 1) == world:
            store.set(f"{prefix}all-read", "1")
        if rank == 0:
            store.wait([f"{prefix}all-read"], timedelta(seconds=timeout))
            for key in [f"{prefix}{r}" for r in range(world)] + [f"{prefix}read", f"{prefix}all-read"]:
                store.delete_key(key)
    except (RuntimeError, TimeoutError, OSError):
        pass  # a rank that left cannot read; the others have their answer


__all__ = ["DEFAULT_TIMEOUT_S", "agree_in_group", "check_timeout", "join_job"]
