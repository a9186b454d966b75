"""Benchmark: time from process start to the first compiled forward, cold against warm (the checkpoint's compile
cache, preshard.runtime.compile_cache).

The tiny MiniMax-H3 (or --hidden/--heads/--layers/--ffn for a wider one) is converted at --tp in a temporary folder.
Each run is a fresh torchrun job of --tp gloo ranks: import, `load_sharded(..., compile=CompileOptions(cache=C))`,
one forward under no_grad at --rows packed rows. Every run starts with an empty inductor cache folder of its own
(TORCHINDUCTOR_CACHE_DIR), so nothing is reused but what the compile cache holds:

  cold   C is an empty folder: the ranks compile everything (and write their entries)
  warm   C holds the entries one untimed cold run wrote before the timed runs: the ranks load them

Runs alternate (cold, warm, warm, cold, ...). Per run: the wall time from the launch to the slowest rank's first
compiled forward returning, the whole job's wall (to exit), and its CPU seconds (user + sys of torchrun, the ranks
and the C++ compilers they run); the medians, and warm / cold of each. The load average is printed before and
after.

    python benchmarks/bench_compile_cache.py                    # tiny H3, tp2, 7 runs of each
    python benchmarks/bench_compile_cache.py --runs 3
    python benchmarks/bench_compile_cache.py --hidden 3072 --heads 24 --ffn 8192 --layers 2 --runs 3  # wider
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import bench_env, loadavg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_job(checkpoint: str, cache: str, out: str, rows: int) -> None:
    """One rank: load compiled, one forward; report when it returned (seconds since the launch) and the counters."""
    import torch
    import torch.distributed as dist

    from preshard.examples.minimax_h3 import make_inputs, model_class
    from preshard.runtime.compile_cache import CompileOptions
    from preshard.runtime.load import load_sharded

    net = load_sharded(model_class(), checkpoint, compile=CompileOptions(cache=cache))
    config = dict(json.loads((Path(checkpoint) / "config.json").read_text()))
    loaded = time.time() - float(os.environ["BENCH_LAUNCH_T"])
    with torch.no_grad():
        net(**make_inputs(config, rows), return_dict=False)
    dist.barrier()
    first = time.time() - float(os.environ["BENCH_LAUNCH_T"])
    counters = torch._dynamo.utils.counters
    rank = dist.get_rank()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "loaded_s": loaded,
                "first_forward_s": first,
                "inductor": dict(counters["inductor"]),
                "aot_autograd": dict(counters["aot_autograd"]),
            }
        )
    )


def run_job(checkpoint: Path, cache: Path, tp: int, rows: int, work: Path, env: dict[str, str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
    inductor = Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(tp),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        os.path.abspath(__file__), "--rank-job", str(checkpoint), "--cache", str(cache), "--out", str(out),
        "--rows", str(rows),
    ]  # fmt: skip
    launch = time.time()
    env = {**env, "BENCH_LAUNCH_T": repr(launch), "TORCHINDUCTOR_CACHE_DIR": str(inductor), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"torchrun failed:\n{log[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(inductor, ignore_errors=True)
    return {
        "first_forward_s": max(r["first_forward_s"] for r in ranks),
        "loaded_s": max(r["loaded_s"] for r in ranks),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "fxgraph_hits": sum(r["inductor"].get("fxgraph_cache_hit", 0) for r in ranks),
        "fxgraph_misses": sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in ranks),
        "warned": "compile cache:" in log,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each, cold and warm (default 7)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", type=int, default=37, help="packed rows of the forward (default 37)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args.rank_job, args.cache, args.out, args.rows)
        return

    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.minimax_h3 import build_model, save_checkpoint, tiny_config

    overrides = {}
    if args.hidden:
        heads = args.heads or 24
        overrides.update(num_attention_heads=heads, attention_head_dim=args.hidden // heads)
    for name, value in (("num_layers", args.layers), ("ffn_dim", args.ffn)):
        if value:
            overrides[name] = value
    work = Path(tempfile.mkdtemp(prefix="bench-compile-cache-"))
    try:
        env = bench_env(XDG_CACHE_HOME=str(work / "user-cache"))  # this run's HMAC secret, not the user's
        source = save_checkpoint(build_model(tiny_config(**overrides), dtype="float32"), work / "source")
        checkpoint = work / "tp"
        convert_checkpoint(source, checkpoint, tp=args.tp, progress=False)
        print(f"load before: {loadavg()}; tp={args.tp}, rows={args.rows}, {overrides or 'tiny config'}", flush=True)
        warm_cache = work / "warm-cache"
        prep = run_job(checkpoint, warm_cache, args.tp, args.rows, work, env)
        print(f"prep (cold, untimed): first forward {prep['first_forward_s']:.1f}s, cpu {prep['cpu_s']:.1f}s")
        results: dict[str, list[dict]] = {"cold": [], "warm": []}
        for i in range(args.runs):
            for kind in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                cache = warm_cache if kind == "warm" else work / f"cold-{i}"
                run = run_job(checkpoint, cache, args.tp, args.rows, work, env)
                shutil.rmtree(work / f"cold-{i}", ignore_errors=True)
                results[kind].append(run)
                print(
                    f"run {i} {kind}: first forward {run['first_forward_s']:6.1f}s  load {run['loaded_s']:5.1f}s  "
                    f"job wall {run['wall_s']:6.1f}s  cpu {run['cpu_s']:6.1f}s  fxgraph hits {run['fxgraph_hits']} "
                    f"misses {run['fxgraph_misses']}  load avg {loadavg().split()[0]}",
                    flush=True,
                )
        print(f"load after: {loadavg()}")
        print(f"{'':6} {'first fwd s':>12} {'job wall s':>11} {'cpu s':>8}   (medians of {args.runs})")
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("first_forward_s", "wall_s", "cpu_s")}
               for k, v in results.items()}  # fmt: skip
        for kind, m in med.items():
            print(f"{kind:6} {m['first_forward_s']:12.1f} {m['wall_s']:11.1f} {m['cpu_s']:8.1f}")
        ratio = {m: med["warm"][m] / med["cold"][m] for m in med["warm"]}
        print(
            f"warm/cold {ratio['first_forward_s']:9.2f}x {ratio['wall_s']:10.2f}x {ratio['cpu_s']:7.2f}x   (goal: "
            "first forward <= 0.25x)"
        )
        pairs = [w["first_forward_s"] / c["first_forward_s"] for w, c in zip(results["warm"], results["cold"])]
        print("per-run warm/cold (first forward): " + ", ".join(f"{p:.2f}" for p in pairs))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
