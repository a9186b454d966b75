"""Benchmark: what fusing a LoRA at conversion (`convert-checkpoint --lora`) costs over the same conversion without it.

* Real shapes: MiniMax-H3 at its real width (hidden 5376, ffn 14336, AdaLN projection 96768 x 2688), --layers
  transformer blocks and --refiner refiner blocks, written by `preshard.examples.synthetic` from a repeated random
  buffer; a random bf16 LoRA of --rank on every Linear of the model in the diffusers format (`transformer.<module>.
  lora_A.weight` / `lora_B.weight` / `.alpha`).
* Whole processes: `convert-checkpoint SRC OUT --tp T --no-progress && sync`, with and without `--lora FILE`,
  alternating, every run in its own process group (interpreter start, imports, reading the LoRA through diffusers
  and the model built on the meta device included), the output removed after each run.
* Warm page cache: the source and the LoRA are read with `cat` before each run, so the ratio compares the work.
* Per step: wall time (median, min-max), user+sys CPU of the process tree, peak RSS; for the LoRA step the fusion's
  arithmetic (2 x rank x out x in multiply-adds per Linear) over the extra wall time.

    python benchmarks/bench_lora.py --layers 1 --reps 3
    python benchmarks/bench_lora.py --layers 2 --rank 128 --tp 4 --workdir /fast/disk

Disk: the source, one output and the LoRA (about 2.2x the checkpoint); the temporary folder is removed at the end.
Run it from the repository (or with PYTHONPATH pointing at src/) so that the preshard under test is the working
tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _harness import GB, MIB, bench_env, loadavg, timed, tree_bytes

PLAIN, FUSED = "convert", "convert --lora"

PREPARE = textwrap.dedent(
    """
    import json, sys
    import torch
    from safetensors.torch import save_file
    from preshard.examples.synthetic import minimax_h3_tensors, total_nbytes, write_safetensors_checkpoint
    from preshard.examples.minimax_h3 import _model_class
    src, lora, layers, refiner, rank = sys.argv[1], sys.argv[2], *[int(a) for a in sys.argv[3:6]]
    tensors, config = minimax_h3_tensors(num_layers=layers, num_refiner_layers=refiner)
    write_safetensors_checkpoint(src, tensors, config, data="random", max_shard_bytes=2 << 30)
    g = torch.Generator().manual_seed(0)
    state, flops = {}, 0
    for name, (code, shape) in tensors.items():
        if not name.endswith(".weight") or len(shape) != 2 or name.startswith(("norm", "rope")):
            continue
        module, (out, inp) = name[: -len(".weight")], shape
        state[f"transformer.{module}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp**0.5).bfloat16()
        state[f"transformer.{module}.lora_B.weight"] = (0.01 * torch.randn(out, rank, generator=g)).bfloat16()
        state[f"transformer.{module}.alpha"] = torch.tensor(float(rank))
        flops += 2 * rank * out * inp
    save_file(state, lora)
    print(json.dumps({"tensors": len(tensors), "data_bytes": total_nbytes(tensors), "modules": len(state) // 3,
                      "lora_bytes": sum(t.numel() * t.element_size() for t in state.values()), "flops": flops}))
    """
)


def report(runs: list[dict], info: dict) -> str:
    med = {s: statistics.median(r["wall_s"] for r in runs if r["step"] == s) for s in (PLAIN, FUSED)}
    head = f"{'step':<16} {'n':>2} {'wall s median [min-max]':>26} {'CPU s':>7} {'max RSS MiB':>12} {'/ convert':>9}"
    lines = [head, "-" * len(head)]
    for step in (PLAIN, FUSED):
        sel = [r for r in runs if r["step"] == step]
        walls = [r["wall_s"] for r in sel]
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in sel)
        rss = max(r["maxrss_kib"] for r in sel) * 1024
        lines.append(
            f"{step:<16} {len(sel):>2} {f'{med[step]:.2f} [{min(walls):.2f}-{max(walls):.2f}]':>26} {cpu:>7.2f} "
            f"{rss / MIB:>12.0f} {med[step] / med[PLAIN]:>9.2f}"
        )
    extra = med[FUSED] - med[PLAIN]
    rate = f"{info['flops'] / extra / 1e9:.1f} GFLOP/s over the extra wall time" if extra > 0 else "no extra time"
    lines += [
        "",
        f"LoRA: {info['modules']} Linear layers, {info['lora_bytes'] / MIB:.0f} MiB, {info['flops'] / 1e9:.0f} GFLOP "
        f"of fusion arithmetic; {rate}.",
        "wall: the whole process group from start to exit, its closing sync included; CPU s: user+sys of the",
        "tree (median); max RSS: the largest process of the tree, highest of its runs; '/ convert': ratio of medians.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks at real width (default 1)")
    parser.add_argument("--refiner", type=int, default=1, help="refiner blocks (default 1; the plan needs 1)")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (default 64)")
    parser.add_argument("--tp", type=int, default=2, help="TP degree (default 2)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions of each step (default 3)")
    parser.add_argument("--workdir", default=None, help="where to put the temporary folder (default: system temp)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a step is killed")
    parser.add_argument("--json", dest="json_path", help="write every raw number to this JSON file")
    args = parser.parse_args(argv)

    env = bench_env()
    load_before = loadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-lora-", dir=args.workdir))
    try:
        src, lora, out = root / "src", root / "lora.safetensors", root / "out"
        prepare = [sys.executable, "-c", PREPARE, str(src), str(lora), str(args.layers), str(args.refiner)]
        done = subprocess.run([*prepare, str(args.rank)], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"preparing failed:\n{done.stderr[-3000:]}")
        info = json.loads(done.stdout.strip().splitlines()[-1])
        base = f"convert-checkpoint {shlex.quote(str(src))} {shlex.quote(str(out))} --tp {args.tp} --no-progress"
        commands = {PLAIN: f"{base} && sync", FUSED: f"{base} --lora {shlex.quote(str(lora))} && sync"}
        runs = []
        warm = f"cat {shlex.quote(str(src))}/*.safetensors {shlex.quote(str(lora))} > /dev/null"
        for rep in range(args.reps):
            for step in (PLAIN, FUSED) if rep % 2 == 0 else (FUSED, PLAIN):
                subprocess.run(["bash", "-c", f"{warm} && sync"], check=True)
                result = timed(commands[step], env, root / "log.txt", args.timeout)
                result.update(step=step, rep=rep, written_bytes=tree_bytes(out))
                runs.append(result)
                shutil.rmtree(out)
        print(
            f"bench_lora: MiniMax-H3 real width, {args.layers} layer(s) + {args.refiner} refiner, {info['tensors']} "
            f"tensors, {info['data_bytes'] / GB:.2f} GB; LoRA rank {args.rank}; tp={args.tp}; {platform.node()}, "
            f"{os.cpu_count()} CPUs; load average before: {load_before}"
        )
        print(report(runs, info))
        print(f"load average after: {loadavg()}")
        if args.json_path:
            Path(args.json_path).write_text(json.dumps({"args": vars(args), "info": info, "runs": runs}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
