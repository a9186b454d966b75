"""Integrity under concurrency, interrupts and hostile files (issue 9): no damaged commit, no traceback, nothing
silently accepted.

- signals: SIGINT, SIGTERM and SIGKILL at random moments to `convert-checkpoint` processes; counted only where
  they landed while tensors were being written (see `crash_soak.CrashHarness._landed`), bounded by signals;
- concurrency: pairs of conversions into one output at varied delays, with and without `--wait`, and a holder
  killed while another waits: never a commit that fails `verify --source`, the loser names the winner's pid;
- resume: a damaged record in the partial (framing, data, cut short) is redone with everything after it, and
  torch's own `dcp_to_torch_save` reads the result; a signal during the re-check stops it at the next record;
  a source rewritten mid-run commits nothing;
- bad input: one line, exit status 2 (a PreshardError in Python), nothing written;
- zero-size tensors: convert, verify, torch's reader and load at tp=1 and tp=2.

Processes are forked from a zygote that has imported preshard (`crash_soak.Zygote`), so each costs milliseconds
instead of an interpreter start; one test runs the real `convert-checkpoint` script as well.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from clitools import assert_one_line, console_script
from multiproc import init_gloo, run_ranks
from torch import nn

from preshard import MeshSpec, command_scope, convert_checkpoint, load_sharded, verify_checkpoint
from preshard.cli import convert_checkpoint_command, main
from preshard.converter import convert as convert_module
from preshard.converter import writer as writer_module
from preshard.errors import Interrupted, MismatchError, UsageError
from preshard.format.manifest import read_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
crash_soak = importlib.import_module("crash_soak")

LINUX_PROC_IO = Path("/proc/self/io").is_file() and os.access("/proc/self/io", os.R_OK)
needs_proc = pytest.mark.skipif(not LINUX_PROC_IO, reason="needs Linux /proc/<pid>/io to tell where a signal landed")


def partial_of(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def lock_of(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cli(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(convert_checkpoint_command, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    if not LINUX_PROC_IO:
        pytest.skip("needs Linux /proc/<pid>/io")
    with crash_soak.Zygote(tmp_path_factory.mktemp("zygote-logs")) as z:
        yield z


@pytest.fixture(scope="module")
def crash_source(tmp_path_factory) -> tuple[Path, Path]:
    """96 tensors, 36 MiB: big enough that the journal is synced mid-run (every 16 MiB), so resumes happen."""
    root = tmp_path_factory.mktemp("crash")
    return crash_soak.build_source(root / "src", blocks=12, width=512), root / "plan.json"


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("small")
    return crash_soak.build_source(root / "src", blocks=3, width=32), root / "plan.json"


# ---------------------------------------------------------------------------------------------------------
# Signals through the command line


@needs_proc
@pytest.mark.timeout(150)
def test_signals_at_random_moments_through_the_cli(zygote, crash_source, tmp_path):
    """>= 12 SIGINT/SIGTERM/SIGKILL that landed while tensors were being written (>= 3 of each), at most 40 sent:
    130/143 and one line, the partial kept, no half-written or lost output, re-runs keep the journalled tensors."""
    source, plan = crash_source
    before = tree_hash(source)
    harness = crash_soak.CrashHarness(zygote, source, plan, tmp_path / "out", tps=(4,), seed=20240901)
    stats = harness.run(40, need_while_writing=12, need_each=3, rerun_every=4, reset_probability=0.3)
    print(stats.summary())
    assert not stats.failures, stats.summary()
    assert stats.while_writing() >= 12, stats.summary()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        assert stats.while_writing(signum) >= 3, stats.summary()
    assert stats.exits[signal.SIGINT, 130] >= 3 and stats.exits[signal.SIGTERM, 143] >= 3, stats.summary()
    assert stats.resumes >= 1 and stats.tensors_reused > 0, stats.summary()
    assert stats.overwrites >= 1, stats.summary()  # signals also hit runs replacing a complete checkpoint
    assert verify_checkpoint(tmp_path / "out", source=source).ok
    assert not partial_of(tmp_path / "out").exists() and not lock_of(tmp_path / "out").exists()
    assert tree_hash(source) == before


@needs_proc
@pytest.mark.timeout(120)
def test_the_real_script_stops_cleanly_on_sigint_and_sigterm_mid_write(crash_source, tmp_path):
    """The installed `convert-checkpoint`, a fresh interpreter each time: signalled once its data files are partly
    written, it exits 130/143 with one line, keeps the partial, and a third run finishes with a valid output."""
    source, plan = crash_source
    out = tmp_path / "out"
    for signum, status, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        proc = subprocess.Popen(
            [console_script("convert-checkpoint"), source, out, "--tp", "4", "--plan", plan, "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        written, deadline = 0, time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline and written < 4 << 20:
            written = crash_soak.written_bytes(proc.pid) or 0  # 4 MiB of the 36 MiB written: mid-way through tensors
            time.sleep(0.0005)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
        assert written >= 4 << 20 and crash_soak.data_bytes(partial_of(out)) < 36 << 20  # it stopped mid-write
        assert_one_line(proc.returncode, stderr, status, word, "re-run the same command to resume")
        assert stdout == "" and not out.exists() and (partial_of(out) / "job.json").is_file()
    assert cli(source, out, "--tp", "4", "--plan", plan, "--no-progress")[0] == 0
    assert verify_checkpoint(out, source=source).ok and not partial_of(out).exists()


# ---------------------------------------------------------------------------------------------------------
# Concurrency


def _other_pid_named(stderr: str, pid: int, out: Path) -> bool:
    line = stderr.strip()
    return (
        line == (f"error: another conversion (pid {pid}) is writing {out}; wait for it to finish, or pass --wait")
        and len(stderr.splitlines()) == 1
    )


def _blocked_on_a_flock(pid: int) -> bool:
    """The kernel lists `pid` as waiting for a flock (a "->" line of /proc/locks)."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return False
    return any("->" in line and "FLOCK" in line and f" {pid} " in line for line in text.splitlines())


