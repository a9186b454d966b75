"""The README's first command: `preshard demo` converts, launches torchrun, and matches the unsharded model."""

import re
import subprocess
import sys


def test_preshard_demo_runs_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "preshard.cli", "demo", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-> OK" in done.stdout
    diff = float(re.search(r"max abs diff ([0-9.e+-]+)", done.stdout).group(1))
    assert diff <= 1e-5
    # 4 ranks (tp=2 x ulysses=2), each reading less than the whole checkpoint, each with CP attention on its share.
    ranks = re.findall(r"rank (\d) .*read ([\d,]+) B of ([\d,]+) B.*attention saw \[(\d+)\]", done.stdout)
    assert len(ranks) == 4
    for _, read, total, rows in ranks:
        assert int(read.replace(",", "")) < int(total.replace(",", ""))
        assert int(rows) == 19  # ceil(37 / 2)
    assert (tmp_path / "tp2-ring1-ulysses2" / "manifest.json").is_file()
