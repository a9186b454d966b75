"""What `preshard plan SRC --check --tp N` costs at full width: MiniMax-H3's published config (the class defaults).

Writes the published config.json and a packed input (37 rows) to a scratch folder, runs the command as a program and
reports its CPU seconds (user + sys of it and its ranks), wall seconds, the peak RSS of the largest process and the
load average before and after. Usage: python benchmarks/bench_plan_check.py [--tp 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    from safetensors.torch import save_file

    from preshard.examples.minimax_h3 import make_inputs, model_class
    from preshard.examples.published import published

    entry = published("MiniMax-H3")
    with tempfile.TemporaryDirectory(prefix="plan-check-cost-") as scratch:
        folder = Path(scratch) / "transformer"
        folder.mkdir()
        config = {"_class_name": entry.class_name, **entry.config}
        (folder / "config.json").write_text(json.dumps(config))
        defaults = inspect.signature(model_class().__init__).parameters  # the class defaults: the released model
        full = {k: p.default for k, p in defaults.items() if k != "self"} | entry.config
        save_file(make_inputs(full, 37), str(Path(scratch) / "inputs.safetensors"))
        load_before = os.getloadavg()
        start = time.perf_counter()
        command = [sys.executable, "-m", "preshard", "plan", str(folder), "--check", "--tp", str(args.tp), "--inputs",
                   str(Path(scratch) / "inputs.safetensors")]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(done.stdout.strip())
        print(done.stderr.strip()[-2000:])
        print(
            f"exit {done.returncode}; tp={args.tp}; CPU {usage.ru_utime + usage.ru_stime:.1f} s "
            f"(user {usage.ru_utime:.1f}, sys {usage.ru_stime:.1f}); wall {wall:.1f} s; "
            f"peak RSS of the largest process {usage.ru_maxrss / 1024 / 1024:.2f} GiB; "
            f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores"
        )


if __name__ == "__main__":
    main()
