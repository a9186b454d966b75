"""Hostile inputs, round 3 (issue 20): each bug of the list has a test here that fails without its fix.

- resume keyed on content: a source file swapped between runs (in place or renamed over it, same size, header
  and mtime) never leaves records of the old bytes; what is kept is proven, the resumed output is byte-identical
  to a fresh conversion of the current source;
- one checkpoint per job: a rank delayed across an --overwrite, or across a Hub branch that moved, is refused on
  every rank alike; a checkpoint replaced during the load is refused too; the control loads;
- links: a CP-only reshard from a Hub repo stands on its own once the HF cache is removed;
- the folder as boundary: symbolic links out of the checkpoint, FIFOs and sockets, under every command that opens
  the file; `.metadata` is covered by the manifest (and old manifests without that record still load);
- bounded work: safetensors shapes past int64, meshes of 10**12 ranks, names with NUL bytes: one line, fast; huge
  zero-element shapes that fit convert without iterating over their rows;
- signals: a signal whose exception is swallowed where it lands (numpy's import does) still ends the command with
  130/143, before anything is written; one deferred past the last safe point too;
- tracebacks: running out of memory or threads is one line; load_sharded of a file names the folder;
- and a short run of `scripts/hostile_soak.py` (all classes but the slow ones).
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import signal
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from clitools import assert_one_line, cli_runner
from fake_hub import FakeHub
from hub_fixtures import HfEnv
from manifests import edit_manifest
from multiproc import init_gloo, run_ranks

from preshard.cli import main
from preshard.converter import convert as convert_module
from preshard.converter.convert import convert_checkpoint
from preshard.errors import CorruptCheckpointError, MismatchError, UsageError
from preshard.format.manifest import DCP_METADATA_NAME, read_manifest
from preshard.plans import from_model
from preshard.runtime.load import load_sharded
from preshard.tools.reshard import reshard_checkpoint
from preshard.tools.verify import verify_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
hostile_soak = importlib.import_module("hostile_soak")
SyntheticModel = hostile_soak.SyntheticModel


def cli(*args):
    result = cli_runner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(source, plan, tp=1 checkpoint) of the synthetic model; shared: copy before damaging."""
    return hostile_soak.build_checkpoint(tmp_path_factory.mktemp("hostile"))


@pytest.fixture()
def ck(base, tmp_path) -> Path:
    return Path(shutil.copytree(base[2], tmp_path / "ck"))


@pytest.fixture()
def soak(base, tmp_path):
    """The soak's own cases and contracts, on this module's inputs, with its wall-clock bounds off (no test times a
    command: bounded work is counted, section 5)."""
    return hostile_soak.Soak(tmp_path, max_seconds=math.inf, inputs=base)


# ---------------------------------------------------------------------------------------------------------
# 1. Resume keyed on content


class _Crash(Exception):
    pass


def _stopped_after(source: Path, plan: Path, out: Path, tensors: int, monkeypatch) -> list[str]:
    """A tp=2 conversion stopped after `tensors` tensors, each journalled; returns the write order."""
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)
    seen: list[str] = []

    def crash(name: str) -> None:
        seen.append(name)
        if len(seen) == tensors:
            raise _Crash

    with pytest.raises(_Crash):
        convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=crash)
    return convert_module.plan_conversion(source, mesh=convert_module.MeshSpec(tp=2), plan=plan).write_order


