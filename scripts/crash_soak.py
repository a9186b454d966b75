"""Crash soak for the converter: SIGKILL it at random moments, check atomicity and resume after every kill.

    python scripts/crash_soak.py                       # 200 kills, a ~70 MB synthetic checkpoint at tp=4
    python scripts/crash_soak.py --kills 50 --width 256 --seed 3

Each conversion runs in a child forked from a forkserver that has already imported preshard (so a
kill costs milliseconds, not an interpreter start) and is killed with SIGKILL after a random delay
drawn over the length of a full conversion. After every kill:

- the output path holds no checkpoint, or a complete one that verifies against the source (the
  previous one, when the run was replacing an existing output, or the new one if the kill came after
  the commit); a previous output is never lost;
- now and then the conversion is re-run to the end in this process: it must skip exactly the
  tensors the journal records as finished and produce a checkpoint that verifies bit for bit against
  the source; sometimes the output is then deleted, so that kills hit fresh conversions as well as
  replacements.

Prints a summary: kills, where they landed, resumes, tensors reused, failures. Exit status 1 on any
failure. `tests/test_reliability.py` runs the same harness with 20 kills on a smaller checkpoint.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preshard.converter import convert as convert_module
from preshard.converter.convert import convert_checkpoint
from preshard.converter.workdir import JOB_NAME, JOURNAL_NAME, partial_dir
from preshard.format.manifest import MANIFEST_NAME
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


@dataclass
class SoakStats:
    kills: int = 0
    finished_before_kill: int = 0
    reruns: int = 0
    resumes: int = 0  # re-runs that found finished tensors in the journal and skipped them
    tensors_reused: int = 0
    verified: int = 0  # checksums, coverage, .metadata: after every kill
    verified_with_source: int = 0  # and bit for bit against the source: after every re-run
    stages: Counter = field(default_factory=Counter)  # where each kill landed
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    full_seconds: float = 0.0

    def summary(self) -> str:
        stages = ", ".join(f"{k}: {v}" for k, v in sorted(self.stages.items()))
        lines = [
            f"kills: {self.kills} (runs that finished before their kill: {self.finished_before_kill})",
            f"kills landed: {stages}",
            f"re-runs to completion: {self.reruns}, of which resumes: {self.resumes}, "
            f"tensors reused: {self.tensors_reused}",
            f"verifications: {self.verified}, of which bit for bit against the source: {self.verified_with_source}",
            f"failures: {len(self.failures)}",
            *[f"  {f}" for f in self.failures[:20]],
            f"time: {self.seconds:.1f} s (a full conversion took {self.full_seconds:.2f} s at the start)",
        ]
        return "\n".join(lines)


def _child_convert(source: str, output: str, kwargs: dict) -> None:
    """The killed child: a plain conversion. tqdm's lock is made a thread lock first, since the
    multiprocessing semaphore it would create is leaked (and warned about) when the child is killed."""
    import threading

    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())
    convert_checkpoint(source, output, **kwargs)


class CrashHarness:
    """Kill-and-check loop around convert_checkpoint on one source, output and TP degree."""

    def __init__(self, source: Path, plan: Path, output: Path, *, tp: int = 4, seed: int = 0) -> None:
        self.source, self.plan, self.output, self.tp = Path(source), Path(plan), Path(output), tp
        self.work = partial_dir(self.output)
        self.rng = random.Random(seed)
        self.ctx = multiprocessing.get_context("forkserver")
        # The forkserver imports preshard (and so torch) once; each child forked from it then only imports this
        # small module (found through the sys.path it inherits), so a kill costs milliseconds, not a torch import.
        self.ctx.set_forkserver_preload(["preshard.converter.convert", "preshard.tools.verify", "tqdm.auto"])
        self.stats = SoakStats()
        self.total_tensors = 0
        self.full_seconds = 0.0

    def _kwargs(self) -> dict:
        return {"tp": self.tp, "plan": str(self.plan), "overwrite": True, "progress": False}

    def _start(self):
        proc = self.ctx.Process(
            target=_child_convert, args=(str(self.source), str(self.output), self._kwargs()), daemon=True
        )
        proc.start()
        return proc

    def calibrate(self) -> float:
        """One full conversion in a child, timed (this also starts the forkserver)."""
        shutil.rmtree(self.output, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)
        for _ in range(2):  # the first run also pays for the forkserver's start
            start = time.perf_counter()
            proc = self._start()
            proc.join(600)
            self.full_seconds = self.stats.full_seconds = time.perf_counter() - start
            if proc.exitcode != 0:
                raise RuntimeError(f"the calibration conversion failed with exit code {proc.exitcode}")
        result = verify_checkpoint(self.output, source=self.source)
        if not result.ok:
            raise RuntimeError(f"the calibration conversion does not verify: {result.problems[:3]}")
        self.total_tensors = result.tensors
        return self.full_seconds

    def journal_entries(self) -> int:
        """Finished tensors a re-run will find: complete journal lines of this same job's partial folder."""
        try:
            json.loads((self.work / JOB_NAME).read_text())["job"]
            lines = (self.work / JOURNAL_NAME).read_text().splitlines()
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        count = 0
        for line in lines:
            try:
                json.loads(line)
            except ValueError:
                break
            count += 1
        return count

    def _stage(self) -> str:
        if not self.work.exists():
            return "before the work folder / after the commit"
        if not (self.work / JOB_NAME).exists():
            return "finishing (metadata, manifest, commit)"
        done = self.journal_entries()
        if done == 0:
            return "tensors 0"
        quarter = min(3, 4 * done // max(1, self.total_tensors))
        return f"tensors {25 * quarter}-{25 * (quarter + 1)}%"

    def _check_output(self, had_output: bool, when: str, source: bool = False) -> None:
        if not self.output.exists():
            if had_output:
                self.stats.failures.append(f"{when}: the previous complete output at {self.output} is gone")
            return
        if not (self.output / MANIFEST_NAME).is_file():
            self.stats.failures.append(f"{when}: {self.output} exists without a manifest (a half-written output)")
            return
        result = verify_checkpoint(self.output, source=self.source if source else None)
        self.stats.verified += 1
        self.stats.verified_with_source += source
        if not result.ok:
            self.stats.failures.append(f"{when}: {self.output} does not verify: {result.problems[:3]}")

    def kill_once(self) -> bool:
        """Start a conversion, SIGKILL it after a random delay, check the output. True if it was killed."""
        had_output = (self.output / MANIFEST_NAME).is_file()
        # Over what is left of this run: a resumed run is shorter by the tensors it skips.
        share = 0.1 + 0.9 * (1.0 - self.journal_entries() / max(1, self.total_tensors))
        delay = self.rng.uniform(0.0, 1.05 * self.full_seconds * share)
        start = time.perf_counter()
        proc = self._start()
        proc.join(delay)
        if proc.exitcode is None:
            proc.kill()
        else:  # it finished first: learn how long a run really takes now (the machine's load changes)
            self.full_seconds = 0.5 * (self.full_seconds + (time.perf_counter() - start) / share)
        proc.join(60)
        killed = proc.exitcode == -signal.SIGKILL
        if killed:
            self.stats.kills += 1
            self.stats.stages[self._stage()] += 1
        elif proc.exitcode == 0:
            self.stats.finished_before_kill += 1
        else:
            self.stats.failures.append(f"a conversion exited with code {proc.exitcode} before its kill")
        self._check_output(had_output, f"kill {self.stats.kills} after {delay:.2f} s")
        return killed

    def rerun(self) -> int:
        """Finish the conversion in this process; it must skip exactly the tensors the journal records."""
        expected_skip = self.journal_entries()
        written: list[str] = []
        convert_module._after_tensor_hook = written.append
        try:
            convert_checkpoint(self.source, self.output, **self._kwargs())
        finally:
            convert_module._after_tensor_hook = None
        self.stats.reruns += 1
        if len(written) != self.total_tensors - expected_skip:
            self.stats.failures.append(
                f"re-run wrote {len(written)} tensors; with {expected_skip} finished in the journal it should "
                f"write {self.total_tensors - expected_skip}"
            )
        if expected_skip and len(written) < self.total_tensors:
            self.stats.resumes += 1
            self.stats.tensors_reused += self.total_tensors - len(written)
        self._check_output(True, f"re-run after kill {self.stats.kills}", source=True)
        return len(written)

    def run(self, kills: int, *, rerun_every: int = 4, reset_probability: float = 0.5) -> SoakStats:
        start = time.perf_counter()
        if not self.full_seconds:
            self.calibrate()
        shutil.rmtree(self.output, ignore_errors=True)  # start with a fresh conversion
        while self.stats.kills < kills:
            if self.kill_once() and self.stats.kills % rerun_every == 0:
                self.rerun()
                if self.rng.random() < reset_probability:
                    shutil.rmtree(self.output)
        self.rerun()
        self.stats.seconds = time.perf_counter() - start
        return self.stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=40, help="8 tensors per block")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rerun-every", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    args = parser.parse_args(argv)

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="preshard-soak-")
        workdir = Path(tmp.name)
    try:
        source = build_source(workdir / "src", blocks=args.blocks, width=args.width, seed=args.seed)
        harness = CrashHarness(source, workdir / "plan.json", workdir / "out", tp=args.tp, seed=args.seed)
        full = harness.calibrate()
        size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        print(
            f"source: {harness.total_tensors} tensors, {size / 2**20:.1f} MiB; a full conversion at tp={args.tp} "
            f"takes {full:.2f} s",
            flush=True,
        )
        stats = harness.run(args.kills, rerun_every=args.rerun_every)
        print(stats.summary())
        return 1 if stats.failures else 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    # Run as `crash_soak`, not `__main__`, so that the forkserver children can import the child function.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import crash_soak

    sys.exit(crash_soak.main())
