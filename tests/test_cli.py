"""The command-line conventions, one test each: --version on both entry points; --json, --quiet/-q and
--progress/--no-progress on every command (--json: one object of what the command did), --dry-run on every command
that writes, --subfolder/--revision/--token wherever a Hub id is accepted; one progress flag spelling (on by default
on a terminal, plain lines otherwise, huggingface_hub's bars following it); a finished identical conversion re-run
exits 0 ("already converted"), a resumed one says what it kept; exit codes in --help and README (0 ok, 1 verify
found problems, 2 usage or input error, 130/143 interrupted); and `inspect` naming a missing path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import cli_runner

from preshard import __version__
from preshard.cli import _hub_progress, convert_checkpoint_command, main
from preshard.format.manifest import read_manifest
from preshard.progress import Progress

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

ROOT = Path(__file__).resolve().parents[1]
EXIT_CODES = "Exit status: 0 ok, 1 verify found problems, 2 usage or input error, 130 interrupted (SIGINT), 143"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def source(tiny_sources) -> Path:
    return tiny_sources("mixed")


@pytest.fixture(scope="module")
def checkpoint(converted) -> Path:
    return converted("mixed", 2)


def test_version_on_both_entry_points():
    for command, name in ((main, "preshard"), (convert_checkpoint_command, "convert-checkpoint")):
        run = cli_runner().invoke(command, ["--version"])
        assert run.exit_code == 0 and run.stdout.strip() == f"{name}, version {__version__}", run.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "preshard.cli", "--version"], capture_output=True, text=True, timeout=60, env=_env()
    )  # fmt: skip
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_exit_codes_are_in_every_help_and_in_the_cli_manual():
    for args in ([], ["convert"], ["inspect"], ["verify"], ["plan"], ["demo"]):
        run = cli_runner().invoke(main, [*args, "--help"])
        assert run.exit_code == 0 and EXIT_CODES in " ".join(run.stdout.split()), (args, run.stdout)
    run = cli_runner().invoke(convert_checkpoint_command, ["-h"])
    assert EXIT_CODES in " ".join(run.stdout.split())
    manual = (ROOT / "docs" / "cli-and-hub.md").read_text()
    section = manual[manual.index("### Exit status") :]
    for code in ("0", "1", "2", "130", "143"):
        assert re.search(rf"\|\s*`?{code}`?\s*\|", section), code


COMMANDS = ["convert", "inspect", "verify", "reshard", "unshard", "plan", "demo", "check"]
HUB_ID_COMMANDS = ["convert", "inspect", "verify", "reshard", "unshard", "plan"]


def _options(args: list[str]) -> set[str]:
    run = cli_runner().invoke(main, [*args, "--help"])
    assert run.exit_code == 0, run.stderr
    return set(re.findall(r"(--[a-z][a-z-]*|-q)\b", run.stdout))


def test_every_command_has_the_output_options_and_the_writers_a_dry_run():
    for command in COMMANDS:
        options = _options([command])
        assert {"--json", "--quiet", "-q", "--progress", "--no-progress"} <= options, (command, options)
        if command in ("convert", "reshard", "unshard"):
            assert "--dry-run" in options, command
        if command in HUB_ID_COMMANDS:
            assert {"--subfolder", "--revision", "--token"} <= options, (command, options)
    assert "--workers" in _options(["reshard"]) and "--workers" in _options(["convert"])


def test_quiet_prints_nothing_and_json_one_object(source, checkpoint, tmp_path):
    runs = {
        "inspect": ["inspect", str(checkpoint)],
        "verify": ["verify", str(checkpoint)],
        "plan": ["plan", str(source), "--devices", "2"],
        "convert": ["convert", str(source), str(tmp_path / "c"), "--tp", "2"],
        "reshard": ["reshard", str(checkpoint), str(tmp_path / "r"), "--tp", "1"],
        "unshard": ["unshard", str(checkpoint), str(tmp_path / "u")],
        "reshard dry run": ["reshard", str(checkpoint), str(tmp_path / "r2"), "--tp", "1", "--dry-run"],
        "unshard dry run": ["unshard", str(checkpoint), str(tmp_path / "u2"), "--dry-run"],
    }
    for name, args in runs.items():
        quiet = cli_runner().invoke(main, [*args, "-q"])
        assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == "", (name, quiet.stdout, quiet.stderr)
    for name, args in runs.items():
        args = [*args, "--overwrite"] if name in ("convert", "reshard", "unshard") else args
        run = cli_runner().invoke(main, [*args, "--json"])
        assert run.exit_code == 0, (name, run.stderr)
        data = json.loads(run.stdout)  # exactly one JSON document
        assert isinstance(data, dict) and data["command"] == name.split()[0], (name, data)
    assert not (tmp_path / "r2").exists() and not (tmp_path / "u2").exists()  # dry runs write nothing
    unsharded = json.loads(
        cli_runner().invoke(main, ["unshard", str(checkpoint), str(tmp_path / "u3"), "--json"]).stdout
    )
    assert unsharded["bytes"] == sum(f["size"] for f in unsharded["files"]) > 0


def test_an_identical_finished_conversion_is_already_converted(source, tmp_path):
    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "2", "--no-progress"]
    first = cli_runner().invoke(convert_checkpoint_command, [*args, "--json"])
    assert first.exit_code == 0 and json.loads(first.stdout)["status"] == "converted", first.stderr
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = cli_runner().invoke(convert_checkpoint_command, args)
    assert again.exit_code == 0 and again.stdout.startswith("already converted: nothing to do"), again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing rewritten
    data = json.loads(cli_runner().invoke(convert_checkpoint_command, [*args, "--json"]).stdout)
    assert data["status"] == "already converted" and data["manifest_digest"] == read_manifest(out).digest
    # anything different still needs --overwrite: another mesh, another cast, other source bytes
    for changed in (["--ulysses", "2"], ["--dtype", "fp32"]):
        other = cli_runner().invoke(convert_checkpoint_command, [*args, *changed])
        assert other.exit_code == 2 and "already exists; pass --overwrite" in other.stderr, (changed, other.stderr)


def test_a_source_with_other_bytes_is_not_already_converted(tiny_sources, tmp_path):
    """Same names, sizes and headers, one data byte flipped: the source hashes differ (the negative control for a
    check that would look at the headers only)."""
    import shutil

    source = Path(shutil.copytree(tiny_sources("float32"), tmp_path / "src"))
    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "2", "--no-progress"]
    assert cli_runner().invoke(convert_checkpoint_command, args).exit_code == 0
    weights = next(source.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    other = cli_runner().invoke(convert_checkpoint_command, args)
    assert other.exit_code == 2 and "already exists; pass --overwrite" in other.stderr, other.stdout


def test_a_resumed_conversion_says_what_it_kept(source, tmp_path, monkeypatch):
    from preshard.converter import convert

    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "2", "--no-progress"]
    monkeypatch.setattr(convert, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    written: list[str] = []

    def crash(name: str) -> None:
        written.append(name)
        if len(written) == 30:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert.convert_checkpoint(source, out, tp=2, progress=False, on_tensor=crash)
    resumed = cli_runner().invoke(convert_checkpoint_command, [*args, "--json"])
    assert resumed.exit_code == 0, resumed.stderr
    data = json.loads(resumed.stdout)
    # Kept: at least one tensor, not all. (A few more than the 30 the hook saw may be: the writers write a slab of
    # small tensors as one batch, and what became durable before the crash is claimed.)
    total = len(read_manifest(out).tensors)
    assert data["status"] == "resumed" and 1 <= data["kept_tensors"] < total and data["kept_bytes"] > 0, data
    text = cli_runner().invoke(convert_checkpoint_command, [*args, "--overwrite"]).stdout
    assert "; resumed: kept" not in text  # a fresh conversion (nothing to keep) says nothing of the kind


def test_inspect_json(checkpoint):
    run = cli_runner().invoke(main, ["inspect", str(checkpoint), "--json"])
    assert run.exit_code == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["mesh"]["tp"] == 2 and len(data["files"]) == 2 and len(data["tp_ranks"]) == 2
    first = data["tp_ranks"][0]
    framing = sum(len(c.framing.header) for cs in read_manifest(checkpoint).chunks_for_tp_rank(0).values() for c in cs)
    assert first["read_bytes_per_rank"] == first["own_bytes"] + first["replicated_bytes"] + framing
    assert data["read_bytes_per_rank"] == max(r["read_bytes_per_rank"] for r in data["tp_ranks"])


def test_verify_json_exit_0_and_1(checkpoint, private_copy):
    good = cli_runner().invoke(main, ["verify", str(checkpoint), "--json"])
    assert good.exit_code == 0, good.stdout + good.stderr
    assert json.loads(good.stdout)["ok"] is True and json.loads(good.stdout)["problems"] == []

    damaged = private_copy(checkpoint)
    data = bytearray((damaged / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "__1_0.distcp").write_bytes(bytes(data))
    bad = cli_runner().invoke(main, ["verify", str(damaged), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)  # still one JSON document on stdout
    assert report["ok"] is False and any("__1_0.distcp" in p for p in report["problems"])


def test_plan_json(source):
    run = cli_runner().invoke(main, ["plan", str(source), "--devices", "2", "--device-memory", "1", "--json"])
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    meshes = report["meshes"]
    assert report["command"] == "plan" and report["recommended"]["recommended"] is True
    assert {(m["tp"], m["ring"], m["ulysses"]) for m in meshes} == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    assert sum(m["recommended"] for m in meshes) == 1 and all(m["fits"] for m in meshes)


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_progress_flag_spelling_and_defaults(command, source, checkpoint, tmp_path):
    """CliRunner's stderr is no terminal: plain lines with --progress, nothing with --no-progress or by default."""
    if command == "convert":
        base = [str(source), str(tmp_path / "out"), "--tp", "2", "--overwrite"]
        word, cli = "converting", convert_checkpoint_command
    else:
        base, word, cli = ["verify", str(checkpoint)], "verifying", main
    shown = cli_runner().invoke(cli, [*base, "--progress"])
    assert shown.exit_code == 0, shown.stderr
    assert re.search(rf"^{word}: 100% \(.+ of .+\)$", shown.stderr, re.M), shown.stderr
    for flags in (["--no-progress"], []):
        quiet = cli_runner().invoke(cli, [*base, *flags])
        assert quiet.exit_code == 0 and word not in quiet.stderr, (flags, quiet.stderr)


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = Progress(100, "x")
    assert bar.enabled and bar._bar is not None  # tqdm
    bar.close()
    assert Progress(100, "x", enabled=False)._bar is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    lines = Progress(100, "x", enabled=True)
    assert lines.enabled and lines._bar is None
    lines.update(100)
    lines.close()
    assert capsys.readouterr().err.strip().endswith("x: 100% (100 B of 100 B)")


