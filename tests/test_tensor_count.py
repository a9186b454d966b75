"""Cost linear in the tensor count, and signals acted on before the commit whatever the count.

Work is counted, not timed (a loaded machine changes times, never counts): every Python and C function call a
command makes, in every thread, for a source of N tensors and of 4N. A linear command makes at most about 4x the
calls (less: its fixed part does not grow); one quadratic step, such as the band size recomputed as a max over
every tensor for each tensor (issue 20), makes it about 16x.

The signal tests run the real CLI on a source of many tensors and send SIGINT once the command has reached a given
phase (the child reports it through a pipe): the command must end with the one-line error and exit 130, nothing
committed. How long it took is printed, not asserted (a loaded machine changes times).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from preshard.converter.convert import convert_checkpoint
from preshard.examples.synthetic import MANY_TENSORS_PLAN, many_tiny_tensors, write_safetensors_checkpoint
from preshard.format.manifest import read_manifest
from preshard.tools.planner import plan_meshes
from preshard.tools.reshard import reshard_checkpoint
from preshard.tools.unshard import unshard_checkpoint
from preshard.tools.verify import verify_checkpoint

PLAN = MANY_TENSORS_PLAN
SMALL, LARGE = 256, 1024  # tensors
LINEAR = 4.5  # the most a linear command's calls may grow from SMALL to LARGE tensors (4x, with some slack)


def many_tensors(folder: Path, count: int, files: int = 1) -> tuple[Path, Path]:
    """A source of `count` tiny tensors (count/4 blocks: colwise bf16 weight and bias, rowwise fp32 weight, a norm)
    and its plan file."""
    tensors = many_tiny_tensors(count)
    shard = None if files == 1 else (count // 4) * 240 // files + 1
    write_safetensors_checkpoint(folder, tensors, {"_class_name": "ManyTensors"}, data="random", max_shard_bytes=shard)
    plan = folder.parent / f"{folder.name}-plan.json"
    plan.write_text(json.dumps(PLAN))
    return folder, plan


class _Model(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out, self.norm = nn.Linear(4, 8), nn.Linear(8, 4, bias=False), nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(4))


def _calls(fn) -> int:
    """Function calls `fn()` makes, in this thread and every thread it starts (cProfile in each)."""
    profiles: list[cProfile.Profile] = []

    def start_in_thread(*_) -> None:  # the first event of a new thread: profile it from here on
        threading.setprofile(None)
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    main = cProfile.Profile()
    profiles.append(main)
    threading.setprofile(start_in_thread)
    main.enable()
    try:
        fn()
    finally:
        main.disable()
        threading.setprofile(None)
    total = 0
    for profile in profiles:
        profile.create_stats()
        total += sum(calls for _, calls, _, _, _ in pstats.Stats(profile).stats.values())
    return total


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    return {n: many_tensors(root / f"src{n}", n, files=2) for n in (SMALL, LARGE)}


def _grow(sources, tmp_path, command) -> float:
    """How much more work `command` does for LARGE tensors than for SMALL (after a first run, which imports)."""
    counts = {}
    for n, (src, plan) in [("warm-up", sources[SMALL]), *sources.items()]:
        work = tmp_path / f"n{n}"
        work.mkdir()
        counts[n] = command(src, plan, work)
    del counts["warm-up"]
    growth = counts[LARGE] / counts[SMALL]
    print(f"calls: {counts} -> x{growth:.2f} for x{LARGE // SMALL} tensors")
    return growth


def _converted(src: Path, plan: Path, work: Path, tp: int = 2) -> Path:
    out = work / f"tp{tp}"
    if not out.exists():
        convert_checkpoint(src, out, tp=tp, plan=plan, progress=False)
    return out


COMMANDS = {
    "convert": lambda src, plan, work: _calls(lambda: _converted(src, plan, work)),
    "plan": lambda src, plan, work: _calls(lambda: plan_meshes(src, plan=plan, devices=2)),
    "read manifest (inspect, load)": lambda src, plan, work: (
        _converted(src, plan, work) and _calls(lambda: read_manifest(_converted(src, plan, work)))
    ),
    "verify --source": lambda src, plan, work: (
        _converted(src, plan, work) and _calls(lambda: verify_checkpoint(_converted(src, plan, work), source=src))
    ),
    "reshard": lambda src, plan, work: (
        _converted(src, plan, work)
        and _calls(lambda: reshard_checkpoint(_converted(src, plan, work), work / "tp1", tp=1, progress=False))
    ),
    "unshard": lambda src, plan, work: (
        _converted(src, plan, work)
        and _calls(lambda: unshard_checkpoint(_converted(src, plan, work), work / "rebuilt", progress=False))
    ),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_work_grows_linearly_with_the_tensor_count(command, sources, tmp_path):
    assert _grow(sources, tmp_path, COMMANDS[command]) < LINEAR


def test_loading_grows_linearly_with_the_tensor_count(sources, tmp_path):
    from preshard import load_sharded

    def load(src: Path, plan: Path, work: Path) -> int:
        checkpoint = _converted(src, plan, work, tp=1)
        with torch.device("meta"):
            model = _Model(len(read_manifest(checkpoint).tensors) // 4)
        for name, p in model.named_parameters():
            p.data = p.data.to(torch.bfloat16 if ".proj." in name else torch.float32)
        return _calls(lambda: load_sharded(model, checkpoint, device="cpu"))

    assert _grow(sources, tmp_path, load) < LINEAR


class _Attention(nn.Module):
    """What the model check takes for a diffusers attention module: a processor it can swap, and heads."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.processor = 2, None
        self.to_q, self.to_out = nn.Linear(4, 8), nn.ModuleList([nn.Linear(8, 4)])
        self.norm_q = nn.RMSNorm(4)  # per head: left whole

    def set_processor(self, processor) -> None:
        self.processor = processor


