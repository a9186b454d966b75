"""How long a conversion, reshard or unshard will take, from what this machine shows just now (the dry runs).

Why a model and not one read/write probe: a short probe alone missed by 4x both ways. A source already in the page
cache costs no disk read at all (the conversion then took 3.75 s where "at least 16 s" was said), and on a busy
machine the CPU work, not the disk, sets the pace. So the estimate adds up what the work really consists of, each
part measured here:

    seconds = start + max(check, data),   data = max(disk, cpu)

- `start`: interpreter start, imports and planning, which the command's own process pays again (the CLI passes its
  own age; a conversion run from an already-running Python pays none).
- `check`: the plan checked against the model class (importing diffusers, building the model on the meta device)
  and the DCP import for the commit: the converter runs them on a thread beside the data, so they overlap it; the
  dry run does the same work and times it (with the cyclic GC paused, as the converter pauses it).
- `disk`: the source bytes that are not in the page cache (`mincore`, as the reader itself asks) at the device's
  direct-read rate, plus the output at its direct write+fsync rate, both probed as the converter reads and writes:
  O_DIRECT (so a cached probe region cannot flatter the rate), 4 reads and 4 files at once.
- `cpu`: the per-byte work of the pipeline (copies out of the page cache and into the staging buffers, the xxh3
  passes over source and output), timed on a 64 MiB buffer now, so the machine's current load is in the figure,
  times CPU_OVERHEAD, the ratio of the converter's measured CPU time to those passes (README, "Dry run").

Each rate is the median of ROUNDS short probes (a third of the probe's bytes each, the disk ones on distinct
regions and files): one round that a neighbour's burst slows down, or a device cache flatters, no longer sets the
figure (single 64 MiB probes moved the estimate of one source 4.5x over four runs a minute apart on a loaded 2-core
machine). The slowest and fastest rounds give the estimate's spread, printed beside it (`Estimate.low`/`high`).

The pipeline overlaps reading, writing and CPU work, hence the max. What no probe sees: a disk whose sustained rate
falls below its burst rate, and other jobs arriving during the run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from preshard.format.fileio import DirectIOBuffer
from preshard.process import gc_paused
from preshard.sources.reader import cached_bytes

PROBE_BYTES = 64 << 20
PROBE_BLOCK = 8 << 20
ALIGN = 4096
ROUNDS = 3  # short probes per rate: the median is the rate, the slowest and fastest the spread
PARALLEL = 4  # concurrent direct reads of a band (sources/reader.py) and data files written at once
# The converter's CPU time per byte over the bare copies and hashes the probe times (threads, queues, O_DIRECT
# system calls, numpy views, the journal): measured on this project's 2-core machine, README "Dry run".
CPU_OVERHEAD = 1.2


@dataclass(frozen=True)
class Probe:
    """This machine's rates just now, each in bytes per second (None: not measured)."""

    read: float | None  # O_DIRECT read from the source's file system
    write: float | None  # O_DIRECT write + fsync on the output's file system
    copy: float | None  # memory copy
    hash: float | None  # xxh3 pass (xxh3_64 and xxh3_128 run at about the same speed)
    probe_bytes: int = 0
    slowest: Probe | None = None  # each rate's slowest round (None: one round only)
    fastest: Probe | None = None


