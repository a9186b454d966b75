"""Parallel conversion: several processes, on one host or several sharing a file system, one output.

    convert-checkpoint SRC OUT --tp 8 --workers 4                       # 4 local processes
    torchrun --nnodes 2 --nproc-per-node 4 ... -m preshard.torchrun_convert SRC OUT --tp 8

The data files are divided among the processes (contiguous runs of TP ranks, so that a colwise tensor's
rows for one process are one range); each process reads only the source rows its files need (a column
split needs every row), plus, for the source files it is assigned to hash, every byte of them in order.
Every record's place is known before anything is written (`preshard.format.layout`), so the processes
never wait for one another's bytes.

Coordination is a short, fixed sequence of exchanges (`Coordinator.exchange`, an all-gather over a gloo
group), the same in every process: the job's key (every process must have planned the same conversion);
the lowest rank's setup (it alone takes the output's lock, prepares the working folder and, when resuming,
re-checks what is there; the others then adopt their files' kept records); one exchange per sync point
(each process's files durable up to that point, and the checksums it wrote; the lowest rank journals
them, so the journal is the single-process one and a resume works with any number of processes); the
file checksums and source hashes; and the commit, which the lowest rank alone performs. Each exchange
carries every process's status: a process that fails or is interrupted says so at its next exchange and
stops; every other process raises the same error there and stops too. No process waits on one that has
stopped, and the output is committed only when every process has finished its files.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import ctypes
import multiprocessing
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preshard import errors
from preshard.errors import DeviceError, Interrupted, PreshardError, WorkerError

if TYPE_CHECKING:
    from preshard.format.manifest import Manifest

# What a worker runs: convert.write_conversion(job, output, coordinator=..., external_stop=..., **options). It is
# passed in (run_workers' `write`), so this module never imports convert.py, which imports it.
WriteConversion = Callable[..., object]

TIMEOUT_S = 1800.0  # the default of `worker_timeout`
WORKER_RANK: int | None = None  # in a process started by run_workers: its rank (tests act on one worker)
# The torchrun job this thread converts in: set only inside `torchrun_job()`'s block, which the torchrun entry
# (`run_under_torchrun`) holds around the one conversion it runs; a context variable, so nothing outside the block
# (another thread, a later call) sees it.
_JOB: contextvars.ContextVar[Coordinator | None] = contextvars.ContextVar("preshard_torchrun_job", default=None)


def worker_timeout() -> float:
    """How long one process waits for the others at an exchange (the lowest rank re-checking a large partial
    conversion before the first one, a slow host): 30 minutes, or `PRESHARD_WORKER_TIMEOUT_S`, read when the
    workers' group is made (never at import)."""
    return float(os.environ.get("PRESHARD_WORKER_TIMEOUT_S", TIMEOUT_S))


class Coordinator:
    """The exchanges between the processes of one conversion. Without a group it is a single process, whose
    exchanges return its own payload at once (or raise its own error)."""

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.failed = False  # a failure has been exchanged: there are no more exchanges

    def exchange(self, payload: Any, error: BaseException | None = None) -> list[Any]:
        """Every process's payload, in rank order.

        Raises:
            `error` itself when given (after telling the others); the first failure another process reported,
            rebuilt here (same class and message); WorkerError when another process cannot be reached.
        """
        if self.failed:
            raise RuntimeError("no exchange after a failure")  # a bug: every failure ends the exchanges
        if self.world == 1:
            if error is not None:
                self.failed = True
                raise error
            return [payload]
        import torch.distributed as dist

        mine = (describe(error, self.rank), None) if error is not None else (None, payload)
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, mine, group=self.group)
        except Exception as exc:  # gloo: a peer process died, or the timeout passed
            self.failed = True
            if error is not None:
                raise error from None
            lost = WorkerError(
                f"lost contact with another conversion worker ({' '.join(str(exc).split())[:200]}); the finished "
                "part is kept: re-run the same command to resume"
            )
            lost.lost_contact = True
            raise lost from None
        failures = [item[0] for item in gathered if item[0] is not None]
        if failures:
            self.failed = True
            if error is not None:
                raise error
            raise rebuild(min(failures, key=lambda d: d["rank"]))
        return [item[1] for item in gathered]

    def fail(self, error: BaseException) -> None:
        """Tell the others that this process failed (once; the caller raises `error` itself)."""
        if not self.failed:
            with contextlib.suppress(BaseException):
                self.exchange(None, error)
            self.failed = True


def active_coordinator() -> Coordinator | None:
    """The coordinator of the torchrun job whose `torchrun_job()` block this thread is in, if any: within it,
    `convert_checkpoint` converts as this process's part of the job."""
    return _JOB.get()


