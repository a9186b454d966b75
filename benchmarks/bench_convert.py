"""Benchmark: convert-checkpoint against `cp -r` + `sync` and a plain read, on MiniMax-H3's real shapes.

Why it is built this way (each point is a way an earlier version of this benchmark flattered or
penalised the converter):

* Real shapes. The source is MiniMax-H3 at its real width (hidden 5376, 56 heads, ffn 14336, AdaLN
  projection 96768 x 2688 bf16 = 496 MiB, float32 where the published checkpoint keeps float32) with
  --layers transformer blocks plus both refiner blocks, written by `preshard.examples.synthetic` from a
  repeated random buffer (no model is instantiated). Memory and per-tensor costs scale with these shapes.
* Whole processes, both sides synced. Every step is one shell command in its own process group, timed
  from its start to its exit: `cp -r SRC DST && sync`, `cat SRC/* > /dev/null`, and
  `convert-checkpoint SRC OUT --tp T --cp C --no-progress && sync` (interpreter start and imports included).
  Before each step the machine is synced outside the clock, so no step pays for another's dirty pages.
* Alternating repetitions. Each --reps repetition runs every step once, in an order that rotates from
  repetition to repetition, warm and cold interleaved, so drift in the machine's load or the disk's
  state is spread over all steps instead of landing on one.
* Warm and cold. Warm: the source is read with cat first (and the imports warmed after a cache drop).
  Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before the step, only where that file can be
  written (else cold runs are skipped and the output says so).
* Per step: wall time; user+sys CPU of the whole process tree (os.wait4 on the shell, which has waited
  for its children); peak RSS (wait4's ru_maxrss: the largest process of the tree, i.e. the converter);
  GB/s and CPU seconds per GB over the source bytes (GB = 1e9 bytes). This driver imports neither torch
  nor preshard (the checkpoint is written by a child), so ru_maxrss does not inherit its footprint.
* --workers P runs are added for each P when `convert-checkpoint --help` offers --workers.
* The fixed cost: `import torch` alone, and converting the tiny embedded MiniMax-H3 (52 tensors, 0.4 MB) are
  timed too; their CPU difference is the conversion's fixed CPU over `import torch` (interpreter, imports, plan,
  commit), and the data path's CPU s/GB is the big conversion's CPU minus the tiny one's, over its bytes.
* --model-check adds a conversion with a copy of the built-in plan as a plan file (its description edited: the
  same rules, but not the plan as shipped, so not vouched for): the plan is then checked against the model class
  (diffusers imported, the model built on the meta device) on a thread while converting: what that costs.
* --busy N [M ...] runs N (then M, ...) processes spinning on the CPU during every step, cp included ("with
  another job running"), each count a table of its own, alternating with the others within each repetition.

    python benchmarks/bench_convert.py --layers 2 --reps 5 --tp 8 --cp 4 --workers --no-cold --model-check --busy 0 1
    python benchmarks/bench_convert.py --layers 2 --reps 3 --tp 8 --cp 4 --workers 2 4
    python benchmarks/bench_convert.py --layers 1 --reps 1 --no-cold --json out.json --workdir /fast/disk

Disk: the source, one converter output and one cp copy at most (about 3x the source); the temporary
folder is removed at the end. Run it from the repository (or with PYTHONPATH pointing at src/) so that
the converter under test is the working tree's.
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

from _harness import GB, GIB, MIB, bench_env, cold_possible, drop_caches, loadavg, timed, tree_bytes

# Runs in a child so this driver stays small (its peak RSS would otherwise be inherited by ru_maxrss).
GENERATE = textwrap.dedent(
    """
    import json, sys
    from preshard.examples.synthetic import minimax_h3_tensors, tensor_nbytes, total_nbytes
    from preshard.examples.synthetic import write_safetensors_checkpoint
    folder, layers, shard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tensors, config = minimax_h3_tensors(num_layers=layers)
    paths = write_safetensors_checkpoint(folder, tensors, config, data="random", max_shard_bytes=shard)
    name = max(tensors, key=lambda n: tensor_nbytes(tensors[n]))
    print(json.dumps({
        "tensors": len(tensors), "data_bytes": total_nbytes(tensors), "files": [p.name for p in paths],
        "largest": name, "largest_shape": tensors[name][1], "largest_dtype": tensors[name][0],
        "largest_bytes": tensor_nbytes(tensors[name]), "hidden": config["hidden_size"],
        "heads": config["num_attention_heads"], "ffn": config["ffn_dim"], "refiner": config["num_refiner_layers"],
    }))
    """
)
CP = "cp -r + sync"
IMPORTS = "import preshard.cli, preshard.converter.convert"
TORCH = "import torch"
TINY = "convert tiny (52 tensors)"
MODEL_CHECK = "convert, model check"
TINY_SOURCE = textwrap.dedent(
    """
    import sys
    from preshard.examples.minimax_h3 import build_model, save_checkpoint
    save_checkpoint(build_model(dtype="mixed", seed=0), sys.argv[1])
    """
)
REFERENCES = ("imports", TORCH, TINY)  # not compared with cp or the read
PLAN_FILE = textwrap.dedent(
    """
    import json, sys
    from importlib import resources
    plan = json.loads((resources.files("preshard.plans") / "builtin" / "minimax-h3.json").read_text())
    plan["description"] += " (a copy: not the plan as shipped, so it is checked against the model class)"
    open(sys.argv[1], "w").write(json.dumps(plan))
    """
)


def _convert_command(env: dict[str, str]) -> list[str]:
    script = Path(sys.executable).parent / "convert-checkpoint"
    if script.is_file():
        return [str(script)]
    found = shutil.which("convert-checkpoint", path=env.get("PATH"))
    if found:
        return [found]
    return [sys.executable, "-c", "from preshard.cli import convert_checkpoint_command; convert_checkpoint_command()"]


def _own_peak_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _quiet(cmd: str, env: dict[str, str]) -> None:
    subprocess.run(["bash", "-c", cmd], env=env, check=True, stdout=subprocess.DEVNULL)


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _label(cache: str, busy: int) -> str:
    return cache if not busy else f"{cache}, {busy} busy"


def report(runs: list[dict], source_bytes: int, largest_bytes: int, modes: list[tuple[str, int]]) -> str:
    lines = []
    steps = list(dict.fromkeys(r["step"] for r in runs))
    for cache, busy in modes:
        rows = [r for r in runs if r["mode"] == _label(cache, busy)]
        if not rows:
            continue
        med = {s: statistics.median(r["wall_s"] for r in rows if r["step"] == s) for s in steps}
        held = "dropped before each step" if cache == "cold" else "holding the source"
        other = f"; {busy} other process(es) spinning on the CPU throughout" if busy else "; no other job of ours"
        lines.append(f"\n{_label(cache, busy)} (page cache {held}{other})")
        head = (
            f"{'step':<24} {'n':>2} {'wall s median [min-max]':>26} {'GB/s':>6} {'CPU s':>7} {'CPU s/GB':>8} "
            f"{'max RSS MiB':>12} {'over largest':>12} {'written GB':>10} {'/ cp+sync':>9} {'/ read':>7}"
        )
        lines += [head, "-" * len(head)]
        for step in steps:
            sel = [r for r in rows if r["step"] == step]
            if not sel:
                continue
            wall, lo, hi = _stats([r["wall_s"] for r in sel])
            cpu = statistics.median(r["user_s"] + r["sys_s"] for r in sel)
            rss = max(r["maxrss_kib"] for r in sel) * 1024
            written = statistics.median(r["written_bytes"] for r in sel)
            is_ref = step in REFERENCES
            ratio_cp = "" if step == CP or is_ref else f"{wall / med[CP]:.2f}"
            ratio_rd = "" if step == "read" or is_ref else f"{wall / med['read']:.2f}"
            over = f"{(rss - largest_bytes) / MIB:+.0f}" if step.startswith("convert") and not is_ref else ""
            gbs = "" if is_ref else f"{source_bytes / GB / wall:.2f}"
            cpu_gb = "" if is_ref else f"{cpu / (source_bytes / GB):.2f}"
            lines.append(
                f"{step:<24} {len(sel):>2} {f'{wall:.2f} [{lo:.2f}-{hi:.2f}]':>26} {gbs:>6} {cpu:>7.2f} "
                f"{cpu_gb:>8} {rss / MIB:>12.0f} {over:>12} {written / GB:>10.2f} {ratio_cp:>9} {ratio_rd:>7}"
            )
        present = [s for s in steps if any(r["step"] == s for r in rows)]
        cpu = {s: statistics.median(r["user_s"] + r["sys_s"] for r in rows if r["step"] == s) for s in present}
        if TINY in cpu and TORCH in cpu:
            lines.append(f"fixed CPU over `import torch` (convert tiny - import torch): {cpu[TINY] - cpu[TORCH]:.2f} s")
            for step in present:
                if step.startswith("convert ") and step != TINY:
                    data = (cpu[step] - cpu[TINY]) / (source_bytes / GB)
                    lines.append(f"data path CPU s/GB ({step} - convert tiny): {data:.2f}")
    lines += [
        "",
        "wall: the whole process group from start to exit (convert: interpreter start, imports, conversion,",
        "fsyncs and the closing sync; cp: copy and sync). CPU s: user+sys of the process tree (kernel",
        "writeback threads are not counted on either side). GB/s and CPU s/GB over the source bytes (1e9).",
        "peak RSS: the largest process of the step's tree (ru_maxrss), the highest of the step's runs; 'over",
        "largest' subtracts the largest source tensor. CPU s and written GB: medians. '/ cp+sync' and '/ read':",
        "ratio of medians. 'imports' is `python -c` importing the converter, 'import torch' torch alone, 'convert",
        "tiny' a conversion of the tiny embedded model (references for the fixed cost, not compared).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks at real width (default 2: 4.0 GiB)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions of every step (default 3)")
    parser.add_argument("--tp", type=int, default=8, help="TP degree to convert to (default 8)")
    parser.add_argument("--cp", type=int, default=4, help="CP degree to convert to (default 4)")
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4], help="also convert with --workers P")
    parser.add_argument("--shard-mib", type=int, default=2048, help="max safetensors file size (default 2048)")
    parser.add_argument("--workdir", default=None, help="where to put the temporary folder (default: system temp)")
    parser.add_argument("--no-cold", action="store_true", help="skip cold runs even where the cache can be dropped")
    parser.add_argument("--no-warm", action="store_true", help="skip warm runs")
    parser.add_argument("--no-imports", action="store_true", help="skip the fixed-cost reference steps")
    parser.add_argument("--model-check", action="store_true", help="also convert with the plan check against the model")
    parser.add_argument(
        "--busy", type=int, nargs="+", default=[0], help="CPU-spinning processes during every step: one table per count"
    )
    parser.add_argument("--max-disk-gb", type=float, default=20.0, help="refuse to need more disk (default 20)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a step is killed")
    parser.add_argument("--json", dest="json_path", help="write every raw number to this JSON file")
    args = parser.parse_args(argv)
    if args.layers < 0 or args.reps < 1:
        parser.error("--layers must be >= 0 and --reps >= 1")

    command = shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])])
    print(f"command: {command}")
    env = bench_env()
    load_start = loadavg()
    print(f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}")
    print(f"loadavg at start: {load_start}")
    if any(args.busy):
        print(f"another job: {' / '.join(map(str, args.busy))} process(es) spinning on the CPU during every step")

    convert = _convert_command(env)
    help_text = subprocess.run([*convert, "--help"], env=env, capture_output=True, text=True).stdout
    workers_ok = "--workers" in help_text
    workers = sorted(set(args.workers)) if workers_ok else []
    if args.workers and not workers_ok:
        print(f"note: convert-checkpoint has no --workers option; the --workers {args.workers} runs are skipped")
    modes = [m for m, off in (("warm", args.no_warm), ("cold", args.no_cold)) if not off]
    can_cold, why = cold_possible()
    print(f"cold runs: {'possible' if can_cold else 'not possible'} ({why})" + (" (--no-cold)" if args.no_cold else ""))
    if not can_cold and "cold" in modes:
        modes.remove("cold")
    if not modes:
        parser.error("nothing to run: neither warm nor cold runs")
    modes = [(m, b) for m in modes for b in dict.fromkeys(args.busy)]

    root = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir))
    runs: list[dict] = []
    try:
        src, dst, out = root / "transformer", root / "copy", root / "out"
        t0 = time.perf_counter()
        gen = subprocess.run(
            [sys.executable, "-c", GENERATE, str(src), str(args.layers), str(args.shard_mib * MIB)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if gen.returncode:
            raise SystemExit(f"writing the checkpoint failed:\n{gen.stderr[-3000:]}")
        info = json.loads(gen.stdout.strip().splitlines()[-1])
        source_bytes = tree_bytes(src)
        headers = source_bytes - info["data_bytes"]
        if not 0 < headers < 64 * MIB * len(info["files"]):
            raise SystemExit(f"source folder holds {source_bytes} bytes for {info['data_bytes']} data bytes")
        need = 3 * source_bytes
        if need > args.max_disk_gb * GB:
            raise SystemExit(f"needs ~{need / GB:.1f} GB of disk (source, output, copy) > --max-disk-gb")
        if shutil.disk_usage(root).free < need - source_bytes + GIB:
            raise SystemExit(f"not enough free disk under {root} for ~{need / GB:.1f} GB")
        print(
            f"source: MiniMax-H3 real width (hidden {info['hidden']}, {info['heads']} heads, ffn {info['ffn']}), "
            f"{args.layers} transformer + {info['refiner']} refiner blocks: {info['tensors']} tensors, "
            f"{source_bytes / GIB:.3f} GiB ({source_bytes / GB:.3f} GB) in {len(info['files'])} safetensors files; "
            f"largest {info['largest']} {info['largest_shape']} {info['largest_dtype']} = "
            f"{info['largest_bytes'] / MIB:.0f} MiB; written in {time.perf_counter() - t0:.1f} s"
        )
        if source_bytes < 4 * GIB:
            print(f"note: the source is under 4 GiB (--layers {args.layers}); use --layers >= 2 for the default size")
        print(f"disk: at most ~{need / GB:.1f} GB under {root}")

        files = " ".join(shlex.quote(str(src / f)) for f in sorted(os.listdir(src)))
        q = shlex.quote
        conv = shlex.join(convert) + f" {q(str(src))} {q(str(out))} --tp {args.tp} --cp {args.cp} --no-progress"
        steps = {CP: f"cp -r {q(str(src))} {q(str(dst))} && sync", "read": f"cat {files} > /dev/null"}
        steps[f"convert tp{args.tp} cp{args.cp}"] = f"{conv} && sync"
        for p in workers:
            steps[f"convert --workers {p}"] = f"{conv} --workers {p} && sync"
        if args.model_check:
            plan_file = root / "minimax-h3-plan.json"  # the built-in plan, as a file: checked against the model
            _quiet(shlex.join([sys.executable, "-c", PLAN_FILE, str(plan_file)]), env)
            steps[MODEL_CHECK] = f"{conv} --plan {q(str(plan_file))} && sync"
        if not args.no_imports:
            tiny = root / "tiny"
            _quiet(shlex.join([sys.executable, "-c", TINY_SOURCE, str(tiny)]), env)
            steps["imports"] = shlex.join([sys.executable, "-c", IMPORTS])
            steps[TORCH] = shlex.join([sys.executable, "-c", TORCH])
            steps[TINY] = shlex.join(convert) + f" {q(str(tiny))} {q(str(out))} --tp 2 --cp 2 --no-progress && sync"
        print(f"steps: {json.dumps(steps, indent=1)}", flush=True)

        names = list(steps)
        imports_cold = True  # the imports' files may not be cached yet
        for rep in range(args.reps):
            rep_modes = modes if rep % 2 == 0 else modes[::-1]
            for cache, nbusy in rep_modes:
                mode = _label(cache, nbusy)
                k = rep % len(names)
                for position, step in enumerate(names[k:] + names[:k]):
                    os.sync()
                    if cache == "cold":
                        drop_caches()
                        imports_cold = True
                    else:
                        if imports_cold:
                            _quiet(shlex.join([sys.executable, "-c", IMPORTS]), env)
                            imports_cold = False
                        _quiet(f"cat {files} > /dev/null", env)
                    load = loadavg()
                    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(nbusy)]
                    try:
                        result = timed(steps[step], env, root / "step.log", args.timeout)
                    finally:
                        for proc in busy:
                            proc.kill()
                            proc.wait()
                    written = tree_bytes(dst) + tree_bytes(out)
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.rmtree(out, ignore_errors=True)
                    run = {"rep": rep, "mode": mode, "position": position, "step": step, "loadavg_before": load}
                    run.update(result, written_bytes=written)
                    runs.append(run)
                    print(
                        f"rep {rep} {mode:<12} {step:<24} {result['wall_s']:8.2f} s  cpu "
                        f"{result['user_s'] + result['sys_s']:7.2f} s  rss {result['maxrss_kib'] / 1024:6.0f} MiB  "
                        f"load {load.split()[0]}",
                        flush=True,
                    )
        load_end = loadavg()
        print(report(runs, source_bytes, info["largest_bytes"], modes))
        print(f"\nthis driver's own peak RSS: {_own_peak_kib() / 1024:.0f} MiB")
        print(f"loadavg at start: {load_start}\nloadavg at end:   {load_end}")
        if args.json_path:
            record = {
                "command": command, "args": vars(args), "cpus": os.cpu_count(), "platform": platform.platform(),
                "loadavg_start": load_start, "loadavg_end": load_end, "cold_possible": can_cold, "cold_note": why,
                "workers_supported": workers_ok, "source": {**info, "bytes": source_bytes, "layers": args.layers},
                "steps": steps, "runs": runs,
            }  # fmt: skip
            Path(args.json_path).write_text(json.dumps(record, indent=1) + "\n")
            print(f"raw numbers: {args.json_path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