@dataclass(frozen=True)
class Work:
    """What a command reads, writes and passes over with the CPU, in bytes."""

    source_bytes: int  # read from the input
    cached_bytes: int  # of which in the page cache now
    output_bytes: int  # written
    copy_bytes: int  # copied by the CPU (a cached read is a copy, so is staging)
    hash_bytes: int  # passed over by xxh3

    @staticmethod
    def conversion(source_bytes: int, cached: int, output_bytes: int) -> Work:
        """Source hashed once (provenance), read by copy where cached; output staged (a copy), then its chunk and
        file hashes. A reshard's input chunks are hash-checked as read, as a source is hashed: the same work.
        `cached` counts whole files (headers too), so it is capped at the bytes read."""
        cached = min(cached, source_bytes)
        return Work(source_bytes, cached, output_bytes, cached + output_bytes, source_bytes + 2 * output_bytes)

    @staticmethod
    def unshard(input_bytes: int, cached: int, output_bytes: int) -> Work:
        """Chunks read (a copy where cached) into the rebuilt files, each file's xxh3_128 checked."""
        cached = min(cached, input_bytes)
        return Work(input_bytes, cached, output_bytes, cached + output_bytes, output_bytes)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    start_seconds: float
    check_seconds: float
    disk_seconds: float | None  # None: a rate could not be measured
    cpu_seconds: float
    work: Work
    probe: Probe
    low: float | None = None  # the estimate at each rate's fastest round, and at its slowest
    high: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["probe"] = {k: v for k, v in data["probe"].items() if k not in ("probe_bytes", "slowest", "fastest")}
        return data

    def describe(self) -> str:
        """One line: the figure and what it is made of."""
        w, p = self.work, self.probe
        share = min(1.0, w.cached_bytes / w.source_bytes) if w.source_bytes else 1.0
        disk = "not measured" if self.disk_seconds is None else human_seconds(self.disk_seconds)
        return (
            f"about {human_seconds(self.seconds)} = start {human_seconds(self.start_seconds)} + the larger of the "
            f"model check ({human_seconds(self.check_seconds)}) and the data: the larger of disk {disk} "
            f"({share:.0%} of the input in the page cache; read {_rate(p.read)}, write+fsync {_rate(p.write)}) "
            f"and CPU {human_seconds(self.cpu_seconds)} (copy {_rate(p.copy)}, xxh3 {_rate(p.hash)}, measured now)"
            + self._spread()
        )

    def _spread(self) -> str:
        if self.low is None or self.high is None:
            return ""
        return f"; {human_seconds(self.low)} to {human_seconds(self.high)} from the probes' fastest and slowest rounds"


def timed_check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """`fn(*args, **kwargs)` (planning with the model check) and its seconds, the cyclic GC paused as the command's
    scope pauses it for the conversion (`preshard.process.gc_paused`); plus the DCP import that the converter's
    background thread also does."""
    with gc_paused():
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        import preshard.format.dcp_metadata  # noqa: F401

        return result, time.perf_counter() - start


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0 where that cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def input_cached(paths: list[Path]) -> int:
    """Bytes of these files in the page cache now; where `mincore` cannot say, none (the cautious answer)."""
    total = 0
    for path in paths:
        total += cached_bytes(path) or 0
    return total


