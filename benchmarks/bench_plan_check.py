"""What `preshard plan SRC --check --tp N` costs at full width: MiniMax-H3's published config (the class defaults).

Writes the published config.json and a packed input (37 rows) to a scratch folder and runs, by default, the three
steps the command takes one process each (build the one-block model with random weights and save it; `preshard
convert --tp N`; `preshard check`), or with `--one-command` the command itself; reports per process the CPU seconds
(user + sys, its ranks included), wall seconds and peak RSS (of the largest process), and the load average.

    python benchmarks/bench_plan_check.py [--tp 2] [--one-command]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUILD = """
import sys
from preshard.examples.minimax_h3 import model_class
from preshard.tools.plan_check import _build, randomize_, reduced_config
import json
cls = model_class()
small, _ = reduced_config(json.loads(open(sys.argv[1]).read()))
model = _build(cls, small)
randomize_(model, 0)
model.save_pretrained(sys.argv[2], max_shard_size="1GB")
"""


def run(name: str, command: list[str]) -> None:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read() if child.stdout is not None else ""
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    shown = [line for line in out.splitlines() if "max abs diff" in line or "match" in line or "error" in line]
    print("\n".join(shown[-4:]))
    print(
        f"{name}: exit {os.waitstatus_to_exitcode(status)}; CPU {usage.ru_utime + usage.ru_stime:.1f} s "
        f"(user {usage.ru_utime:.1f}, sys {usage.ru_stime:.1f}); wall {wall:.1f} s; peak RSS "
        f"{usage.ru_maxrss / 1024 / 1024:.2f} GiB; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--one-command", action="store_true")
    args = parser.parse_args()
    from safetensors.torch import save_file

    from preshard.examples.minimax_h3 import make_inputs, model_class
    from preshard.examples.published import published

    entry = published("MiniMax-H3")
    defaults = inspect.signature(model_class().__init__).parameters  # the class defaults: the released model
    full = {k: p.default for k, p in defaults.items() if k != "self"} | entry.config
    full = {k: list(v) if isinstance(v, tuple) else v for k, v in full.items()}
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="plan-check-cost-") as scratch:
        root = Path(scratch)
        (root / "transformer").mkdir()
        (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": entry.class_name, **full}))
        inputs = str(root / "inputs.safetensors")
        save_file(make_inputs(full, 37), inputs)
        tp = str(args.tp)
        print(f"{os.cpu_count()} cores; MiniMax-H3, one block per stack, tp={tp}")
        if args.one_command:
            run("plan --check", [py, "-m", "preshard", "plan", str(root / "transformer"), "--check", "--tp", tp,
                                 "--inputs", inputs])  # fmt: skip
            return
        model, out = str(root / "model"), str(root / "out")
        run("build + save", [py, "-c", BUILD, str(root / "transformer" / "config.json"), model])
        run("convert", [py, "-m", "preshard", "convert", model, out, "--tp", tp, "--quiet"])
        run("check", [py, "-m", "preshard", "check", out, "--source", model, "--inputs", inputs, "--no-progress"])


if __name__ == "__main__":
    main()
