"""A rank's fetch from an S3 server (preshard's ranged, verified fetch into its rank folder) against a plain parallel
download of the same byte ranges (the same number of threads, into memory, no check, nothing written).

The server is moto's S3 server behind the test proxy (tests/support/s3_server.py), in a process of its own, so the
CPU seconds measured here are the client's alone. The checkpoint is MiniMax-H3 at its real width
(`preshard.examples.synthetic`), converted locally into s3:// by `convert_checkpoint` (staged, manifest last).
Repetitions alternate the two, each fetch into a fresh cache folder.

    PYTHONPATH=src python benchmarks/bench_s3.py --layers 1 --refiner-layers 1 --tp 4 --rank 1 --reps 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
BUCKET = "bench"


def _serve(queue, stop) -> None:
    from s3_server import S3Server

    with S3Server() as server:
        server.bucket(BUCKET)
        queue.put(server.env())
        stop.wait()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _plain(store, manifest, rank: int, workers: int) -> int:
    ranges = [
        (c.file, c.offset, c.offset + c.load_bytes) for cs in manifest.chunks_for_tp_rank(rank).values() for c in cs
    ]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return sum(pool.map(lambda r: len(store.fs.cat_file(store.path(r[0]), start=r[1], end=r[2])), ranges))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--refiner-layers", type=int, default=1)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(queue, stop), daemon=True)
    server.start()
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    try:
        os.environ.update(queue.get(timeout=120))
        os.environ["PRESHARD_CACHE"] = str(work / "cache")
        from preshard.converter.convert import convert_checkpoint
        from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint
        from preshard.format.object_store import open_store
        from preshard.runtime.object_rank import fetch_rank_checkpoint, fetch_workers

        tensors, config = minimax_h3_tensors(num_layers=args.layers, num_refiner_layers=args.refiner_layers)
        write_safetensors_checkpoint(work / "src", tensors, config, data="random", max_shard_bytes=2 << 30)
        url = f"s3://{BUCKET}/h3-tp{args.tp}"
        started = time.perf_counter()
        manifest = convert_checkpoint(work / "src", url, tp=args.tp, progress=False)
        print(f"converted into {url} in {time.perf_counter() - started:.1f} s")
        shutil.rmtree(work / "src")
        store = open_store(url)
        share = manifest.read_bytes(args.rank)
        total = sum(f.size for f in manifest.files)
        print(f"rank {args.rank} share {share / 1e9:.3f} GB of {total / 1e9:.3f} GB; load {os.getloadavg()}")
        rows: dict[str, list[tuple[float, float]]] = {"preshard fetch": [], "plain parallel download": []}
        for rep in range(args.reps):
            for name in rows:
                shutil.rmtree(work / "cache", ignore_errors=True)
                cpu, wall = _cpu(), time.perf_counter()
                if name == "preshard fetch":
                    got = fetch_rank_checkpoint(url, tp_rank=args.rank).stats.bytes_read
                else:
                    got = _plain(store, manifest, args.rank, fetch_workers())
                rows[name].append((time.perf_counter() - wall, _cpu() - cpu))
                assert got == share, (name, got, share)
                print(f"rep {rep} {name}: {rows[name][-1][0]:.2f} s wall, {rows[name][-1][1]:.2f} CPU s")
        print(f"load average after: {os.getloadavg()}")
        print("\n| | wall s (median) | CPU s (median) | GB/s | CPU s/GB |\n|---|---|---|---|---|")
        for name, values in rows.items():
            wall = statistics.median(v[0] for v in values)
            cpu = statistics.median(v[1] for v in values)
            print(f"| {name} | {wall:.2f} | {cpu:.2f} | {share / 1e9 / wall:.3f} | {cpu / (share / 1e9):.2f} |")
    finally:
        stop.set()
        server.join(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
