"""Parallel and pipelined conversion: the same bytes whatever the number of processes, resumable across
process counts, and every failure or signal in a worker stops the whole job cleanly.

The source has every sharding style (packed_rowwise with unequal blocks included), bf16 and fp32, a
scalar, over three files with an index. Bands are made tiny (`slicing.BAND_BYTES`) so that every tensor
takes many bands: a packed column split then goes block-major (each rank file must get a tensor's records
in file order; before that fix a packed_rowwise tensor larger than one band could not be converted at
all), row splits read only their rows, and the writers' staging buffers wrap mid-record. Workers are
forked from this process, so monkeypatches made here reach them.
"""

from __future__ import annotations

import errno
import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from preshard.converter import convert as convert_module
from preshard.converter import parallel
from preshard.converter.convert import convert_checkpoint
from preshard.converter.signals import command_scope
from preshard.converter.workdir import JOURNAL_NAME, partial_dir
from preshard.converter.writer import RecordFileWriter
from preshard.errors import Interrupted, UsageError, WorkerError
from preshard.format import slicing
from preshard.format.layout import TensorLayout, place_records
from preshard.format.styles import make_style
from preshard.tools.verify import verify_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked (Linux)")

W = 96  # width: divisible by 1..4 and by every block
PLAN = {
    "name": "parallel-test",
    "linear": [
        {"match": "blocks.*.q", "style": "colwise"},
        {"match": "blocks.*.o", "style": "rowwise"},
        {"match": "blocks.*.ff", "style": "packed_colwise", "blocks": 2},
        {"match": "blocks.*.proj", "style": "packed_rowwise", "blocks": [W, 2 * W]},
        {"match": "blocks.*.ada", "style": "replicated_input_rowwise"},
    ],
}
BLOCKS = 3
TENSORS_PER_BLOCK = 8
SMALL_BAND = 4096