def _swap(path: Path, tensor: str, how: str, scratch: Path) -> None:
    """Replace `path` by the same file with `tensor` changed: same size, same header, same mtime."""
    from safetensors.torch import load_file, save_file

    before = os.stat(path)
    tensors = load_file(str(path))
    tensors[tensor] = tensors[tensor] + 1
    save_file(tensors, str(scratch))
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert scratch.read_bytes()[:header] == path.read_bytes()[:header] and scratch.stat().st_size == before.st_size
    if how == "in place":
        with open(path, "r+b") as f:
            f.write(scratch.read_bytes())
    else:
        os.replace(scratch, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_resume_keeps_only_what_the_current_source_proves(base, tmp_path, monkeypatch, how):
    source0, plan, _ = base
    source = Path(shutil.copytree(source0, tmp_path / "src"))
    out = tmp_path / "out"
    order = _stopped_after(source, plan, out, 20, monkeypatch)
    first = sorted(source.glob("*.safetensors"))[0]
    changed = 5  # a tensor of the first file, among the 20 journalled
    from safetensors import safe_open

    with safe_open(str(first), "pt") as f:
        assert order[changed] in f.keys()
    _swap(first, order[changed], how, tmp_path / "new.safetensors")

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    written: list[str] = []
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    # Kept: the tensors before the changed one (the source proves them); redone: it and everything after it.
    assert written == order[changed:]
    assert verify_checkpoint(out, source=source).ok
    convert_checkpoint(source, tmp_path / "fresh", tp=2, plan=plan, progress=False)
    assert tree(out) == tree(tmp_path / "fresh")  # byte for byte, manifest included


def test_an_unchanged_source_resumes_every_journalled_tensor(base, tmp_path, monkeypatch):
    """The negative control: the proof holds for the same bytes, so the resume keeps all it journalled."""
    source, plan, _ = base
    out = tmp_path / "out"
    order = _stopped_after(source, plan, out, 20, monkeypatch)
    journalled = len((out.parent / f".{out.name}.partial" / "journal.jsonl").read_text().splitlines())
    assert journalled >= 15
    written: list[str] = []
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    assert written == order[journalled:]
    assert verify_checkpoint(out, source=source).ok


def test_a_resume_with_workers_after_a_swap_verifies_against_the_current_source(base, tmp_path, monkeypatch):
    source0, plan, _ = base
    source = Path(shutil.copytree(source0, tmp_path / "src"))
    out = tmp_path / "out"
    order = _stopped_after(source, plan, out, 14, monkeypatch)
    _swap(sorted(source.glob("*.safetensors"))[0], order[3], "renamed over", tmp_path / "new.safetensors")
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, workers=2)
    assert verify_checkpoint(out, source=source).ok


# ---------------------------------------------------------------------------------------------------------
# 2. One checkpoint per job