def _holds(pid: int, out: Path) -> bool:
    try:
        return lock_of(out).read_text().strip() == str(pid)
    except OSError:
        return False


@pytest.fixture(scope="module")
def pair_source(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pairs")
    return crash_soak.build_source(root / "src", blocks=12, width=192), root / "plan.json"


@needs_proc
@pytest.mark.timeout(150)
def test_concurrent_conversions_into_one_output_never_commit_a_damaged_checkpoint(zygote, pair_source, tmp_path):
    """12 pairs of processes converting into the same output, the second started at a varied delay into the first
    (some with --wait, some at another tp, some with the first SIGKILLed while the second waits for it): each pair
    contends for the lock (shown by the loser's error, or by the kernel listing the waiter), neither fails
    otherwise, and what is committed verifies against the source."""
    source, plan = pair_source
    out = tmp_path / "out"

    def args(tp: int, *extra: str) -> list:
        return [source, out, "--tp", str(tp), "--plan", plan, "--no-progress", "--overwrite", *extra]

    start = time.monotonic()
    run = zygote.spawn(args(4))
    while not out.exists() and zygote.poll(run) is None:
        time.sleep(0.001)
    seconds = time.monotonic() - start  # until the commit
    assert zygote.finish(run) == 0
    refused = waited = taken_over = pairs = 0
    # (delay as a share of one conversion, does the second --wait, tp of each, SIGKILL the first as the second waits)
    cases = [
        (0.0, False, 4, 4, False), (0.0, True, 4, 2, False), (0.1, False, 4, 4, False), (0.1, True, 2, 4, False),
        (0.2, False, 2, 2, False), (0.3, True, 4, 4, False), (0.4, False, 4, 2, False), (0.5, True, 4, 4, False),
        (0.6, False, 2, 4, False), (0.05, True, 4, 4, True), (0.3, True, 2, 2, True), (0.7, True, 2, 4, False),
    ]  # fmt: skip
    # Bounded by pairs, not time: on a loaded machine a pair may miss (the first done before the second starts);
    # then the delays shrink. Every pair is checked either way.
    while pairs < 24 and not (refused + waited + taken_over >= 10 and min(refused, waited) >= 3 and taken_over):
        share, wait, tp_a, tp_b, kill_first = case = cases[pairs % len(cases)]
        pairs += 1
        first = zygote.spawn(args(tp_a))
        zygote.wait(first, share * seconds)
        second = zygote.spawn(args(tp_b, *(["--wait"] if wait else [])))
        blocked = False
        while wait and not blocked and zygote.poll(first) is None:
            blocked = _blocked_on_a_flock(second.pid)
            time.sleep(0.001)
        if kill_first and blocked:
            zygote.signal(first, signal.SIGKILL)
        codes = zygote.finish(first, 60), zygote.finish(second, 60)
        (_, err_a), (_, err_b) = first.output(), second.output()
        where = f"pair {pairs} {case}: exits {codes}, stderr {err_a!r} / {err_b!r}"
        contended = blocked
        if 2 in codes:  # refused: only one without --wait can be, naming the other (which got the lock first)
            loser, winner = (second, first) if codes[1] == 2 else (first, second)
            assert loser is first or not wait, where
            assert _other_pid_named(loser.output()[1], winner.pid, out), where
            refused, contended = refused + 1, True
        if kill_first:
            assert codes[0] in (-signal.SIGKILL, 0, 2) and codes[1] == 0 and not err_b, where
            taken_over += blocked and codes[0] == -signal.SIGKILL
        elif wait:
            assert codes in ((0, 0), (2, 0)) and not err_b, where
            waited += blocked
        else:
            assert codes in ((0, 0), (0, 2), (2, 0)), where
        if not contended:
            seconds *= 0.7
        result = verify_checkpoint(out, source=source)
        assert result.ok, (where, result.problems[:3])
        assert read_manifest(out).tp in (tp_a, tp_b)
        assert not lock_of(out).exists() and not partial_of(out).exists(), where
    print(f"{pairs} pairs: {refused} refused naming the holder, {waited} waited, {taken_over} took over a killed one")
    assert refused + waited + taken_over >= 10 and min(refused, waited) >= 3 and taken_over >= 1, pairs
    # A waiter stopped while it waits: one line, 143, and the holder is not disturbed.
    first = zygote.spawn(args(4))
    while zygote.poll(first) is None and not _holds(first.pid, out):
        time.sleep(0.001)
    second = zygote.spawn(args(2, "--wait"))
    while not _blocked_on_a_flock(second.pid) and zygote.poll(first) is None:
        time.sleep(0.001)
    if zygote.poll(first) is None:
        zygote.signal(second, signal.SIGTERM)
        assert zygote.finish(second, 60) == 143
        assert_one_line(143, second.output()[1], 143, "terminated (SIGTERM)")
    assert zygote.finish(first, 60) == 0 and read_manifest(out).tp in (4, 2)
    check = CliRunner().invoke(main, ["verify", str(out), "--source", str(source)])
    assert check.exit_code == 0 and check.stdout.startswith("OK "), check.output


def test_a_stale_lock_file_of_a_dead_process_is_taken_over(small_source, tmp_path):
    source, plan = small_source
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_of(out).write_text(dead.stdout)  # what a SIGKILLed conversion leaves: the file, without the flock
    code, stdout, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert code == 0 and not stderr, stderr
    assert not lock_of(out).exists() and verify_checkpoint(out, source=source).ok


def test_a_symlinked_lock_or_partial_never_writes_through_the_link(small_source, tmp_path):
    source, plan = small_source
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock_of(out).symlink_to(victim)
    code, _, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 2, "is a symbolic link")
    assert victim.read_text() == "precious\n" and not out.exists()
    lock_of(out).unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine\n")
    partial_of(out).symlink_to(elsewhere, target_is_directory=True)
    code, _, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert code == 0, stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"] and verify_checkpoint(out, source=source).ok
    assert not partial_of(out).exists() and not partial_of(out).is_symlink()