def _build_source(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(7)

    def rand(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    files: list[dict[str, torch.Tensor]] = [{} for _ in range(3)]
    for b in range(BLOCKS):
        files[b % 3].update(
            {
                f"blocks.{b}.q.weight": rand(W, W),
                f"blocks.{b}.q.bias": rand(W, dtype=torch.float32),
                f"blocks.{b}.o.weight": rand(W, 2 * W, dtype=torch.float32),
                f"blocks.{b}.ff.weight": rand(4 * W, W),
                f"blocks.{b}.proj.weight": rand(W, 3 * W),
                f"blocks.{b}.ada.weight": rand(W // 2, W),
                f"blocks.{b}.norm.weight": rand(W, dtype=torch.float32),
                f"blocks.{b}.scale": torch.tensor(1.5 + b),
            }
        )
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder.parent / "plan.json").write_text(json.dumps(PLAN))
    return folder


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return _build_source(tmp_path_factory.mktemp("parallel") / "src")


@pytest.fixture(autouse=True)
def small_bands(monkeypatch):
    monkeypatch.setattr(slicing, "BAND_BYTES", SMALL_BAND)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the manifest's `created`, so files compare exactly


def _convert(source: Path, out: Path, tp: int = 4, **kwargs):
    return convert_checkpoint(source, out, tp=tp, plan=source.parent / "plan.json", progress=False, **kwargs)


def _assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    different = [n for n in names if not filecmp.cmp(a / n, b / n, shallow=False)]
    assert not different, f"{different} differ between {a.name} and {b.name}"


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict[str, Path]:
    """One-process conversions at tp 4 (and one with a cast), to compare the parallel ones against."""
    mp = pytest.MonkeyPatch()
    mp.setattr(slicing, "BAND_BYTES", SMALL_BAND)
    mp.setenv("SOURCE_DATE_EPOCH", "1700000000")
    root = tmp_path_factory.mktemp("reference")
    try:
        refs = {"tp4": root / "tp4", "tp4-bf16": root / "tp4-bf16"}
        _convert(source, refs["tp4"])
        _convert(source, refs["tp4-bf16"], dtype="bf16")
    finally:
        mp.undo()
    return refs


def test_many_bands_are_cut_in_each_files_record_order():
    """A packed column split spanning several bands is read block-major: each file's chunks arrive in order."""
    layout = TensorLayout.make(
        "m.weight", make_style("packed_rowwise", (W, 2 * W)), (W, 3 * W), torch.bfloat16, torch.bfloat16
    )
    chunks = place_records([layout], 4).chunks["m.weight"]
    bands = slicing.band_plan(layout, chunks, band_bytes=SMALL_BAND)
    assert len(bands) > 2
    for file in {c.file for c in chunks}:
        order = [c.offset for band in bands for c in band.chunks if c.file == file]
        firsts = list(dict.fromkeys(order))
        assert firsts == sorted(firsts), "a record started before the one before it in the file was finished"
    # one process's share of a colwise tensor: only the rows of its chunks are read
    colwise = TensorLayout.make("q.weight", make_style("colwise"), (W, W), torch.bfloat16, torch.bfloat16)
    mine = [c for c in place_records([colwise], 4).chunks["q.weight"] if c.owner in (2, 3)]
    rows = sorted(
        {
            r
            for band in slicing.band_plan(colwise, mine, band_bytes=512)
            for r in range(band.start, band.start + band.count)
        }
    )
    assert rows == list(range(W // 2, W))
    whole = slicing.band_plan(colwise, mine, whole=True, band_bytes=512)  # to hash the file: every row, in order
    assert [b.start for b in whole] == list(range(0, W, 2)) and sum(b.count for b in whole) == W


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_workers_write_the_same_bytes_as_one_process(source, reference, tmp_path, workers):
    out = tmp_path / "out"
    manifest = _convert(source, out, workers=workers)
    _assert_same_files(reference["tp4"], out)
    assert len(manifest.tensors) == BLOCKS * TENSORS_PER_BLOCK
    assert verify_checkpoint(out, source=source).ok


def test_workers_with_a_cast_write_the_same_bytes(source, reference, tmp_path):
    out = tmp_path / "out"
    _convert(source, out, workers=2, dtype="bf16")
    _assert_same_files(reference["tp4-bf16"], out)


def test_one_process_without_direct_io_writes_the_same_bytes(source, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("PRESHARD_DIRECT_IO", "0")  # read when each reader and writer is made
    out = tmp_path / "out"
    _convert(source, out)
    _assert_same_files(reference["tp4"], out)


def test_worker_count_is_checked(source, tmp_path):
    with pytest.raises(UsageError, match="more than --tp 2"):
        _convert(source, tmp_path / "out", tp=2, workers=3)
    with pytest.raises(UsageError, match="positive integer"):
        _convert(source, tmp_path / "out", workers=0)


def _interrupt_after(count: int, rank: int | None, out: Path):
    """A hook that, in worker `rank` (None: the one process), sends SIGINT to the process that started the
    conversion (this one) after `count` tensors, once the journal holds two tensors."""
    seen = []

    def hook(name: str) -> None:
        if parallel.WORKER_RANK == rank:
            seen.append(name)
            if len(seen) == count:
                journal, deadline = partial_dir(out) / JOURNAL_NAME, time.monotonic() + 20
                while time.monotonic() < deadline and journal.read_text().count("\n") < 2:
                    time.sleep(0.01)
                os.kill(os.getpid() if rank is None else os.getppid(), signal.SIGINT)
                if rank is not None:
                    time.sleep(0.5)  # let the launcher relay the stop before this worker goes on

    return hook


@pytest.mark.parametrize("first, second", [(2, 1), (2, 3), (1, 2)])
def test_interrupted_conversion_resumes_with_any_number_of_workers(
    source, reference, tmp_path, monkeypatch, first, second
):
    out = tmp_path / "out"
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    hook = _interrupt_after(6, None, out) if first == 1 else _interrupt_after(4, first - 1, out)
    with pytest.raises(Interrupted) as caught, command_scope():  # the CLI's scope: signals stop at a safe point
        _convert(source, out, workers=first, on_tensor=hook)
    assert caught.value.signal_number == signal.SIGINT
    assert not out.exists()
    journaled = (partial_dir(out) / JOURNAL_NAME).read_text().count("\n")
    assert 2 <= journaled < BLOCKS * TENSORS_PER_BLOCK

    written: list[str] = []
    _convert(source, out, workers=second, on_tensor=written.append)
    _assert_same_files(reference["tp4"], out)
    if second == 1:  # every tensor not in the journal is written once, the journalled ones are kept
        assert len(written) == BLOCKS * TENSORS_PER_BLOCK - journaled
    assert not partial_dir(out).exists()


def test_disk_full_in_one_worker_stops_all_and_a_rerun_resumes(source, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_write = RecordFileWriter._write
    calls = {"n": 0}

    def write_until_full(self, data):
        if self.path.name == "__3_0.distcp":  # worker 1's file (workers=2, tp=4)
            calls["n"] += 1
            if calls["n"] > 30:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, data)

    monkeypatch.setattr(RecordFileWriter, "_write", write_until_full)
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)
    with pytest.raises(OSError) as caught:
        _convert(source, out, workers=2)
    assert caught.value.errno == errno.ENOSPC
    assert not out.exists()
    assert (partial_dir(out) / JOURNAL_NAME).read_text().count("\n") > 0
    monkeypatch.setattr(RecordFileWriter, "_write", real_write)
    _convert(source, out, workers=2)
    _assert_same_files(reference["tp4"], out)


def test_a_worker_that_dies_is_named_and_the_others_stop(source, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def hook(name: str) -> None:
        if parallel.WORKER_RANK == 1 and name.startswith("blocks.1."):
            os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1 died .signal SIGKILL"):
        _convert(source, out, workers=2, on_tensor=hook)
    assert time.monotonic() - start < 60  # worker 0 noticed at once, not at a timeout
    assert not out.exists()
    _convert(source, out, workers=2)
    _assert_same_files(reference["tp4"], out)


_SLOW_CLI = """
import functools, sys, time
from preshard.format import slicing
from preshard.converter import convert
slicing.BAND_BYTES = 4096
convert.SYNC_MIN_BYTES = 1
# the CLI's call of the library, given a hook that slows every tensor down
convert.convert_checkpoint = functools.partial(convert.convert_checkpoint, on_tensor=lambda name: time.sleep(0.15))
from preshard.cli import convert_checkpoint_command
convert_checkpoint_command.main(sys.argv[1:], prog_name="convert-checkpoint")
"""


@pytest.mark.parametrize(
    "how, workers",
    [("SIGINT to the process group", 1), ("SIGINT to the process group", 2), ("SIGTERM to the launcher", 2)],
)
def test_cli_signal_stops_every_thread_and_worker_with_one_line(source, reference, tmp_path, how, workers):
    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "4", "--plan", str(source.parent / "plan.json"), "--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SOURCE_DATE_EPOCH": "1700000000"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *args], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    journal = partial_dir(out) / JOURNAL_NAME
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.is_file() and journal.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    if how.startswith("SIGINT"):
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    expected = 130 if how.startswith("SIGINT") else 143
    assert proc.returncode == expected, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "re-run the same command" in lines[0], stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert not out.exists() and journal.is_file()
    _convert(source, out, workers=workers)
    _assert_same_files(reference["tp4"], out)


def test_torchrun_entry_point_writes_the_same_bytes(source, reference, tmp_path):
    from multiproc import free_port

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SOURCE_DATE_EPOCH": "1700000000"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "preshard.torchrun_convert", str(source), str(out), "--tp", "4",
        "--plan", str(source.parent / "plan.json"), "--no-progress",
    ]  # fmt: skip
    # slicing.BAND_BYTES is the default here (a fresh interpreter): the reference used small bands; the bytes
    # written do not depend on the band size, which this comparison also shows.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1, done.stdout  # one summary line, from the lowest rank
    _assert_same_files(reference["tp4"], out)


@pytest.mark.parametrize("small_band_bytes", [0, 1024, 1 << 30])
@pytest.mark.parametrize("workers", [1, 2])
def test_small_bands_read_into_slabs_write_the_same_bytes(
    source, reference, tmp_path, monkeypatch, small_band_bytes, workers
):
    """Small bands are read one after another into a slab and handed on together (issue 21: 100 000 tiny tensors):
    every band read alone (0), a mix of slabs and bands read alone (1024), every band in a slab of at most 3 bands
    (so slabs end at sync points, mid-tensor and between files), with and without a cast and workers: the same
    bytes as the reference, whatever the mix."""
    from preshard.converter import pipeline

    monkeypatch.setattr(pipeline, "SMALL_BAND_BYTES", small_band_bytes)
    monkeypatch.setattr(pipeline, "SLAB_BANDS", 3)
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1 << 12)  # many sync points, some inside a slab
    _convert(source, tmp_path / "tp4", workers=workers)
    _assert_same_files(reference["tp4"], tmp_path / "tp4")
    _convert(source, tmp_path / "tp4-bf16", dtype="bf16", workers=workers)
    _assert_same_files(reference["tp4-bf16"], tmp_path / "tp4-bf16")


@pytest.mark.parametrize("workers", [1, 2])
def test_plan_check_against_the_model_runs_while_converting_and_blocks_the_commit(tiny_sources, tmp_path, workers):
    """The attention rules are checked against the model class (diffusers, on the meta device) on a thread
    while the data is written; a failing check is the conversion's error and nothing is committed."""
    from preshard.errors import PlanError

    plan = json.loads((Path(convert_module.__file__).parents[1] / "plans/builtin/minimax-h3.json").read_text())
    plan["attention"][0]["divide"] = [*plan["attention"][0]["divide"], "no_such_attribute"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    out = tmp_path / "out"
    with pytest.raises(PlanError, match="no integer attribute 'no_such_attribute'"):
        convert_checkpoint(tiny_sources("mixed"), out, tp=2, plan=plan_file, progress=False, workers=workers)
    assert not out.exists()


def test_direct_source_reads_give_the_same_bytes_and_hashes(source, reference, tmp_path, monkeypatch):
    """Bands not in the page cache are read with O_DIRECT (aligned around the band, in concurrent parts):
    forced here for every band (a test cannot drop the cache), the output is the same, byte for byte."""
    from preshard.sources import reader as reader_module
    from preshard.sources.local import open_local

    monkeypatch.setattr(reader_module._Residency, "cached", lambda self, fd, offset, length: False)
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(reader_module, "DIRECT_PART_BYTES", 4096)  # several parts per band
    src = open_local(source)
    direct = reader_module.SourceReader(src)
    cached = reader_module.SourceReader(src, direct=False)
    try:
        if direct._direct_fd(src.input_paths()[0]) is None:
            pytest.skip("this file system does not take O_DIRECT")
        for name in src.read_order():
            entry = src.tensors[name]
            rows = entry.shape[0] if entry.shape else 1
            for start in range(0, rows, 7):
                count = min(7, rows - start) if entry.shape else 1
                size = count * entry.row_bytes if entry.shape else entry.nbytes
                a = direct.read_band(name, start, count, np.empty(reader_module.band_buffer_bytes(size), np.uint8))
                b = cached.read_band(name, start, count, np.empty(reader_module.band_buffer_bytes(size), np.uint8))
                assert np.array_equal(a, b), name
        assert direct.direct_bytes > 0 and cached.direct_bytes == 0
        assert (
            direct.file_hashes()
            == cached.file_hashes()
            == {p.name: reader_module.hash_file(p) for p in src.input_paths() if p.is_file()}
        )
    finally:
        direct.close()
        cached.close()
    out = tmp_path / "out"
    _convert(source, out, workers=2)
    _assert_same_files(reference["tp4"], out)
