"""`preshard plan` and `convert-checkpoint --dry-run`: figures from safetensors headers alone.

- On MiniMax-H3's full-size shapes (real headers, data as holes: no disk, no weights), `preshard plan` prints the
  per-rank figures of tp 1/2/4/7/8 in under 10 s without reading tensor data (the process's read count, with a
  negative control showing that reading the holes would count);
- its weights per rank equal a hand count from the plan's rules; with AdaLN replicated nothing fits 24 GiB (the
  seed's trn2 finding); on the tiny checkpoint its disk and load-read figures equal a real conversion's;
- a dry run writes nothing and predicts the real output's size exactly; an output file system without space is
  refused before any write, with and without --dry-run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from clitools import cli_runner

from preshard.cli import convert_checkpoint_command, main
from preshard.format.manifest import read_manifest
from preshard.plans.registry import load_plan
from preshard.tools.planner import plan_meshes

pytest.importorskip("diffusers")

GIB = 1 << 30
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def h3_full(tmp_path_factory) -> tuple[Path, dict, dict]:
    """MiniMax-H3 at full size (638 tensors, 61.7 GiB) as safetensors headers over holes: (folder, specs, config)."""
    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint

    tensors, config = minimax_h3_tensors()
    folder = tmp_path_factory.mktemp("h3-full") / "transformer"
    write_safetensors_checkpoint(folder, tensors, config, data="hole", max_shard_bytes=10 * GIB)
    return folder, tensors, config


MEASURE = """
import json, sys, time
import preshard.cli, preshard.tools.planner, preshard.converter.convert  # imports outside the measurement

def io():
    with open("/proc/self/io") as f:
        return dict((k, int(v)) for k, v in (line.split(": ") for line in f.read().splitlines()))

def measure(body):
    before, start = io(), time.perf_counter()
    try:
        body()
        code = 0
    except SystemExit as exc:
        code = exc.code
    seconds, after = time.perf_counter() - start, io()
    return {"code": code, "seconds": seconds, "rchar": after["rchar"] - before["rchar"]}

def plan():
    preshard.cli.main(sys.argv[2:])

def control():  # a read of 32 MiB of the holes: zeros, but read all the same
    with open(sys.argv[1], "rb") as f:
        f.seek(1 << 30)
        f.read(32 << 20)

