"""Crash soak for `convert-checkpoint`: SIGKILL, SIGTERM and SIGINT at random moments, through the command line.

    python scripts/crash_soak.py                          # 200 signals, a 30 MiB synthetic checkpoint, tp 4 <-> 2
    python scripts/crash_soak.py --signals 60 --blocks 24 --seed 3

Every conversion is the command line itself (`preshard.cli:convert_checkpoint_command`, what the
`convert-checkpoint` script runs) in its own process, forked from a zygote that has already imported
preshard and torch: a process costs milliseconds instead of a 3-5 s interpreter start, yet it parses
its arguments, installs its signal handlers, exits and finalises exactly as the script does. The
parent signals it at a random moment: after a random delay, or once the partial output holds a random
number of bytes. Whether the signal landed while tensors were being written is decided from what the
child did, not from the loop: the child's own write counter (`/proc/<pid>/io` wchar, read by the zygote
at the instant it sends the signal) shows tensor bytes had gone out, and the partial's data files,
after the child is gone, still fall short of the full size (they only grow while tensors are written).

After every signal:
- SIGINT/SIGTERM: exit status 130/143 and exactly one line on stderr, no traceback, no "Exception
  ignored" (or 0 and nothing, if the conversion finished first); the partial kept for a resume;
- the output path holds the previous checkpoint untouched, or a complete new one that verifies bit for
  bit against the source (`verify --source`); a previous checkpoint is never lost;
- now and then the conversion is finished in this process: it must skip exactly the tensors the
  journal holds (when the partial is this job's) and verify against the source. Runs alternate
  `--overwrite` of an existing checkpoint, fresh outputs and (with `--tp` twice) a change of mesh,
  whose re-run must start over.

Prints a summary (signals by kind and where they landed, exits, re-runs, reuse, bad outputs) and exits
1 on any failure. `tests/test_signals_and_concurrency.py` runs the same harness in CI with fewer signals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preshard.converter.convert import convert_checkpoint
from preshard.converter.workdir import JOB_NAME, JOURNAL_NAME, lock_path, partial_dir
from preshard.format.manifest import MANIFEST_NAME, read_manifest
from preshard.tools.verify import verify_checkpoint

PLAN = {
    "name": "synthetic",
    "linear": [
        {"match": "blocks.*.attn.to_q", "style": "colwise"},
        {"match": "blocks.*.attn.to_out", "style": "rowwise"},
        {"match": "blocks.*.ff.proj", "style": "packed_colwise", "blocks": 2},
        {"match": "blocks.*.ada", "style": "replicated_input_rowwise"},
    ],
}
SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGKILL: "SIGKILL"}
# A SIGINT/SIGTERM that arrives once the child is past its last check may let it finish: then exit 0.
EXPECTED_EXIT = {signal.SIGINT: (130, 0), signal.SIGTERM: (143, 0), signal.SIGKILL: (-signal.SIGKILL, 0)}
# Bytes a conversion writes besides tensor records before its first record: its pid in the lock file,
# job.json, the journal's kept lines (counted separately). More than this (plus the journal) = records.
NON_RECORD_SLACK = 4096


def build_source(folder: Path, *, blocks: int = 25, width: int = 256, files: int = 3, seed: int = 0) -> Path:
    """A synthetic diffusers-style checkpoint: 8 tensors per block (every sharding style, bf16 and fp32),
    split over `files` safetensors files with an index; the JSON plan is written next to it as plan.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    state: dict[str, torch.Tensor] = {}
    for b in range(blocks):
        p = f"blocks.{b}"
        state[f"{p}.attn.to_q.weight"] = rand(width, width)
        state[f"{p}.attn.to_q.bias"] = rand(width)
        state[f"{p}.attn.to_out.weight"] = rand(width, width)
        state[f"{p}.attn.to_out.bias"] = rand(width, dtype=torch.float32)
        state[f"{p}.ff.proj.weight"] = rand(2 * width, width)
        state[f"{p}.ff.proj.bias"] = rand(2 * width)
        state[f"{p}.ada.weight"] = rand(width, width, dtype=torch.float32)
        state[f"{p}.norm.weight"] = rand(width, dtype=torch.float32)
    names = list(state)
    per_file = -(-len(names) // files)
    weight_map = {}
    for i in range(files):
        file_name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: state[n] for n in names[i * per_file : (i + 1) * per_file]}
        save_file(part, str(folder / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder.parent / "plan.json").write_text(json.dumps(PLAN))
    return folder


# ---------------------------------------------------------------------------------------------------------
# The zygote: a process that has imported preshard and forks one command-line run per request


def _zygote_child(request: dict, protocol_fds: tuple[int, ...]) -> None:
    """In the forked child: become `convert-checkpoint ARGS` with stdout/stderr in files. Never returns: the
    SystemExit it ends with unwinds to the interpreter's top level, which finalises as the real script's does."""
    for fd in protocol_fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for target, path in ((1, request["stdout"]), (2, request["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.close(null)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter starts with
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from preshard.cli import convert_checkpoint_command

    sys.argv = ["convert-checkpoint", *request["args"]]
    sys.exit(convert_checkpoint_command())


def _running(pid: int) -> bool:
    """Not yet exited (a zombie has exited: its status waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _lock_state(output: Path) -> tuple[int, int] | None:
    """The output's lock file as (inode, mtime), None if there is none: a run that takes the lock writes its pid."""
    try:
        stat = lock_path(output).stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def written_bytes(pid: int) -> int | None:
    """Bytes the process has passed to write/pwrite so far (Linux /proc/<pid>/io), None if unreadable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def serve_zygote() -> None:
    """The zygote's loop: requests are JSON lines on stdin, replies and exit reports JSON lines on stdout.

    No try/finally or with-block encloses the fork: a child's SystemExit must unwind straight to the top.
    """
    import preshard.cli  # noqa: F401  (preloaded, so that each forked run starts at once and imports nothing:
    import preshard.converter.convert  # noqa: F401  a module compiled in the child would add to its write count)
    import preshard.tools.inspect  # noqa: F401

    requests, replies = 0, os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing but replies may reach the protocol pipe
    os.close(devnull)
    live: set[int] = set()
    pending = b""

    def send(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    def reap() -> None:
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            live.discard(pid)
            send({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    send({"op": "ready"})
    while True:
        ready, _, _ = select.select([requests], [], [], 0.002)
        reap()
        if not ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _zygote_child(request, (requests, replies))
                live.add(pid)
                send({"op": "spawned", "id": request["id"], "pid": pid})
            elif request["op"] == "signal":
                reap()
                pid, wchar, alive = request["pid"], None, False
                if pid in live and _running(pid):  # not reaped, so the pid is still this child's
                    alive, wchar = True, written_bytes(pid)
                    os.kill(pid, request["signal"])
                send({"op": "signalled", "id": request["id"], "pid": pid, "alive": alive, "wchar": wchar})
    for pid in live:
        os.kill(pid, signal.SIGKILL)
    while live:
        pid, _ = os.waitpid(-1, 0)
        live.discard(pid)


@dataclass
class Run:
    """One command-line run forked by the zygote."""

    pid: int
    stdout: Path
    stderr: Path
    started: float
    code: int | None = None

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(errors="replace"), self.stderr.read_text(errors="replace")


class Zygote:
    """Client side: start the zygote, fork runs of `convert-checkpoint`, signal them, collect exit statuses."""

    def __init__(self, logs: Path, timeout: float = 120.0) -> None:
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self._ids = 0
        self._replies: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the harness, not every child at once
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_for(lambda: self._replies.pop(-1, None), "the zygote to start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._cond:
                if message["op"] == "exited":
                    self._exits[message["pid"]] = message["code"]
                else:
                    self._replies[message.get("id", -1)] = message
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait_for(self, take, what: str, timeout: float | None = None):
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while True:
                value = take()
                if value is not None:
                    return value
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the zygote exited ({self.proc.returncode}) while waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))

    def _request(self, message: dict) -> dict:
        self._ids += 1
        message["id"] = self._ids
        with self._write_lock:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        reply = self._wait_for(lambda: self._replies.pop(message["id"], None), message["op"])
        if reply is None:
            raise RuntimeError(f"the zygote did not answer {message['op']}")
        return reply

    def spawn(self, args: list[str], cwd: Path | None = None) -> Run:
        """Fork `convert-checkpoint ARGS` (run from `cwd`)."""
        stem = self.logs / f"run-{self._ids + 1}"
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        request = {"op": "spawn", "args": [str(a) for a in args], "stdout": str(out), "stderr": str(err)}
        reply = self._request({**request, "cwd": str(cwd or "")})
        return Run(reply["pid"], out, err, time.monotonic())

    def signal(self, run: Run, signum: int) -> tuple[bool, int | None]:
        """Send `signum` unless the run has already exited. Returns whether it was sent, and the bytes the run had
        written by then (/proc/<pid>/io wchar; None where unreadable)."""
        reply = self._request({"op": "signal", "pid": run.pid, "signal": int(signum)})
        return reply["alive"], reply["wchar"]

    def poll(self, run: Run) -> int | None:
        with self._cond:
            run.code = self._exits.get(run.pid, run.code)
        return run.code

    def wait(self, run: Run, timeout: float | None = None) -> int | None:
        """The run's exit status (negative: killed by that signal), or None if it is still running at `timeout`."""
        code = self._wait_for(lambda: self._exits.get(run.pid), f"pid {run.pid} to exit", timeout)
        run.code = code
        return code

    def finish(self, run: Run, timeout: float | None = None) -> int:
        """Wait for the run; SIGKILL it if it outlives `timeout` (and report that as a failure to the caller)."""
        code = self.wait(run, timeout)
        if code is None:
            self.signal(run, signal.SIGKILL)
            code = self.wait(run, 30)
            raise RuntimeError(f"run {run.pid} hung and was killed (exit {code}); stderr: {run.output()[1][-500:]}")
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the zygote kills and reaps what is left, then exits
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._reader.join(10)
        self.proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------
# The harness


def data_bytes(folder: Path) -> int:
    """What the data files in `folder` hold now (0 when it does not exist)."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(".distcp"):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
    except (FileNotFoundError, NotADirectoryError):
        return 0
    return total


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]] | None:
    """(size, mtime, inode) of every file in `folder`: equal snapshots mean the folder was not touched."""
    if not folder.is_dir():
        return None
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino) for p in folder.iterdir()}


def journal_entries(work: Path) -> int:
    """Complete journal lines in the partial folder (what a resume of the same job would try to keep)."""
    try:
        text = (work / JOURNAL_NAME).read_text()
    except OSError:
        return 0
    count = 0
    for line in text.split("\n")[:-1]:
        try:
            json.loads(line)
        except ValueError:
            break
        count += 1
    return count


@dataclass
class Mesh:
    tp: int
    seconds: float = 0.0  # a full conversion, as last measured
    total_bytes: int = 0  # of the data files of a complete conversion
    tensors: int = 0
    job: str | None = None  # the partial folder's job key, once seen


@dataclass
class SoakStats:
    sent: Counter = field(default_factory=Counter)  # by signal
    landed: Counter = field(default_factory=Counter)  # (signal, where)
    exits: Counter = field(default_factory=Counter)  # (signal, status)
    commits_checked: int = 0  # outputs that changed and were verified against the source
    overwrites: int = 0  # signalled runs that were replacing an existing checkpoint
    mesh_changes: int = 0
    reruns: int = 0
    resumes: int = 0  # re-runs that kept tensors of a signalled run
    tensors_reused: int = 0
    restarts_after_mesh_change: int = 0  # re-runs whose partial was another mesh's, so redone from scratch
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def signals(self) -> int:
        return sum(self.sent.values())

    def while_writing(self, signum: int | None = None) -> int:
        return sum(n for (s, where), n in self.landed.items() if where == "while writing" and signum in (None, s))

    def summary(self) -> str:
        kinds = ", ".join(f"{SIGNAL_NAMES[s]} {n}" for s, n in sorted(self.sent.items()))
        places = sorted({where for _, where in self.landed})
        landed = "; ".join(
            f"{where}: " + ", ".join(f"{SIGNAL_NAMES[s]} {self.landed[s, where]}" for s in sorted(self.sent))
            for where in places
        )
        exits = ", ".join(f"{SIGNAL_NAMES[s]}->{code}: {n}" for (s, code), n in sorted(self.exits.items()))
        lines = [
            f"signals: {self.signals} ({kinds}); landed while tensors were being written: {self.while_writing()}",
            f"where they landed: {landed}",
            f"exit statuses: {exits}",
            f"signalled runs replacing an existing checkpoint (--overwrite): {self.overwrites}; mesh changes: "
            f"{self.mesh_changes}",
            f"re-runs to completion: {self.reruns}, of which resumes: {self.resumes} ({self.tensors_reused} tensors "
            f"reused), restarts after a mesh change: {self.restarts_after_mesh_change}",
            f"changed outputs verified against the source: {self.commits_checked}",
            f"bad outputs or wrong behaviour: {len(self.failures)}",
            *[f"  {f}" for f in self.failures[:20]],
            f"time: {self.seconds:.1f} s",
        ]
        return "\n".join(lines)


class CrashHarness:
    """Signal-and-check loop around `convert-checkpoint` runs on one source and output, over one or more meshes."""

    def __init__(
        self, zygote: Zygote, source: Path, plan: Path, output: Path, *, tps: tuple[int, ...] = (4,), seed: int = 0
    ) -> None:
        self.zygote = zygote
        self.source, self.plan, self.output = Path(source), Path(plan), Path(output)
        self.work = partial_dir(self.output)
        self.rng = random.Random(seed)
        self.meshes = [Mesh(tp) for tp in tps]
        self.mesh = self.meshes[0]
        self.stats = SoakStats()
        self.verified: dict[str, tuple[int, int, int]] | None = None  # snapshot of the output when last verified

    def args(self, mesh: Mesh) -> list[str]:
        args = [self.source, self.output, "--tp", str(mesh.tp), "--plan", self.plan, "--no-progress"]
        return [*args, "--overwrite"] if self.output.exists() else args

    def calibrate(self) -> None:
        """One full command-line run per mesh, timed, its output verified; then no output is left."""
        for mesh in self.meshes:
            shutil.rmtree(self.output, ignore_errors=True)
            start = time.monotonic()
            run = self.zygote.spawn(self.args(mesh))
            code = self.zygote.finish(run)
            mesh.seconds = time.monotonic() - start
            if code != 0:
                raise RuntimeError(f"the calibration run at tp={mesh.tp} failed ({code}): {run.output()[1][-500:]}")
            result = verify_checkpoint(self.output, source=self.source)
            if not result.ok:
                raise RuntimeError(f"the calibration output does not verify: {result.problems[:3]}")
            manifest = read_manifest(self.output)
            mesh.total_bytes = sum(f.size for f in manifest.files)
            mesh.tensors = len(manifest.tensors)
        shutil.rmtree(self.output, ignore_errors=True)

    def _fail(self, message: str) -> None:
        self.stats.failures.append(f"signal {self.stats.signals}: {message}")

    def _check_output(self, before, had_output: bool, when: str) -> None:
        """The output is the one last verified, untouched, or a complete new one that verifies with the source."""
        after = snapshot(self.output)
        if after is None:
            if had_output:
                self._fail(f"{when}: the previous checkpoint at {self.output} is gone")
            return
        if after == before and after == self.verified:
            return
        if not (self.output / MANIFEST_NAME).is_file():
            self._fail(f"{when}: {self.output} exists without a manifest (a half-written output)")
            return
        result = verify_checkpoint(self.output, source=self.source)
        self.stats.commits_checked += 1
        if not result.ok:
            self._fail(f"{when}: {self.output} does not verify against the source: {result.problems[:3]}")
        self.verified = snapshot(self.output)

    def _wait_until(self, run: Run, mode: str, journal_before: int) -> float:
        """Block until the moment to signal `run`: a random delay, or once it has written a random share of what is
        left to write (its own write counter, so a resume's re-reading and truncating do not count)."""
        mesh = self.mesh
        if mode == "time":
            delay = self.rng.uniform(0.0, 1.1 * mesh.seconds)
            self.zygote.wait(run, delay)
            return delay
        left = mesh.total_bytes * (1 - journal_entries(self.work) / max(1, mesh.tensors))
        target = journal_before + NON_RECORD_SLACK + self.rng.uniform(0.0, left)
        deadline = time.monotonic() + 10 * mesh.seconds + 5
        while time.monotonic() < deadline and self.zygote.poll(run) is None:
            if (written_bytes(run.pid) or 0) >= target:
                break
            time.sleep(0.001)
        return target

    def _landed(self, sent: bool, wchar: int | None, journal_before: int) -> str:
        """Where the signal landed, from what the child had done, never from the loop.

        While writing: the child had written tensor records by the instant of the signal (its write count exceeds
        what it writes besides records: lock, job.json, the journal it rewrote), and after it is gone the partial
        still has its job.json (removed only once every tensor is written) and less than the full data (the data
        files only grow while tensors are written, so they were short at the signal too).
        """
        if not sent:
            return "after the run ended"
        if wchar is None:
            return "unknown (no /proc/<pid>/io)"
        if wchar <= journal_before + NON_RECORD_SLACK:
            return "before any tensor was written"
        if (self.work / JOB_NAME).is_file() and data_bytes(self.work) < self.mesh.total_bytes:
            return "while writing"
        return "after the tensors were written"

    def signal_once(self, signum: int, mode: str) -> str:
        """Start a conversion, signal it at a random moment, check everything; returns where the signal landed."""
        mesh = self.mesh
        before = snapshot(self.output)
        had_output = before is not None and (self.output / MANIFEST_NAME).is_file()
        journal = self.work / JOURNAL_NAME
        journal_before = journal.stat().st_size if journal.is_file() else 0
        lock_before = _lock_state(self.output)  # a killed run's lock file: the next run takes it over
        run = self.zygote.spawn(self.args(mesh))
        at = self._wait_until(run, mode, journal_before)
        sent, wchar = self.zygote.signal(run, signum)
        self.stats.sent[signum] += 1
        self.stats.overwrites += had_output
        try:
            code = self.zygote.finish(run, 60)
        except RuntimeError as exc:
            self._fail(str(exc))
            return "hung"
        stdout, stderr = run.output()
        where = self._landed(sent, wchar, journal_before)
        if where == "while writing":
            mesh.job = json.loads((self.work / JOB_NAME).read_text())["job"]
        self.stats.landed[signum, where] += 1
        self.stats.exits[signum, code] += 1
        name = f"{SIGNAL_NAMES[signum]} at {mode} {at:.3g} ({where}, tp={mesh.tp})"
        allowed = EXPECTED_EXIT[signum] if sent else (0,)
        if code not in allowed:
            self._fail(f"{name}: exit status {code}, expected one of {allowed}; stderr: {stderr[-800:]!r}")
        lines = stderr.splitlines()
        if code in (130, 143):
            word = "interrupted" if code == 130 else "terminated"
            if len(lines) != 1 or not lines[0].startswith(f"error: {word}"):
                self._fail(f"{name}: stderr is not one 'error: {word}' line: {stderr[-800:]!r}")
            if where == "while writing":
                if "re-run the same command to resume" not in stderr:
                    self._fail(f"{name}: the message does not say how to resume: {stderr!r}")
                if not self.work.is_dir():
                    self._fail(f"{name}: the partial output was not kept")
        elif code == 0 and (stderr or not stdout.startswith("wrote ")):
            self._fail(f"{name}: a finished run printed {stdout!r} / {stderr!r}")
        lock_after = _lock_state(self.output)
        if code != -signal.SIGKILL and lock_after is not None and lock_after != lock_before:
            self._fail(f"{name}: the lock file was left behind by a run that exited")
        # (A lock file a killed run left, which this run never reached, untouched: stopped before taking the lock.)
        self._check_output(before, had_output, name)
        return where

    def rerun(self) -> None:
        """Finish the conversion in this process; it must keep exactly the journalled tensors of its own job."""
        mesh = self.mesh
        try:
            job = json.loads((self.work / JOB_NAME).read_text())["job"]
        except (OSError, ValueError, KeyError, TypeError):
            job = None
        entries = journal_entries(self.work)
        if job is None:
            expected = mesh.tensors  # nothing to resume
        elif job == mesh.job:
            expected = mesh.tensors - entries  # every journalled tensor kept, the rest written
        elif any(job == m.job for m in self.meshes if m is not mesh):
            expected = mesh.tensors  # another mesh's partial: discarded, everything written again
        else:
            expected = None  # a partial of a job not seen yet: only the result can be checked
        written: list[str] = []
        try:
            convert_checkpoint(
                self.source, self.output, tp=mesh.tp, plan=self.plan, overwrite=True, progress=False,
                on_tensor=written.append,
            )  # fmt: skip
        except Exception as exc:  # a failed re-run is a finding, not a crash of the harness
            self._fail(f"re-run at tp={mesh.tp} failed: {type(exc).__name__}: {exc}")
            return
        self.stats.reruns += 1
        if expected is not None and len(written) != expected:
            self._fail(f"re-run at tp={mesh.tp} wrote {len(written)} tensors, not {expected} ({entries} journalled)")
        if len(written) < mesh.tensors:
            self.stats.resumes += 1
            self.stats.tensors_reused += mesh.tensors - len(written)
        elif job is not None and job != mesh.job and entries:
            self.stats.restarts_after_mesh_change += 1
        if self.work.exists():
            self._fail(f"re-run at tp={mesh.tp} left the partial folder behind")
        self._check_output(None, True, f"re-run at tp={mesh.tp}")

    def run(
        self,
        max_signals: int,
        *,
        need_while_writing: int = 0,
        need_each: int = 0,
        rerun_every: int = 4,
        reset_probability: float = 0.3,
        mesh_change_probability: float = 0.25,
        byte_trigger_share: float = 0.7,
    ) -> SoakStats:
        """Signal up to `max_signals` runs, cycling SIGINT, SIGTERM, SIGKILL; stop early once `need_while_writing`
        signals (and `need_each` of every kind) have landed while tensors were being written."""
        start = time.monotonic()
        if not all(m.total_bytes for m in self.meshes):
            self.calibrate()
        kinds = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
        while self.stats.signals < max_signals:
            if need_while_writing and self.stats.while_writing() >= need_while_writing:
                if all(self.stats.while_writing(s) >= need_each for s in kinds):
                    break
            signum = kinds[self.stats.signals % len(kinds)]
            mode = "bytes" if self.rng.random() < byte_trigger_share else "time"
            self.signal_once(signum, mode)
            if len(self.meshes) > 1 and self.rng.random() < mesh_change_probability:
                # The next run (a signalled one, or the re-run below) meets the other mesh's partial and output.
                self.mesh = self.rng.choice([m for m in self.meshes if m is not self.mesh])
                self.stats.mesh_changes += 1
            if self.stats.signals % rerun_every == 0:
                self.rerun()
                if self.rng.random() < reset_probability:
                    shutil.rmtree(self.output)
                    self.verified = None
        self.rerun()
        self.stats.seconds = time.monotonic() - start
        return self.stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signals", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=40, help="8 tensors per block")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tp", type=int, action="append", help="TP degrees to alternate (default: 4 and 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rerun-every", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    args = parser.parse_args(argv)
    tps = tuple(args.tp or (4, 2))

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="preshard-soak-")
        workdir = Path(tmp.name)
    try:
        with Zygote(workdir / "logs") as zygote:
            source = build_source(workdir / "src", blocks=args.blocks, width=args.width, seed=args.seed)
            harness = CrashHarness(zygote, source, workdir / "plan.json", workdir / "out", tps=tps, seed=args.seed)
            harness.calibrate()
            size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
            times = ", ".join(f"tp={m.tp} {m.seconds:.2f} s" for m in harness.meshes)
            print(f"source: {harness.mesh.tensors} tensors, {size / 2**20:.1f} MiB; full runs: {times}", flush=True)
            stats = harness.run(args.signals, rerun_every=args.rerun_every)
        print(stats.summary())
        return 1 if stats.failures else 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        serve_zygote()
    else:
        sys.exit(main())