def owned_files(tp: int, world: int, rank: int) -> list[int]:
    """The TP ranks whose data files process `rank` of `world` writes: a contiguous run, as even as can be."""
    return [r for r in range(tp) if r * world // tp == rank]


# ---------------------------------------------------------------------------------------------------------
# Errors across processes


def describe(error: BaseException, rank: int) -> dict[str, Any]:
    """A plain description of an error, to rebuild it in another process."""
    origin = getattr(error, "from_worker", rank)
    if isinstance(error, Interrupted):
        return {"rank": origin, "kind": "interrupted", "message": str(error), "signal": error.signal_number}
    if isinstance(error, KeyboardInterrupt):
        message = "interrupted (SIGINT); the finished part is kept: re-run the same command to resume"
        return {"rank": origin, "kind": "interrupted", "message": message, "signal": int(signal.SIGINT)}
    if isinstance(error, PreshardError):
        lost = getattr(error, "lost_contact", False)
        return {"rank": origin, "kind": "preshard", "class": type(error).__name__, "message": str(error), "lost": lost}
    if isinstance(error, OSError):
        return {
            "rank": origin, "kind": "os", "errno": error.errno, "strerror": error.strerror,
            "filename": None if error.filename is None else str(error.filename), "message": str(error),
        }  # fmt: skip
    return {"rank": origin, "kind": "other", "message": f"{type(error).__name__}: {error}"}


def rebuild(description: dict[str, Any]) -> BaseException:
    """The error `describe` described, marked with the worker it came from (`from_worker`)."""
    kind, message = description["kind"], description["message"]
    error: BaseException
    if kind == "interrupted":
        error = Interrupted(message, description["signal"])
    elif kind == "preshard":
        cls = getattr(errors, description["class"], None)
        if not (isinstance(cls, type) and issubclass(cls, PreshardError)) or cls is Interrupted:
            cls = PreshardError
        error = cls(message)
    elif kind == "os":
        error = OSError(description["errno"], description["strerror"], description["filename"])
    else:
        error = WorkerError(f"conversion worker {description['rank']} failed: {message}")
    error.from_worker = description["rank"]
    error.lost_contact = description.get("lost", False)
    return error


# ---------------------------------------------------------------------------------------------------------
# Local workers: convert-checkpoint --workers P


def _die_with_parent() -> None:
    """Linux: SIGTERM this process if the launching one dies, so no worker outlives a killed launcher."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _local_worker(
    rank: int,
    world: int,
    store_path: str,
    write: WriteConversion,
    job: Any,
    output: str,
    options: dict[str, Any],
    conn: connection.Connection,
    stop_signal: Any,
) -> None:
    global WORKER_RANK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the conversion defers it; the launcher relays signals
    torch = sys.modules.get("torch")
    if torch is not None:  # a forked child of a process whose OpenMP pool ran hangs in its first parallel op
        torch.set_num_threads(1)  # (--quantize, --lora and --dtype compute with torch in the workers)
    _die_with_parent()
    WORKER_RANK = rank
    message: tuple[str, Any]
    try:
        import torch.distributed as dist

        outcome = options.pop("outcome")
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=worker_timeout())
        )
        try:
            coordinator = Coordinator(rank, world)
            write(
                job, Path(output), coordinator=coordinator, external_stop=lambda: stop_signal.value or None,
                outcome=outcome, **options,
            )  # fmt: skip
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        message = ("ok", outcome)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        own = getattr(exc, "from_worker", rank) == rank
        if own and not isinstance(exc, (PreshardError, OSError, KeyboardInterrupt)):
            traceback.print_exc()  # a bug: its traceback, once, from the worker where it happened
        message = ("error", (describe(exc, rank), own))
    with contextlib.suppress(Exception):
        conn.send(message)
    conn.close()


def run_workers(
    write: WriteConversion,
    job: Any,
    output: Path,
    *,
    workers: int,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    outcome: Any = None,
    on_tensor: Callable[[str], None] | None = None,
) -> Manifest:
    """Convert `job` (a `ConversionPlan`) into `output` with `workers` local processes (forked: nothing is imported
    again), each running `write` (`convert.write_conversion`) on its share.

    SIGINT/SIGTERM to this process is relayed to the workers, which stop at a safe point; this process then
    raises `Interrupted`. A worker that fails makes every worker stop; this process raises its error.

    Raises:
        The error of the lowest worker that failed (a PreshardError, OSError or Interrupted as in a single
        process); WorkerError for a worker that died without a word (killed, out of memory).
    """
    from preshard.converter.signals import deferred_signals
    from preshard.format.manifest import read_manifest

    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory(prefix="preshard-workers-") as tmp, deferred_signals() as stop:
        stop_signal = ctx.Value("i", 0, lock=False)
        procs, readers = [], {}
        try:
            for rank in range(workers):
                options = {"overwrite": overwrite, "wait": wait, "progress": progress if rank == 0 else False}
                options["check_model"] = True  # on the lowest rank, while it converts
                options["outcome"] = copy.copy(outcome) if rank == 0 else None  # filled in, sent back
                options["on_tensor"] = on_tensor  # every worker's (forked: a closure travels)
                reader, writer = ctx.Pipe(duplex=False)
                args = (
                    rank,
                    workers,
                    os.path.join(tmp, "store"),
                    write,
                    job,
                    str(output),
                    options,
                    writer,
                    stop_signal,
                )
                proc = ctx.Process(target=_local_worker, args=args, name=f"preshard-worker-{rank}")
                proc.start()
                writer.close()
                procs.append(proc)
                readers[reader] = rank
            outcomes: dict[int, tuple[str, Any]] = {}
            while readers:
                if stop.signal_number is not None and not stop_signal.value:
                    stop_signal.value = stop.signal_number
                for conn in connection.wait(list(readers), timeout=0.1):
                    rank = readers.pop(conn)
                    try:
                        outcomes[rank] = conn.recv()
                    except EOFError:
                        procs[rank].join(10)
                        outcomes[rank] = ("died", procs[rank].exitcode)
                    conn.close()
        except BaseException:  # KeyboardInterrupt outside a command scope: the workers stop at their next safe point
            stop_signal.value = stop_signal.value or int(signal.SIGINT)
            raise
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            for conn in readers:
                conn.close()
        # Inside the block: a signal the workers finished before acting on is delivered when it ends (no exit 0).
        if all(kind == "ok" for kind, _ in outcomes.values()):
            if outcome is not None and outcomes[0][1] is not None:
                vars(outcome).update(vars(outcomes[0][1]))
            return read_manifest(output)
        raise _launcher_error(outcomes, stop.signal_number)


def _launcher_error(outcomes: dict[int, tuple[str, Any]], signal_number: int | None) -> BaseException:
    """The error to raise for failed workers: the cause, not its echoes. In order: the lowest worker's own
    failure; a worker that died (the others lost contact with it); what the workers relayed."""
    reported = [value for kind, value in (outcomes[r] for r in sorted(outcomes)) if kind == "error"]
    own = [d for d, is_own in reported if is_own and not d.get("lost")]
    for description in own:
        return rebuild(description)
    died = [(r, code) for r, (kind, code) in sorted(outcomes.items()) if kind == "died"]
    if not died:
        for description, _ in reported:
            return rebuild(description)
    if signal_number is not None:
        name = "interrupted (SIGINT)" if signal_number == signal.SIGINT else "terminated (SIGTERM)"
        return Interrupted(f"{name}; the finished part is kept: re-run the same command to resume", signal_number)
    rank, code = died[0]
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    return WorkerError(
        f"conversion worker {rank} died ({how}), perhaps out of memory; re-run the same command to resume"
    )


# ---------------------------------------------------------------------------------------------------------
# torchrun: python -m preshard.torchrun_convert SRC OUT --tp 8 ... (the CLI layer calls this)


@contextlib.contextmanager
def torchrun_job() -> Iterator[Coordinator]:
    """Join the gloo group of the torchrun job this process is part of; within the block, `convert_checkpoint`
    (in this thread) shares the conversion with the job's other processes through the coordinator yielded. The
    group is left when the block ends, whatever happens.

    Raises:
        DeviceError: the process was not started by torchrun (no RANK/WORLD_SIZE in its environment).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise DeviceError(
            "this conversion runs under torchrun (e.g. torchrun --nproc-per-node 4 -m preshard.torchrun_convert "
            "SRC OUT --tp 8); on one host, convert-checkpoint SRC OUT --tp 8 --workers 4 does the same"
        )
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=worker_timeout()))
    coordinator = Coordinator(rank, world)
    token = _JOB.set(coordinator)
    try:
        yield coordinator
    finally:
        _JOB.reset(token)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_under_torchrun(convert: Callable[[], object], prog: str) -> None:
    """Run `convert` (one conversion) as this process's part of a torchrun job (`torchrun_job`), with one summary
    line for the job, from the lowest rank."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            f"error: {prog} runs under torchrun (e.g. torchrun --nproc-per-node 4 -m preshard.torchrun_convert "
            "SRC OUT --tp 8); on one host, convert-checkpoint SRC OUT --tp 8 --workers 4 does the same",
            file=sys.stderr,
        )
        sys.exit(2)
    with torchrun_job() as coordinator, contextlib.ExitStack() as stack:
        if coordinator.rank != 0:
            stack.enter_context(contextlib.redirect_stdout(open(os.devnull, "w")))  # noqa: SIM115
        convert()


__all__ = [
    "Coordinator", "active_coordinator", "owned_files", "run_under_torchrun", "run_workers", "torchrun_job",
    "worker_timeout",
]  # fmt: skip
