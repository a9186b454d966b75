"""Reliability: verifiable shards, damage caught at verify and load, every bad input a clear error.

(Signals, concurrent conversions, resume after damage and a changing source: tests/test_signals_and_concurrency.py.)

- damage: one flipped byte anywhere in any data file is caught by verify (naming the tensor when the
  byte is tensor data); a missing or truncated rank file is caught at load, naming the file;
- bad input: each is one line "error: ..." and exit status 2 from the CLI, no traceback, no output
  written, the source untouched (fuzzed headers and manifests: tests/unit, tests/test_edited_checkpoints.py).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from manifests import edit_manifest
from multiproc import RankFailure, init_gloo, run_ranks

from preshard.cli import convert_checkpoint_command, main
from preshard.converter import convert as convert_module
from preshard.converter.convert import convert_checkpoint
from preshard.converter.workdir import partial_dir
from preshard.converter.writer import RecordFileWriter
from preshard.errors import ChecksumMismatch, PreshardError
from preshard.format.layout import data_file_name
from preshard.format.manifest import DCP_METADATA_NAME, MANIFEST_NAME, read_manifest
from preshard.sources.safetensors_file import read_header
from preshard.tools.verify import verify_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
crash_soak = importlib.import_module("crash_soak")


# ---------------------------------------------------------------------------------------------------------
# Fixtures: the tiny MiniMax-H3 checkpoint (several files + index) converted at tp=1 and tp=2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from preshard.examples.minimax_h3 import build_model, save_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    source = save_checkpoint(build_model(seed=0), root / "src", max_shard_bytes=200_000)
    out = {"src": source}
    for tp in (1, 2):
        out[f"tp{tp}"] = root / f"tp{tp}"
        convert_checkpoint(source, out[f"tp{tp}"], tp=tp, progress=False)
    return out


@pytest.fixture()
def tp1(tiny, tmp_path) -> Path:
    """A private copy of the tp=1 checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny["tp1"], tmp_path / "tp1"))


@pytest.fixture()
def tp2(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny["tp2"], tmp_path / "tp2"))


def _model_class():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel


def _load(checkpoint: Path, **kwargs):
    from preshard.runtime.load import load_sharded

    return load_sharded(_model_class(), checkpoint, device="cpu", **kwargs)


def _edit_manifest(checkpoint: Path, edit, sealed: bool = True) -> None:
    """Edit manifest.json and re-seal its digest, so only the structural cross-checks can catch the edit."""
    edit_manifest(checkpoint, edit, sealed=sealed)