# ---------------------------------------------------------------------------------------------------------
# Resume re-checks every kept record; a changing source commits nothing


def _partial_after(source: Path, plan: Path, out: Path, tensors: int, monkeypatch) -> list[str]:
    """Leave a partial conversion at tp=2 with `tensors` tensors journalled; returns the write order."""
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    written: list[str] = []

    def crash_after(name: str) -> None:
        written.append(name)
        if len(written) == tensors:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=crash_after)
    job = convert_module.plan_conversion(source, mesh=MeshSpec(tp=2), plan=plan)
    return job.write_order


def _damage(work: Path, chunk, how: str) -> None:
    path = work / chunk.file
    data = bytearray(path.read_bytes())
    if how == "header":
        data[chunk.offset + 5] ^= 0x01
    elif how == "data":
        data[chunk.data_offset + chunk.data_length // 2] ^= 0x20
    elif how == "trailer":
        data[chunk.end - 3] ^= 0x01
    elif how == "cut short":
        del data[chunk.data_offset + 1 :]
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["header", "trailer", "data", "cut short"])
def test_a_damaged_record_in_the_partial_is_redone_with_everything_after_it(small_source, tmp_path, monkeypatch, how):
    source, plan = small_source
    out = tmp_path / "out"
    order = _partial_after(source, plan, out, 18, monkeypatch)
    damaged = 7
    job = convert_module.plan_conversion(source, mesh=MeshSpec(tp=2), plan=plan)
    chunk = job.files.chunks[order[damaged]][-1]
    _damage(partial_of(out), chunk, how)
    written: list[str] = []
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    assert written == order[damaged:]  # the damaged tensor and everything written after it; nothing before
    assert verify_checkpoint(out, source=source).ok
    # torch's own reader of the DCP checkpoint gives back the source, bit for bit
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(out), str(tmp_path / "whole.pt"))
    back = torch.load(tmp_path / "whole.pt", weights_only=True)
    expected = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(back) == sorted(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_a_signal_during_the_resume_check_stops_it_at_the_next_record(small_source, tmp_path, monkeypatch):
    """Re-checking a large partial takes as long as reading it: Ctrl-C must stop that too, not wait for writing."""
    source, plan = small_source
    out = tmp_path / "out"
    order = _partial_after(source, plan, out, 18, monkeypatch)
    journalled = len((partial_of(out) / "journal.jsonl").read_text().splitlines())
    assert journalled >= 10
    before = tree_hash(partial_of(out))
    reads_after_signal: list[int] = []
    real_pread = writer_module.pread_into

    def pread_then_signal(*args, **kwargs):
        if reads_after_signal:
            reads_after_signal[0] += 1
        elif real_pread.calls >= 6:  # in the third kept record's check
            reads_after_signal.append(0)
            os.kill(os.getpid(), signal.SIGINT)
        real_pread.calls += 1
        return real_pread(*args, **kwargs)

    real_pread.calls = 0
    monkeypatch.setattr(writer_module, "pread_into", pread_then_signal)
    written: list[str] = []
    with pytest.raises(Interrupted), command_scope():  # the scope the CLI enters: signals stop at a safe point
        convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    assert reads_after_signal and reads_after_signal[0] <= 3, reads_after_signal  # the rest of one record at most
    assert written == [] and tree_hash(partial_of(out)) == before  # nothing lost: the journal is intact
    monkeypatch.setattr(writer_module, "pread_into", real_pread)
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    assert written == order[journalled:]  # the re-run still keeps every journalled tensor
    assert verify_checkpoint(out, source=source).ok


def test_a_record_damaged_on_disk_while_converting_is_not_blessed_by_the_manifest(small_source, tmp_path, monkeypatch):
    """The file checksums are what the converter wrote, not a re-read of the disk: a byte changed under it (here in a
    record's framing, which no chunk checksum covers) is reported by verify."""
    source, plan = small_source
    out = tmp_path / "out"
    job = convert_module.plan_conversion(source, mesh=MeshSpec(tp=2), plan=plan)
    victim = job.files.chunks[job.write_order[2]][0]
    damaged: list[bool] = []

    def damage_once(name: str) -> None:
        path = partial_of(out) / victim.file
        if not damaged and path.exists() and path.stat().st_size >= victim.end:  # written out, not just staged
            _damage(partial_of(out), victim, "header")
            damaged.append(True)

    # Stages of one block: records are written out as they come, not only at the end (the source is small).
    monkeypatch.setattr(convert_module, "stage_bytes", lambda files: writer_module.ALIGN)
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=damage_once)
    assert damaged, "the record was never written out before the last tensor: nothing was tested"
    problems = verify_checkpoint(out, source=source).problems
    assert any(victim.file in p for p in problems), problems


