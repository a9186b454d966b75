"""A disk that fills up while a conversion writes (issue 36): the output goes to a small tmpfs that another writer
fills right after the converter's free-space checks passed. The conversion fails with one line naming the full
disk and the fix, commits no output, keeps its partial folder, and after the space is freed the same command
resumes and writes a checkpoint that verifies. Needs root to mount the tmpfs (skipped with the reason otherwise);
the same case, with a reshard and an unshard, is `scripts/hostile_soak.py --classes fulldisks`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
disks = importlib.import_module("hostile_soak_disks")
hostile_soak = importlib.import_module("hostile_soak")


@pytest.fixture
def folder(tmp_path) -> Path:
    if not disks.mount_permitted(tmp_path):
        pytest.skip("mounting a small tmpfs is not permitted here (needs root in a container that allows mounts)")
    return tmp_path


@pytest.mark.quick
def test_conversion_onto_a_disk_that_fills_fails_in_one_line_and_resumes(folder):
    with disks.small_disk(folder) as disk:
        out = disk / "out"
        command = disks._convert(folder, out)
        with disks.filled_after_check(disk, disks._checks()) as filler:
            failed = hostile_soak.run_cli(*command)
        assert hostile_soak.one_line(failed, "disk is full", "free space") is None, failed.stderr
        assert filler.stat().st_size > 0
        assert not out.exists()  # nothing committed
        kept = [p for p in disk.iterdir() if p.name != "filler"]
        assert kept and all(p.name.startswith(".") for p in kept)  # the hidden partial, to resume from
        filler.unlink()
        again = hostile_soak.run_cli(*command)
        assert again.status == 0, again.stderr
        assert hostile_soak.run_cli("verify", out).status == 0


@pytest.mark.quick
def test_the_control_on_an_empty_small_disk_converts(folder):
    with disks.small_disk(folder) as disk:
        done = hostile_soak.run_cli(*disks._convert(folder, disk / "out"))
        assert done.status == 0, done.stderr
        assert (disk / "out" / "manifest.json").is_file()