def test_hub_download_bars_follow_the_progress_flag(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    enable_progress_bars()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for flag, disabled in ((False, True), (True, False), (None, False)):
        with _hub_progress(flag):
            assert are_progress_bars_disabled() is disabled, flag
        assert not are_progress_bars_disabled()  # restored
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with _hub_progress(None):
        assert are_progress_bars_disabled()


def test_inspect_names_a_missing_path(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    run = cli_runner().invoke(main, ["inspect", str(missing)])
    assert run.exit_code == 2
    assert run.stderr.splitlines() == [
        f"error: checkpoint {missing} does not exist; pass the folder convert-checkpoint wrote"
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    run = cli_runner().invoke(main, ["inspect", str(empty)])
    assert run.exit_code == 2 and f"{empty} is not a complete preshard checkpoint" in run.stderr


def test_usage_errors_are_one_line_exit_2(source):
    for args in (["plan"], ["convert", str(source)], ["plan", str(source), "--devices", "x"], ["nope"]):
        run = cli_runner().invoke(main, args)
        lines = run.stderr.splitlines()
        assert run.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, run.stderr)
        assert "Traceback" not in run.stdout + run.stderr


def test_keyboard_interrupt_outside_a_conversion_exits_130(source, monkeypatch):
    import preshard.tools.planner as planner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(planner, "plan_meshes", interrupted)
    run = cli_runner().invoke(main, ["plan", str(source)])
    assert run.exit_code == 130 and run.stderr.strip() == "error: interrupted"


INTERRUPT = """
import functools, os, signal, sys
from preshard.converter import convert
from preshard.cli import convert_checkpoint_command

def convert_and_signal(signum, args):
    sent = []

    def hook(name):
        if not sent:  # once: a second signal of the same kind would stop the process at once
            sent.append(name)
            os.kill(os.getpid(), signum)

    real = convert.convert_checkpoint
    convert.convert_checkpoint = functools.partial(real, on_tensor=hook)  # the CLI's call of the library
    try:
        convert_checkpoint_command(args)
    finally:
        convert.convert_checkpoint = real

source, root, plan = sys.argv[1:4]
common = ["--tp", "2", "--plan", plan, "--no-progress"]
try:  # SIGINT: caught here, so that the same process (imports paid once) goes on to SIGTERM
    convert_and_signal(signal.SIGINT, [source, root + "/int", *common])
except SystemExit as exc:
    print("SIGINT exit", exc.code, flush=True)
convert_and_signal(signal.SIGTERM, [source, root + "/term", *common])  # the process exits
"""


def test_a_signal_during_a_conversion_exits_128_plus_its_number(source, tmp_path):
    from preshard.plans.registry import load_plan

    plan = load_plan("minimax-h3").to_dict() | {"attention": []}  # no head checks: the child skips diffusers
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT, str(source), str(tmp_path), str(plan_file)],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert proc.stdout.strip() == f"SIGINT exit {128 + signal.SIGINT}" == "SIGINT exit 130", proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM == 143, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), proc.stderr
    assert "interrupted (SIGINT)" in lines[0] and "terminated (SIGTERM)" in lines[1]
    assert all("re-run the same command to resume" in line for line in lines)
    for name in ("int", "term"):  # nothing committed; the finished part kept for a resume
        assert not (tmp_path / name).exists() and (tmp_path / f".{name}.partial").is_dir()