@pytest.mark.parametrize("change", ["data in place", "header in place", "replaced", "appended"])
def test_a_source_rewritten_during_the_conversion_commits_nothing(small_source, tmp_path, monkeypatch, change):
    original, plan = small_source
    source = Path(shutil.copytree(original, tmp_path / "src"))
    out = tmp_path / "out"
    first = sorted(source.glob("*.safetensors"))[0]
    header_length = struct.unpack("<Q", first.read_bytes()[:8])[0]
    seen: list[str] = []

    def rewrite(name: str) -> None:
        seen.append(name)
        if len(seen) != 10:  # the first file has been read by now
            return
        data = bytearray(first.read_bytes())
        if change == "data in place":
            data[8 + header_length + 100] ^= 0xFF
        elif change == "header in place":
            text = data[8 : 8 + header_length].decode()
            data[8 : 8 + header_length] = text.replace("[32,32]", "[16,64]", 1).encode()  # still a valid file
            assert bytes(data) != first.read_bytes()
        elif change == "appended":
            data += b"\0" * 64
        if change == "replaced":
            temporary = first.with_suffix(".new")
            temporary.write_bytes(bytes(data[:-8]) + bytes(8))
            os.replace(temporary, first)
        else:
            with open(first, "r+b") as f:
                f.write(data)

    with monkeypatch.context() as patch:  # the CLI's call of the library, given the hook
        real = convert_module.convert_checkpoint
        patch.setattr(convert_module, "convert_checkpoint", functools.partial(real, on_tensor=rewrite))
        code, stdout, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 2, f"source file {first.name} changed while it was being converted")
    assert not out.exists() and partial_of(out).is_dir()
    code, _, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress")
    if change == "appended":  # no longer a valid safetensors file: refused up front
        assert_one_line(code, stderr, 2, first.name)
        return
    assert code == 0, stderr  # the new source, converted from scratch
    assert verify_checkpoint(out, source=source).ok