def _rank_delayed_across_overwrite(rank: int, world_size: int, folder: str, mode: str) -> str:
    """Rank 1 opens the checkpoint once rank 0 waits in the checkpoint agreement (both ranks have joined the load
    before), after it was replaced by a conversion of another source (mode "overwrite"), or it is replaced while
    both read (mode "during"), or not at all ("control")."""
    from preshard.runtime import load as load_module
    from preshard.runtime import reader as reader_module

    init_gloo()
    root = Path(folder)
    marker = root / "rank0-agreeing"
    checkpoint = root / "a" / "ck"

    def replace() -> None:
        convert_checkpoint(root / "b" / "src", checkpoint, tp=2, plan=root / "a" / "plan.json", overwrite=True)

    if mode == "during":  # after the agreement, while reading: rank 1 replaces the checkpoint under both ranks
        real_read = reader_module.ShardReader.read_all

        def read_then_replace(self, targets):
            real_read(self, targets)
            if rank == 1:
                replace()

        reader_module.ShardReader.read_all = read_then_replace
    elif rank == 0:
        real = load_module.agree_on_checkpoint

        def announce(*args, **kwargs):
            marker.write_text("")
            return real(*args, **kwargs)

        load_module.agree_on_checkpoint = announce
    else:  # once both ranks have joined the load, rank 1 opens the checkpoint only when rank 0 is in the agreement
        real_open = load_module._open_checkpoint

        def open_late(*args, **kwargs):
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if mode == "overwrite":
                replace()
            return real_open(*args, **kwargs)

        load_module._open_checkpoint = open_late
    try:
        model = load_sharded(SyntheticModel, checkpoint, device="cpu")
    except (MismatchError, CorruptCheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded " + str(float(model.blocks[0].attn.to_q.weight.double().sum()))


def _two_sources(tmp_path: Path) -> Path:
    hostile_soak.build_checkpoint(tmp_path / "a", seed=0, tp=2)
    other = hostile_soak.crash_soak.build_source(tmp_path / "b" / "src", blocks=3, width=32, seed=1)
    (other / "config.json").write_text((tmp_path / "a" / "ck" / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("mode", ["overwrite", "during"])
def test_a_checkpoint_replaced_under_a_job_is_refused_on_every_rank(tmp_path, mode):
    folder = _two_sources(tmp_path)
    results = run_ranks(_rank_delayed_across_overwrite, 2, str(folder), mode, timeout=240)
    assert results[0] == results[1], results  # the same one line on every rank
    kind, _, message = results[0].partition(": ")
    if mode == "overwrite":
        assert kind == "MismatchError" and "opened different checkpoints" in message
        assert "rank 0 manifest" in message and "rank 1 manifest" in message
    else:
        assert kind == "CorruptCheckpointError" and "was replaced while it was being loaded" in message
    assert "\n" not in message


def test_the_control_without_a_replacement_loads_the_same_weights_on_every_rank(tmp_path):
    folder = _two_sources(tmp_path)
    results = run_ranks(_rank_delayed_across_overwrite, 2, str(folder), "control", timeout=240)
    assert all(r.startswith("loaded") for r in results), results


def _rank_loads_a_moving_branch(rank: int, world_size: int, repo: str, folder: str) -> str:
    from preshard.runtime import load as load_module

    init_gloo()
    root = Path(folder)
    if rank == 0:
        real = load_module.agree_on_checkpoint

        def announce(*args, **kwargs):
            (root / "rank0-agreeing").write_text("")
            return real(*args, **kwargs)

        load_module.agree_on_checkpoint = announce
    else:  # opens the checkpoint once the branch has moved (the test moves it when rank 0 waits in the agreement)
        real_open = load_module._open_checkpoint

        def open_late(*args, **kwargs):
            deadline = time.monotonic() + 120
            while not (root / "moved").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            return real_open(*args, **kwargs)

        load_module._open_checkpoint = open_late
    try:
        load_sharded(SyntheticModel, repo, device="cpu")
    except MismatchError as exc:
        return str(exc)
    return "loaded"


def test_a_hub_branch_moving_under_a_job_is_refused_on_every_rank(fake_hub: FakeHub, hf_env: HfEnv, tmp_path):
    folder = _two_sources(tmp_path)
    first = tree(folder / "a" / "ck")
    convert_checkpoint(folder / "b" / "src", tmp_path / "ck-b", tp=2, plan=folder / "a" / "plan.json")
    fake_hub.add_repo("org/moving", first)
    second = fake_hub.add_commit("org/moving", tree(tmp_path / "ck-b"))
    old = fake_hub.repos["org/moving"].commits
    first_commit = next(c for c in old if c != second)
    fake_hub.set_ref("org/moving", "main", first_commit)

    def move_when_rank0_agrees() -> None:
        deadline = time.monotonic() + 120
        while not (folder / "rank0-agreeing").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        fake_hub.set_ref("org/moving", "main", second)
        (folder / "moved").write_text("")

    mover = threading.Thread(target=move_when_rank0_agrees, daemon=True)
    mover.start()
    results = run_ranks(_rank_loads_a_moving_branch, 2, "org/moving", str(folder), timeout=240)
    mover.join()
    assert results[0] == results[1], results
    assert "opened different checkpoints" in results[0] and "Hub branch moved" in results[0]
    assert first_commit[:12] in results[0] and second[:12] in results[0] and "pin revision=" in results[0]


# ---------------------------------------------------------------------------------------------------------
# 3. Links resolved: a CP-only reshard from the Hub stands on its own


def test_a_cp_only_reshard_from_a_hub_repo_verifies_after_the_cache_is_removed(
    fake_hub: FakeHub, hf_env, base, tmp_path
):
    fake_hub.add_repo("org/ck", tree(base[2]))
    out = tmp_path / "out"
    reshard_checkpoint("org/ck", out, ulysses=2, progress=False)
    assert any(p.is_symlink() for p in (hf_env.cache / "models--org--ck" / "snapshots").rglob("*"))  # what it read
    shutil.rmtree(hf_env.home)
    assert not any(p.is_symlink() for p in out.iterdir())
    result = verify_checkpoint(out)
    assert result.ok, result.problems
    assert read_manifest(out).mesh.ulysses == 2


# ---------------------------------------------------------------------------------------------------------
# 4. The folder is the boundary


@pytest.mark.parametrize("name", ["manifest.json", DCP_METADATA_NAME, "config.json", "__0_0.distcp"])
def test_a_link_out_of_the_checkpoint_is_refused_by_every_command_that_opens_it(soak, tmp_path, name):
    for cmd in hostile_soak.COMMANDS:
        folder = tmp_path / cmd
        folder.mkdir()
        why = soak._outside_link(name, cmd)(folder)
        assert why is None, (cmd, why)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("name", ["manifest.json", DCP_METADATA_NAME, "config.json", "__0_0.distcp"])
def test_a_fifo_or_socket_in_a_checkpoint_is_one_line_never_waited_on(soak, tmp_path, name, kind):
    for cmd in hostile_soak.COMMANDS:
        folder = tmp_path / cmd
        folder.mkdir()
        why = soak._special(name, kind, cmd)(folder)
        assert why is None, (cmd, why)


def test_links_inside_the_folder_are_followed(ck):
    (ck / "sub").mkdir()
    for name in ("config.json", "__0_0.distcp", DCP_METADATA_NAME):
        shutil.move(str(ck / name), ck / "sub" / name)
        (ck / name).symlink_to(Path("sub") / name)
    assert verify_checkpoint(ck).ok
    assert load_sharded(SyntheticModel, ck, device="cpu") is not None


def test_a_fifo_config_in_a_source_is_refused_not_waited_on(base, tmp_path):
    source = Path(shutil.copytree(base[0], tmp_path / "src"))
    (source / "config.json").unlink()
    os.mkfifo(source / "config.json")
    code, _, stderr = cli("convert", source, tmp_path / "out", "--tp", "1", "--plan", base[1], "--no-progress")
    assert_one_line(code, stderr, 2, "config.json", "a FIFO")


def test_metadata_is_recorded_in_the_manifest_and_checked(ck):
    manifest = read_manifest(ck)
    assert manifest.metadata is not None and manifest.metadata.size == (ck / DCP_METADATA_NAME).stat().st_size
    # Re-pickled with another protocol: the same content (torch's dcp.load would read it), other bytes.
    import pickle

    from preshard.format.dcp_metadata import dcp_metadata

    (ck / DCP_METADATA_NAME).write_bytes(pickle.dumps(dcp_metadata(manifest), protocol=2))  # torch's own objects
    problems = verify_checkpoint(ck).problems
    assert problems == [f"{DCP_METADATA_NAME} differs from the one written with the checkpoint (size or xxh3_128)"]
    with pytest.raises(CorruptCheckpointError, match="differs from the one written"):
        reshard_checkpoint(ck, ck.parent / "cp", ulysses=2, progress=False)


def test_a_manifest_without_the_metadata_record_is_still_read(ck, tmp_path):
    """Manifests written before the record: verified and loaded as before; a CP-only reshard records it."""
    edit_manifest(ck, lambda d: d.pop("metadata"))
    assert read_manifest(ck).metadata is None
    assert verify_checkpoint(ck).ok
    assert load_sharded(SyntheticModel, ck, device="cpu") is not None
    out = tmp_path / "cp"
    assert reshard_checkpoint(ck, out, ulysses=2, progress=False).metadata is not None
    assert verify_checkpoint(out).ok


# ---------------------------------------------------------------------------------------------------------
# 5. Bounded work for any header or manifest


CALL_BUDGET = 50_000  # Python calls for one command on a hostile header: about 1 100-7 800 measured; a loop over
# its rows or elements (2**58 and more) would pass any budget at once


class _CallBudget(Exception):
    pass


def _counted(fn):
    """fn() with every Python call counted, in this thread and the threads it starts; stopped past CALL_BUDGET.
    Bounded work shown by counting, not by a clock (a loaded machine slows a command tenfold)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1
            if calls[0] > CALL_BUDGET:
                raise _CallBudget(f"more than {CALL_BUDGET} calls")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        return fn(), calls[0]
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


@pytest.fixture()
def unclocked_soak(base, tmp_path):
    """The soak's cases with its wall-clock bounds off: the tests below count calls instead."""
    return hostile_soak.Soak(tmp_path, max_seconds=math.inf, inputs=base)


@pytest.mark.parametrize("label", sorted(hostile_soak.Soak.HEADERS))
def test_a_safetensors_shape_past_int64_is_one_line_in_bounded_work(unclocked_soak, tmp_path, label):
    shape, dtype = hostile_soak.Soak.HEADERS[label]
    for cmd in ("convert", "plan", "verify-source"):
        folder = tmp_path / cmd
        folder.mkdir()
        why, calls = _counted(lambda cmd=cmd, folder=folder: unclocked_soak._hostile_header(shape, dtype, cmd)(folder))
        assert why is None, cmd
        assert calls <= CALL_BUDGET, (cmd, calls)


@pytest.mark.parametrize("label", sorted(hostile_soak.Soak.FIT))
def test_a_huge_zero_element_shape_that_fits_converts_without_iterating_rows(unclocked_soak, tmp_path, label):
    shape, dtype = hostile_soak.Soak.FIT[label]
    why, calls = _counted(lambda: unclocked_soak._fitting_header(shape, dtype)(tmp_path))
    assert why is None and calls <= CALL_BUDGET, calls


@pytest.mark.parametrize(
    "label", ["ring=ulysses=10**6", "tp=10**6", "NUL in config name", "NUL in source file name", "shape 2**70"]
)
def test_a_resealed_hostile_manifest_is_one_line_in_bounded_work_everywhere(unclocked_soak, tmp_path, label):
    edit = unclocked_soak.manifest_edits()[label]
    for cmd in ("verify", "inspect", "reshard-cp", "unshard", "load"):
        folder = tmp_path / cmd
        folder.mkdir()
        why, calls = _counted(lambda cmd=cmd, folder=folder: unclocked_soak._hostile_manifest(edit, cmd)(folder))
        assert why is None, (cmd, why)
        assert calls <= CALL_BUDGET, (cmd, calls)


# ---------------------------------------------------------------------------------------------------------
# 7. Signals at any moment


def _swallowing(monkeypatch, module, name: str, signum: int) -> None:
    """`module.name` now first receives `signum` where its handler's exception is swallowed, as numpy's import does
    to anything raised while `import torch` runs."""
    real = getattr(module, name)

    def call(*args, **kwargs):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(0.2)  # the handler runs here and raises
        except Exception:  # noqa: BLE001 - what the swallowing code does
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, call)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_signal_during_start_up_stops_the_conversion_before_it_writes(base, tmp_path, monkeypatch, signum):
    source, plan, _ = base
    _swallowing(monkeypatch, convert_module, "convert_checkpoint", signum)
    out = tmp_path / "out"
    code, stdout, stderr = cli("convert", source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 128 + signum, "SIGINT" if signum == signal.SIGINT else "SIGTERM")
    assert not out.exists() and stdout == ""


def test_a_swallowed_signal_in_a_command_that_never_defers_is_not_exit_0(base, monkeypatch):
    from preshard.tools import verify as verify_module

    _swallowing(monkeypatch, verify_module, "verify_checkpoint", signal.SIGINT)
    code, _, stderr = cli("verify", base[2])
    assert_one_line(code, stderr, 130, "interrupted (SIGINT)")


def test_a_signal_deferred_past_the_last_safe_point_is_not_exit_0(base, tmp_path, monkeypatch):
    """SIGTERM once the output is committed: the command ends with 143 (the output is complete and verifies)."""
    source, plan, _ = base
    real_commit = convert_module.commit

    def commit_then_signal(work, output):
        real_commit(work, output)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(convert_module, "commit", commit_then_signal)
    out = tmp_path / "out"
    code, _, stderr = cli("convert", source, out, "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 143, "terminated (SIGTERM)")
    assert verify_checkpoint(out, source=source).ok


# ---------------------------------------------------------------------------------------------------------
# 8. The remaining tracebacks


def test_load_sharded_of_a_manifest_path_names_the_folder_to_pass(ck):
    with pytest.raises(UsageError, match=f"pass the folder {ck}$"):
        load_sharded(SyntheticModel, ck / "manifest.json", device="cpu")


def test_running_out_of_memory_in_the_plan_check_is_one_line(base, tmp_path, monkeypatch):
    source, plan, _ = base

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(from_model, "check_plan_against_model", out_of_memory)
    code, _, stderr = cli("convert", source, tmp_path / "out", "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 2, "out of memory while converting")
    from preshard.errors import ResourceError

    with pytest.raises(ResourceError):
        convert_checkpoint(source, tmp_path / "out", tp=2, plan=plan, progress=False)


def test_a_thread_that_cannot_start_is_one_line(base, tmp_path, monkeypatch):
    source, plan, _ = base
    real_start = threading.Thread.start

    def start(self):
        if self.name.startswith("write "):
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    code, _, stderr = cli("convert", source, tmp_path / "out", "--tp", "2", "--plan", plan, "--no-progress")
    assert_one_line(code, stderr, 2, "cannot start a thread")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# 9. The soak, short


@pytest.mark.timeout(600)
def test_a_short_hostile_soak_holds(tmp_path):
    """The soak as a script, on the classes the tests above do not run in full (fresh interpreters: one case;
    links and special files: see their tests)."""
    classes = "headers,manifests,misuse,resume,signals"
    # --max-seconds inf: the soak's clock off; the tests above show bounded work by counting calls.
    args = ["--classes", classes, "--resumes", "2", "--signals", "1", "--max-seconds", "inf"]
    args += ["--workdir", str(tmp_path)]
    assert hostile_soak.main(args) == 0


def test_the_synthetic_model_matches_its_checkpoint(base):
    """The soak's loads mean something: the model is the checkpoint's, tensor for tensor."""
    model = load_sharded(SyntheticModel, base[2], device="cpu")
    from safetensors.torch import load_file

    expected = {k: v for f in sorted(base[0].glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    got = model.state_dict()
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
