"""Benchmark: the cost of every command per tensor, for sources of many tiny tensors.

What it answers: does any command cost more than linearly in the number of tensors? Mixture-of-experts DiTs,
LoRA-merged and quantized checkpoints (a scale per weight) have tens of thousands of tensors; a step that is
quadratic in their count (a max over every tensor recomputed per tensor, a list searched per tensor) is
invisible at the 600 tensors of a dense DiT and takes hours at 100 000.

* The source: N tiny tensors (N/4 blocks of a colwise Linear [8, 4] bf16 with its bias, a rowwise Linear [4, 8]
  fp32 and a replicated norm weight [4] fp32), in one safetensors file (or --files of them, with an index),
  written by `preshard.examples.synthetic`, with a plan file naming the two Linear patterns. Bytes are
  negligible: what is measured is the per-tensor work.
* Every command is one process, timed from start to exit (interpreter start and imports included, the same
  at every N): `preshard plan`, `convert-checkpoint --dry-run`, `convert-checkpoint --tp 2`, `preshard inspect`,
  `preshard verify`, `preshard verify --source`, `preshard reshard --tp 1`, `preshard unshard`, and a
  `load_sharded` of the tp=1 checkpoint in one process (world size 1; the model, nn.Linear modules on the
  meta device, is built before the clock: that is the user's code).
* Per command and N: wall time, CPU (user+sys of the process tree), microseconds per tensor, and the slope
  between consecutive N (the extra microseconds per extra tensor). Linear cost shows as a slope that stays
  put while N grows tenfold; a quadratic one as a slope that grows tenfold with N.

    python benchmarks/bench_tensor_count.py                          # 1 000 / 10 000 / 100 000 tensors
    python benchmarks/bench_tensor_count.py --counts 1000 10000 --commands convert verify

Disk: a few hundred MB at 100 000 tensors (the manifest dominates); the temporary folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _harness import bench_env, loadavg, timed

GENERATE = textwrap.dedent(
    """
    import json, sys
    from preshard.examples.synthetic import MANY_TENSORS_PLAN, many_tiny_tensors, write_safetensors_checkpoint
    folder, count, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tensors = many_tiny_tensors(count)
    total = sum(128 if n.endswith("out.weight") else 64 if n.endswith("proj.weight") else 16 for n in tensors)
    shard = None if files <= 1 else -(-total // files)
    write_safetensors_checkpoint(folder, tensors, {"_class_name": "ManyTensors"}, data="random", max_shard_bytes=shard)
    with open(sys.argv[4], "w") as f:
        json.dump(MANY_TENSORS_PLAN, f)
    print(len(tensors))
    """
)

# load_sharded of a tp=1 checkpoint in one process; the model (meta-device modules) is built before the clock.
LOAD = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    from preshard import load_sharded
    checkpoint, blocks = sys.argv[1], int(sys.argv[2])

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.out, self.norm = nn.Linear(4, 8), nn.Linear(8, 4, bias=False), Norm()

    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    with torch.device("meta"):
        model = Many()
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.bfloat16 if ".proj." in name else torch.float32)
    start = time.perf_counter()
    load_sharded(model, checkpoint, device="cpu")
    print(f"load_sharded {time.perf_counter() - start:.3f} s")
    """
)