# ---------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, nothing written


def _safetensors(folder: Path, header: dict, data: bytes) -> Path:
    folder.mkdir()
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return folder


def _weights(folder: Path, config: str | None = None, index: str | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"a.weight": torch.randn(8, 8)}, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(config)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder


DEEP = "[" * 100_000 + "]" * 100_000


def _plan(tmp: Path, **fields) -> Path:
    path = tmp / "bad-plan.json"
    path.write_text(fields.pop("text", None) or json.dumps({"name": "p", "linear": [], **fields}))
    return path


def _empty_plan(tmp: Path) -> list:
    """A valid plan, so that a case fails only for what it is about (not for having no plan)."""
    return ["--plan", _plan(tmp)]


BAD_INPUTS = {
    "config.json a list": (lambda t: [_weights(t / "s", "[1, 2]"), "--tp", "1", *_empty_plan(t)], "config.json"),
    "config.json a string": (lambda t: [_weights(t / "s", '"abc"'), "--tp", "1", *_empty_plan(t)], "config.json"),
    "config.json nested deeply": (lambda t: [_weights(t / "s", DEEP), "--tp", "1", *_empty_plan(t)], "too deeply"),
    "index nested deeply": (
        lambda t: [_weights(t / "s", None, '{"weight_map": ' + DEEP + "}"), "--tp", "1", *_empty_plan(t)],
        "nested too deeply",
    ),
    "plan nested deeply": (lambda t: [_weights(t / "s"), "--tp", "1", "--plan", _plan(t, text=DEEP)], "too deeply"),
    "plan attention 5": (lambda t: [_weights(t / "s"), "--tp", "1", "--plan", _plan(t, attention=5)], "'attention'"),
    "plan style 5": (
        lambda t: [_weights(t / "s"), "--tp", "1", "--plan", _plan(t, linear=[{"match": "a", "style": 5}])],
        "style",
    ),
    "attention rule matching no module": (
        lambda t: [_weights(t / "s"), "--tp", "1", "--plan", _plan(t, attention=[{"match": "x.*", "divide": []}])],
        "matches no module",
    ),
    "--tp abc": (lambda t: [_weights(t / "s"), "--tp", "abc", *_empty_plan(t)], "'abc' is not a valid integer"),
    "--ring 0": (lambda t: [_weights(t / "s"), "--tp", "1", "--ring", "0", *_empty_plan(t)], "--ring"),
    "--ulysses 0": (lambda t: [_weights(t / "s"), "--tp", "1", "--ulysses", "0", *_empty_plan(t)], "--ulysses"),
    "--cp 0": (lambda t: [_weights(t / "s"), "--tp", "1", "--cp", "0", *_empty_plan(t)], "--cp"),
    "--order ''": (
        lambda t: [_weights(t / "s"), "--tp", "1", "--order", "", *_empty_plan(t)], "must name each of tp, ring"
    ),
    "--order tp,tp,ring": (
        lambda t: [_weights(t / "s"), "--tp", "1", "--order", "tp,tp,ring", *_empty_plan(t)], "exactly once"
    ),
    "--dtype int8": (lambda t: [_weights(t / "s"), "--tp", "1", "--dtype", "int8", *_empty_plan(t)], "not supported"),
    "bool in a shape": (
        lambda t: [_safetensors(t / "s", {"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, bytes(8)),
                   "--tp", "1", *_empty_plan(t)],
        "invalid shape",
    ),
    "non-string __metadata__": (
        lambda t: [_safetensors(t / "s", {"__metadata__": {"format": 1},
                                          "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
                   "--tp", "1", *_empty_plan(t)],
        "__metadata__",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, case):
    make, fragment = BAD_INPUTS[case]
    args = make(tmp_path)
    before = tree_hash(tmp_path)
    out = tmp_path / "out"
    code, stdout, stderr = cli(args[0], out, *args[1:], "--no-progress")
    assert_one_line(code, stderr, 2, fragment)
    assert tree_hash(tmp_path) == before and not out.exists() and not partial_of(out).exists()
    assert not lock_of(out).exists()


def test_output_paths_that_cannot_work_are_refused_before_anything_is_written(small_source, tmp_path, monkeypatch):
    source, plan = small_source
    done = tmp_path / "done"
    assert cli(source, done, "--tp", "2", "--plan", plan, "--no-progress")[0] == 0
    sub = done / "sub"
    sub.mkdir()
    link = tmp_path / "link"
    link.symlink_to(done, target_is_directory=True)
    before = tree_hash(tmp_path)
    cases = [(done, ".", "is the current folder"), (sub, str(done), "holds the current folder"),
             (tmp_path, str(link), "is a symbolic link"), (tmp_path, str(source), "overlaps the source"),
             (tmp_path, str(source.parent), "overlaps the source")]  # fmt: skip
    for cwd, out, fragment in cases:
        monkeypatch.chdir(cwd)
        code, _, stderr = cli(source, out, "--tp", "2", "--plan", plan, "--no-progress", "--overwrite")
        assert_one_line(code, stderr, 2, fragment)
        assert tree_hash(tmp_path) == before, out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "link"]
    assert verify_checkpoint(done).ok


def _linear_checkpoint(tmp: Path) -> Path:
    from safetensors.torch import save_file

    layer = nn.Linear(4, 4)
    (tmp / "lin").mkdir()
    save_file({k: v.detach() for k, v in layer.state_dict().items()}, str(tmp / "lin" / "model.safetensors"))
    (tmp / "lin" / "config.json").write_text(json.dumps({"in_features": 4, "out_features": 4}))
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"name": "lin", "linear": []}))
    convert_checkpoint(tmp / "lin", tmp / "ckpt", tp=1, plan=plan, progress=False)
    return tmp / "ckpt"


def test_load_sharded_bad_arguments_are_one_line_errors(tmp_path):
    ckpt = _linear_checkpoint(tmp_path)

    def factory() -> nn.Module:
        return nn.Linear(4, 4)

    cases = [
        (lambda: load_sharded(nn.Linear, ckpt, device="cpu"), MismatchError, "names no model class (_class_name)"),
        (lambda: load_sharded(factory, ckpt, device="cpu", dtype=torch.int8), UsageError, "not supported"),
        (lambda: load_sharded(factory, ckpt, device="cpu", dtype="int8"), UsageError, "not supported"),
        (lambda: load_sharded(factory, ckpt, device="cpu", ring=0), UsageError, "ring"),
        (lambda: load_sharded(factory, ckpt, device="cpu", ulysses=0), UsageError, "ulysses"),
        (lambda: load_sharded(factory, ckpt, device="cpu", order=""), UsageError, "must name each of"),
        (lambda: convert_checkpoint(tmp_path / "lin", tmp_path / "o", tp=1, ring=0), UsageError, "ring"),
        (lambda: convert_checkpoint(tmp_path / "lin", tmp_path / "o", tp=1, order=""), UsageError, "must name"),
        (lambda: MeshSpec(tp=2, ulysses=0), UsageError, "ulysses"),
    ]
    for call, kind, fragment in cases:
        with pytest.raises(kind, match=None) as info:
            call()
        message = str(info.value)
        assert fragment in message and "\n" not in message, message
    assert not (tmp_path / "o").exists()
    half = load_sharded(factory, ckpt, device="cpu", dtype="fp16")  # an accepted spelling loads, cast
    assert half.weight.dtype == torch.float16


# ---------------------------------------------------------------------------------------------------------
# Zero-size tensors (legal in safetensors)


class ZeroSized(nn.Module):
    """Linear layers with an empty side, under every style, plus empty parameters that are replicated."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
            self.col_empty_out = nn.Linear(8, 0)  # colwise weight (0, 8), bias (0,)
            self.col_empty_in = nn.Linear(0, 8)  # colwise weight (8, 0): two empty chunks at tp=2
            self.row_empty_in = nn.Linear(0, 8)  # rowwise weight (8, 0)
            self.row_empty_out = nn.Linear(8, 0)  # rowwise weight (0, 8): two empty chunks at tp=2
            self.packed = nn.Linear(0, 8)  # packed_colwise (8, 0), 2 blocks: four empty chunks at tp=2
        self.dense = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty2d = nn.Parameter(torch.zeros(0, 3))
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + i)


ZERO_PLAN = {"name": "zero", "linear": [
    {"match": "col_empty_out", "style": "colwise"}, {"match": "col_empty_in", "style": "colwise"},
    {"match": "row_empty_in", "style": "rowwise"}, {"match": "row_empty_out", "style": "rowwise"},
    {"match": "packed", "style": "packed_colwise", "blocks": 2}, {"match": "dense", "style": "colwise"}]}  # fmt: skip


def _load_zero_rank(rank: int, world_size: int, checkpoint: str) -> dict:
    init_gloo()
    from preshard.runtime.saving import local_state_dict

    model = load_sharded(ZeroSized, checkpoint, device="cpu")
    with local_state_dict(model):  # this rank's slices (state_dict() alone gathers the full tensors)
        local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"local": local, "full": full}


@pytest.fixture(scope="module")
def zero_sized(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("zero")
    state = {k: v.detach().clone() for k, v in ZeroSized().state_dict().items()}
    (root / "src").mkdir()
    save_file(state, str(root / "src" / "model.safetensors"))
    (root / "src" / "config.json").write_text(json.dumps({"_class_name": "ZeroSized"}))
    (root / "plan.json").write_text(json.dumps(ZERO_PLAN))
    return root / "src", root / "plan.json", state


@pytest.mark.parametrize("tp", [1, 2])
def test_zero_size_tensors_convert_verify_and_load(zero_sized, tmp_path, tp):
    source, plan, state = zero_sized
    out = tmp_path / "out"
    code, _, stderr = cli(source, out, "--tp", str(tp), "--plan", plan, "--no-progress")
    assert code == 0, stderr
    check = CliRunner().invoke(main, ["verify", str(out), "--source", str(source)])
    assert check.exit_code == 0 and check.stdout.startswith("OK "), check.output
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(out), str(tmp_path / "whole.pt"))
    back = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    if tp == 1:
        loaded = load_sharded(ZeroSized, out, device="cpu").state_dict()
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        return
    ranks = run_ranks(_load_zero_rank, 2, str(out), timeout=120)
    records = read_manifest(out).tensors
    for rank, got in enumerate(ranks):
        loaded = got["local"]
        assert sorted(got["full"]) == sorted(state) and all(torch.equal(got["full"][k], state[k]) for k in state)
        for name, full in state.items():
            layout = records[name].layout
            d = layout.shard_dim
            if d is None:
                assert torch.equal(loaded[name], full), (rank, name)
            else:
                pieces = [full.narrow(d, offsets[d], sizes[d]) for offsets, sizes in layout.boxes(2, rank)]
                assert torch.equal(loaded[name], torch.cat(pieces, d)), (rank, name)
