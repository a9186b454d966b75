"""The shard reader's two paths against a raw read of the same bytes, in one run (warm page cache).

    python benchmarks/bench_reader.py [--layers 1] [--tp 8] [--rank 0] [--reps 5] [--workdir DIR]

- raw: positional reads of exactly the byte ranges the rank reads (its chunks' records), into freshly allocated
  memory (as a load must fill newly allocated parameters);
- direct: `ShardReader` into contiguous CPU tensors (the CPU path: bytes land in the parameters themselves);
- staged: the accelerator path run on the CPU: host buffers filled by a reader thread ahead of the copies into
  the targets (on CUDA those copies are asynchronous on a side stream; here they are synchronous CPU copies, so
  this measures the pipeline's overhead and overlap on the host side, not a GPU's).

The checkpoint is MiniMax-H3 at its real width (preshard.examples.synthetic) with `--layers` layers, converted
once in a temp dir that is deleted at the end. Medians of alternating repetitions; ratios against raw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _raw(checkpoint: Path, manifest, tp_rank: int) -> float:
    chunks = sorted(
        (c for cs in manifest.chunks_for_tp_rank(tp_rank).values() for c in cs), key=lambda c: (c.file, c.offset)
    )
    fds = {name: os.open(checkpoint / name, os.O_RDONLY) for name in {c.file for c in chunks}}
    start = time.perf_counter()
    # Into fresh memory, as a load must: the first touch of newly allocated pages is part of reading a shard.
    buffer = memoryview(torch.empty(sum(c.framing.length for c in chunks), dtype=torch.uint8).numpy())
    position = 0
    for c in chunks:
        os.preadv(fds[c.file], [buffer[position : position + c.framing.length]], c.offset)
        position += c.framing.length
    elapsed = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return elapsed


def _read(checkpoint: Path, manifest, tp_rank: int, staged: bool) -> float:
    from preshard.runtime.reader import ShardReader

    start = time.perf_counter()
    targets = {
        name: torch.empty(r.layout.local_shape(manifest.tp), dtype=r.layout.dtype)
        for name, r in manifest.tensors.items()
    }
    reader = ShardReader(checkpoint, manifest, tp_rank, verify=False, pin=False)
    if staged:
        reader._direct = lambda chunk, target: False  # take the accelerator path on the CPU
    with reader:
        reader.read_all(targets)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    print("command: python benchmarks/bench_reader.py " + " ".join(sys.argv[1:]))
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")

    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint
    from preshard.format.manifest import read_manifest

    with tempfile.TemporaryDirectory(prefix="preshard-bench-reader-", dir=args.workdir) as tmp:
        root = Path(tmp)
        tensors, config = minimax_h3_tensors(num_layers=args.layers)
        write_safetensors_checkpoint(root / "src", tensors, config, data="random")
        checkpoint = root / f"tp{args.tp}"
        convert_checkpoint(root / "src", checkpoint, tp=args.tp, progress=False)
        manifest = read_manifest(checkpoint)
        rank_bytes = sum(c.framing.length for cs in manifest.chunks_for_tp_rank(args.rank).values() for c in cs)
        print(f"rank {args.rank} of tp={args.tp} reads {rank_bytes / 2**20:.0f} MiB")
        _raw(checkpoint, manifest, args.rank)  # warm the page cache
        times: dict[str, list[float]] = {"raw": [], "direct": [], "staged": []}
        steps = list(times)
        for rep in range(args.reps):
            for step in steps[rep % 3 :] + steps[: rep % 3]:  # rotate the order
                if step == "raw":
                    times[step].append(_raw(checkpoint, manifest, args.rank))
                else:
                    times[step].append(_read(checkpoint, manifest, args.rank, staged=step == "staged"))
        raw = statistics.median(times["raw"])
        print(f"{'step':<8} {'median':>8} {'min':>8} {'max':>8} {'GB/s':>6} {'/ raw':>6}")
        for step, values in times.items():
            median = statistics.median(values)
            print(
                f"{step:<8} {median:>7.3f}s {min(values):>7.3f}s {max(values):>7.3f}s "
                f"{rank_bytes / median / 1e9:>6.2f} {median / raw:>6.2f}"
            )
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