COMMANDS = ("plan", "dry-run", "convert", "inspect", "verify", "verify-source", "reshard", "unshard", "load")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 10000, 100000], help="tensor counts")
    parser.add_argument("--files", type=int, default=1, help="safetensors files of the source (default 1)")
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS, help="what to time")
    parser.add_argument("--workdir", default=None, help="where to put the temporary folder (default: system temp)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a step is killed")
    parser.add_argument("--json", dest="json_path", help="write every raw number to this JSON file")
    args = parser.parse_args(argv)
    counts = sorted(set(args.counts))
    commands = [c for c in COMMANDS if c in args.commands]
    needs = {"inspect", "verify", "verify-source", "reshard", "unshard", "load"}
    if needs & set(commands) and "convert" not in commands:
        commands.insert(commands.index(next(c for c in COMMANDS if c in needs)), "convert")
    if "load" in commands and "reshard" not in commands:
        commands.insert(commands.index("load"), "reshard")

    command = shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])])
    print(f"command: {command}")
    print(f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}")
    load_start = loadavg()
    print(f"loadavg at start: {load_start}", flush=True)
    env = bench_env()
    tool = shlex.join([sys.executable, "-c", "from preshard.cli import main; main()"])
    q = shlex.quote
    root = Path(tempfile.mkdtemp(prefix="bench_tensor_count-", dir=args.workdir))
    runs: list[dict] = []
    try:
        for count in counts:
            src, plan = root / f"src{count}", root / f"plan{count}.json"
            out, tp1, rebuilt = root / f"tp2-{count}", root / f"tp1-{count}", root / f"unshard-{count}"
            t0 = time.perf_counter()
            gen = subprocess.run(
                [sys.executable, "-c", GENERATE, str(src), str(count), str(args.files), str(plan)],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            if gen.returncode:
                raise SystemExit(f"writing the source failed:\n{gen.stderr[-3000:]}")
            n = int(gen.stdout.split()[-1])
            print(f"\n{n} tensors: source written in {time.perf_counter() - t0:.1f} s", flush=True)
            steps = {
                "plan": f"{tool} plan {q(str(src))} --plan {q(str(plan))} --devices 2",
                "dry-run": f"{tool} convert {q(str(src))} {q(str(out))} --tp 2 --plan {q(str(plan))} --dry-run",
                "convert": f"{tool} convert {q(str(src))} {q(str(out))} --tp 2 --plan {q(str(plan))} --no-progress",
                "inspect": f"{tool} inspect {q(str(out))}",
                "verify": f"{tool} verify {q(str(out))} --no-progress",
                "verify-source": f"{tool} verify {q(str(out))} --source {q(str(src))} --no-progress",
                "reshard": f"{tool} reshard {q(str(out))} {q(str(tp1))} --tp 1 --no-progress",
                "unshard": f"{tool} unshard {q(str(out))} {q(str(rebuilt))} --no-progress",
                "load": shlex.join([sys.executable, "-c", LOAD, str(tp1), str(n // 4)]),
            }
            for step in commands:
                load = loadavg()
                result = timed(steps[step], env, root / "step.log", args.timeout)
                cpu = result["user_s"] + result["sys_s"]
                runs.append({"count": n, "step": step, "loadavg_before": load, **result})
                print(
                    f"  {step:<14} {result['wall_s']:8.2f} s  cpu {cpu:7.2f} s  "
                    f"{result['wall_s'] / n * 1e6:8.1f} us/tensor  load {load.split()[0]}",
                    flush=True,
                )
            shutil.rmtree(rebuilt, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
            for folder in (out, tp1):
                shutil.rmtree(folder, ignore_errors=True)
        print()
        print(report(runs, commands))
        load_end = loadavg()
        print(f"\nloadavg at start: {load_start}\nloadavg at end:   {load_end}")
        if args.json_path:
            record = {"command": command, "args": vars(args), "cpus": os.cpu_count(), "loadavg_start": load_start,
                      "loadavg_end": load_end, "runs": runs}  # fmt: skip
            Path(args.json_path).write_text(json.dumps(record, indent=1) + "\n")
            print(f"raw numbers: {args.json_path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report(runs: list[dict], commands: list[str]) -> str:
    counts = sorted({r["count"] for r in runs})
    by = {(r["step"], r["count"]): r for r in runs}
    head = (
        f"{'command':<14} {'tensors':>8} {'wall s':>8} {'CPU s':>8} {'wall us/tensor':>15} {'slope wall us':>14} "
        f"{'slope CPU us':>13}"
    )
    lines = [head, "-" * len(head)]
    for step in commands:
        previous = None
        for n in counts:
            r = by.get((step, n))
            if r is None:
                continue
            cpu = r["user_s"] + r["sys_s"]
            slope = slope_cpu = ""
            if previous is not None:
                extra = n - previous["count"]
                slope = f"{(r['wall_s'] - previous['wall_s']) / extra * 1e6:.1f}"
                slope_cpu = f"{(cpu - previous['user_s'] - previous['sys_s']) / extra * 1e6:.1f}"
            lines.append(
                f"{step:<14} {n:>8} {r['wall_s']:>8.2f} {cpu:>8.2f} {r['wall_s'] / n * 1e6:>15.1f} {slope:>14} "
                f"{slope_cpu:>13}"
            )
            previous = r
    lines += [
        "",
        "wall: the whole process from start to exit (interpreter start and imports included); CPU: user+sys of",
        "the process tree. slope: extra microseconds (wall, CPU) per extra tensor from the previous count; a",
        "linear command keeps it roughly constant as the count grows tenfold (CPU is the steadier on a loaded",
        "machine).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
