"""Nothing silent for more than a few seconds: a resumed conversion says it re-checks what it kept, importing a model
class (the user's, or diffusers for a class's plan) and planning from a class's modules each print one line where
progress is shown (and none with --quiet); under torchrun, diffusers' and transformers' progress bars show on rank 0
only (`runtime/rank_bars.py`: scoped, restored after), counted on the stderr of two real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import assembled_model
import pytest
from clitools import cli_runner
from multiproc import run_ranks
from tiny_diffusers import save

from preshard.cli import main
from preshard.converter.convert import convert_checkpoint

SRC = str(Path(__file__).resolve().parents[1] / "src")
RESUME = "resuming: re-checking what the interrupted run wrote"


class _Stop(Exception):
    pass


def test_a_resume_says_it_re_checks_once_and_a_fresh_conversion_does_not(tiny_sources, tmp_path, capsys):
    source = tiny_sources("float32")
    written = []

    def stop_after_three(name: str) -> None:
        written.append(name)
        if len(written) == 3:
            raise _Stop

    with pytest.raises(_Stop):
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=True, on_tensor=stop_after_three)
    assert capsys.readouterr().err.count(RESUME) == 0  # a fresh conversion has nothing to re-check
    convert_checkpoint(source, tmp_path / "out", tp=2, progress=True)
    assert capsys.readouterr().err.count(RESUME) == 1
    with pytest.raises(_Stop):
        written.clear()
        convert_checkpoint(source, tmp_path / "quiet", tp=2, progress=False, on_tensor=stop_after_three)
    convert_checkpoint(source, tmp_path / "quiet", tp=2, progress=False)
    assert capsys.readouterr().err.count(RESUME) == 0  # --no-progress: no line


def test_importing_the_users_model_class_is_one_line_and_quiet_prints_none(tmp_path):
    source = save(assembled_model.build()[0], tmp_path / "src")
    spec = "assembled_model:AssembledTransformer2DModel"
    shown = cli_runner().invoke(
        main, ["convert", str(source), str(tmp_path / "a"), "--tp", "2", "--model-class", spec, "--progress"]
    )
    assert shown.exit_code == 0, shown.stderr
    assert shown.stderr.count(f"importing model class {spec}") == 1, shown.stderr
    assert shown.stderr.count("planning: reading the plan of AssembledTransformer2DModel") == 1, shown.stderr
    quiet = cli_runner().invoke(
        main, ["convert", str(source), str(tmp_path / "b"), "--tp", "2", "--model-class", spec, "-q"]
    )
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_importing_diffusers_for_a_plan_is_one_line_in_a_fresh_process(tmp_path):
    from tiny_zoo import build

    source = save(build("ChromaTransformer2DModel")[0], tmp_path / "src")  # no built-in plan: the class is read
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "preshard", "convert", str(source), str(tmp_path / "o"), "--tp", "2", "--progress"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("importing diffusers for the model class ChromaTransformer2DModel") == 1, done.stderr
    assert done.stderr.count("planning: reading the plan of ChromaTransformer2DModel") == 1, done.stderr


def _rank_bars(rank: int, world: int, folder: str) -> dict:
    """A loader decorated as load_pipeline is, drawing a diffusers and a transformers bar; this rank's fd 2 to a
    file, so that what reaches stderr is counted."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from preshard.runtime.rank_bars import rank0_bars

    class Pipe:
        disabled = None

        def set_progress_bar_config(self, **kwargs):
            self.disabled = kwargs.get("disable")

    @rank0_bars
    def load() -> Pipe:
        list(diffusers_logging.tqdm(range(3), desc="diffusers-bar"))
        list(transformers_logging.tqdm(range(3), desc="transformers-bar"))
        return Pipe()

    path = Path(folder) / f"stderr-{rank}"
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            pipe = load()
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
    after = list(diffusers_logging.tqdm(range(3), desc="after"))  # restored: a bar again (to the real stderr)
    return {
        "stderr": path.read_text(),
        "disabled": pipe.disabled,
        "restored": diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled(),
        "after": len(after),
    }


def test_under_torchrun_only_rank_0_draws_the_libraries_bars(tmp_path):
    ranks = run_ranks(_rank_bars, 2, str(tmp_path), env={"TORCHELASTIC_RUN_ID": "bars"}, timeout=300)
    zero, one = ranks
    assert zero["stderr"].count("diffusers-bar") >= 1 and zero["stderr"].count("transformers-bar") >= 1, zero
    assert "diffusers-bar" not in one["stderr"] and "transformers-bar" not in one["stderr"], one
    assert zero["disabled"] is None and one["disabled"] is True  # the pipeline's own (denoising) bar: rank 1 off
    assert zero["restored"] and one["restored"]  # scoped: every rank's bars as they were after the call


@pytest.mark.quick
def test_the_opt_out_keeps_every_ranks_bars_and_outside_torchrun_nothing_changes(monkeypatch):
    from diffusers.utils import logging as diffusers_logging

    from preshard.runtime.rank_bars import bars_on_rank0

    assert diffusers_logging.is_progress_bar_enabled()
    with bars_on_rank0(1):
        assert not diffusers_logging.is_progress_bar_enabled()
    assert diffusers_logging.is_progress_bar_enabled()  # restored
    with bars_on_rank0(None):  # not a torchrun job
        assert diffusers_logging.is_progress_bar_enabled()
    monkeypatch.setenv("PRESHARD_ALL_RANK_BARS", "1")
    with bars_on_rank0(1):
        assert diffusers_logging.is_progress_bar_enabled()