def test_the_model_check_grows_linearly_with_the_module_count():
    """Checking a plan against the model (at conversion, for a plan file) and against the checkpoint's tensors
    (whether a built-in plan may skip that) are linear in the modules: the column-split outputs beside each
    attention module were found by a scan of every styled module (quadratic: about x12 here)."""
    from preshard.format.plan import Plan, resolve_plan
    from preshard.plans.model_check import check_model_structure
    from preshard.plans.tensor_check import structure_shown_by_tensors

    plan = Plan.from_dict({
        "format": 1, "name": "attention", "attention": [{"match": "blocks.*.attn", "divide": ["heads"]}],
        "linear": [{"match": "blocks.*.attn.to_q", "style": "colwise"},
                   {"match": "blocks.*.attn.to_out.0", "style": "rowwise"}],
    })  # fmt: skip
    counts = {}
    for blocks in (SMALL // 4, LARGE // 4):
        model = nn.Module()
        model.blocks = nn.ModuleList(nn.Module() for _ in range(blocks))
        for block in model.blocks:
            block.attn = _Attention()
        shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        layouts = resolve_plan(plan, shapes, 2)
        assert structure_shown_by_tensors(plan, layouts)
        counts[blocks] = _calls(lambda m=model: check_model_structure(plan, m, 2)) + _calls(
            lambda t=layouts: structure_shown_by_tensors(plan, t)
        )
    growth = counts[LARGE // 4] / counts[SMALL // 4]
    assert growth < LINEAR, counts


# ---------------------------------------------------------------------------------------------------------
# Signals in every phase of a conversion of many tensors

# The child converts through the CLI, reporting on fd 3 when it enters the phase named in argv (a wrapper around
# the function that starts the phase, in the child only).
_CHILD = textwrap.dedent(
    """
    import os, sys
    import preshard.converter.convert as convert
    phase, report = sys.argv[1], int(sys.argv[2])
    module, name = {"planning": (convert, "resolve_plan"), "tasks": (convert, "_tasks"),
                    "commit": (convert._Conversion, "_final_files")}[phase]
    original = getattr(module, name)

    def entered(*args, **kwargs):
        os.write(report, b"x")
        return original(*args, **kwargs)

    setattr(module, name, entered)
    from preshard.cli import convert_checkpoint_command
    sys.argv = ["convert-checkpoint", *sys.argv[3:]]
    convert_checkpoint_command()
    """
)


@pytest.fixture(scope="module")
def large_source(tmp_path_factory):
    return many_tensors(tmp_path_factory.mktemp("large") / "src", 60_000)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", ["planning", "tasks", "commit"])
def test_sigint_in_every_phase_stops_the_conversion_before_its_commit_with_one_line(phase, large_source, tmp_path):
    src, plan = large_source
    out = tmp_path / "out"
    read, write = os.pipe()
    args = [sys.executable, "-c", _CHILD, phase, str(write), str(src), str(out), "--tp", "2", "--plan", str(plan)]
    proc = subprocess.Popen(
        [*args, "--no-progress"], pass_fds=(write,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 500)
        assert ready and os.read(read, 1) == b"x", f"the conversion never reached {phase}"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        line = proc.stderr.readline()
        acted = time.monotonic() - sent
        proc.wait(timeout=60)
    finally:
        os.close(read)
        if proc.poll() is None:
            proc.kill()
    print(f"{phase}: acted on after {acted:.3f} s")
    assert proc.returncode == 130 and line.startswith("error: interrupted (SIGINT)"), (proc.returncode, line)
    assert not out.exists()
