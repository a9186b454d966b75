"""Benchmark: what dropping padded keys costs in CP attention, against masking them, and the ring block kernel.

One process, one thread (a CP rank's share of the cores; timed as wall clock and as the thread's CPU time, which
other jobs on the machine disturb much less), float32, q/k/v `[1, heads, rows, head_dim]` as a rank
holds them after the Ulysses exchange (default 8 heads of 64: 16 heads over ulysses=2; 2000 + 256 rows: image and
text of a Flux-like joint attention). Variants, alternating, median of --reps each:

  sdpa           plain SDPA over all keys, no mask (an even length: nothing to drop)
  sdpa+mask      the same with an additive mask that masks nothing (what a masking design pays at an even length)
  drop 2 rows    the padding of two joined sequences dropped as preshard does (one key row of each sequence is
                 padding: the real runs are concatenated, then plain SDPA over the real keys)
  mask 2 rows    the same two rows masked instead (additive -inf mask over all keys)
  ring kernel    one ring step on the fused kernel that returns the log-sum-exp (what each ring step now runs)
  ring kernel+key mask  the same step with a key mask (a text padding mask: the block's last quarter masked), as
                 a ring step of HunyuanVideo's masked joint attention runs it
  ring math      the same step on the float32 math path ring attention used before

    python benchmarks/bench_cp_attention.py
    python benchmarks/bench_cp_attention.py --heads 16 --rows 4096 --text 512 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from preshard.runtime import cp_attention as CPA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2000, help="image rows")
    parser.add_argument("--text", type=int, default=256, help="text rows, joined before the image rows")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    n = args.text + args.rows
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=g) for _ in range(3))
    scale = args.head_dim**-0.5
    no_mask = torch.zeros(1, 1, 1, n)
    runs = [(0, args.text - 1), (args.text, n - 1)]  # each sequence's last row is padding
    two_rows = torch.zeros(1, 1, 1, n)
    two_rows[..., args.text - 1] = two_rows[..., n - 1] = float("-inf")
    half = n // 2
    key_mask = torch.arange(half) < half - half // 4  # [Lk]: the last quarter of the block's keys masked
    key_mask = key_mask[None, None, None, :]

    variants = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "sdpa+mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=no_mask, scale=scale),
        "drop 2 rows": lambda: F.scaled_dot_product_attention(
            q, CPA._select_rows(k, runs), CPA._select_rows(v, runs), scale=scale
        ),
        "mask 2 rows": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=two_rows, scale=scale),
        "ring kernel": lambda: CPA.block_attention_with_lse(q[:, :, :half], k[:, :, :half], v[:, :, :half], scale),
        "ring kernel+key mask": lambda: CPA.block_attention_with_lse(
            q[:, :, :half], k[:, :, :half], v[:, :, :half], scale, key_mask
        ),
        "ring math": lambda: CPA._attention_f32(q[:, :, :half], k[:, :, :half], v[:, :, :half], None, scale),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm up
        for rep in range(args.reps):
            names = list(variants)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                t0, c0 = time.perf_counter(), time.thread_time()
                variants[name]()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
    ref, cpu_ref = statistics.median(times["sdpa"]), statistics.median(cpu["sdpa"])
    print(f"q/k/v [1, {args.heads}, {n}, {args.head_dim}] float32, {args.threads} thread(s), {args.reps} reps")
    print("| variant | wall ms (median) | / sdpa | CPU ms (median) | / sdpa |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        note = f" (queries and keys {half})" if name.startswith("ring") else ""
        wall, c = statistics.median(ts), statistics.median(cpu[name])
        print(f"| {name}{note} | {1000 * wall:.1f} | {wall / ref:.2f} | {1000 * c:.1f} | {c / cpu_ref:.2f} |")
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}")


if __name__ == "__main__":
    main()
