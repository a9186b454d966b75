"""Hostile soak: a few hundred mixed cases a hostile user would try, through the command line and the library,
and a count of what held.

    python scripts/hostile_soak.py                       # every class, about 310 cases
    python scripts/hostile_soak.py --classes links,headers --seed 3

Each case builds its own hostile input in a temporary folder, runs one command and checks the contract: one
line `error: ...` and exit status 2 (130/143 for a signal), no traceback, nothing written, nothing followed out
of the checkpoint folder, no wait on a FIFO, bounded time and memory; or, where the input is legitimate, a
correct result. The classes (issue 20):

- resume: a conversion stopped after k tensors, then one source file swapped for another of the same size,
  header and mtime (in place, or renamed over it), or not swapped at all; the re-run must verify bit for bit
  against the source as it is now and be byte-identical to a fresh conversion of it.
- links: manifest.json, .metadata, config.json or a data file replaced by a symbolic link to a copy outside the
  folder, under verify, inspect, a CP-only and a TP reshard, unshard and load_sharded: refused, naming the link;
  a link that stays inside the folder is followed.
- special: the same files replaced by a FIFO or a Unix socket: refused in one line, never waited on.
- headers: safetensors headers whose shapes overflow int64 (a dimension of 2**63 with no elements, strides past
  2**63) under convert, plan and verify --source: one line, fast; huge zero-element shapes that do fit: converted
  without iterating over their rows.
- manifests: re-sealed manifests (digest recomputed) with a mesh of 10**12 ranks, a NUL byte or a path in a
  recorded name, a shape past int64: one line from verify, inspect, reshard, unshard and load_sharded, fast.
- signals: SIGINT or SIGTERM at a random moment of a fresh `python -m preshard.cli convert` (start-up imports
  included): never exit 0 after the signal; one line and 130/143, or death by the signal before anything is
  written.
- misuse: load_sharded given a manifest or data file path, a folder without a manifest: one line naming the fix.
- jobs: two gloo ranks, one delayed across an --overwrite of the checkpoint (or not: the control): refused on
  both ranks with the same line; the control loads.

Round 4 (issue 31):

- edges: plan --devices past the world-size cap, --device-memory inf, an output of only spaces, a source that is
  not UTF-8, manifests of a past or future version (a CorruptCheckpointError): one line each, nothing written.
- sources: a dangling config.json link, a FIFO config, an empty index: one line; config.json edited or swapped
  for a FIFO while the tensors are written: the committed config is the one planned from, no hang.
- reads: a flipped bit in a data file: refused by load_sharded's default (and verify=True); verify=False loads.
- ranks: two gloo ranks, one never joining, one refused its device before joining, one asking another dtype:
  every rank that called load_sharded fails with one line; the control loads.
- hub: a conversion from a Hub repo, and a load of a converted one, on a fake Hub on the loopback
  (tests/support/fake_hub.py) answering 503 once, 429 twice with Retry-After, 503 always, dropping the connection
  mid-body, cutting a body short, an X-Repo-Commit that is no commit hash, slowly (past a 1 s read timeout), or
  other bytes of the same length: transient faults retried (counted from the fake Hub's request log) to the bytes a
  local conversion writes; lasting ones one line, nothing written.
- cache: a converted checkpoint in the HF cache, offline, a blob replaced by one of the same size (a flipped bit,
  another conversion's data file, config.json or manifest.json edited): refused by load_sharded's default; the
  control and verify=False load.
- group: a gloo group the caller made with a 600 s timeout, each rank its own process (tests/support/group_rank.py):
  a rank killed before load_sharded (rank 0, the store's server, too), refused its device, given another or a bad
  dtype, or missing the checkpoint: every other rank exits 1 with one line within timeout=; the control loads.
- lora: a LoRA with NaN or Inf in a factor or bias, an alpha of NaN or +-Inf, a --lora-scale of 1e300, nan or inf,
  factors whose product overflows float32: one line naming the module, nothing written; the control converts.

More classes live in `scripts/hostile_soak_*.py`, one module per topic: each names its classes in
`CASES: dict[str, Callable[[Soak], list[Case]]]` and is found here by its file name (this folder's own code,
nothing a data file names).

Prints one line per class (cases, held) and every failure; exits 1 on any failure.
`tests/test_untrusted_input.py` runs a smaller mix in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import crash_soak  # noqa: E402  (scripts/: the synthetic source builder)

# The topic modules (hostile_soak_*.py) import this one by name: run as a script, it is that module too.
sys.modules.setdefault("hostile_soak", sys.modules[__name__])

from preshard.errors import CorruptCheckpointError, PreshardError  # noqa: E402
from preshard.format.jsonio import canonical_json  # noqa: E402

CASE_TIMEOUT_S = 120  # a case that takes longer hangs (a FIFO waited on, an unbounded loop): a failure
FILES = ("manifest.json", ".metadata", "config.json", "__0_0.distcp")
COMMANDS = ("verify", "inspect", "reshard-cp", "reshard-tp", "unshard", "load")
# Which command opens which file of a (tp=1) checkpoint: a link or FIFO in place of a file a command never opens
# does not concern it (it must simply work).
OPENS = {
    "manifest.json": set(COMMANDS),
    ".metadata": {"verify", "reshard-cp"},
    "config.json": set(COMMANDS) - {"inspect"},
    "__0_0.distcp": set(COMMANDS) - {"inspect"},
}
WIDTH, BLOCKS = 32, 3


# ---------------------------------------------------------------------------------------------------------
# Inputs


class SyntheticModel(nn.Module):
    """The module tree of `crash_soak.build_source`'s tensors, so that load_sharded can load those checkpoints."""

    def __init__(self, blocks: int = BLOCKS, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            block = nn.Module()
            block.attn = nn.Module()
            block.attn.to_q = nn.Linear(width, width)
            block.attn.to_out = nn.Linear(width, width)
            block.ff = nn.Module()
            block.ff.proj = nn.Linear(width, 2 * width)
            block.ada = nn.Linear(width, width, bias=False)
            block.norm = nn.Module()
            block.norm.weight = nn.Parameter(torch.empty(width))
            self.blocks.append(block)


def build_checkpoint(root: Path, seed: int = 0, tp: int = 1) -> tuple[Path, Path, Path]:
    """(source, plan, checkpoint): the synthetic source (with a config.json naming SyntheticModel) converted at `tp`
    (1: it loads in this one process)."""
    from preshard.converter.convert import convert_checkpoint

    source = crash_soak.build_source(root / "src", blocks=BLOCKS, width=WIDTH, seed=seed)
    (source / "config.json").write_text(json.dumps({"_class_name": "SyntheticModel", "width": WIDTH}))
    plan = root / "plan.json"  # build_source writes it beside the source
    checkpoint = root / "ck"
    convert_checkpoint(source, checkpoint, tp=tp, plan=str(plan), progress=False)
    return source, plan, checkpoint


def write_safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def reseal(folder: Path, edit: Callable[[dict], None]) -> None:
    """Edit the manifest and recompute its digest: only preshard's structural checks stand in the way."""
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    body = {k: v for k, v in data.items() if k != "digest"}
    data["digest"] = xxhash.xxh3_128_hexdigest(canonical_json(body))
    path.write_text(json.dumps(data))


def tree(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------
# Running one command


@dataclass
class Outcome:
    status: int
    stderr: str
    stdout: str = ""
    error: BaseException | None = None
    seconds: float = 0.0


def run_cli(*args: str) -> Outcome:
    """The `preshard` command line, in this process (click's runner: the real argument parsing and error handling)."""
    from click.testing import CliRunner

    from preshard.cli import main

    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    start = time.perf_counter()
    result = runner.invoke(main, [str(a) for a in args])
    seconds = time.perf_counter() - start
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        text = "".join(traceback.format_exception(result.exception))
        return Outcome(-1, f"Traceback (in-process)\n{text}", result.stdout, result.exception, seconds)
    return Outcome(result.exit_code, result.stderr, result.stdout, None, seconds)


def run_library(fn: Callable[[], object]) -> Outcome:
    start = time.perf_counter()
    try:
        fn()
    except PreshardError as exc:
        return Outcome(2, f"error: {exc}", error=exc, seconds=time.perf_counter() - start)
    except Exception as exc:  # a traceback, for the contract
        import traceback

        return Outcome(-1, "".join(traceback.format_exception(exc)), error=exc, seconds=time.perf_counter() - start)
    return Outcome(0, "", seconds=time.perf_counter() - start)


def one_line(outcome: Outcome, *fragments: str, status: int = 2) -> str | None:
    """None if `outcome` is exactly one `error: ` line with `status` holding every fragment, else what is wrong."""
    lines = outcome.stderr.splitlines()
    if outcome.status != status:
        return f"exit {outcome.status} (wanted {status}): {outcome.stderr.strip()[-400:]}"
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in outcome.stderr:
        return f"not one error line: {outcome.stderr.strip()[-400:]}"
    missing = [f for f in fragments if f not in lines[0]]
    return f"{lines[0]!r} lacks {missing}" if missing else None


def command(name: str, checkpoint: Path, out: Path) -> Outcome:
    """One of COMMANDS on `checkpoint` (writing into `out` where it writes)."""
    if name == "verify":
        return run_cli("verify", checkpoint)
    if name == "inspect":
        return run_cli("inspect", checkpoint)
    if name == "reshard-cp":
        return run_cli("reshard", checkpoint, out, "--tp", "1", "--ulysses", "2", "--no-progress")
    if name == "reshard-tp":
        return run_cli("reshard", checkpoint, out, "--tp", "2", "--no-progress")
    if name == "unshard":
        return run_cli("unshard", checkpoint, out, "--no-progress")
    if name == "load":
        from preshard.runtime.load import load_sharded

        return run_library(lambda: load_sharded(SyntheticModel, checkpoint, device="cpu"))
    raise ValueError(name)


def verify_problems(outcome: Outcome) -> bool:
    """verify reports problems as lines and exits 1: that holds as long as nothing else went wrong."""
    return outcome.status == 1 and "Traceback" not in outcome.stderr + outcome.stdout


# ---------------------------------------------------------------------------------------------------------
# The soak


@dataclass
class Case:
    klass: str
    name: str
    run: Callable[[Path], str | None]  # in a fresh folder; returns None when the contract held, else why not


@dataclass
class Stats:
    cases: Counter = field(default_factory=Counter)
    held: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{k:10s} {self.held[k]:4d} of {n:4d} held" for k, n in sorted(self.cases.items())]
        total, held = sum(self.cases.values()), sum(self.held.values())
        lines.append(f"{'all':10s} {held:4d} of {total:4d} held; failures: {len(self.failures)}; {self.seconds:.0f} s")
        lines += [f"  FAILED {f}" for f in self.failures[:40]]
        return "\n".join(lines)


class _Timeout(Exception):
    pass


class _Crash(Exception):
    pass


@contextlib.contextmanager
def watchdog(seconds: float):
    """Raise _Timeout in this (the main) thread after `seconds`: a blocking open of a FIFO is interrupted too."""

    def fire(signum, frame):
        raise _Timeout(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Soak:
    def __init__(
        self,
        root: Path,
        seed: int = 0,
        max_seconds: float = 1.0,
        case_timeout: float = CASE_TIMEOUT_S,
        inputs: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """Cases in folders under `root`, on `inputs` (source, plan, tp=1 checkpoint; default: built here)."""
        import preshard.cli  # noqa: F401  (imported up front: a case's time is its work, not first imports)
        import preshard.runtime.load  # noqa: F401
        import preshard.tools.reshard  # noqa: F401
        import preshard.tools.unshard  # noqa: F401
        import preshard.tools.verify  # noqa: F401

        self.root = root
        self.rng = random.Random(seed)
        self.max_seconds = max_seconds  # for a one-line refusal of a hostile header or manifest
        self.case_timeout = case_timeout
        self.source, self.plan, self.checkpoint = inputs or build_checkpoint(root / "base")
        self.stats = Stats()
        self._n = 0

    def fresh(self) -> Path:
        self._n += 1
        folder = self.root / f"case{self._n}"
        folder.mkdir()
        return folder

    def copy_checkpoint(self, folder: Path) -> Path:
        return Path(shutil.copytree(self.checkpoint, folder / "ck", symlinks=True))

    def chunks(self) -> list:
        """The records of the checkpoint's data files that hold bytes."""
        from preshard.format.manifest import read_manifest

        return [c for t in read_manifest(self.checkpoint).tensors.values() for c in t.chunks if c.data_length]

    def h3_checkpoint(self) -> Path:
        """The tiny MiniMax-H3 converted at tp=2 (a class diffusers has, for ranks that are their own processes),
        built at the first call."""
        checkpoint = self.root / "h3" / "tp2"
        if not checkpoint.exists():
            from preshard.converter.convert import convert_checkpoint
            from preshard.examples.minimax_h3 import build_model, save_checkpoint

            source = save_checkpoint(build_model(dtype="float32", seed=0), self.root / "h3" / "src" / "transformer")
            convert_checkpoint(source, checkpoint, tp=2, progress=False)
        return checkpoint

    def flux_lora(self) -> tuple[Path, Path]:
        """(a tiny Flux source, a LoRA with a bias on its block 0 attention), built at the first call."""
        source = self.root / "flux" / "src"
        lora = self.root / "flux" / "lora.safetensors"
        if not lora.exists():
            from tiny_diffusers import build, save
            from tiny_lora import make_lora

            model, _ = build("flux")
            save(model, source)
            make_lora(model, lora, pattern=r"transformer_blocks\.0\.attn\.to_[qkv]", bias=True)
        return source, lora

    def run(self, cases: list[Case]) -> Stats:
        start = time.perf_counter()
        for i, case in enumerate(cases):
            folder = self.fresh()
            self.stats.cases[case.klass] += 1
            try:
                with watchdog(self.case_timeout):
                    why = case.run(folder)
            except _Timeout as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - the harness's own failure counts as the case's
                why = f"harness: {type(exc).__name__}: {exc}"
            if why is None:
                self.stats.held[case.klass] += 1
            else:
                self.stats.failures.append(f"{case.klass}/{case.name}: {' '.join(why.split())[:600]}")
            shutil.rmtree(folder, ignore_errors=True)
            if (i + 1) % 25 == 0:
                print(f"  {i + 1}/{len(cases)} cases, {len(self.stats.failures)} failures", flush=True)
        self.stats.seconds = time.perf_counter() - start
        return self.stats

    # -- links and special files

    def link_cases(self) -> list[Case]:
        cases = []
        for name in FILES:
            for cmd in COMMANDS:
                cases.append(Case("links", f"{name} -> outside, {cmd}", self._outside_link(name, cmd)))
            cases.append(Case("links", f"{name} -> inside, verify and load", self._inside_link(name)))
        return cases

    def _refused(self, outcome: Outcome, out: Path, name: str, cmd: str, *fragments: str) -> str | None:
        """The contract for a hostile file `name` under `cmd`: refused (verify: reported) where the command opens
        it, nothing written; where it does not open it, the command simply works."""
        if name not in OPENS or cmd not in OPENS[name]:
            return None if outcome.status == 0 else f"{cmd} never opens {name}, yet: {outcome.stderr[-300:]}"
        if cmd == "verify" and outcome.status == 1:  # reported as a problem (else: no checkpoint to verify, one line)
            if not verify_problems(outcome) or not all(f in outcome.stdout for f in fragments):
                return f"verify did not report it: {outcome.status} {outcome.stdout[-300:]} {outcome.stderr[-200:]}"
        else:
            why = one_line(outcome, *fragments)
            if why:
                return why
        return "an output was written" if out.exists() else None

    def _outside_link(self, name: str, cmd: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            ck = self.copy_checkpoint(folder)
            outside = folder / "outside"
            outside.mkdir()
            shutil.move(str(ck / name), outside / name)
            (ck / name).symlink_to(outside / name)
            out = folder / "out"
            return self._refused(command(cmd, ck, out), out, name, cmd, "symbolic link", "outside")

        return case

    def _inside_link(self, name: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            ck = self.copy_checkpoint(folder)
            (ck / "sub").mkdir()
            shutil.move(str(ck / name), ck / "sub" / name)
            (ck / name).symlink_to(Path("sub") / name)
            outcome = command("verify", ck, folder / "out")
            if outcome.status != 0:
                return f"verify of a checkpoint whose {name} links inside it: {outcome.stdout[-300:]}{outcome.stderr}"
            loaded = command("load", ck, folder / "out")
            return None if loaded.status == 0 else f"load: {loaded.stderr[-300:]}"

        return case

    def special_cases(self) -> list[Case]:
        cases = []
        for name in FILES:
            for kind in ("fifo", "socket"):
                for cmd in COMMANDS:
                    cases.append(Case("special", f"{name} as a {kind}, {cmd}", self._special(name, kind, cmd)))
        return cases

    def _special(self, name: str, kind: str, cmd: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            ck = self.copy_checkpoint(folder)
            (ck / name).unlink()
            held = None
            if kind == "fifo":
                os.mkfifo(ck / name)
            else:  # bound at a short path (AF_UNIX paths are short), then renamed into place
                held = socket.socket(socket.AF_UNIX)
                short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp" if os.path.isdir("/tmp") else None))
                held.bind(str(short / "s"))
                os.rename(short / "s", ck / name)
                short.rmdir()
            out = folder / "out"
            try:
                outcome = command(cmd, ck, out)
            finally:
                if held is not None:
                    held.close()
            return self._refused(outcome, out, name, cmd, "a FIFO" if kind == "fifo" else "a socket")

        return case

    # -- hostile headers

    HEADERS = {
        "dim 2**63 no elements": ([2**63, 0], "F32"),
        "dim 2**63 second": ([0, 2**63], "F32"),
        "dim 2**62 of F32": ([2**62, 0], "F32"),
        "stride overflow": ([0, 2**40, 2**40], "BF16"),
        "stride overflow 3": ([0, 2**32, 2**31], "F32"),
        "dim 10**30": ([10**30, 0], "U8"),
        "negative dim": ([-1, 4], "F32"),
        "bool dim": ([True, 4], "F32"),
        "float dim": ([2.0, 4], "F32"),
        "2**63-1 bytes": ([2**61, 4], "F32"),
    }
    FIT = {"rows 2**58 no elements": ([2**58, 0], "F32"), "cols 2**58 no elements": ([0, 2**58], "BF16")}

    def header_cases(self) -> list[Case]:
        cases = []
        for label, (shape, dtype) in self.HEADERS.items():
            for cmd in ("convert", "plan", "verify-source"):
                cases.append(Case("headers", f"{label}, {cmd}", self._hostile_header(shape, dtype, cmd)))
        for label, (shape, dtype) in self.FIT.items():
            cases.append(Case("headers", f"{label}, converted fast", self._fitting_header(shape, dtype)))
        return cases

    def _header_source(self, folder: Path, shape: list, dtype: str) -> Path:
        src = folder / "src"
        src.mkdir()
        header = {
            "a.weight": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]},
            "b.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        }
        write_safetensors(src / "model.safetensors", header, bytes(16))
        return src

    def _hostile_header(self, shape: list, dtype: str, cmd: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            src = self._header_source(folder, shape, dtype)
            plan = folder / "plan.json"
            plan.write_text(json.dumps({"name": "x", "linear": [{"match": "a", "style": "colwise"}]}))
            if cmd == "convert":
                outcome = run_cli("convert", src, folder / "out", "--tp", "2", "--plan", plan, "--no-progress")
            elif cmd == "plan":
                outcome = run_cli("plan", src, "--plan", plan)
            else:
                outcome = run_cli("verify", self.checkpoint, "--source", src)
            why = one_line(outcome, "a.weight")
            if why:
                return why
            return self._bounded_and_nothing_written(outcome, folder)

        return case

    def _bounded_and_nothing_written(self, outcome, folder: Path) -> str | None:
        """A refusal must come fast and leave no output behind."""
        if outcome.seconds > self.max_seconds:
            return f"took {outcome.seconds:.2f} s"
        return "an output was written" if (folder / "out").exists() else None

    def _fitting_header(self, shape: list, dtype: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            src = self._header_source(folder, shape, dtype)
            plan = folder / "plan.json"
            plan.write_text(json.dumps({"name": "x", "linear": [{"match": "a", "style": "colwise"}]}))
            out = folder / "out"
            outcome = run_cli("convert", src, out, "--tp", "2", "--plan", plan, "--no-progress")
            if outcome.status != 0:
                return f"convert: {outcome.stderr[-300:]}"
            if outcome.seconds > 5 * self.max_seconds:  # the soak's clock; tests count calls instead
                return f"took {outcome.seconds:.2f} s"
            checked = run_cli("verify", out, "--source", src)
            return None if checked.status == 0 else f"verify: {checked.stdout[-300:]}"

        return case

    # -- hostile manifests (re-sealed)

    def manifest_edits(self) -> dict[str, Callable[[dict], None]]:
        def mesh(**sizes):
            return lambda d: d["mesh"].update(sizes)

        def first_source_file(key, value):
            return lambda d: d["source"]["files"][0].update({key: value})

        def first_shape(value):
            def edit(d):
                name = sorted(d["tensors"])[0]
                d["tensors"][name]["shape"][0] = value

            return edit

        return {
            "ring=ulysses=10**6": mesh(ring=10**6, ulysses=10**6),
            "ring=10**12": mesh(ring=10**12),
            "tp=10**6": mesh(tp=10**6),
            "ulysses=2**64": mesh(ulysses=2**64),
            "NUL in config name": lambda d: d["config"].update(name="config\0.json"),
            "path as config name": lambda d: d["config"].update(name="../config.json"),
            "NUL in source file name": first_source_file("name", "model\0.safetensors"),
            "path as source file name": first_source_file("name", "../../etc/passwd"),
            "NUL in index name": lambda d: d["source"].update(index_name="index\0.json"),
            "shape 2**70": first_shape(2**70),
            "chunk offset 2**64": lambda d: d["tensors"][sorted(d["tensors"])[0]]["chunks"][0].update(offset=2**64),
            "metadata record of another file": lambda d: d.update(
                metadata={"name": "config.json", "size": 1, "xxh3_128": "0" * 32}
            ),
        }

    def manifest_cases(self) -> list[Case]:
        cases = []
        for label, edit in self.manifest_edits().items():
            for cmd in ("verify", "inspect", "reshard-cp", "unshard", "load"):
                cases.append(Case("manifests", f"{label}, {cmd}", self._hostile_manifest(edit, cmd)))
        return cases

    def _hostile_manifest(self, edit: Callable[[dict], None], cmd: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            ck = self.copy_checkpoint(folder)
            reseal(ck, edit)
            outcome = command(cmd, ck, folder / "out")
            if cmd == "verify":  # verify reports a bad manifest as its one problem, exit 1
                if outcome.status != 1 or "Traceback" in outcome.stderr + outcome.stdout:
                    return f"verify: {outcome.status} {outcome.stdout[-300:]} {outcome.stderr[-300:]}"
            else:
                why = one_line(outcome)
                if why:
                    return why
            return self._bounded_and_nothing_written(outcome, folder)

        return case

    # -- resume after a source swap

    def resume_cases(self, count: int) -> list[Case]:
        cases = []
        for i in range(count):
            how = ("in place", "renamed over", "unchanged")[i % 3]
            stop_after = self.rng.randrange(3, BLOCKS * 8 - 2)
            which = self.rng.randrange(3)  # build_source writes 3 files
            name = f"{how}, file {which}, stopped after {stop_after}"
            cases.append(Case("resume", name, self._resume(how, stop_after, which)))
        return cases

    def _resume(self, how: str, stop_after: int, which: int) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            from safetensors.torch import load_file, save_file

            from preshard.converter import convert as convert_module
            from preshard.converter.convert import convert_checkpoint

            src = Path(shutil.copytree(self.source, folder / "src"))
            out = folder / "out"
            seen: list[str] = []

            def stop(name: str) -> None:
                seen.append(name)
                if len(seen) == stop_after:
                    raise _Crash  # between two tensors, as a crash would stop it

            saved = convert_module.SYNC_MIN_BYTES
            convert_module.SYNC_MIN_BYTES = 1  # journal every tensor
            try:
                with contextlib.suppress(_Crash):
                    convert_checkpoint(src, out, tp=2, plan=str(self.plan), progress=False, on_tensor=stop)
            finally:
                convert_module.SYNC_MIN_BYTES = saved
            target = sorted(src.glob("*.safetensors"))[which]
            if how != "unchanged":
                before = os.stat(target)
                tensors = load_file(str(target))
                name = self.rng.choice(sorted(tensors))
                tensors[name] = tensors[name] + 1 if tensors[name].is_floating_point() else tensors[name] ^ 1
                replacement = folder / "new.safetensors"
                save_file(tensors, str(replacement))
                header = 8 + int.from_bytes(target.read_bytes()[:8], "little")
                if replacement.read_bytes()[:header] != target.read_bytes()[:header] or (
                    replacement.stat().st_size != before.st_size
                ):
                    return "harness: the swapped file's header or size differs"
                if how == "in place":
                    with open(target, "r+b") as f:
                        f.write(replacement.read_bytes())
                else:
                    os.replace(replacement, target)
                os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
            env = os.environ.get("SOURCE_DATE_EPOCH")
            os.environ["SOURCE_DATE_EPOCH"] = "1700000000"
            try:
                convert_checkpoint(src, out, tp=2, plan=str(self.plan), progress=False)
                convert_checkpoint(src, folder / "fresh", tp=2, plan=str(self.plan), progress=False)
            finally:
                if env is None:
                    del os.environ["SOURCE_DATE_EPOCH"]
                else:
                    os.environ["SOURCE_DATE_EPOCH"] = env
            checked = run_cli("verify", out, "--source", src)
            if checked.status != 0:
                return f"verify --source after the resume: {checked.stdout[-400:]}"
            if tree(out) != tree(folder / "fresh"):
                return "the resumed conversion differs from a fresh one of the current source"
            return None

        return case

    # -- signals at any moment, start-up imports included

    def signal_cases(self, count: int) -> list[Case]:
        cases = []
        for i in range(count):
            signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
            delay = self.rng.uniform(0.05, 6.0)
            name = f"{signal.Signals(signum).name} after {delay:.2f} s"
            cases.append(Case("signals", name, self._signal(signum, delay)))
        return cases

    def _signal(self, signum: int, delay: float) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            out = folder / "out"
            args = [sys.executable, "-m", "preshard.cli", "convert", str(self.source), str(out), "--tp", "2"]
            args += ["--plan", str(self.plan), "--no-progress"]
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(delay)
            finished = proc.poll() is not None
            # Its outcome already printed (the summary is all it prints): then it ignores signals while it exits.
            printed = bool(select.select([proc.stdout], [], [], 0)[0])
            if not finished:
                proc.send_signal(signum)
            stdout, stderr = proc.communicate(timeout=100)
            if finished or printed:  # done before the signal: the outcome must simply be right
                return None if proc.returncode in (0, 128 + signum) else f"exit {proc.returncode}: {stderr[-300:]}"
            code = proc.returncode
            if code == 0:
                return f"exit 0 after {signal.Signals(signum).name}: {stdout.strip()[-200:]}"
            if code == -signum:  # the default action, before preshard's handlers: nothing may have been written
                return "killed by the signal, but an output was written" if out.exists() else None
            if code == 128 + signum:
                lines = stderr.splitlines()
                if len(lines) != 1 or not lines[0].startswith("error: "):
                    return f"exit {code} but not one line: {stderr[-300:]}"
                if out.exists():
                    from preshard.tools.verify import verify_checkpoint

                    return None if verify_checkpoint(out, source=self.source).ok else "a damaged output"
                return None
            return f"exit {code} after {signal.Signals(signum).name}: {stderr[-300:]}"

        return case

    # -- misuse

    def misuse_cases(self) -> list[Case]:
        from preshard.runtime.load import load_sharded

        def load(path_of: Callable[[Path], Path], *fragments: str) -> Callable[[Path], str | None]:
            def case(folder: Path) -> str | None:
                ck = self.copy_checkpoint(folder)
                outcome = run_library(lambda: load_sharded(SyntheticModel, path_of(ck), device="cpu"))
                return one_line(outcome, *fragments)

            return case

        def empty(ck: Path) -> Path:
            folder = ck.parent / "empty"
            folder.mkdir()
            return folder

        def cli(*args: object, fragment: str) -> Callable[[Path], str | None]:
            return lambda folder: one_line(run_cli(*args), fragment)

        ck = self.checkpoint
        return [
            Case("misuse", "load a manifest path", load(lambda ck: ck / "manifest.json", "pass the folder")),
            Case("misuse", "load a data file path", load(lambda ck: ck / "__0_0.distcp", "is a file")),
            Case("misuse", "load a folder without a manifest", load(empty, "manifest.json is missing")),
            Case("misuse", "load a missing path", load(lambda ck: ck / "nope", "does not exist")),
            Case("misuse", "verify a manifest path", cli("verify", ck / "manifest.json", fragment="not a folder")),
            Case("misuse", "inspect a data file", cli("inspect", ck / "__0_0.distcp", fragment="is a file")),
            Case("misuse", "reshard a data file", cli("reshard", ck / "__0_0.distcp", ck.parent / "x", "--tp", "1",
                                                      fragment="is a file")),
        ]  # fmt: skip

    # -- one checkpoint per job

    def job_cases(self, count: int) -> list[Case]:
        return [Case("jobs", f"{('control', 'overwrite')[i % 2]} {i}", self._job(i % 2 == 1)) for i in range(count)]

    def _job(self, overwrite: bool) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            from multiproc import run_ranks

            _, plan, ck = build_checkpoint(folder / "a", seed=0, tp=2)
            other = crash_soak.build_source(folder / "b" / "src", blocks=BLOCKS, width=WIDTH, seed=1)
            (other / "config.json").write_text((ck / "config.json").read_text())
            results = run_ranks(job_rank, 2, str(ck), str(other), str(plan), overwrite, str(folder), timeout=240)
            if not overwrite:
                return None if all(r == "loaded" for r in results) else f"control: {results}"
            if len(set(results)) != 1 or "opened different checkpoints" not in results[0]:
                return f"ranks did not refuse alike: {results}"
            return None

        return case


def job_rank(rank: int, world_size: int, checkpoint: str, other: str, plan: str, overwrite: bool, folder: str) -> str:
    """One rank of a two-rank job: rank 1, once both ranks have joined the load, waits to open the checkpoint until
    rank 0 is in the checkpoint agreement, then (if `overwrite`) replaces it with a conversion of another source."""
    from multiproc import init_gloo

    from preshard.converter.convert import convert_checkpoint
    from preshard.runtime import load

    init_gloo()
    marker = Path(folder) / "rank0-agreeing"
    if rank == 0:
        real = load.agree_on_checkpoint

        def announce(*args, **kwargs):
            marker.write_text("")
            return real(*args, **kwargs)

        load.agree_on_checkpoint = announce
    else:
        real_open = load._open_checkpoint

        def open_late(*args, **kwargs):
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if overwrite:
                convert_checkpoint(other, checkpoint, tp=2, plan=plan, overwrite=True, progress=False)
            return real_open(*args, **kwargs)

        load._open_checkpoint = open_late
    try:
        load.load_sharded(SyntheticModel, checkpoint, device="cpu")
    except PreshardError as exc:
        return str(exc)
    return "loaded"


# ---------------------------------------------------------------------------------------------------------
# Round 4 (issue 31): wrong bytes by default, option and path edges, sources changing under the reader, ranks
# that never join or disagree


def edge_cases(soak: Soak) -> list[Case]:
    source, plan = soak.source, str(soak.plan)

    def cli(*args: object, fragment: str) -> Callable[[Path], str | None]:
        return lambda folder: one_line(run_cli(*args), fragment)

    def into(name: str, fragment: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            cwd = os.getcwd()
            os.chdir(folder)
            try:
                outcome = run_cli("convert", source, name, "--tp", "1", "--plan", plan, "--no-progress")
            finally:
                os.chdir(cwd)
            return one_line(outcome, fragment) or (f"{name!r} was created" if (folder / name).exists() else None)

        return case

    def non_utf8_source(folder: Path) -> str | None:
        odd = folder / os.fsdecode(b"src\xff")
        shutil.copytree(source, odd)
        return one_line(run_cli("convert", odd, folder / "out", "--tp", "1", "--plan", plan), "UTF-8")

    cases = [
        Case("edges", "plan --devices 10**15", cli("plan", source, "--plan", plan, "--devices", str(10**15),
                                                   fragment="--devices must be")),
        Case("edges", "plan --devices 2**21", cli("plan", source, "--plan", plan, "--devices", str(2**21),
                                                  fragment="--devices must be")),
        Case("edges", "plan --device-memory inf", cli("plan", source, "--plan", plan, "--device-memory", "inf",
                                                      fragment="--device-memory")),
        Case("edges", "convert into ' '", into(" ", "only whitespace")),
        Case("edges", "convert into '  '", into("  ", "only whitespace")),
        Case("edges", "convert a non-UTF-8 source", non_utf8_source),
    ]  # fmt: skip
    for version, fragment in ((1, "no longer loads"), (3, "newer than"), (99, "newer than")):

        def versioned(folder: Path, version: int = version, fragment: str = fragment) -> str | None:
            ck = soak.copy_checkpoint(folder)
            reseal(ck, lambda m: m.update(version=version))
            from preshard.format.manifest import read_manifest

            outcome = run_library(lambda: read_manifest(ck))
            if not isinstance(outcome.error, CorruptCheckpointError):
                return f"version {version}: {type(outcome.error).__name__}, not CorruptCheckpointError"
            return one_line(outcome, fragment)

        cases.append(Case("edges", f"manifest version {version}", versioned))
    return cases


def source_cases(soak: Soak) -> list[Case]:
    plan = str(soak.plan)

    def copy(folder: Path) -> Path:
        return Path(shutil.copytree(soak.source, folder / "src"))

    def refused(prepare: Callable[[Path], None], fragment: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            src = copy(folder)
            prepare(src)
            out = folder / "out"
            why = one_line(run_cli("convert", src, out, "--tp", "1", "--plan", plan), fragment)
            return why or (f"{out} was written" if out.exists() else None)

        return case

    def dangling(src: Path) -> None:
        (src / "config.json").unlink()
        (src / "config.json").symlink_to(src / "gone.json")

    def fifo(src: Path) -> None:
        (src / "config.json").unlink()
        os.mkfifo(src / "config.json")

    def index_of(text: str) -> Callable[[Path], None]:
        def prepare(src: Path) -> None:
            for f in src.glob("*.safetensors"):
                f.unlink()
            (src / "model.safetensors.index.json").write_text(text)

        return prepare

    def changed_after_planning(kind: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            src = copy(folder)
            config = src / "config.json"
            original = config.read_bytes()

            changed: list[str] = []

            def change(name: str) -> None:
                if changed:
                    return
                changed.append(name)
                config.unlink()
                if kind == "fifo":
                    os.mkfifo(config)
                else:
                    config.write_text(json.dumps({"_class_name": "Other", "width": 1}))

            outcome = run_library(
                lambda: __import__("preshard.converter.convert", fromlist=["x"]).convert_checkpoint(
                    src, folder / "out", tp=1, plan=plan, progress=False, on_tensor=change
                )
            )
            if outcome.status != 0:
                return f"conversion failed: {outcome.stderr[-300:]}"
            committed = (folder / "out" / "config.json").read_bytes()
            return None if committed == original else "the config edited after planning was committed"

        return case

    return [
        Case("sources", "dangling config.json link", refused(dangling, "does not exist")),
        Case("sources", "config.json a FIFO", refused(fifo, "config.json")),
        Case("sources", "index {}", refused(index_of("{}"), "not a valid safetensors index")),
        Case("sources", "index with an empty weight_map", refused(index_of('{"weight_map": {}}'), "names no tensor")),
        Case("sources", "config edited after planning", changed_after_planning("edit")),
        Case("sources", "config a FIFO after planning", changed_after_planning("fifo")),
    ]


def read_cases(soak: Soak) -> list[Case]:
    """A data file holding other bytes of the same length: refused by default, loaded only with verify=False."""
    from preshard.format.manifest import read_manifest
    from preshard.runtime.load import load_sharded

    def damaged(where: str, verify: bool | None) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            ck = soak.copy_checkpoint(folder)
            chunks = [c for t in read_manifest(ck).tensors.values() for c in t.chunks if c.data_length]
            chunk = {"first": chunks[0], "last": chunks[-1], "random": soak.rng.choice(chunks)}[where]
            with open(ck / chunk.file, "r+b") as f:
                f.seek(chunk.data_offset + chunk.data_length // 2)
                byte = f.read(1)[0]
                f.seek(chunk.data_offset + chunk.data_length // 2)
                f.write(bytes([byte ^ 0x01]))
            kwargs = {} if verify is None else {"verify": verify}
            outcome = run_library(lambda: load_sharded(SyntheticModel, ck, device="cpu", **kwargs))
            if verify is False:
                return None if outcome.status == 0 else f"verify=False refused: {outcome.stderr[-200:]}"
            return one_line(outcome, "checksum mismatch", chunk.tensor)

        return case

    return [
        Case("reads", f"a flipped bit in the {where} chunk, verify={verify}", damaged(where, verify))
        for where in ("first", "last", "random", "random")
        for verify in (None, True)
    ] + [Case("reads", "the control: verify=False loads it", damaged("random", False))]


def rank_cases(soak: Soak) -> list[Case]:
    """Two gloo ranks, one of which never joins, is refused its device before joining, or asks for another dtype."""

    def job(scenario: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            from multiproc import run_ranks

            _, _, ck = build_checkpoint(folder / "a", seed=0, tp=2)
            results = run_ranks(rank_rank, 2, str(ck), scenario, timeout=180)
            want = {
                "absent": ("JobTimeoutError", "rank 1 of 2 did not reach load_sharded"),
                "cuda": ("DeviceError", "device 'cuda'"),
                "dtype": ("MismatchError", "different dtype"),
                "same": (None, None),
            }[scenario]
            shown = [r for r in results if r != "absent"]
            if want[0] is None:
                return None if shown == ["loaded", "loaded"] else f"control: {results}"
            if not shown or not all(r.startswith(want[0]) and want[1] in r for r in shown):
                return f"{scenario}: {results}"
            return None

        return case

    return [Case("ranks", name, job(name)) for name in ("absent", "cuda", "dtype", "same")]


def rank_rank(rank: int, world_size: int, checkpoint: str, scenario: str) -> str:
    from preshard.runtime.load import load_sharded

    if scenario == "absent" and rank == 1:
        return "absent"  # never reaches load_sharded, as if killed before it
    kwargs: dict = {"timeout": 2} if scenario == "absent" else {}
    if rank == 1 and scenario in ("cuda", "dtype"):
        kwargs = {"device": "cuda"} if scenario == "cuda" else {"dtype": "bf16"}
    try:
        load_sharded(SyntheticModel, checkpoint, **({"device": "cpu"} | kwargs))
    except PreshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


# ---------------------------------------------------------------------------------------------------------
# Round 4, continued (issue 31): a Hub that stumbles (a FakeHub on the loopback), damaged HF-cache blobs of the same
# size, a process group the caller made, LoRA factors that are not numbers

HUB_SOURCE = "org/src"
HUB_CHECKPOINT = "org/ck"


@contextlib.contextmanager
def hub_env(folder: Path, *, offline: bool = False, env: dict[str, str] | None = None, read_timeout: int | None = None):
    """huggingface_hub pointed at a FakeHub on the loopback (none when `offline`), with a private HF_HOME under
    `folder`, `env` set and its download read timeout at `read_timeout` s (HF_HUB_DOWNLOAD_TIMEOUT), for the block."""
    import pytest
    from fake_hub import FakeHub
    from hub_fixtures import closed_port_endpoint, configure_hf
    from huggingface_hub import close_session, constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    bars_were_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as stack:
        hub = None if offline else stack.enter_context(FakeHub())
        configure_hf(mp, folder / "hf_home", hub.endpoint if hub else closed_port_endpoint(), offline=offline)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        if read_timeout is not None:
            mp.setenv("HF_HUB_DOWNLOAD_TIMEOUT", str(read_timeout))
            mp.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", read_timeout)
        close_session()
        try:
            yield hub
        finally:
            close_session()
            if not bars_were_disabled:
                enable_progress_bars()


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def same_length_other_bytes(data: bytes) -> bytes:
    """The last 16 bytes inverted: a safetensors file keeps its header, so only a hash can tell."""
    return data[:-16] + bytes(b ^ 0xFF for b in data[-16:])


RETRY_LINE = ("the Hub stumbled on ", "the download of ")  # one line per retry, before the error (hub_retry.py)


def after_retries(outcome: Outcome) -> Outcome:
    """`outcome` without the one line per retry that a stumbling Hub prints before the error, when every other line
    is one (a retry line must be one line: a second line of it stays and fails `one_line`)."""
    kept = [line for line in outcome.stderr.splitlines() if not line.startswith(RETRY_LINE)]
    return Outcome(outcome.status, "\n".join(kept), outcome.stdout, outcome.error, outcome.seconds)


def hub_cases(soak: Soak) -> list[Case]:
    """A conversion from a Hub repo, and a load of a converted one, while the Hub stumbles: transient faults retried
    and the result the same as from a local folder; lasting faults one line, nothing written."""
    plan = str(soak.plan)
    files = folder_files(soak.source)
    weights = sorted(name for name in files if name.endswith(".safetensors"))[0]
    local_data = {p.name: p.read_bytes() for p in soak.checkpoint.glob("*.distcp")}
    info = f"/api/models/{HUB_SOURCE}/revision/main"

    def gets(hub, suffix: str) -> int:
        return sum(1 for r in hub.log() if r.method == "GET" and r.path.endswith(suffix))

    def convert(
        fault: dict | None, fragments: tuple[str, ...] | None, requests: tuple[str, int] | None = None, **options
    ) -> Callable[[Path], str | None]:
        """A conversion of HUB_SOURCE with `fault` injected; `fragments` None: it converts, to the bytes a local
        conversion wrote, with `requests` (path suffix, GET count) made; else one line holding them."""

        def case(folder: Path) -> str | None:
            out = folder / "out"
            with hub_env(folder, env=options.get("env"), read_timeout=options.get("read_timeout")) as hub:
                hub.add_repo(HUB_SOURCE, files)
                if options.get("served"):
                    hub.repos[HUB_SOURCE].served[weights] = same_length_other_bytes(files[weights])
                if fault:
                    hub.fail(**fault)
                outcome = run_cli("convert", HUB_SOURCE, out, "--tp", "1", "--plan", plan, "--no-progress")
                counted = gets(hub, requests[0]) if requests else None
            if fragments is not None:
                return one_line(after_retries(outcome), *fragments) or (f"{out} was written" if out.exists() else None)
            if outcome.status != 0:
                return f"did not convert: {outcome.stderr[-400:]}"
            if {p.name: p.read_bytes() for p in out.glob("*.distcp")} != local_data:
                return "the data files differ from a local conversion's"
            if requests and counted != requests[1]:
                return f"{counted} GETs of {requests[0]}, wanted {requests[1]}"
            return None

        return case

    def load(fault: dict | None, fragments: tuple[str, ...] | None, **options) -> Callable[[Path], str | None]:
        """load_sharded of the converted checkpoint from the Hub with `fault`: loads the local bytes, or one line."""

        def case(folder: Path) -> str | None:
            from preshard.runtime.load import load_sharded

            ck_files = folder_files(soak.checkpoint)
            data = next(name for name in ck_files if name.endswith(".distcp"))
            with hub_env(folder, env=options.get("env")) as hub:
                hub.add_repo(HUB_CHECKPOINT, ck_files)
                if options.get("served"):  # a byte inside a record flipped: the file's tail may hold no record
                    chunk = soak.rng.choice([c for c in soak.chunks() if c.file == data])
                    served = bytearray(ck_files[data])
                    served[chunk.data_offset + chunk.data_length // 2] ^= 0x01
                    hub.repos[HUB_CHECKPOINT].served[data] = bytes(served)
                if fault:
                    hub.fail(**{"path": data, **fault})
                models: list[nn.Module] = []
                outcome = run_library(lambda: models.append(load_sharded(SyntheticModel, HUB_CHECKPOINT, device="cpu")))
            if fragments is not None:
                return one_line(after_retries(outcome), *fragments)
            if outcome.status != 0:
                return f"did not load: {outcome.stderr[-400:]}"
            mine = load_sharded(SyntheticModel, soak.checkpoint, device="cpu").state_dict()
            theirs = models[0].state_dict()
            return None if all(torch.equal(mine[k], theirs[k]) for k in mine) else "other weights than the local load"

        return case

    once = {"path": weights, "method": "GET"}
    always = {**once, "times": None}
    one_retry = {"env": {"PRESHARD_HUB_RETRIES": "1"}}
    return [
        Case("hub", "the control: no fault", convert(None, None, (weights, 1))),
        Case("hub", "503 once on the repo info", convert({"kind": "status", "path": info}, None, (info, 2))),
        Case("hub", "503 once on the weights", convert({"kind": "status", **once}, None, (weights, 2))),
        Case("hub", "429 x2 with Retry-After on the repo info",
             convert({"kind": "status", "path": info, "status": 429, "retry_after": 1, "times": 2}, None, (info, 3))),
        Case("hub", "429 x2 with Retry-After on the weights",
             convert({"kind": "status", **once, "status": 429, "retry_after": 1, "times": 2}, None, (weights, 3))),
        Case("hub", "503 always on the weights",
             convert({"kind": "status", **always}, (weights, "HTTP 503", "PRESHARD_HUB_RETRIES"), **one_retry)),
        Case("hub", "connection dropped mid-body once", convert({"kind": "close", **once}, None)),
        Case("hub", "connection dropped mid-body always",
             convert({"kind": "close", **always}, (weights, "RemoteProtocolError"), **one_retry)),
        Case("hub", "body cut short once", convert({"kind": "short", **once}, None, (weights, 2))),
        Case("hub", "body cut short always",
             convert({"kind": "short", **always}, (weights, "ended early"), **one_retry)),
        Case("hub", "X-Repo-Commit not a hash",
             convert({"kind": "commit", "path": weights, "method": "HEAD", "times": None}, ("not a commit hash",))),
        Case("hub", "X-Repo-Commit a path out of the cache",
             convert({"kind": "commit", "path": weights, "method": "HEAD", "times": None, "commit": "../../../escape"},
                     ("not a commit hash",))),
        Case("hub", "slow answer once", convert({"kind": "slow", **once, "delay": 6}, None, (weights, 2),
                                                read_timeout=1)),
        Case("hub", "slow answer always", convert({"kind": "slow", **always, "delay": 6}, (weights, "ReadTimeout"),
                                                  read_timeout=1, **one_retry)),
        Case("hub", "weights served with other bytes of the same length", convert(None, (weights, "sha256"),
                                                                                   served=True)),
        Case("hub", "load: the control", load(None, None)),
        Case("hub", "load: 503 once on the data file", load({"kind": "status", "method": "GET"}, None)),
        Case("hub", "load: data file cut short once", load({"kind": "short", "method": "GET"}, None)),
        Case("hub", "load: data file dropped mid-body always",
             load({"kind": "close", "method": "GET", "times": None}, ("__0_0.distcp",), **one_retry)),
        Case("hub", "load: data file served with other bytes of the same length", load(None, ("checksum",),
                                                                                       served=True)),
    ]  # fmt: skip


def cache_cases(soak: Soak) -> list[Case]:
    """A converted checkpoint in the HF cache (offline) whose blobs were replaced by others of the same size:
    refused by load_sharded's default; the undamaged control and verify=False load."""
    from fake_hub import fake_commit, make_hf_cache

    from preshard.format.manifest import read_manifest
    from preshard.runtime.load import load_sharded

    files = folder_files(soak.checkpoint)
    data = next(name for name in files if name.endswith(".distcp"))
    chunks = [c for t in read_manifest(soak.checkpoint).tensors.values() for c in t.chunks if c.data_length]
    _, _, other = build_checkpoint(soak.root / "other-seed", seed=1)  # the same layout: the same size, other weights
    other_data = (other / data).read_bytes()

    def another_conversion() -> bytes:
        return other_data

    def flip(where: str) -> Callable[[dict[str, bytes]], None]:
        def damage(blobs: dict[str, bytes]) -> None:
            chunk = {"first": chunks[0], "last": chunks[-1], "random": soak.rng.choice(chunks)}[where]
            raw = bytearray(blobs[data])
            raw[chunk.data_offset + chunk.data_length // 2] ^= 0x01
            blobs[data] = bytes(raw)

        return damage

    def replace_data(blobs: dict[str, bytes]) -> None:
        blobs[data] = another_conversion()

    def edit_text(name: str, old: bytes, new: bytes) -> Callable[[dict[str, bytes]], None]:
        def damage(blobs: dict[str, bytes]) -> None:
            assert len(old) == len(new) and old in blobs[name], (name, old)
            blobs[name] = blobs[name].replace(old, new, 1)

        return damage

    def case(
        damage: Callable[[dict[str, bytes]], None] | None, fragments: tuple[str, ...] | None, verify: bool = True
    ) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            with hub_env(folder, offline=True):
                snapshot = make_hf_cache(folder / "hf_home", HUB_CHECKPOINT, fake_commit("soak"), files)
                if damage is not None:
                    blobs = dict(files)
                    damage(blobs)
                    for name, raw in blobs.items():
                        if raw != files[name]:
                            assert len(raw) == len(files[name])
                            (snapshot / name).resolve().write_bytes(raw)  # the blob, in place
                outcome = run_library(lambda: load_sharded(SyntheticModel, HUB_CHECKPOINT, device="cpu", verify=verify))
            if fragments is None:
                return None if outcome.status == 0 else f"did not load: {outcome.stderr[-400:]}"
            return one_line(outcome, *fragments)

        return run

    config = json.loads(files["config.json"])
    width = str(config["width"]).encode()
    return [
        Case("cache", "the control: undamaged", case(None, None)),
        Case("cache", "a flipped bit in the first chunk", case(flip("first"), ("checksum mismatch", data))),
        Case("cache", "a flipped bit in the last chunk", case(flip("last"), ("checksum mismatch", data))),
        Case("cache", "a flipped bit in a random chunk", case(flip("random"), ("checksum mismatch", data))),
        Case("cache", "another conversion's data file", case(replace_data, ("checksum mismatch", data))),
        Case("cache", "the control: verify=False loads a flipped bit", case(flip("random"), None, verify=False)),
        Case("cache", "config.json edited, same size",
             case(edit_text("config.json", b'"width": ' + width, b'"width": ' + str(int(width) + 1).encode()),
                  ("config.json",))),
        Case("cache", "manifest.json edited, same size",
             case(edit_text("manifest.json", b'"tp": 1', b'"tp": 2'), ("manifest",))),
    ]  # fmt: skip


def group_cases(soak: Soak) -> list[Case]:
    """A job whose caller made the gloo process group with a 600 s timeout: a rank killed before load_sharded, refused
    its device, asking another dtype, or missing the checkpoint fails every other rank with one line within
    load_sharded's timeout=, not the group's; the control loads. Ranks are processes (tests/support/group_rank.py)."""
    from group_rank import caught, error_lines, run_job

    built = soak.h3_checkpoint()  # here, not in a case: its build is no case's time

    def checkpoint() -> Path:
        return built

    def job(steps: list[list[dict]], survivors: list[int], fragment: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            results = run_job(steps, checkpoint())
            shown = []
            for rank in survivors:
                status, _, stderr = results[rank]
                lines = error_lines(rank, stderr)
                if status != 1 or len(lines) != 1 or fragment not in lines[0] or "Traceback" in "\n".join(stderr):
                    return f"rank {rank}: exit {status}, {stderr[-3:]}"
                shown.append(rank)
            return None if shown == survivors else f"ranks {shown} reported, not {survivors}"

        return case

    def missing_on_one(folder: Path) -> str | None:
        ck = checkpoint()
        relative = {"checkpoint": f"./{ck.name}"}
        results = run_job([[{"catch": relative, "cwd": str(ck.parent)}], [{"catch": relative, "cwd": str(folder)}]], ck)
        errors = [caught(out) for _, out, _ in results]
        if not all(len(e) == 1 and e[0] and e[0].startswith("CheckpointNotFoundError") for e in errors):
            return f"{errors}"
        return None if "rank 1 of the job failed to open" in (errors[0][0] or "") else f"{errors}"

    def control(folder: Path) -> str | None:
        results = run_job([[{"load": {}}], [{"load": {}}]], checkpoint())
        return None if all(s == 0 and "loaded" in out for s, out, _ in results) else f"{results}"

    timeout = {"load": {"timeout": 10}}
    return [
        Case("group", "rank 1 killed before load_sharded", job([[timeout], [{"kill": True}]], [0],
                                                                 "rank 1 of 2 did not reach load_sharded")),
        Case("group", "rank 0 (the store's) killed before load_sharded", job([[{"kill": True}], [timeout]], [1],
                                                                          "lost the process group's store")),
        Case("group", "rank 1 given device='cuda'", job([[{"load": {}}], [{"load": {"device": "cuda"}}]], [0, 1],
                                                       "device 'cuda'")),
        Case("group", "rank 1 given another dtype", job([[{"load": {}}], [{"load": {"dtype": "bf16"}}]], [0, 1],
                                                       "different dtype")),
        Case("group", "rank 1 given dtype='float7'", job([[{"load": {}}], [{"load": {"dtype": "float7"}}]], [0, 1],
                                                        "float7")),
        Case("group", "the checkpoint missing on rank 1", missing_on_one),
        Case("group", "the control: the same request loads", control),
    ]  # fmt: skip


def lora_cases(soak: Soak) -> list[Case]:
    """A LoRA whose factors, alpha or scale are not finite float32 numbers, or whose product overflows: one line
    naming the module, nothing written; the control converts."""
    import math

    from safetensors.torch import load_file, save_file

    to_q = "transformer.transformer_blocks.0.attn.to_q"
    module = "transformer_blocks.0.attn.to_q"
    soak.flux_lora()  # built here, not in a case: its build is no case's time

    def case(edit: Callable[[dict], None] | None, fragments: tuple[str, ...] | None, scale: str = "1.0"):
        def run(folder: Path) -> str | None:
            source, lora = soak.flux_lora()
            state = dict(load_file(str(lora)))
            if edit is not None:
                edit(state)
            path = folder / "lora.safetensors"
            save_file(state, str(path))
            out = folder / "out"
            outcome = run_cli("convert", source, out, "--tp", "2", "--lora", path, "--lora-scale", scale,
                              "--no-progress")  # fmt: skip
            if fragments is None:
                return None if outcome.status == 0 else f"did not convert: {outcome.stderr[-400:]}"
            return one_line(outcome, *fragments) or (f"{out} was written" if out.exists() else None)

        return run

    def fill(key: str, value: float, index: int = 0) -> Callable[[dict], None]:
        def edit(state: dict) -> None:
            tensor = state[f"{to_q}.{key}"].clone()
            tensor.view(-1)[index] = value
            state[f"{to_q}.{key}"] = tensor

        return edit

    def alpha(value: float) -> Callable[[dict], None]:
        return lambda state: state.update({f"{to_q}.alpha": torch.tensor(value)})

    def overflow(state: dict) -> None:
        state[f"{to_q}.lora_B.weight"] = torch.full_like(state[f"{to_q}.lora_B.weight"], 3e38)
        state[f"{to_q}.lora_A.weight"] = torch.full_like(state[f"{to_q}.lora_A.weight"], 10.0)

    return [
        Case("lora", "the control: finite factors", case(None, None)),
        Case("lora", "NaN in lora_A", case(fill("lora_A.weight", math.nan), (module, "lora_A", "NaN or Inf"))),
        Case("lora", "Inf in lora_B", case(fill("lora_B.weight", math.inf, 5), (module, "lora_B", "NaN or Inf"))),
        Case("lora", "-Inf in lora_A", case(fill("lora_A.weight", -math.inf, 7), (module, "lora_A", "NaN or Inf"))),
        Case("lora", "NaN in lora_B's bias", case(fill("lora_B.bias", math.nan), (module, "NaN or Inf"))),
        Case("lora", "alpha NaN", case(alpha(math.nan), (module, "alpha"))),
        Case("lora", "alpha Inf", case(alpha(math.inf), (module, "alpha"))),
        Case("lora", "alpha -Inf", case(alpha(-math.inf), (module, "alpha"))),
        Case("lora", "--lora-scale 1e300", case(None, (module, "scaling of"), scale="1e300")),
        Case("lora", "--lora-scale nan", case(None, ("scale of LoRA", "must be a finite number"), scale="nan")),
        Case("lora", "--lora-scale inf", case(None, ("scale of LoRA", "must be a finite number"), scale="inf")),
        Case("lora", "factors whose product overflows", case(overflow, (module, "not finite", "--lora-scale"))),
    ]


def all_cases(soak: Soak, classes: set[str], *, resumes: int, signals: int, jobs: int) -> list[Case]:
    makers = {
        "links": soak.link_cases,
        "special": soak.special_cases,
        "headers": soak.header_cases,
        "manifests": soak.manifest_cases,
        "resume": lambda: soak.resume_cases(resumes),
        "signals": lambda: soak.signal_cases(signals),
        "misuse": soak.misuse_cases,
        "jobs": lambda: soak.job_cases(jobs),
        "edges": lambda: edge_cases(soak),
        "sources": lambda: source_cases(soak),
        "reads": lambda: read_cases(soak),
        "ranks": lambda: rank_cases(soak),
        "hub": lambda: hub_cases(soak),
        "cache": lambda: cache_cases(soak),
        "group": lambda: group_cases(soak),
        "lora": lambda: lora_cases(soak),
    }
    for name, make in topic_makers().items():
        makers[name] = lambda make=make: make(soak)
    unknown = classes - set(makers)
    if unknown:
        raise SystemExit(f"unknown classes {sorted(unknown)}; choose from {', '.join(makers)}")
    cases = [c for name, make in makers.items() if name in classes for c in make()]
    soak.rng.shuffle(cases)
    return cases


def topic_makers() -> dict[str, Callable[[Soak], list[Case]]]:
    """The classes of the topic modules beside this script (`hostile_soak_*.py`), by class name."""
    makers: dict[str, Callable[[Soak], list[Case]]] = {}
    for path in sorted(HERE.glob("hostile_soak_*.py")):
        makers.update(importlib.import_module(path.stem).CASES)
    return makers


CLASSES = "links,special,headers,manifests,resume,signals,misuse,jobs,edges,sources,reads,ranks,hub,cache,group,lora"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = ",".join([CLASSES, *topic_makers()])
    parser.add_argument("--classes", default=every, help=f"comma-separated (default: {every})")
    parser.add_argument("--resumes", type=int, default=24, help="resume cases")
    parser.add_argument("--signals", type=int, default=16, help="signal cases (each starts a fresh interpreter)")
    parser.add_argument("--jobs", type=int, default=2, help="two-rank job cases (each starts two processes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, help="seconds before a case is a hang")
    parser.add_argument(
        "--max-seconds", type=float, default=1.0, help="time a refusal of a hostile header or manifest may take"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    args = parser.parse_args(argv)
    tmp = None
    root = args.workdir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="preshard-hostile-")
        root = Path(tmp.name)
    try:
        soak = Soak(root, args.seed, args.max_seconds, args.case_timeout)
        classes = {c.strip() for c in args.classes.split(",") if c.strip()}
        cases = all_cases(soak, classes, resumes=args.resumes, signals=args.signals, jobs=args.jobs)
        print(f"{len(cases)} cases ({', '.join(sorted(classes))}), seed {args.seed}", flush=True)
        stats = soak.run(cases)
        print(stats.summary())
        return 1 if stats.failures else 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