def probe(read_from: Path | None, write_in: Path | None, nbytes: int = PROBE_BYTES) -> Probe:
    """Measure the rates the estimate needs (each the median of ROUNDS short probes); nothing is left behind.
    `read_from`: the largest input file (read with O_DIRECT, which goes to the device whatever is cached);
    `write_in`: the output's folder (temporary files, written with O_DIRECT and fsynced, then removed)."""
    buffer = DirectIOBuffer(nbytes)  # aligned, as O_DIRECT needs, in the converter's kind of memory
    rounds: dict[str, list[float | None]] = {"read": [], "write": [], "copy": [], "hash": []}
    try:
        view = buffer.view
        part = nbytes // ROUNDS // ALIGN * ALIGN
        for i in range(ROUNDS):
            piece = view[i * part : (i + 1) * part]
            rounds["read"].append(_direct_read(read_from, piece, i) if read_from is not None else None)
            rounds["write"].append(_direct_write(write_in, piece) if write_in is not None else None)
        view[:] = os.urandom(PROBE_BLOCK) * (nbytes // PROBE_BLOCK) + os.urandom(nbytes % PROBE_BLOCK)
        source = buffer.array
        target = np.empty(nbytes, dtype=np.uint8)
        np.copyto(target, source)  # both buffers faulted in first: the pipeline's buffers are reused, so are these
        for i in range(ROUNDS):
            piece = slice(i * part, (i + 1) * part)
            start = time.perf_counter()
            np.copyto(target[piece], source[piece])  # as the pipeline copies (numpy)
            rounds["copy"].append(_per_s(part, time.perf_counter() - start))
            start = time.perf_counter()
            xxhash.xxh3_128(view[piece]).digest()
            rounds["hash"].append(_per_s(part, time.perf_counter() - start))
        del source, piece
        del view
    finally:
        buffer.close()

    def pick(choose: Callable[[list[float]], float]) -> dict[str, float | None]:
        return {name: choose(got) if (got := [r for r in rates if r]) else None for name, rates in rounds.items()}

    median = pick(statistics.median)
    return Probe(**median, probe_bytes=nbytes, slowest=Probe(**pick(min)), fastest=Probe(**pick(max)))


def estimate(work: Work, rates: Probe, *, start_seconds: float = 0.0, check_seconds: float = 0.0) -> Estimate:
    """The model of the module docstring."""
    uncached = max(0, work.source_bytes - work.cached_bytes)
    disk: float | None = 0.0
    if uncached:
        disk = None if rates.read is None else uncached / rates.read
    if work.output_bytes and disk is not None:
        disk = None if rates.write is None else disk + work.output_bytes / rates.write
    cpu = 0.0
    if rates.copy:
        cpu += work.copy_bytes / rates.copy
    if rates.hash:
        cpu += work.hash_bytes / rates.hash
    cpu *= CPU_OVERHEAD
    data = max(disk or 0.0, cpu)
    seconds = start_seconds + max(check_seconds, data)
    low = high = None
    if rates.fastest is not None and rates.slowest is not None:
        low = estimate(work, rates.fastest, start_seconds=start_seconds, check_seconds=check_seconds).seconds
        high = estimate(work, rates.slowest, start_seconds=start_seconds, check_seconds=check_seconds).seconds
    return Estimate(seconds, start_seconds, check_seconds, disk, cpu, work, rates, low, high)


def human_seconds(seconds: float) -> str:
    """'under 0.1 s', '0.4 s', '12 s', '3 min 5 s', '1 h 2 min'."""
    if seconds < 0.1:
        return "under 0.1 s"
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _rate(rate: float | None) -> str:
    from preshard.units import human_bytes

    return f"{human_bytes(rate)}/s" if rate else "not measured"


def _per_s(n: int, seconds: float) -> float | None:
    return n / seconds if n and seconds > 0 else None


def _parts(view: memoryview) -> list[memoryview]:
    step = len(view) // PARALLEL // ALIGN * ALIGN
    return [view[i * step : (i + 1) * step] for i in range(PARALLEL)] if step else []


def _direct_read(path: Path, view: memoryview, round_: int = 0) -> float | None:
    """Read up to len(view) bytes from region `round_` of ROUNDS around the middle of `path` with O_DIRECT, in PARALLEL
    concurrent parts as the reader does; None where O_DIRECT is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        parts = _parts(view[: min(len(view), size) // ALIGN * ALIGN])
        if not parts:
            return None
        span = sum(len(p) for p in parts)
        regions = max(1, min(ROUNDS, size // span))
        offset = ((size - regions * span) // 2 // ALIGN * ALIGN) + (round_ % regions) * span

        def read(i: int) -> int:
            return os.preadv(fd, [parts[i]], offset + i * len(parts[0]))

        start = time.perf_counter()
        with ThreadPoolExecutor(PARALLEL) as pool:
            done = sum(pool.map(read, range(len(parts))))
        return _per_s(done, time.perf_counter() - start)
    except OSError:
        return None
    finally:
        os.close(fd)


def _direct_write(folder: Path, view: memoryview) -> float | None:
    """Write len(view) bytes into PARALLEL temporary files in `folder` at once, as the writer threads write the data
    files (O_DIRECT, buffered where refused), each fsynced; the files are removed again."""
    if shutil.disk_usage(folder).free < 4 * len(view):
        return None
    parts = _parts(view)
    names = []
    try:
        for _ in parts:
            fd, name = tempfile.mkstemp(prefix=".preshard-probe-", dir=folder)
            os.close(fd)
            names.append(name)

        def write(i: int) -> None:
            try:
                fd = os.open(names[i], os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                fd = os.open(names[i], os.O_WRONLY)
            try:
                for j in range(0, len(parts[i]), PROBE_BLOCK):
                    os.pwrite(fd, parts[i][j : j + PROBE_BLOCK], j)
                os.fsync(fd)
            finally:
                os.close(fd)

        start = time.perf_counter()
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(write, range(len(parts))))
        return _per_s(sum(len(p) for p in parts), time.perf_counter() - start)
    except OSError:
        return None
    finally:
        for name in names:
            os.unlink(name)


__all__ = [
    "CPU_OVERHEAD",
    "Estimate",
    "Probe",
    "Work",
    "estimate",
    "human_seconds",
    "input_cached",
    "probe",
    "process_age",
    "timed_check",
]