print(json.dumps([measure(plan), measure(control)]), file=sys.stderr)
"""


def run_measured(hole_file: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`preshard ARGS` in a fresh interpreter: its exit code, wall time and bytes read (rchar), then the same
    measurement of a 32 MiB read of `hole_file` (the negative control)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(hole_file), *args], capture_output=True, text=True, timeout=120, env=env
    )  # fmt: skip
    measured, control = json.loads(proc.stderr.strip().splitlines()[-1])
    return proc, measured, control


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_plan_on_full_size_h3_reads_headers_only(h3_full):
    folder, _, _ = h3_full
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert weights > 60 * GIB

    big = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    proc, measured, control = run_measured(big, "plan", str(folder), "--devices", "8", "--device-memory", "24")

    assert measured["code"] in (0, None), proc.stdout + proc.stderr
    assert measured["rchar"] < 16 << 20, measured  # headers (~100 kB) and small files; the data is 61.7 GiB
    rows = {m[2]: m[0] for m in re.finditer(r"^(\*?)\s+(\d+)\s.*$", proc.stdout, re.M)}
    assert sorted(rows, key=int) == ["1", "2", "4", "7", "8"]
    assert "30.95 GiB" in rows["2"] and "no, 6.95 GiB over" in rows["2"]  # the seed's ~31 GiB at TP=2
    assert rows["4"].startswith("*") and "yes" in rows["4"]
    assert "(7 of 8 devices)" in rows["7"]
    assert "* recommended: tp=4 x ring=1 x ulysses=2" in proc.stdout
    assert "activations" in proc.stdout.lower() and "come on top" in proc.stdout

    assert control["rchar"] >= 32 << 20, control  # the negative control: reading the holes would count


def _hand_weights(tensors: dict, plan_name: str, tp: int, drop: tuple[str, ...] = ()) -> int:
    """Bytes per rank counted from the plan's rules by hand: a Linear weight (or colwise bias) named by a rule
    is split tp ways, a rowwise bias and everything else is held whole."""
    rules = [r for r in load_plan(plan_name).to_dict()["linear"] if r["match"] not in drop]
    itemsize = {"BF16": 2, "F32": 4}
    total = 0
    for name, (code, shape) in tensors.items():
        module, _, param = name.rpartition(".")
        nbytes = itemsize[code]
        for size in shape:
            nbytes *= size
        style = next((r["style"] for r in rules if _matches(r["match"], module)), None)
        split = style is not None and (param == "weight" or style in ("colwise", "packed_colwise"))
        total += nbytes // tp if split else nbytes
    return total


def _matches(pattern: str, module: str) -> bool:
    want, have = pattern.split("."), module.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def test_weights_per_rank_match_a_hand_count_and_adaln_replicated_never_fits(h3_full, tmp_path: Path):
    folder, tensors, _ = h3_full
    report = plan_meshes(folder, device_memory_gib=24)
    by_tp = {m.tp: m for m in report.meshes}
    assert report.tp_degrees == [1, 2, 4, 7, 8, 14, 28, 56]
    for tp, mesh in by_tp.items():
        assert mesh.weight_bytes_per_rank == _hand_weights(tensors, "minimax-h3", tp), tp
        assert (mesh.ring, mesh.ulysses, mesh.world_size) == (1, 1, tp)
    assert [tp for tp, m in by_tp.items() if m.fits] == [4, 7, 8, 14, 28, 56]

    # The seed's trn2 plan kept adaln_proj replicated: about 40 % of the weights on every rank.
    plan = load_plan("minimax-h3").to_dict()
    adaln = "transformer_blocks.*.adaln_proj.linear"
    plan["linear"] = [r for r in plan["linear"] if r["match"] != adaln]
    plan_file = tmp_path / "adaln-replicated.json"
    plan_file.write_text(json.dumps(plan))
    replicated = plan_meshes(folder, device_memory_gib=24, plan=str(plan_file))
    for mesh in replicated.meshes:
        assert mesh.weight_bytes_per_rank == _hand_weights(tensors, "minimax-h3", mesh.tp, drop=(adaln,))
        assert mesh.replicated_bytes_per_rank > 24 * GIB and not mesh.fits
    assert replicated.recommended is None and "no mesh fits" in replicated.reason


def test_smallest_fitting_mesh_leaves_the_recommendations_headroom(h3_full):
    """The "smallest TP" per device size of the model table (docs/memory.md): the first TP degree whose
    weights leave 20 % free (24 GiB: tp=4 at 15.57 GiB, as the recommendation; tp=2's 30.95 GiB would not even fit
    32 GiB with headroom)."""
    from preshard.errors import UsageError
    from preshard.tools.planner import smallest_fitting

    report = plan_meshes(h3_full[0])
    assert {gib: smallest_fitting(report, gib).tp for gib in (24, 32, 40, 80, 141)} == {
        24: 4, 32: 4, 40: 2, 80: 1, 141: 1
    }  # fmt: skip
    assert smallest_fitting(report, 31, headroom=0).tp == 2  # 30.95 GiB fits 31 with nothing to spare
    assert smallest_fitting(report, 1) is None  # 1.28 GiB at tp=56 leaves under 20 % of 1 GiB
    assert plan_meshes(h3_full[0], device_memory_gib=24).recommended.tp == smallest_fitting(report, 24).tp
    for bad in ({"device_memory_gib": 0}, {"device_memory_gib": 24, "headroom": 1.0}):
        with pytest.raises(UsageError):
            smallest_fitting(report, **bad)


def test_plan_figures_equal_a_real_conversion(tiny_sources, converted):
    source = tiny_sources("mixed")
    for tp in (1, 2, 4):
        manifest = read_manifest(converted("mixed", tp))
        mesh = next(m for m in plan_meshes(source).meshes if m.tp == tp)
        assert mesh.disk_bytes == sum(f.size for f in manifest.files)
        assert mesh.largest_file_bytes == max(f.size for f in manifest.files)
        # what the shard reader reads: each record's framing header and its data (not the trailer)
        reads = [
            sum(len(c.framing.header) + c.data_length for cs in manifest.chunks_for_tp_rank(r).values() for c in cs)
            for r in range(tp)
        ]
        assert mesh.read_bytes_per_rank == max(reads)
        held = [sum(c.data_length for cs in manifest.chunks_for_tp_rank(r).values() for c in cs) for r in range(tp)]
        assert mesh.weight_bytes_per_rank == max(held)


def test_plan_json_meshes_fill_the_devices_and_the_cast_is_counted(h3_full):
    folder, tensors, _ = h3_full
    run = cli_runner().invoke(main, ["plan", str(folder), "--devices", "8", "--json"])
    assert run.exit_code == 0, run.stderr
    meshes = json.loads(run.stdout)["meshes"]
    required = {"tp", "ring", "ulysses", "weight_bytes_per_rank", "fits"}
    assert all(required <= set(m) for m in meshes)
    splits = {(m["tp"], m["ring"], m["ulysses"]) for m in meshes}
    assert {(1, r, 8 // r) for r in (1, 2, 4, 8)} | {(2, r, 4 // r) for r in (1, 2, 4)} <= splits
    assert {(4, 1, 2), (4, 2, 1), (7, 1, 1), (8, 1, 1)} <= splits and len(splits) == 11
    assert all(m["fits"] is None and not m["recommended"] for m in meshes)
    assert [m["fills_devices"] for m in meshes if m["tp"] == 7] == [False]

    cast = plan_meshes(folder, dtype="bf16")
    numel = sum(_numel(shape) for _, shape in tensors.values())
    assert cast.stored_bytes == 2 * numel < plan_meshes(folder).stored_bytes


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# convert-checkpoint --dry-run


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_dry_run_writes_nothing_and_predicts_the_output(tiny_sources, tmp_path: Path):
    source = tiny_sources("mixed")
    parent = tmp_path / "outputs"
    parent.mkdir()
    (parent / "neighbour.txt").write_text("untouched\n")
    before = _listing(parent)

    dry = cli_runner().invoke(convert_checkpoint_command, [str(source), str(parent / "out"), "--tp", "2", "--dry-run"])

    assert dry.exit_code == 0, dry.stderr
    assert _listing(parent) == before  # not even the probe's temporary file is left
    text = dry.stdout
    assert text.startswith("dry run: nothing was written")
    assert "tp=2 x ring=1 x ulysses=1" in text and "-> ok" in text and "time:      about" in text

    real = cli_runner().invoke(
        convert_checkpoint_command, [str(source), str(parent / "out"), "--tp", "2", "--no-progress"]
    )
    assert real.exit_code == 0, real.stderr
    from preshard.units import human_bytes

    manifest = read_manifest(parent / "out")
    assert f"2 data files, {human_bytes(sum(f.size for f in manifest.files))}" in text


def test_dry_run_json_gives_the_same_figures_and_json_needs_dry_run(tiny_sources, tmp_path: Path):
    source = tiny_sources("mixed")
    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "2", "--ulysses", "2"]
    dry = cli_runner().invoke(convert_checkpoint_command, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written
    assert report["mesh"]["tp"] == 2 and report["mesh"]["ulysses"] == 2 and report["world_size"] == 4
    assert report["fits_disk"] is True and report["space_error"] is None
    assert report["weight_bytes_per_rank"] == report["own_bytes_per_rank"] + report["replicated_bytes_per_rank"]
    assert report["estimate_seconds"] > 0 and report["estimate"]["probe"]["write"] > 0
    low, high = report["estimate"]["low"], report["estimate"]["high"]  # the spread (estimate_seconds is rounded)
    assert low - 1e-3 <= report["estimate_seconds"] <= high + 1e-3
    assert report["command"] == "convert" and report["status"] == "dry run"

    assert not out.exists()
    real = cli_runner().invoke(convert_checkpoint_command, [*args, "--no-progress", "--json"])
    assert real.exit_code == 0, real.stderr
    done = json.loads(real.stdout)  # a real conversion's one object: what it wrote
    assert done["status"] == "converted" and done["manifest_digest"] == read_manifest(out).digest
    assert done["data_bytes"] == sum(f.size for f in read_manifest(out).files) and done["seconds"] > 0
    sizes = [(out / f.name).stat().st_size for f in read_manifest(out).files]
    assert report["data_file_bytes"] == sizes  # exact, from the record layout
    assert report["needed_bytes"] >= sum(sizes)


def test_read_bytes_have_one_definition_and_one_key(tiny_sources, converted, tmp_path: Path):
    """plan, convert --dry-run and inspect give the same bytes a rank reads at load, under `read_bytes_per_rank`:
    each record's framing header and data, counted here by hand (the load report's equality: tests/test_load.py)."""
    source = tiny_sources("mixed")
    manifest = read_manifest(converted("mixed", 2))
    by_hand = max(
        sum(len(c.framing.header) + c.data_length for cs in manifest.chunks_for_tp_rank(r).values() for c in cs)
        for r in range(2)
    )
    plan = json.loads(cli_runner().invoke(main, ["plan", str(source), "--devices", "2", "--json"]).stdout)
    (mesh,) = [m for m in plan["meshes"] if m["tp"] == 2]
    dry = cli_runner().invoke(
        convert_checkpoint_command, [str(source), str(tmp_path / "o"), "--tp", "2", "--dry-run", "--json"]
    )
    inspected = cli_runner().invoke(main, ["inspect", str(converted("mixed", 2)), "--json"])
    figures = {
        "plan": mesh["read_bytes_per_rank"],
        "dry run": json.loads(dry.stdout)["read_bytes_per_rank"],
        "inspect": json.loads(inspected.stdout)["read_bytes_per_rank"],
    }
    assert set(figures.values()) == {by_hand}, (figures, by_hand)
    data_only = max(sum(c.data_length for cs in manifest.chunks_for_tp_rank(r).values() for c in cs) for r in range(2))
    assert by_hand > data_only  # the framing counts: the negative control for a data-only count


def _no_space(monkeypatch: pytest.MonkeyPatch, free_bytes: int) -> None:
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        fields = list(st)
        fields[4] = fields[3] = free_bytes // st.f_frsize  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "convert"])
def test_an_output_file_system_without_space_is_refused_before_any_write(
    tiny_sources, tmp_path: Path, monkeypatch, dry: bool
):
    source = tiny_sources("mixed")
    parent = tmp_path / "outputs"
    parent.mkdir()
    _no_space(monkeypatch, 64 << 10)
    writes: list[str] = []
    real_open = os.open

    def watch_open(path, flags, *args, **kwargs):  # every file the command creates or writes under `parent`
        if str(path).startswith(str(parent)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            writes.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watch_open)
    args = [str(source), str(parent / "out"), "--tp", "2", "--no-progress"] + (["--dry-run"] if dry else [])

    run = cli_runner().invoke(convert_checkpoint_command, args)

    assert run.exit_code == 2, (run.stdout, run.stderr)
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and "needs" in lines[0] and "64.00 KiB free" in lines[0], run.stderr
    assert list(parent.iterdir()) == []
    if dry:
        assert "NOT ENOUGH" in run.stdout and writes == []  # the write probe is skipped, nothing is created
    else:
        assert writes == [], writes  # not even the lock file


def test_plan_errors_are_one_line(tmp_path: Path, h3_full):
    folder, _, _ = h3_full
    cases: dict[str, tuple[list[str], Callable[[str], bool]]] = {
        "missing": (["plan", str(tmp_path / "nope")], lambda m: "does not exist" in m),
        "devices 0": (["plan", str(folder), "--devices", "0"], lambda m: "--devices" in m),
        "memory -1": (["plan", str(folder), "--device-memory", "-1"], lambda m: "--device-memory" in m),
        "bad dtype": (["plan", str(folder), "--dtype", "int8"], lambda m: "--dtype" in m),
        "bad plan": (["plan", str(folder), "--plan", "nope"], lambda m: "unknown plan" in m),
    }
    for name, (args, check) in cases.items():
        run = cli_runner().invoke(main, args)
        lines = run.stderr.splitlines()
        assert run.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, run.stderr)
        assert check(lines[0]), (name, lines[0])


def test_each_probe_rate_is_the_median_of_its_rounds_and_the_spread_their_extremes(tmp_path: Path, monkeypatch):
    from preshard.tools import estimate as est

    reads = iter([50e6, 500e6, 100e6])  # one round slowed by a neighbour, one flattered by a device cache
    monkeypatch.setattr(est, "_direct_read", lambda path, view, round_=0: next(reads))
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * (1 << 20))
    rates = est.probe(source, None, nbytes=3 << 20)
    assert rates.read == 100e6 and rates.slowest.read == 50e6 and rates.fastest.read == 500e6
    work = est.Work.conversion(source_bytes=10**9, cached=0, output_bytes=0)
    got = est.estimate(work, rates)
    assert got.seconds == pytest.approx(max(10.0, got.cpu_seconds))  # 1 GB at the median rate, not at a round's
    assert got.high >= 20.0 - 1e-9 and got.low <= got.seconds <= got.high
    assert "from the probes' fastest and slowest rounds" in got.describe()
