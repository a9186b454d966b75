"""Benchmark: `preshard reshard` and `preshard unshard` against `cp -r` + `sync` of the same checkpoint.

What it answers: how much more than copying the checkpoint does it cost to change its TP degree (every sharded
tensor re-sliced), to change only its CP layout (links and a manifest), and to rebuild the original safetensors?

* Real shapes: MiniMax-H3 at its real width (hidden 5376, 56 heads, ffn 14336; the largest tensor, an AdaLN
  projection, is 96768 x 2688 bf16 = 496 MiB), --layers transformer blocks and --refiner refiner blocks, written by
  `preshard.examples.synthetic` from a repeated random buffer and converted to --tp-from by a child process; the
  source is then deleted (resharding does not need it).
* Whole processes, both sides synced: every step is one shell command in its own process group, timed from start
  to exit: `cp -r IN COPY && sync`, `preshard reshard IN OUT --tp T --no-progress && sync` (interpreter start and
  imports included), the CP-only `preshard reshard IN OUT --tp FROM --cp C && sync`, `preshard unshard IN OUT &&
  sync`. The machine is synced before each step outside the clock, and the step's output removed after it.
* With --convert, the source is kept and converting it to --tp-to directly is timed as well: the cost of the
  alternative to resharding, when the source is still there.
* Warm page cache: the input (and the source) is read with `cat` before each step, so every step reads from
  memory and the ratios compare the work, not the disk. Repetitions rotate the step order so drift in the
  machine's load spreads over all steps.
* Per step: wall time (median, min-max), user+sys CPU of the process tree, peak RSS (os.wait4's ru_maxrss: the
  largest process of the tree; this driver imports neither torch nor preshard, so none is inherited).

    python benchmarks/bench_reshard.py --layers 1 --reps 3 --convert
    python benchmarks/bench_reshard.py --layers 2 --tp-from 8 --tp-to 4 --cp 2 --json out.json --workdir /fast/disk

Disk: the converted input plus one step's output (about 2x the checkpoint) at a time, and the source while the
input is being converted (all along with --convert); the temporary folder is removed at the end. Run it from
the repository (or with PYTHONPATH pointing at src/) so that the preshard under test is the working tree's.
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
import time
from pathlib import Path

from _harness import GB, GIB, MIB, bench_env, loadavg, timed, tree_bytes

CP = "cp -r + sync"

# Runs in a child so that this driver stays small (ru_maxrss of a child would otherwise start at the driver's).
PREPARE = textwrap.dedent(
    """
    import json, shutil, sys
    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.synthetic import minimax_h3_tensors, tensor_nbytes, total_nbytes
    from preshard.examples.synthetic import write_safetensors_checkpoint
    src, out, layers, refiner, tp, shard, keep = sys.argv[1:3] + [int(a) for a in sys.argv[3:8]]
    tensors, config = minimax_h3_tensors(num_layers=layers, num_refiner_layers=refiner)
    paths = write_safetensors_checkpoint(src, tensors, config, data="random", max_shard_bytes=shard)
    convert_checkpoint(src, out, tp=tp, progress=False)
    if not keep:
        shutil.rmtree(src)
    name = max(tensors, key=lambda n: tensor_nbytes(tensors[n]))
    print(json.dumps({
        "tensors": len(tensors), "data_bytes": total_nbytes(tensors), "source_files": len(paths), "largest": name,
        "largest_bytes": tensor_nbytes(tensors[name]), "hidden": config["hidden_size"],
    }))
    """
)


def report(runs: list[dict], input_bytes: int, largest_bytes: int) -> str:
    steps = list(dict.fromkeys(r["step"] for r in runs))
    med = {s: statistics.median(r["wall_s"] for r in runs if r["step"] == s) for s in steps}
    convert = next((s for s in steps if s.startswith("convert")), None)
    head = (
        f"{'step':<28} {'n':>2} {'wall s median [min-max]':>26} {'GB/s':>6} {'CPU s':>7} {'CPU s/GB':>8} "
        f"{'max RSS MiB':>12} {'over largest':>12} {'written GB':>10} {'/ cp+sync':>9} {'/ convert':>9}"
    )
    lines = [head, "-" * len(head)]
    for step in steps:
        sel = [r for r in runs if r["step"] == step]
        walls = [r["wall_s"] for r in sel]
        wall = statistics.median(walls)
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in sel)
        rss = max(r["maxrss_kib"] for r in sel) * 1024
        over = "" if step == CP else f"{(rss - largest_bytes) / MIB:+.0f}"
        written = statistics.median(r["written_bytes"] for r in sel)
        ratio = "" if step == CP else f"{wall / med[CP]:.2f}"
        to_convert = f"{wall / med[convert]:.2f}" if convert and step.startswith("reshard tp") else ""
        lines.append(
            f"{step:<28} {len(sel):>2} {f'{wall:.2f} [{min(walls):.2f}-{max(walls):.2f}]':>26} "
            f"{input_bytes / GB / wall:>6.2f} {cpu:>7.2f} {cpu / (input_bytes / GB):>8.2f} {rss / MIB:>12.0f} "
            f"{over:>12} {written / GB:>10.2f} {ratio:>9} {to_convert:>9}"
        )
    lines += [
        "",
        "wall: the whole process group from start to exit, its closing sync included. GB/s over the input",
        "checkpoint's bytes (1e9). CPU s: user+sys of the process tree (median). max RSS: the largest process of",
        "the step's tree, highest of its runs; 'over largest' subtracts the largest tensor. written GB: bytes in",
        "the step's output folder (hard links counted at full size). CPU s/GB: over the input's bytes. '/ cp+sync'",
        "and '/ convert' (a TP reshard against converting the source straight to the new TP degree): ratios of",
        "medians.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks at real width (default 1)")
    parser.add_argument("--refiner", type=int, default=1, help="refiner blocks (default 1; the plan needs 1)")
    parser.add_argument("--tp-from", type=int, default=4, help="TP degree of the input checkpoint (default 4)")
    parser.add_argument("--tp-to", type=int, default=2, help="TP degree to reshard to (default 2)")
    parser.add_argument("--cp", type=int, default=2, help="CP degree of the CP-only reshard (default 2)")
    parser.add_argument("--reps", type=int, default=3, help="rotating repetitions of every step (default 3)")
    parser.add_argument("--shard-mib", type=int, default=2048, help="max source safetensors file size")
    parser.add_argument("--no-unshard", action="store_true", help="skip the unshard step")
    parser.add_argument(
        "--convert", action="store_true", help="keep the source and also time converting it to --tp-to (+1x disk)"
    )
    parser.add_argument("--workdir", default=None, help="where to put the temporary folder (default: system temp)")
    parser.add_argument("--max-disk-gb", type=float, default=12.0, help="refuse to need more disk (default 12)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a step is killed")
    parser.add_argument("--json", dest="json_path", help="write every raw number to this JSON file")
    args = parser.parse_args(argv)
    if args.layers < 0 or args.reps < 1 or args.tp_from == args.tp_to:
        parser.error("--layers must be >= 0, --reps >= 1, and --tp-to must differ from --tp-from")

    command = shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])])
    print(f"command: {command}")
    env = bench_env()
    load_start = loadavg()
    print(f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}")
    print(f"loadavg at start: {load_start}")
    preshard = [sys.executable, "-c", "from preshard.cli import main; main()"]

    root = Path(tempfile.mkdtemp(prefix="bench_reshard-", dir=args.workdir))
    runs: list[dict] = []
    try:
        src, given, out = root / "transformer", root / f"tp{args.tp_from}", root / "out"
        t0 = time.perf_counter()
        prep = subprocess.run(
            [sys.executable, "-c", PREPARE, str(src), str(given), str(args.layers), str(args.refiner),
             str(args.tp_from), str(args.shard_mib * MIB), str(int(args.convert))],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if prep.returncode:
            raise SystemExit(f"writing and converting the checkpoint failed:\n{prep.stderr[-3000:]}")
        info = json.loads(prep.stdout.strip().splitlines()[-1])
        input_bytes = tree_bytes(given)
        need = (3 if args.convert else 2) * input_bytes
        if need > args.max_disk_gb * GB:
            raise SystemExit(f"needs ~{need / GB:.1f} GB of disk (input, one output, source) > --max-disk-gb")
        print(
            f"input: MiniMax-H3 real width (hidden {info['hidden']}), {args.layers} transformer + {args.refiner} "
            f"refiner blocks, {info['tensors']} tensors, converted for tp={args.tp_from}: {input_bytes / GIB:.3f} GiB "
            f"in {len(list(given.glob('*.distcp')))} data files; largest tensor {info['largest']} "
            f"{info['largest_bytes'] / MIB:.0f} MiB; prepared in {time.perf_counter() - t0:.1f} s "
            + ("(source kept for the convert step)" if args.convert else "(source deleted)")
        )
        q = shlex.quote
        tool = shlex.join(preshard)
        steps = {
            CP: f"cp -r {q(str(given))} {q(str(out))} && sync",
            f"reshard tp{args.tp_from} -> tp{args.tp_to}": (
                f"{tool} reshard {q(str(given))} {q(str(out))} --tp {args.tp_to} --no-progress && sync"
            ),
            f"reshard cp-only (cp {args.cp})": (
                f"{tool} reshard {q(str(given))} {q(str(out))} --tp {args.tp_from} --cp {args.cp} && sync"
            ),
        }
        if args.convert:
            steps[f"convert source -> tp{args.tp_to}"] = (
                f"{tool} convert {q(str(src))} {q(str(out))} --tp {args.tp_to} --no-progress && sync"
            )
        if not args.no_unshard:
            steps["unshard"] = f"{tool} unshard {q(str(given))} {q(str(out))} --no-progress && sync"
        print(f"steps: {json.dumps(steps, indent=1)}", flush=True)
        files = " ".join(q(str(p)) for p in sorted(given.iterdir()))
        if args.convert:
            files += " " + " ".join(q(str(p)) for p in sorted(src.iterdir()))
        names = list(steps)
        for rep in range(args.reps):
            k = rep % len(names)
            for position, step in enumerate(names[k:] + names[:k]):
                subprocess.run(["bash", "-c", f"cat {files} > /dev/null"], check=True)
                os.sync()
                load = loadavg()
                result = timed(steps[step], env, root / "step.log", args.timeout)
                written = tree_bytes(out)
                shutil.rmtree(out, ignore_errors=True)
                run = {"rep": rep, "position": position, "step": step, "loadavg_before": load}
                run.update(result, written_bytes=written)
                runs.append(run)
                print(
                    f"rep {rep} {step:<28} {result['wall_s']:8.2f} s  cpu {result['user_s'] + result['sys_s']:7.2f} s"
                    f"  rss {result['maxrss_kib'] / 1024:6.0f} MiB  load {load.split()[0]}",
                    flush=True,
                )
        load_end = loadavg()
        print()
        print(report(runs, input_bytes, info["largest_bytes"]))
        print(f"\nloadavg at start: {load_start}\nloadavg at end:   {load_end}")
        if args.json_path:
            record = {
                "command": command, "args": vars(args), "cpus": os.cpu_count(), "platform": platform.platform(),
                "loadavg_start": load_start, "loadavg_end": load_end, "input": {**info, "bytes": input_bytes},
                "steps": steps, "runs": runs,
            }  # fmt: skip
            Path(args.json_path).write_text(json.dumps(record, indent=1) + "\n")
            print(f"raw numbers: {args.json_path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
