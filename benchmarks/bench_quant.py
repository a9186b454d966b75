"""A quantized MiniMax-H3 checkpoint against its BF16 original, at the real width: bytes per rank, conversion time
and the time to a loaded model on 2 torchrun ranks, in the same run.

The two sources are written here with seeded random bytes (no weights can be downloaded): the BF16 one as the
published checkpoint lays it out (`examples.synthetic.minimax_h3_tensors`: the `_keep_in_fp32_modules` in F32),
and the FP8 one as a published fp8-scaled release of it would be: every BF16 Linear weight of the transformer and
refiner blocks float8_e4m3fn with a float32 scale beside it (per output channel, `weight_scale` [out]; or
`--granularity block`, `weight_scale_inv` over 128x128 blocks), the rest as in BF16. Conversion is
`convert-checkpoint SRC OUT --tp 2` (a whole process); load is `load_sharded` in each of 2 torchrun ranks (gloo,
CPU), timed from the call to the loaded model (`report.total_seconds`). A third row converts the BF16 source with
`--quantize fp8` (quantized at conversion: per-output-channel scales computed by preshard), against the plain
conversion of the same source. Repetitions alternate the order.

    PYTHONPATH=src python benchmarks/bench_quant.py --layers 2 --reps 2
    PYTHONPATH=src python benchmarks/bench_quant.py --forward --reps 7      # the forwards: CPU s, one thread
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GB, bench_env, loadavg, timed  # noqa: E402

QUANTIZED_PREFIXES = ("transformer_blocks.", "token_refiner.")


def fp8_tensors(tensors: dict, granularity: str) -> dict:
    """The fp8-scaled release of `tensors`: each BF16 Linear weight of the blocks in float8 with its scale."""
    out = {}
    for name, (code, shape) in tensors.items():
        if name.startswith(QUANTIZED_PREFIXES) and name.endswith(".weight") and len(shape) == 2 and code == "BF16":
            out[name] = ("F8_E4M3", shape)
            prefix = name[: -len("weight")]
            if granularity == "block":
                out[prefix + "weight_scale_inv"] = ("F32", (-(-shape[0] // 128), -(-shape[1] // 128)))
            else:
                out[prefix + "weight_scale"] = ("F32", (shape[0],))
        else:
            out[name] = (code, shape)
    return out


def rank_main(checkpoint: str, out_dir: str) -> None:
    """In each torchrun rank: load, and write what the report says."""
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    torch.set_num_threads(1)
    model = load_sharded(MiniMaxH3Transformer3DModel, checkpoint, device="cpu")
    report = model.preshard_report
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    Path(out_dir, f"rank{report.rank}.json").write_text(
        json.dumps({"total_s": report.total_seconds, "read_s": report.read_seconds, "bytes_read": report.bytes_read,
                    "held_bytes": held})
    )  # fmt: skip
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def load_job(checkpoint: Path, work: Path, env: dict[str, str]) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        os.path.abspath(__file__), "--rank-child", str(checkpoint), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise SystemExit(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["held_bytes"])
    shutil.rmtree(out, ignore_errors=True)
    return ranks


# Real-width MiniMax-H3 Linear shapes (out, in): an attention projection (hidden 5376) and the FFN down
# projection (ffn 14336 -> hidden); `--forward` times each quantized forward against the dense layer.
FORWARD_SHAPES = {"attn.to_q": (5376, 5376), "ff.down": (5376, 14336)}


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def forward_bench(reps: int, rows_list: list[int], shapes: list[str]) -> None:
    """Quantized Linear forwards (fp8 and int8, per-channel scales, and the whole-weight dequantization they
    replaced) against the same layer loaded dense (float32 weights, float32 compute), interleaved, one thread."""
    import time

    import torch

    from preshard.format.quant import QuantSpec, quantize_rows
    from preshard.format.style_forwards import dequantized_weight
    from preshard.runtime.quant import attach

    torch.set_num_threads(1)
    print(f"load average at start: {loadavg()}")
    for shape_name in shapes:
        out_f, in_f = FORWARD_SHAPES[shape_name]
        torch.manual_seed(0)
        w = torch.randn(out_f, in_f) / in_f**0.5
        layers: dict[str, object] = {}
        dense = torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False)
        for fmt, dtype_name in (("fp8", "float8_e4m3fn"), ("int8", "int8")):
            q, scale = quantize_rows(w, dtype_name)
            linear = torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False)
            linear.weight = torch.nn.Parameter(q, requires_grad=False)
            linear.register_buffer("weight_scale", scale)
            net = torch.nn.Module()
            net.m = linear
            attach(net, {"m.weight": QuantSpec("m.weight", dtype_name, "channel", "m.weight_scale", "float32")},
                   torch.float32)  # fmt: skip
            layers[fmt] = linear
            if fmt == "fp8":
                dense.weight.copy_(q.float() * scale[:, None])  # the same model, dense

        def before(x: torch.Tensor, old=layers["fp8"]) -> torch.Tensor:
            return torch.nn.functional.linear(x, dequantized_weight(old))

        runs = {
            "dense": dense,
            "fp8": layers["fp8"],
            "int8": layers["int8"],
            "fp8 whole-weight (before)": before,
        }
        for rows in rows_list:
            x = torch.randn(rows, in_f)
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            wall: dict[str, list[float]] = {k: [] for k in runs}
            with torch.no_grad():
                for fn in runs.values():
                    fn(x)  # warm
                for rep in range(reps):
                    for kind in runs if rep % 2 == 0 else reversed(list(runs)):
                        c, t = _cpu_s(), time.perf_counter()
                        runs[kind](x)
                        cpu[kind].append(_cpu_s() - c)
                        wall[kind].append(time.perf_counter() - t)
            base = statistics.median(cpu["dense"])
            print(f"\n{shape_name} [{out_f}, {in_f}], {rows} rows, medians of {reps} interleaved, load {loadavg()}")
            for kind in runs:
                med = statistics.median(cpu[kind])
                took = statistics.median(wall[kind])
                print(f"  {kind:28} CPU {med:8.4f} s ({med / base:5.2f}x dense)  wall {took:8.4f} s")
    print(f"load average at end: {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--granularity", choices=("channel", "block"), default="channel")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--forward", action="store_true", help="time quantized Linear forwards instead")
    parser.add_argument("--rows", default="64,2000", help="--forward: input rows, comma-separated")
    parser.add_argument("--shapes", default=",".join(FORWARD_SHAPES), help="--forward: which shapes")
    parser.add_argument("--rank-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank_main(args.rank_child, args.out)
        return
    if args.forward:
        forward_bench(args.reps, [int(r) for r in args.rows.split(",")], args.shapes.split(","))
        return

    from preshard.examples.synthetic import minimax_h3_tensors, total_nbytes, write_safetensors_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-quant-", dir=args.work))
    env = bench_env()
    print(f"load average at start: {loadavg()}")
    try:
        tensors, config = minimax_h3_tensors(num_layers=args.layers)
        sources = {"bf16": tensors, "fp8": fp8_tensors(tensors, args.granularity)}
        for kind, specs in sources.items():
            write_safetensors_checkpoint(work / kind, specs, config, data="random")
            print(f"{kind}: {total_nbytes(specs) / GB:.2f} GB source, {len(specs)} tensors")
        metrics = ("convert_s", "convert_cpu_s", "load_s")
        runs = {"bf16": ("bf16", ""), "fp8": ("fp8", ""), "bf16->fp8": ("bf16", " --quantize fp8")}
        results: dict[str, dict[str, list[float]]] = {k: {m: [] for m in metrics} for k in runs}
        held: dict[str, list[int]] = {}
        for rep in range(args.reps):
            for kind in runs if rep % 2 == 0 else reversed(list(runs)):
                source, extra = runs[kind]
                out = work / f"{kind.replace('->', '-q-')}-tp2"
                shutil.rmtree(out, ignore_errors=True)
                log = work / f"{out.name}.log"
                step = timed(f"convert-checkpoint {work / source} {out} --tp 2{extra}", env, log, 1800)
                results[kind]["convert_s"].append(step["wall_s"])
                results[kind]["convert_cpu_s"].append(step["user_s"] + step["sys_s"])
                ranks = load_job(out, work, env)
                results[kind]["load_s"].append(max(r["total_s"] for r in ranks))
                held[kind] = [r["held_bytes"] for r in ranks]
                print(f"rep {rep} {kind}: convert {step['wall_s']:.1f} s, load {results[kind]['load_s'][-1]:.1f} s")
        print(f"\nMiniMax-H3 real width, {args.layers} layers, tp=2, {args.granularity} scales; medians of {args.reps}")
        print(f"{'':9} {'GB per rank (max)':>18} {'convert s':>10} {'convert CPU s':>14} {'load s':>8}")
        med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
        for kind in runs:
            print(
                f"{kind:9} {max(held[kind]) / GB:>18.3f} {med[kind]['convert_s']:>10.2f} "
                f"{med[kind]['convert_cpu_s']:>14.2f} {med[kind]['load_s']:>8.2f}"
            )
        ratio = {m: med["fp8"][m] / med["bf16"][m] for m in metrics}
        print(
            f"fp8 / bf16: bytes per rank {max(held['fp8']) / max(held['bf16']):.3f}x, convert "
            f"{ratio['convert_s']:.2f}x, load {ratio['load_s']:.2f}x"
        )
        q = {m: med["bf16->fp8"][m] / med["bf16"][m] for m in metrics}
        print(
            f"bf16 --quantize fp8 / bf16 (same source): bytes per rank "
            f"{max(held['bf16->fp8']) / max(held['bf16']):.3f}x,"
            f" convert {q['convert_s']:.2f}x (CPU {q['convert_cpu_s']:.2f}x), load {q['load_s']:.2f}x"
        )
        print(f"load average at end: {loadavg()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
