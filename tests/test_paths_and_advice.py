"""What a user mistypes or leaves out: a mistyped local folder is a missing folder (not a Hub repo that could not be
reached), missing output parents are created (but not by a dry run), `--overwrite` is suggested only where it would
work, the wait for the model check says so, and a dry run's page-cache share stays within 100 %."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from clitools import cli_runner

from preshard.cli import main
from preshard.errors import CheckpointNotFoundError


def _run(*args: str):
    return cli_runner().invoke(main, [str(a) for a in args])


@pytest.mark.quick
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_mistyped_local_folder_is_a_missing_folder(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    run = _run(command, "h3-tp1-typo")
    assert run.exit_code == 2
    assert "h3-tp1-typo does not exist" in run.stderr and "network" not in run.stderr, run.stderr


@pytest.mark.quick
def test_load_sharded_of_a_mistyped_folder_says_it_does_not_exist(tmp_path, monkeypatch):
    import torch

    from preshard import load_sharded

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="typo does not exist") as caught:
        load_sharded(lambda: torch.nn.Linear(2, 2), "typo")
    assert "network" not in str(caught.value)


def test_output_parents_are_created_and_a_dry_run_creates_none(converted, tmp_path):
    checkpoint = converted("float32", 2)
    dry = _run("unshard", checkpoint, tmp_path / "H3-again" / "transformer", "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert not (tmp_path / "H3-again").exists()  # a dry run writes nothing, not even a folder
    run = _run("unshard", checkpoint, tmp_path / "H3-again" / "transformer", "-q")
    assert run.exit_code == 0, run.stderr
    assert (tmp_path / "H3-again" / "transformer" / "config.json").is_file()
    run = _run("reshard", checkpoint, tmp_path / "a" / "b" / "tp1", "--tp", "1", "-q")
    assert run.exit_code == 0, run.stderr
    assert (tmp_path / "a" / "b" / "tp1" / "manifest.json").is_file()


@pytest.mark.quick
def test_overwrite_is_suggested_only_where_it_would_replace_the_output(tiny_sources, converted, tmp_path):
    source = tiny_sources("float32")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    run = _run("convert", source, other, "--tp", "1")
    assert run.exit_code == 2 and "--overwrite to replace" not in run.stderr, run.stderr
    assert "remove the folder yourself or name a new one" in run.stderr
    assert (other / "todo.txt").read_text() == "keep me"
    existing = converted("float32", 2)
    run = _run("convert", source, existing, "--tp", "1")  # a checkpoint: --overwrite would replace it
    assert run.exit_code == 2 and "pass --overwrite to replace it" in run.stderr, run.stderr


def _slow_model_check(monkeypatch, seconds: float) -> list[float]:
    from preshard.plans import from_model

    calls: list[float] = []

    def slow(*args, **kwargs):
        calls.append(time.monotonic())
        time.sleep(seconds)

    monkeypatch.setattr(from_model, "check_plan_against_model", slow)
    return calls


@pytest.mark.parametrize("progress", [True, False])
def test_the_wait_for_the_model_check_is_one_line_where_progress_is_shown(
    tiny_sources, tmp_path, monkeypatch, capsys, progress
):
    from preshard import convert_checkpoint
    from preshard.plans.registry import load_plan

    plan = load_plan("minimax-h3").to_dict()
    plan["linear"].append({"match": "no_such_module", "style": "colwise", "optional": True})  # not a built-in: checked
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    calls = _slow_model_check(monkeypatch, 3.0)
    convert_checkpoint(tiny_sources("float32"), tmp_path / "out", tp=2, plan=plan_file, progress=progress)
    assert calls, "the model check ran"
    noted = "waiting for the check of the plan against the model class" in capsys.readouterr().err
    assert noted == progress


@pytest.mark.quick
def test_the_page_cache_share_is_at_most_the_bytes_read():
    from preshard.tools.estimate import Work

    # mincore counts whole files (headers too): more than the tensor bytes a conversion reads
    assert Work.conversion(100, 150, 10).cached_bytes == 100
    assert Work.unshard(100, 150, 10).cached_bytes == 100
    assert Work.conversion(100, 40, 10).cached_bytes == 40


@pytest.mark.quick
def test_the_output_of_a_missing_parent_under_a_file_is_refused(tiny_sources, tmp_path):
    (tmp_path / "a-file").write_text("")
    run = _run("convert", tiny_sources("float32"), tmp_path / "a-file" / "out", "--tp", "1")
    assert run.exit_code == 2 and "is a file" in run.stderr, run.stderr
    assert Path(tmp_path / "a-file").is_file()
