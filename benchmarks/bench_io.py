"""Benchmark: the converter's I/O choices, measured: page cache against O_DIRECT, for reads and for writes.

The converter reads every source byte once and never reads its output back, so the page cache only helps
where the source is already in it. This measures, on the machine and file system at hand, what each way
costs in wall time and in CPU time (user + sys of this process; the kernel's writeback threads are not
counted, which flatters buffered writes):

  read  cached     preadv into a reused buffer, the file in the page cache (what a warm conversion does)
  read  buffered   the same from a dropped cache: the kernel allocates, fills and copies a page per page
  read  direct     O_DIRECT from a dropped cache, 4 concurrent parts per band, 2 bands in flight (what a cold
                   conversion does), into huge-page buffers (`preshard.format.fileio.DirectIOBuffer`)
  read  direct 4k  the same into shared `mmap` memory in 4 KiB pages (what the converter used before)
  write buffered   pwrite through the page cache, then fsync
  write direct     O_DIRECT pwrite from an aligned huge-page stage (8 files written at once, as tp=8), then fsync
  write direct 4k  the same from a stage in 4 KiB pages
  cp + sync        `cp` of the source file (copy_file_range where the file system has it), then `sync`: the
                   baseline the converter's benchmarks compare against

Per variant also the mean size of the device's requests (from /sys/dev/block/*/stat, where the folder's device
has one): direct transfers from 4 KiB pages reach the device in requests of 512 KiB, from huge pages in 4 MiB.

Repetitions alternate (every variant once per repetition, in a rotating order). Cold variants need
/proc/sys/vm/drop_caches to be writable; elsewhere they are skipped and the output says so.

    python benchmarks/bench_io.py --size-gib 4 --reps 3 --workdir /path/on/the/disk/to/test
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from preshard.format.fileio import DirectIOBuffer

MIB, GB = 1 << 20, 10**9
BLOCK = 32 * MIB  # one band
DROP_CACHES = "/proc/sys/vm/drop_caches"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _drop() -> bool:
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _buffer(nbytes: int, huge: bool) -> memoryview:
    return DirectIOBuffer(nbytes).view if huge else memoryview(mmap.mmap(-1, nbytes))


def _device_stat(folder: Path) -> Path | None:
    """The block device statistics file of the device holding `folder`, if the system has one."""
    dev = os.stat(folder).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def _requests(stat: Path | None) -> tuple[int, int]:
    """(requests, sectors) read and written so far on the device."""
    if stat is None:
        return 0, 0
    f = [int(x) for x in stat.read_text().split()]
    return f[0] + f[4], f[2] + f[6]


def _read(path: Path, direct: bool, huge: bool = True) -> None:
    """Read the file in bands: buffered, one band at a time; direct, as the converter does: each band in 4
    concurrent parts, two bands in flight."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    parts, ahead = (4, 2) if direct else (1, 1)
    buffers = [_buffer(BLOCK, huge) for _ in range(ahead + 1)]
    step = BLOCK // parts
    pending: deque = deque()
    try:
        with ThreadPoolExecutor(parts * ahead) as pool:
            for k, start in enumerate(range(0, size, BLOCK)):
                view = buffers[k % len(buffers)]
                reads = [
                    pool.submit(os.preadv, fd, [view[i * step : (i + 1) * step]], start + i * step)
                    for i in range(parts)
                    if start + i * step < size
                ]
                pending.append(reads)
                while len(pending) >= ahead:
                    for read in pending.popleft():
                        read.result()
            while pending:
                for read in pending.popleft():
                    read.result()
    finally:
        os.close(fd)


def _write(folder: Path, size: int, direct: bool, files: int = 8, huge: bool = True) -> None:
    per = size // files // BLOCK * BLOCK

    def one(i: int) -> None:
        path = folder / f"out{i}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
        stage = _buffer(8 * MIB, huge)
        stage[:] = os.urandom(8 * MIB)
        try:
            for offset in range(0, per, 8 * MIB):
                os.pwrite(fd, stage, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _copy(source: Path, copy: Path) -> None:
    subprocess.run(["cp", str(source), str(copy)], check=True)
    os.sync()
    copy.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="a folder on the file system to measure (default: temp)")
    args = parser.parse_args(argv)
    if not hasattr(os, "O_DIRECT"):
        raise SystemExit("O_DIRECT is not available on this platform")
    print(f"command: python {' '.join(sys.argv if argv is None else [sys.argv[0], *argv])}")
    with open("/proc/loadavg") as f:
        print(f"{os.cpu_count()} CPUs; loadavg at start: {f.read().strip()}")
    cold = _drop()
    print(f"cold variants: {'on' if cold else 'skipped (' + DROP_CACHES + ' not writable)'}")
    root = Path(tempfile.mkdtemp(prefix="bench_io-", dir=args.workdir))
    size = int(args.size_gib * (1 << 30)) // BLOCK * BLOCK
    source = root / "source"
    with open(source, "wb") as f:
        chunk = os.urandom(64 * MIB)
        for _ in range(size // len(chunk)):
            f.write(chunk)
    size = source.stat().st_size
    variants = {
        "read cached": (False, lambda: _read(source, False)),
        "read buffered": (True, lambda: _read(source, False)),
        "read direct": (True, lambda: _read(source, True)),
        "read direct 4k": (True, lambda: _read(source, True, huge=False)),
        "write buffered": (False, lambda: _write(root, size, False)),
        "write direct": (False, lambda: _write(root, size, True)),
        "write direct 4k": (False, lambda: _write(root, size, True, huge=False)),
        "cp + sync": (False, lambda: _copy(source, root / "copy")),
    }
    stat = _device_stat(root)
    if not cold:
        variants = {k: v for k, v in variants.items() if not v[0]}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    names = list(variants)
    try:
        for rep in range(args.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                needs_cold, run = variants[name]
                os.sync()
                if needs_cold:
                    _drop()
                elif name == "read cached":
                    _read(source, False)
                r0, c0, t0 = _requests(stat), _cpu(), time.perf_counter()
                run()
                wall, cpu, r1 = time.perf_counter() - t0, _cpu() - c0, _requests(stat)
                kib = (r1[1] - r0[1]) / 2 / max(1, r1[0] - r0[0])
                results[name].append((wall, cpu, kib))
                print(f"rep {rep} {name:<15} {wall:6.2f} s  cpu {cpu:5.2f} s  requests of {kib:5.0f} KiB", flush=True)
    finally:
        for p in root.iterdir():
            p.unlink()
        root.rmdir()
    print(f"\n{size / GB:.2f} GB, median of {args.reps}:")
    print(f"{'variant':<15} {'wall s':>7} {'GB/s':>6} {'CPU s':>6} {'CPU s/GB':>8} {'request KiB':>11}")
    for name, runs in results.items():
        wall, cpu, kib = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{name:<15} {wall:7.2f} {size / GB / wall:6.2f} {cpu:6.2f} {cpu / (size / GB):8.2f} {kib:11.0f}")
    print("CPU s: this process's (cp's own CPU is a child's and is counted; writeback threads are not)")
    with open("/proc/loadavg") as f:
        print(f"loadavg at end: {f.read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
