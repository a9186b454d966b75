"""Driving the command line in tests: a CliRunner that keeps stderr apart, the installed console scripts, and
the one-line error contract (the exit status, a single `error: ` line, no traceback, no "Exception ignored")."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner


def cli_runner() -> CliRunner:
    """stdout and stderr kept apart (the default from click 8.2 on; click 8.1 needs mix_stderr=False)."""
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()


def console_script(name: str) -> str:
    """The installed entry point `name` (beside this interpreter, else on PATH); skips the test without it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"console script {name} is not installed")
    return found


def assert_one_line(exit_code: int, stderr: str, status: int, *fragments: str, stdout: str = "") -> str:
    """The command exited with `status` and said one `error: ` line holding every fragment; returns that line."""
    lines = stderr.splitlines()
    assert exit_code == status, (exit_code, stdout, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stdout + stderr and "Exception ignored" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