def _tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _assert_user_error(result, *fragments: str) -> str:
    """Exit status 2, exactly one line on stderr starting with 'error: ', no traceback anywhere."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# verify


def test_verify_clean_checkpoint_is_ok_and_cli_prints_one_line(tiny):
    result = verify_checkpoint(tiny["tp2"], source=tiny["src"])
    assert result.ok, result.problems
    assert result.tensors == result.source_tensors == len(read_manifest(tiny["tp2"]).tensors)
    assert result.files == 2 and result.source_files == 3
    run = CliRunner().invoke(main, ["verify", str(tiny["tp2"]), "--source", str(tiny["src"])])
    assert run.exit_code == 0, run.output
    assert run.stdout.strip().splitlines() == [run.stdout.strip()] and run.stdout.startswith("OK ")


def test_verify_compares_with_the_dtype_cast_source_and_catches_a_rehashed_change(tiny, tmp_path):
    out = tmp_path / "fp16"
    convert_checkpoint(tiny["src"], out, tp=2, dtype="fp16", progress=False)
    assert verify_checkpoint(out, source=tiny["src"]).ok
    # Change one tensor's bytes and re-record every checksum: only the comparison with the source can see it.
    import xxhash

    manifest = read_manifest(out)
    chunk = manifest.tensors["proj_out.weight"].chunks[0]
    path = out / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.data_offset + 1] ^= 0x10
    path.write_bytes(data)

    def rehash(m):
        for c in m["tensors"]["proj_out.weight"]["chunks"]:
            if c["offset"] == chunk.offset and c["file"] == chunk.file:
                stored = data[chunk.data_offset : chunk.data_offset + chunk.data_length]
                c["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(stored))
        for f in m["files"]:
            if f["name"] == chunk.file:
                f["xxh3_128"] = xxhash.xxh3_128_hexdigest(bytes(data))

    _edit_manifest(out, rehash)
    assert verify_checkpoint(out).ok  # self-consistent ...
    result = verify_checkpoint(out, source=tiny["src"])  # ... but not the source's tensor
    assert [p for p in result.problems if "proj_out.weight" in p and "differs from the source" in p], result.problems
    assert result.damaged_tensors == ["proj_out.weight"]


def test_verify_with_source_names_a_changed_source_file_and_tensor(tiny, tmp_path):
    source = Path(shutil.copytree(tiny["src"], tmp_path / "src"))
    header = read_header(next(source.glob("*-00002-of-*.safetensors")))
    entry = max(header.tensors.values(), key=lambda t: t.nbytes)
    data = bytearray(header.path.read_bytes())
    data[entry.start + 3] ^= 0x40
    header.path.write_bytes(data)
    problems = verify_checkpoint(tiny["tp2"], source=source).problems
    assert any(f"source file {header.path.name} has changed" in p for p in problems), problems
    assert any(p.startswith(f"tensor {entry.name}:") and "differs from the source" in p for p in problems), problems
    assert len(problems) == 2, problems


def _flip_positions(manifest, name: str, size: int, rng: random.Random) -> list[int]:
    chunks = [c for t in manifest.tensors.values() for c in t.chunks if c.file == name]
    positions = {0, 1, 7, 30, 64, size // 2, size - 1, size - 2, size - 22, size - 60}
    for c in rng.sample(chunks, min(4, len(chunks))):
        positions |= {c.offset + 3, c.offset + 40, c.data_offset - 1, c.data_offset}
        positions |= {c.data_offset + c.data_length - 1, c.data_offset + c.data_length, c.end - 5}
    positions |= {rng.randrange(size) for _ in range(6)}
    return sorted(p for p in positions if 0 <= p < size)


def test_one_flipped_byte_anywhere_in_any_data_file_is_caught_by_verify(tp2):
    manifest = read_manifest(tp2)
    rng = random.Random(7)
    tested = 0
    for record in manifest.files:
        path = tp2 / record.name
        original = path.read_bytes()
        owner = {}  # byte -> tensor whose data holds it
        for t in manifest.tensors.values():
            for c in t.chunks:
                if c.file == record.name:
                    owner.update(dict.fromkeys(range(c.data_offset, c.data_offset + c.data_length), t.name))
        for position in _flip_positions(manifest, record.name, len(original), rng):
            damaged = bytearray(original)
            damaged[position] ^= 1 << rng.randrange(8)
            path.write_bytes(damaged)
            result = verify_checkpoint(tp2)
            assert not result.ok, f"a flipped byte at {position} of {record.name} went unnoticed"
            if position in owner:
                assert result.damaged_tensors == [owner[position]], (position, result.problems)
                assert owner[position] in result.problems[0] and "xxh3_64" in result.problems[0]
            else:
                assert record.name in result.problems[0] and "torch.save record" in result.problems[0]
            tested += 1
        path.write_bytes(original)
    assert tested >= 30
    assert verify_checkpoint(tp2).ok


def test_verify_cli_exit_1_lists_at_most_20_problems(tp2):
    manifest = read_manifest(tp2)
    name = manifest.files[0].name
    with open(tp2 / name, "r+b") as f:
        f.truncate(100)
    run = CliRunner().invoke(main, ["verify", str(tp2)])
    assert run.exit_code == 1, run.output
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith(f"data file {name} is 100 bytes")
    assert lines[20].startswith("... and ") and lines[20].endswith(" more")
    assert lines[21].startswith("FAILED ") and len(lines) == 22
    assert "lies past the end" in lines[1]


def test_verify_finds_coverage_holes_overlaps_and_wrong_slices_by_arithmetic(tp2):
    """Re-sealed edits (the digest recomputed), each on the original manifest: the structural checks name the tensor."""
    original = (tp2 / MANIFEST_NAME).read_text()

    def fresh():
        (tp2 / MANIFEST_NAME).write_text(original)

    def drop_chunk(m):
        m["tensors"]["transformer_blocks.0.attn.to_q.weight"]["chunks"].pop()

    _edit_manifest(tp2, drop_chunk)
    problems = verify_checkpoint(tp2).problems
    assert any("to_q.weight must have 2 chunks for its colwise split at tp=2" in p for p in problems), problems

    def overlap(m):
        chunks = m["tensors"]["transformer_blocks.0.attn.to_k.weight"]["chunks"]
        chunks[1]["offsets"] = list(chunks[0]["offsets"])

    fresh()
    _edit_manifest(tp2, overlap)
    problems = verify_checkpoint(tp2).problems
    assert any("to_k.weight chunk 1 is offsets" in p and "split at tp=2 gives" in p for p in problems), problems

    def swap_ranks(m):
        chunks = m["tensors"]["transformer_blocks.0.attn.to_v.weight"]["chunks"]
        chunks[0]["file"], chunks[1]["file"] = chunks[1]["file"], chunks[0]["file"]

    fresh()
    _edit_manifest(tp2, swap_ranks)
    problems = verify_checkpoint(tp2).problems
    assert any("to_v.weight chunk 0 (tp rank 0) is recorded in __1_0.distcp" in p for p in problems), problems


def test_verify_checks_metadata_and_config_without_running_pickled_code(tp2, tmp_path):
    (tp2 / "config.json").unlink()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    import pickle

    (tp2 / DCP_METADATA_NAME).write_bytes(pickle.dumps(Evil()))
    problems = verify_checkpoint(tp2).problems
    assert any(p.startswith("config.json is missing") for p in problems), problems
    assert any(p.startswith(f"{DCP_METADATA_NAME} cannot be read") for p in problems), problems
    assert not marker.exists()
    (tp2 / DCP_METADATA_NAME).unlink()
    assert any(p.startswith(f"{DCP_METADATA_NAME} is missing") for p in verify_checkpoint(tp2).problems)


def test_verify_and_load_refuse_a_manifest_with_a_hole_before_reading(tp1):
    _edit_manifest(tp1, lambda m: m["tensors"]["proj_out.weight"]["chunks"].pop())
    with pytest.raises(PreshardError, match="proj_out.weight must have 1 chunks"):
        _load(tp1)
    assert not verify_checkpoint(tp1).ok


# ---------------------------------------------------------------------------------------------------------
# Load-time damage


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_rank_file_is_caught_at_load_naming_the_file(tp1, damage):
    path = tp1 / data_file_name(0)
    if damage == "missing":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1)
    with pytest.raises(PreshardError, match=data_file_name(0)) as info:
        _load(tp1)
    assert ("missing" if damage == "missing" else "truncated") in str(info.value)


def _load_rank(rank: int, world_size: int, checkpoint: str) -> None:
    init_gloo()
    _load(Path(checkpoint))


def test_truncated_rank_file_is_caught_at_load_in_a_tp2_gloo_run(tp2):
    with open(tp2 / data_file_name(1), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(RankFailure) as info:
        run_ranks(_load_rank, 2, str(tp2), timeout=120)
    assert data_file_name(1) in str(info.value) and "truncated" in str(info.value)


def test_checksum_mismatch_is_caught_by_verify_and_by_load_verify_true(tp1):
    manifest = read_manifest(tp1)
    chunk = manifest.tensors["transformer_blocks.1.ff.net.2.weight"].chunks[0]
    path = tp1 / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.data_offset + chunk.data_length // 2] ^= 0x01
    path.write_bytes(data)
    result = verify_checkpoint(tp1)
    assert result.damaged_tensors == ["transformer_blocks.1.ff.net.2.weight"]
    run = CliRunner().invoke(main, ["verify", str(tp1)])
    assert run.exit_code == 1 and "transformer_blocks.1.ff.net.2.weight" in run.stdout
    with pytest.raises(ChecksumMismatch, match=r"transformer_blocks\.1\.ff\.net\.2\.weight"):
        _load(tp1, verify=True)


def test_world_size_that_disagrees_with_the_manifest_names_both_numbers(tiny):
    with pytest.raises(PreshardError) as info:
        _load(tiny["tp2"])
    message = str(info.value)
    assert "runs alone" in message and "needs 2 ranks" in message and "tp=2" in message


def test_manifest_of_a_future_format_version_is_refused_at_load_verify_and_inspect(tp1):
    _edit_manifest(tp1, lambda m: m.update(version=99), sealed=False)
    with pytest.raises(PreshardError, match="manifest version 99, newer than"):
        _load(tp1)
    for command in ("verify", "inspect"):
        _assert_user_error(CliRunner().invoke(main, [command, str(tp1)]), "version 99", "upgrade preshard")


def test_verify_cli_user_errors_exit_2(tmp_path, tiny):
    _assert_user_error(CliRunner().invoke(main, ["verify", str(tmp_path / "nope")]), "does not exist")
    _assert_user_error(CliRunner().invoke(main, ["verify", str(tmp_path)]), "manifest.json is missing")
    run = CliRunner().invoke(main, ["verify", str(tiny["tp1"]), "--source", str(tmp_path / "nope")])
    _assert_user_error(run, "source", "does not exist")


# ---------------------------------------------------------------------------------------------------------
# Bad input to convert-checkpoint: one line, exit 2, nothing written, the source untouched


def _raw_safetensors(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _valid_file(folder: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"a.weight": torch.randn(8, 8), "a.bias": torch.randn(8)}, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def _truncated(folder: Path):
    path = _valid_file(folder)
    path.write_bytes(path.read_bytes()[:-40])
    return path, ["model.safetensors", "truncated"]


def _bad_header_length(folder: Path):
    return _raw_safetensors(folder / "model.safetensors", b"{}", length=10**12), ["bad header length"]


def _header_not_json(folder: Path):
    return _raw_safetensors(folder / "model.safetensors", b"\x00not json{"), ["header is not valid JSON"]


def _offsets_past_end(folder: Path):
    header = {"a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    return _raw_safetensors(folder / "model.safetensors", header, b"\0" * 8), ["a.weight", "past the end"]


def _overlapping(folder: Path):
    header = {
        "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "a.bias": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }
    return _raw_safetensors(folder / "model.safetensors", header, b"\0" * 16), ["overlaps"]


def _index_names_missing_file(folder: Path):
    _valid_file(folder)
    index = {"weight_map": {"a.weight": "model.safetensors", "a.bias": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, ["model-00002-of-00002.safetensors", "missing"]


BAD_SOURCES = [
    _truncated,
    _bad_header_length,
    _header_not_json,
    _offsets_past_end,
    _overlapping,
    _index_names_missing_file,
]


@pytest.fixture()
def small_source(tmp_path) -> tuple[Path, Path]:
    source = crash_soak.build_source(tmp_path / "small" / "src", blocks=2, width=16)
    return source, tmp_path / "small" / "plan.json"


def _convert_cli(source, out, plan, *extra: str):
    args = [str(source), str(out), "--tp", "2", "--plan", str(plan), "--no-progress", *extra]
    return CliRunner().invoke(convert_checkpoint_command, args)


@pytest.mark.parametrize("make", BAD_SOURCES, ids=[f.__name__.strip("_") for f in BAD_SOURCES])
def test_bad_source_is_one_line_exit_2_nothing_written(tmp_path, small_source, make):
    folder = tmp_path / "bad"
    folder.mkdir()
    source, fragments = make(folder)
    before = _tree_hash(folder)
    out = tmp_path / "out"
    _assert_user_error(_convert_cli(source, out, small_source[1]), *fragments)
    assert not out.exists() and not partial_dir(out).exists()
    assert _tree_hash(folder) == before


@pytest.mark.parametrize(
    "plan_text, fragments",
    [
        ('{"name": "p", "linear": [', ["plan file", "is not valid JSON"]),
        (json.dumps({"name": "p", "linear": [{"match": "blocks.*.ada", "style": "diagonal"}]}), ["unknown style"]),
    ],
    ids=["bad-json", "bad-style"],
)
def test_bad_plan_file_is_one_line_exit_2_nothing_written(tmp_path, small_source, plan_text, fragments):
    source, _ = small_source
    plan = tmp_path / "bad-plan.json"
    plan.write_text(plan_text)
    before = _tree_hash(source)
    out = tmp_path / "out"
    _assert_user_error(_convert_cli(source, out, plan), *fragments)
    assert not out.exists() and not partial_dir(out).exists()
    assert _tree_hash(source) == before


def test_output_path_that_is_a_file_is_one_line_exit_2(tmp_path, small_source):
    source, plan = small_source
    out = tmp_path / "out"
    out.write_text("my notes")
    _assert_user_error(_convert_cli(source, out, plan, "--overwrite"), "is a file")
    assert out.read_text() == "my notes" and not partial_dir(out).exists()


def test_disk_full_while_writing_is_one_line_exit_2_and_a_rerun_resumes(tmp_path, small_source, monkeypatch):
    source, plan = small_source
    before = _tree_hash(source)
    out = tmp_path / "out"
    real_write = RecordFileWriter._write
    calls = {"n": 0}

    def write_until_full(self, data):
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(RecordFileWriter, "_write", write_until_full)
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    _assert_user_error(_convert_cli(source, out, plan), "disk is full")
    assert not out.exists()
    assert _tree_hash(source) == before
    monkeypatch.setattr(RecordFileWriter, "_write", real_write)
    written: list[str] = []
    convert_checkpoint(source, out, tp=2, plan=plan, progress=False, on_tensor=written.append)
    assert 0 < len(written) < 16  # the tensors finished before the disk filled up were kept
    assert verify_checkpoint(out, source=source).ok
