"""Benchmark: how close `convert-checkpoint --dry-run`'s time estimate comes to the conversion it describes.

For each repetition, warm (the source read into the page cache first) and cold (the source's pages evicted with
posix_fadvise(DONTNEED) after a sync: only this benchmark's files, nothing else on the machine), it runs the dry run
as its own process (`--dry-run --json`, reading `estimate_seconds`), then the real conversion as a whole process
(`convert-checkpoint SRC OUT ... --no-progress`, interpreter start and imports included, the output removed before),
and prints estimate, measured time and their ratio, with the 1-minute load average before each step. The source is
MiniMax-H3 at its real width (--layers transformer blocks and both refiner blocks; 1 layer: 2.09 GiB), written by
`preshard.examples.synthetic` from a repeated random buffer.

    python benchmarks/bench_estimate.py --layers 1 --reps 3 --tp 4 --cp 2
    python benchmarks/bench_estimate.py --probes 7   # the probes alone: 1 round vs the median of 3

--probes N times the probes alone, N interleaved pairs: the estimate for a fixed cold conversion of 4.31 GB (read
from a 256 MiB file here, written beside it) from a single-round probe (the previous design) and from the median of
ROUNDS rounds, with the CPU seconds each probe took and the spread (max / min) of each estimate over the N runs.

Disk: the source and one output (about twice the source), in a temporary folder removed at the end. Run it from
the repository (or with PYTHONPATH pointing at src/) so that the converter under test is the working tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _harness import GIB, bench_env, loadavg, timed

GENERATE = textwrap.dedent(
    """
    import sys
    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint
    tensors, config = minimax_h3_tensors(num_layers=int(sys.argv[2]))
    write_safetensors_checkpoint(sys.argv[1], tensors, config, data="random", max_shard_bytes=1 << 30)
    """
)


def _evict(folder: Path) -> None:
    """Drop this folder's files from the page cache (written back first), leaving every other file alone."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _warm(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def _load1() -> str:
    return loadavg().split()[0]


def probes_only(runs: int, workdir: Path | None) -> None:
    import resource

    from preshard.tools import estimate as est

    root = Path(tempfile.mkdtemp(prefix="preshard-bench-probes-", dir=workdir))
    try:
        source = root / "source.bin"
        with open(source, "wb") as f:
            for _ in range(32):
                f.write(os.urandom(8 << 20))
        work = est.Work.conversion(source_bytes=4_310_000_000, cached=0, output_bytes=4_310_000_000)
        got: dict[int, list[tuple[float, float]]] = {1: [], est.ROUNDS: []}
        rounds_default = est.ROUNDS
        print(f"load before: {loadavg()}")
        for i in range(runs):
            for rounds in (1, rounds_default) if i % 2 == 0 else (rounds_default, 1):
                est.ROUNDS = rounds
                c0 = resource.getrusage(resource.RUSAGE_SELF)
                seconds = est.estimate(work, est.probe(source, root)).seconds
                c1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
                got[rounds].append((seconds, cpu))
                print(f"run {i} rounds={rounds}: estimate {seconds:7.1f} s  probe CPU {cpu:.2f} s  load {_load1()}")
        est.ROUNDS = rounds_default
        for rounds, rows in got.items():
            values = [s for s, _ in rows]
            print(
                f"rounds={rounds}: estimate median {statistics.median(values):.1f} s, range {min(values):.1f}.."
                f"{max(values):.1f} s (max/min {max(values) / min(values):.2f}), probe CPU median "
                f"{statistics.median(c for _, c in rows):.2f} s"
            )
        print(f"load after: {loadavg()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--probes", type=int, default=0, help="time the probes alone, this many interleaved pairs")
    args = parser.parse_args()
    if args.probes:
        probes_only(args.probes, args.workdir)
        return
    env = bench_env()
    root = Path(tempfile.mkdtemp(prefix="preshard-bench-estimate-", dir=args.workdir))
    rows = []
    try:
        source, out = root / "source", root / "out"
        subprocess.run([sys.executable, "-c", GENERATE, str(source), str(args.layers)], env=env, check=True)
        size = sum(p.stat().st_size for p in source.iterdir())
        mesh = ["--tp", str(args.tp), "--cp", str(args.cp)]
        convert = shlex.join(["convert-checkpoint", str(source), str(out), *mesh, "--no-progress"])
        for rep in range(args.reps):
            for state in ("warm", "cold") if rep % 2 == 0 else ("cold", "warm"):
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                _warm(source) if state == "warm" else _evict(source)
                load_dry = _load1()
                dry = subprocess.run(
                    ["convert-checkpoint", str(source), str(out), *mesh, "--dry-run", "--json"],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                report = json.loads(dry.stdout)
                if state == "cold":
                    _evict(source)  # the dry run reads with O_DIRECT; make sure nothing it touched stays cached
                load_run = _load1()
                run = timed(convert, env, root / "log.txt", timeout=1800)
                est = report["estimate_seconds"]
                rows.append((rep, state, est, run["wall_s"], load_dry, load_run, report["estimate"]))
                cpu = run["user_s"] + run["sys_s"]
                spread = f"{report['estimate']['low']:.1f}..{report['estimate']['high']:.1f} s"
                print(
                    f"rep {rep} {state}: estimate {est:.2f} s (spread {spread}), measured {run['wall_s']:.2f} s "
                    f"({cpu:.2f} CPU s), ratio {run['wall_s'] / est:.2f} (load {load_dry} / {load_run})",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"source: MiniMax-H3, {args.layers} layer(s) at real width, {size / GIB:.2f} GiB; mesh {' '.join(mesh)}")
    print(
        f"{'rep':>3} {'state':<5} {'estimate':>9} {'measured':>9} {'measured/est':>13}  load (dry / run)  cached"
        "   start  check   disk    cpu  spread (fastest..slowest rounds)"
    )
    for rep, state, est, wall, ld, lr, parts in rows:
        share = parts["work"]["cached_bytes"] / max(1, parts["work"]["source_bytes"])
        disk = parts["disk_seconds"] if parts["disk_seconds"] is not None else float("nan")
        print(
            f"{rep:>3} {state:<5} {est:>8.2f}s {wall:>8.2f}s {wall / est:>13.2f}  {ld:>5} / {lr:<5}    {share:>4.0%}"
            f"  {parts['start_seconds']:>6.2f} {parts['check_seconds']:>6.2f} {disk:>6.2f} {parts['cpu_seconds']:>6.2f}"
            f"  {parts['low']:.2f}..{parts['high']:.2f}"
        )
    estimates = [est for _, _, est, *_ in rows]
    if estimates:
        low, high = min(estimates), max(estimates)
        print(f"estimates: {low:.2f}..{high:.2f} s (max/min {high / low:.2f})")
    for state in ("warm", "cold"):
        ratios = [wall / est for _, s, est, wall, *_ in rows if s == state]
        if ratios:
            print(f"{state}: median measured/estimate {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
                  f"max {max(ratios):.2f})")  # fmt: skip
    print(f"load average now: {loadavg()}")


if __name__ == "__main__":
    main()
