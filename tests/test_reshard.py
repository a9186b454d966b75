"""Reshard and unshard without the source: `preshard reshard IN OUT --tp N` and `preshard unshard IN OUT`.

The tiny seeded MiniMax-H3 in mixed fp32/bf16, saved over 9 files with an index, is converted at tp 2 and 4
(session fixtures); each conversion is resharded to the other degree while the source folder is moved away.
The result must be what a direct conversion at the new degree writes, byte for byte (data files, .metadata,
config.json; the manifest differs only in created / derived_from / digest), verify bit for bit against the
source, and compute the unsharded model's function on 2 and 4 gloo ranks. Unshard must give back the source's
own files, byte for byte. Damaged inputs must stop both with nothing committed. A child process measures
reshard's peak memory on a checkpoint 11x its largest tensor.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from multiproc import init_gloo, run_ranks
from safetensors import safe_open

from preshard.cli import main as cli_main
from preshard.errors import ChecksumMismatch, CorruptCheckpointError, PlanError, UsageError
from preshard.format.manifest import DCP_METADATA_NAME, MANIFEST_NAME, read_manifest
from preshard.tools.inspect import inspect_data, provenance_line
from preshard.tools.reshard import reshard_checkpoint
from preshard.tools.unshard import unshard_checkpoint
from preshard.tools.verify import verify_checkpoint

SEQ_LEN = 37
BF16_TOL = 0.05  # as tests/test_load.py: the mixed checkpoint's sharded forward measured 0.0185 at tp=2
VOLATILE = ("created", "derived_from", "digest")  # what may differ from a direct conversion's manifest


def _moved_away(source: Path):
    """A context in which `source` does not exist (renamed aside), restored afterwards whatever happens."""

    class Moved:
        def __enter__(self):
            self.aside = source.parent / f"{source.name}.moved-away"
            os.rename(source, self.aside)
            return self

        def __exit__(self, *exc):
            os.rename(self.aside, source)

    return Moved()


def _data_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME)


def _assert_same_as_direct(out: Path, direct: Path) -> None:
    assert _data_names(out) == _data_names(direct)
    assert any(n.endswith(".distcp") for n in _data_names(out)) and DCP_METADATA_NAME in _data_names(out)
    for name in _data_names(direct):
        assert (out / name).read_bytes() == (direct / name).read_bytes(), name
    got = json.loads((out / MANIFEST_NAME).read_text())
    want = json.loads((direct / MANIFEST_NAME).read_text())
    assert {k: v for k, v in got.items() if k not in VOLATILE} == {k: v for k, v in want.items() if k not in VOLATILE}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, converted, tiny_sources):
    """{(tp_in, tp_out): folder}: each conversion resharded while the source is moved away; plus the CP-only
    change of the tp4->tp2 result to tp=2 x ulysses=2 under key (2, "cp")."""
    root = tmp_path_factory.mktemp("resharded")
    source = tiny_sources("mixed")
    inputs = {tp: converted("mixed", tp) for tp in (1, 2, 4)}  # also the direct conversions to compare with
    out = {}
    with _moved_away(source):
        for tp_in, tp_out in ((4, 2), (2, 4), (4, 1)):
            out[(tp_in, tp_out)] = root / f"tp{tp_in}-to-tp{tp_out}"
            reshard_checkpoint(inputs[tp_in], out[(tp_in, tp_out)], tp=tp_out, progress=False)
        out[(2, "cp")] = root / "tp2-cp2"
        reshard_checkpoint(out[(4, 2)], out[(2, "cp")], tp=2, cp=2, progress=False)
    return out


# --------------------------------------------------------------------------------------------------
# TP changes: the same bytes as a direct conversion, bit for bit against the source


@pytest.mark.parametrize("tp_in, tp_out", [(4, 2), (2, 4), (4, 1)])
def test_reshard_equals_a_direct_conversion(tp_in, tp_out, resharded, converted, tiny_sources):
    out = resharded[(tp_in, tp_out)]
    _assert_same_as_direct(out, converted("mixed", tp_out))
    result = verify_checkpoint(out, source=tiny_sources("mixed"))
    assert result.ok, result.problems
    assert result.source_tensors == len(read_manifest(out).tensors) > 40
    manifest = read_manifest(out)
    given = read_manifest(converted("mixed", tp_in))
    assert manifest.source == given.source  # the original source, so verify --source works
    assert manifest.derived_from is not None and manifest.derived_from.kind == "reshard"
    assert manifest.derived_from.checkpoint == str(converted("mixed", tp_in))
    assert manifest.derived_from.digest == given.digest and manifest.derived_from.mesh["tp"] == tp_in


def test_inspect_shows_where_a_resharded_checkpoint_came_from(resharded, converted):
    manifest = read_manifest(resharded[(4, 2)])
    line = provenance_line(manifest)
    digest = read_manifest(converted("mixed", 4)).digest
    assert f"reshard of {converted('mixed', 4)} (tp=4, manifest digest {digest[:12]}" in line
    assert "reshard of" not in provenance_line(read_manifest(converted("mixed", 4)))  # negative control
    assert inspect_data(manifest)["derived_from"]["checkpoint"] == str(converted("mixed", 4))
    shown = CliRunner().invoke(cli_main, ["inspect", str(resharded[(4, 2)])])
    assert shown.exit_code == 0 and "reshard of" in shown.output


def test_reshard_of_a_cast_checkpoint_keeps_the_cast_and_the_source_dtypes(tmp_path, converted, tiny_sources):
    out = tmp_path / "bf16-tp4"
    manifest = reshard_checkpoint(converted("mixed", 2, dtype="bf16"), out, tp=4, progress=False)
    assert manifest.dtype.torch == torch.bfloat16
    assert {r.layout.source_dtype.torch for r in manifest.tensors.values()} == {torch.float32, torch.bfloat16}
    _assert_same_as_direct(out, converted("mixed", 4, dtype="bf16"))
    assert verify_checkpoint(out, source=tiny_sources("mixed")).ok


def test_an_interrupted_reshard_resumes(tmp_path, converted, monkeypatch):
    from preshard.converter import convert

    class Crash(Exception):
        pass

    written: list[str] = []
    crash = [True]

    def crash_after_ten(name: str) -> None:
        written.append(name)
        if len(written) == 10 and crash[0]:
            raise Crash

    given, direct = converted("mixed", 4), converted("mixed", 2)
    monkeypatch.setattr(convert, "SYNC_MIN_BYTES", 1)  # journal every few tensors of this tiny checkpoint
    out = tmp_path / "out"
    with pytest.raises(Crash):
        reshard_checkpoint(given, out, tp=2, progress=False, on_tensor=crash_after_ten)
    assert not out.exists() and (tmp_path / ".out.partial").is_dir()
    written.clear()
    crash[0] = False
    reshard_checkpoint(given, out, tp=2, progress=False, on_tensor=crash_after_ten)
    assert 0 < len(written) < len(read_manifest(out).tensors) - 5  # the finished tensors were kept
    _assert_same_as_direct(out, direct)


def test_a_tp_degree_the_plan_cannot_split_is_refused_with_the_degrees_that_work(tmp_path, converted):
    with pytest.raises(PlanError, match="TP degrees that work for this checkpoint: 1, 2, 4"):
        reshard_checkpoint(converted("mixed", 2), tmp_path / "tp3", tp=3, progress=False)
    assert not (tmp_path / "tp3").exists()


# --------------------------------------------------------------------------------------------------
# CP-only: no data written


def test_cp_only_reshard_links_the_data_and_writes_only_a_manifest(resharded, converted):
    given, out = resharded[(4, 2)], resharded[(2, "cp")]
    for name in _data_names(given):
        assert os.stat(out / name).st_ino == os.stat(given / name).st_ino, name
    manifest = read_manifest(out)
    assert (manifest.mesh.tp, manifest.mesh.ring, manifest.mesh.ulysses) == (2, 1, 2)
    assert manifest.derived_from.checkpoint == str(given) and manifest.derived_from.mesh["ulysses"] == 1
    assert manifest.tensors == read_manifest(given).tensors
    assert verify_checkpoint(out).ok


def test_cp_only_reshard_copies_where_links_are_impossible(tmp_path, converted, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    given = converted("mixed", 2)
    out = tmp_path / "copied"
    reshard_checkpoint(given, out, ulysses=2, progress=False)  # tp defaults to the checkpoint's
    for name in _data_names(given):
        assert os.stat(out / name).st_ino != os.stat(given / name).st_ino
        assert (out / name).read_bytes() == (given / name).read_bytes()
    assert read_manifest(out).mesh.ulysses == 2 and verify_checkpoint(out).ok


# --------------------------------------------------------------------------------------------------
# The same function as the unsharded model


def _rank_forward(rank: int, world_size: int, checkpoints: list[str], seq_len: int) -> list[tuple]:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard import load_sharded
    from preshard.examples.minimax_h3 import make_inputs, tiny_config

    init_gloo()
    inputs = make_inputs(tiny_config(), seq_len)
    outputs = []
    for checkpoint in checkpoints:
        model = load_sharded(H3, checkpoint)
        with torch.no_grad():
            video, audio = model(**inputs, return_dict=False)
        outputs.append((video.clone(), audio.clone()))
    return outputs


def _assert_close(got, want, tol: float) -> None:
    for what, g, w in zip(("video", "audio"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        diff = (g.float() - w.float()).abs().max().item()
        assert diff <= tol, f"{what} differs from the unsharded model by {diff:.3g} > {tol:g}"


def test_resharded_checkpoints_compute_the_unsharded_function(resharded, references):
    """One spawn of 4 ranks (each spawn costs seconds of imports): the tp2->tp4 reshard at tp=4, and the tp4->tp2
    reshard (its data files linked by the CP-only change) at tp=2 x ulysses=2, i.e. TP groups of 2 ranks."""
    want = references("mixed")
    assert read_manifest(resharded[(2, "cp")]).files == read_manifest(resharded[(4, 2)]).files
    results = run_ranks(_rank_forward, 4, [str(resharded[(2, 4)]), str(resharded[(2, "cp")])], SEQ_LEN)
    for res in results:
        _assert_close(res[0], want, BF16_TOL)
        _assert_close(res[1], want, BF16_TOL)


# --------------------------------------------------------------------------------------------------
# Unshard: the source's own files, bit for bit


def _assert_same_files(got: Path, want: Path) -> None:
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def test_unshard_rebuilds_the_multi_file_source_bit_for_bit(tmp_path, converted, tiny_sources, resharded):
    source = tiny_sources("mixed")
    assert len(list(source.glob("*.safetensors"))) >= 3
    out = tmp_path / "unsharded"
    with _moved_away(source):
        files = unshard_checkpoint(converted("mixed", 4), out, progress=False)
        from_reshard = unshard_checkpoint(resharded[(4, 2)], tmp_path / "from-reshard", progress=False)
    assert sorted(f.name for f in files) == sorted(p.name for p in source.iterdir())
    _assert_same_files(out, source)
    _assert_same_files(tmp_path / "from-reshard", source)
    assert len(from_reshard) == len(files)
    name = "transformer_blocks.0.adaln_proj.linear.weight"
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    with safe_open(str(out / index["weight_map"][name]), "pt") as f:
        assert torch.equal(f.get_tensor(name), _state_dict(source)[name])


@pytest.mark.parametrize("threads, band", [(1, 1 << 30), (1, 700), (4, 700), (4, 1 << 30)])
def test_unshard_in_parallel_writes_what_one_thread_writes(
    threads, band, tmp_path, converted, tiny_sources, monkeypatch
):
    """Files rebuilt at once (each with a reader thread assembling bands ahead), or one after another; bands of
    whole tensors or of a few rows: the same files, byte for byte, which are the source's."""
    from preshard.tools import unshard as unshard_module

    source = tiny_sources("mixed")
    serial = tmp_path / "serial"
    monkeypatch.setattr(unshard_module, "FILE_THREADS", 1)
    monkeypatch.setattr(unshard_module, "READ_AHEAD", 0)
    unshard_checkpoint(converted("mixed", 4), serial, progress=False)
    monkeypatch.setattr(unshard_module, "FILE_THREADS", threads)
    monkeypatch.setattr(unshard_module, "READ_AHEAD", 2)
    monkeypatch.setattr(unshard_module, "BAND_BYTES", band)
    unshard_checkpoint(converted("mixed", 4), tmp_path / "parallel", progress=False)
    _assert_same_files(tmp_path / "parallel", serial)
    _assert_same_files(serial, source)


def test_a_damaged_file_stops_the_others_and_commits_nothing(tmp_path, converted, private_copy, monkeypatch):
    """With files rebuilt at once, a damaged chunk in one stops them all; its error is the one raised."""
    from preshard.tools import unshard as unshard_module

    monkeypatch.setattr(unshard_module, "BAND_BYTES", 700)  # many bands: the others are still writing
    checkpoint = private_copy(converted("mixed", 2))
    tensor = "transformer_blocks.1.ff.net.2.weight"
    _damage(checkpoint, tensor, "data")
    with pytest.raises(ChecksumMismatch, match=f"tensor {tensor}"):
        unshard_checkpoint(checkpoint, tmp_path / "src", progress=False)
    assert not (tmp_path / "src").exists() and not (tmp_path / ".src.partial").exists()


def test_unshard_keeps_the_index_bytes_as_they_were(tmp_path, tiny_sources):
    """A Windows-written index (CRLF, no trailing newline) comes back byte for byte, not with LF line endings."""
    from preshard import convert_checkpoint

    source = tmp_path / "crlf"
    shutil.copytree(tiny_sources("mixed"), source)
    index = source / "diffusion_pytorch_model.safetensors.index.json"
    index.write_bytes(index.read_bytes().rstrip(b"\n").replace(b"\n", b"\r\n"))
    assert b"\r\n" in index.read_bytes()
    convert_checkpoint(source, tmp_path / "ckpt", tp=2, progress=False)
    unshard_checkpoint(tmp_path / "ckpt", tmp_path / "back", progress=False)
    _assert_same_files(tmp_path / "back", source)


def _state_dict(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no iterator
    return tensors


def test_unshard_output_loads_with_diffusers_from_pretrained(tmp_path, converted, tiny_models):
    from diffusers import MiniMaxH3Transformer3DModel as H3
    from diffusers.utils import is_accelerate_available

    out = tmp_path / "unsharded"
    unshard_checkpoint(converted("mixed", 2), out, progress=False)
    want = tiny_models("mixed").state_dict()
    if is_accelerate_available():  # MiniMax-H3 keeps some modules in fp32, which diffusers loads through accelerate
        loaded = H3.from_pretrained(out, torch_dtype=torch.bfloat16).state_dict()  # fp32 modules stay fp32
        assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in want.items()}
        assert all(torch.equal(loaded[k], want[k]) for k in want)
    else:  # the same class without its fp32 list loads without accelerate (every weight then in float32)

        class H3AllFloat32(H3):
            _keep_in_fp32_modules = None

        loaded = H3AllFloat32.from_pretrained(out).state_dict()
        assert loaded.keys() == want.keys()
        assert all(torch.equal(loaded[k], want[k].float()) for k in want)


def test_unshard_undoes_a_lossless_cast_and_refuses_a_lossy_one(tmp_path, converted, tiny_sources):
    widened = converted("bfloat16", 2, dtype="fp32")
    assert {r.layout.dtype.torch for r in read_manifest(widened).tensors.values()} == {torch.float32}
    unshard_checkpoint(widened, tmp_path / "bf16", progress=False)
    _assert_same_files(tmp_path / "bf16", tiny_sources("bfloat16"))

    with pytest.raises(UsageError, match=r"--dtype bfloat16, which lost precision in \d+ tensors .*float32 stored"):
        unshard_checkpoint(converted("mixed", 2, dtype="bf16"), tmp_path / "lossy", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]  # nothing, not even a partial folder


# --------------------------------------------------------------------------------------------------
# Damaged inputs stop both, with nothing committed


def _damage(checkpoint: Path, tensor: str, where: str) -> None:
    chunk = read_manifest(checkpoint).tensors[tensor].chunks[-1]
    offset = chunk.data_offset + chunk.data_length // 2 if where == "data" else chunk.offset + 10
    with open(checkpoint / chunk.file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where, error", [("data", ChecksumMismatch), ("framing", CorruptCheckpointError)])
def test_a_damaged_input_commits_nothing(where, error, tmp_path, converted, private_copy):
    checkpoint = private_copy(converted("mixed", 2))
    tensor = "transformer_blocks.1.adaln_proj.linear.weight"  # column-split: read band-wise from every rank file
    _damage(checkpoint, tensor, where)
    with pytest.raises(error, match=f"tensor {tensor}"):
        reshard_checkpoint(checkpoint, tmp_path / "out", tp=4, progress=False)
    with pytest.raises(error, match=f"tensor {tensor}"):
        unshard_checkpoint(checkpoint, tmp_path / "src", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "src").exists()
    assert not (tmp_path / ".src.partial").exists()


# --------------------------------------------------------------------------------------------------
# Command line and Hub


def test_cli_reshard_and_unshard(tmp_path, converted, tiny_sources):
    runner = CliRunner()
    done = runner.invoke(cli_main, ["reshard", str(converted("mixed", 4)), str(tmp_path / "r"), "--tp", "2"])
    assert done.exit_code == 0, done.output
    assert "mesh tp=2 x ring=1 x ulysses=1" in done.output
    _assert_same_as_direct(tmp_path / "r", converted("mixed", 2))
    again = runner.invoke(cli_main, ["reshard", str(converted("mixed", 4)), str(tmp_path / "r"), "--tp", "2"])
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.output
    bad = runner.invoke(cli_main, ["reshard", str(converted("mixed", 4)), str(tmp_path / "x"), "--tp", "3"])
    assert bad.exit_code == 2 and bad.output.startswith("error: ") and "1, 2, 4" in bad.output
    done = runner.invoke(cli_main, ["unshard", str(tmp_path / "r"), str(tmp_path / "u")])
    assert done.exit_code == 0, done.output
    _assert_same_files(tmp_path / "u", tiny_sources("mixed"))
    helped = runner.invoke(cli_main, ["--help"])
    assert "reshard" in helped.output and "unshard" in helped.output


def test_overwrite_replaces_only_what_the_command_writes(tmp_path, converted):
    """reshard replaces a checkpoint, unshard a safetensors folder; neither deletes a folder of anything else."""
    runner = CliRunner()
    ckpt = converted("mixed", 4)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me\n")
    for args in (["reshard", str(ckpt), str(other), "--tp", "2"], ["unshard", str(ckpt), str(other)]):
        refused = runner.invoke(cli_main, [*args, "--overwrite"])
        assert refused.exit_code == 2 and "--overwrite replaces only that" in refused.output, refused.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other"] and (other / "notes.txt").exists()
    # a checkpoint is not a safetensors folder and a safetensors folder is not a checkpoint
    done = runner.invoke(cli_main, ["reshard", str(ckpt), str(tmp_path / "r"), "--tp", "2"])
    assert done.exit_code == 0, done.output
    refused = runner.invoke(cli_main, ["unshard", str(ckpt), str(tmp_path / "r"), "--overwrite"])
    assert refused.exit_code == 2 and "is not a safetensors checkpoint" in refused.output, refused.output
    done = runner.invoke(cli_main, ["unshard", str(ckpt), str(tmp_path / "u")])
    assert done.exit_code == 0, done.output
    refused = runner.invoke(cli_main, ["reshard", str(ckpt), str(tmp_path / "u"), "--tp", "2", "--overwrite"])
    assert refused.exit_code == 2 and "is not a preshard checkpoint" in refused.output, refused.output
    # and each replaces its own kind
    for args in (["reshard", str(ckpt), str(tmp_path / "r"), "--tp", "1"], ["unshard", str(ckpt), str(tmp_path / "u")]):
        replaced = runner.invoke(cli_main, [*args, "--overwrite"])
        assert replaced.exit_code == 0, replaced.output


def test_reshard_and_unshard_from_a_hub_repo(tmp_path, fake_hub, converted, tiny_sources):
    given = converted("mixed", 2)
    fake_hub.add_repo("org/h3-tp2", {p.name: p.read_bytes() for p in given.iterdir()})
    manifest = reshard_checkpoint("org/h3-tp2", tmp_path / "r", tp=4, progress=False)
    assert manifest.derived_from.checkpoint == "org/h3-tp2"
    assert sorted(fake_hub.downloaded("org/h3-tp2")) == sorted(p.name for p in given.iterdir())
    _assert_same_as_direct(tmp_path / "r", converted("mixed", 4))
    unshard_checkpoint("org/h3-tp2", tmp_path / "u", progress=False)
    _assert_same_files(tmp_path / "u", tiny_sources("mixed"))


# --------------------------------------------------------------------------------------------------
# Memory: bounded by the largest tensor, not the checkpoint

MiB = 1 << 20
# name -> (shape, dtype, style); 180 MiB in all, 11.25x the largest tensor (16 MiB); every split path runs.
MEMORY_TENSORS = {
    **{f"blocks.{i}.down.weight": ((2048, 2048), torch.float32) for i in range(4)},  # rowwise, 16 MiB each
    **{f"blocks.{i}.up.weight": ((2048, 1024), torch.float32) for i in range(4)},  # colwise, 8 MiB each
    **{f"blocks.{i}.gateup.weight": ((4096, 2048), torch.bfloat16) for i in range(4)},  # packed colwise, 16 MiB
    "embed.weight": ((2048, 2048), torch.float32),  # replicated, 16 MiB
    "head.weight": ((1024, 2048), torch.bfloat16),  # replicated, 4 MiB
}
MEMORY_PLAN = {
    "name": "reshard-memory-test",
    "linear": [
        {"match": "blocks.*.up", "style": "colwise"},
        {"match": "blocks.*.down", "style": "rowwise"},
        {"match": "blocks.*.gateup", "style": "packed_colwise", "blocks": 2},
    ],
}
# glibc told to unmap freed buffers at once (as tests/test_convert_memory.py's first run, which explains why):
# the measurement is then what reshard holds, not glibc's bounded cache of freed memory.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 * MiB)}
# Over the largest tensor. Measured: largest + 24 MiB (40 MiB in all): the band of a 16 MiB rowwise tensor (the
# whole tensor), the converter's staging copy of its columns, and the 4 MiB band of one input chunk.
ALLOWED_EXTRA = 64 * MiB
_PEAK = textwrap.dedent(
    """
    import json, sys
    def _report(**extra):
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        print("PEAK " + json.dumps({"peak": peak, **extra}))
    # Everything a reshard imports belongs to the baseline, torch's DCP (for .metadata, ~45 MiB) included: the bound
    # is about the data it holds, not what its imports cost.
    import torch, preshard, preshard.tools.reshard, preshard.format.dcp_metadata
    """
)
RESHARD = _PEAK + textwrap.dedent(
    """
    from preshard.tools.reshard import reshard_checkpoint
    manifest = reshard_checkpoint(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), progress=False)
    _report(tensors=len(manifest.tensors))
    """
)


def _child_peak(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | ALLOCATOR_ENV
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PEAK "))
    return json.loads(line[len("PEAK ") :])


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc/self/status (VmHWM)")
def test_reshard_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    from safetensors.torch import save_file

    from preshard.converter.convert import convert_checkpoint

    source = tmp_path / "src"
    source.mkdir()
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, (name, (shape, dtype)) in enumerate(MEMORY_TENSORS.items()):
        file = f"model-{i:05d}.safetensors"
        tensor = torch.randn(shape, generator=gen).to(dtype) if i % 3 == 0 else torch.full(shape, i, dtype=dtype)
        save_file({name: tensor}, str(source / file))
        weight_map[name] = file
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(MEMORY_PLAN))
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in MEMORY_TENSORS.values()]
    largest, total = max(sizes), sum(sizes)
    assert total >= 10 * largest
    convert_checkpoint(source, tmp_path / "tp4", tp=4, plan=str(plan), progress=False)
    shutil.rmtree(source)  # no source from here on (and the disk space back)

    baseline = _child_peak(_PEAK + "_report()\n")["peak"]
    report = _child_peak(RESHARD, str(tmp_path / "tp4"), str(tmp_path / "tp2"), "2")
    assert report["tensors"] == len(MEMORY_TENSORS)
    assert verify_checkpoint(tmp_path / "tp2").ok
    extra = report["peak"] - baseline
    detail = (
        f"peak {report['peak'] / MiB:.0f} MiB, baseline (import torch, preshard) {baseline / MiB:.0f} MiB, extra "
        f"{extra / MiB:.0f} MiB; largest tensor {largest / MiB:.0f} MiB, checkpoint {total / MiB:.0f} MiB"
    )
    assert extra < largest + ALLOWED_EXTRA, detail


def test_reshard_with_workers_writes_the_same_bytes(tmp_path, converted):
    """--workers on reshard, as on convert: two processes write the new data files; the output is the one a single
    process writes, byte for byte (created/derived_from aside). More workers than TP ranks is refused."""
    single = reshard_checkpoint(converted("mixed", 4), tmp_path / "one", tp=2, progress=False)
    done = CliRunner().invoke(
        cli_main, ["reshard", str(converted("mixed", 4)), str(tmp_path / "two"), "--tp", "2", "--workers", "2", "-q"]
    )
    assert done.exit_code == 0 and done.output == "", done.output
    _assert_same_as_direct(tmp_path / "two", tmp_path / "one")
    assert read_manifest(tmp_path / "two").digest != "" and single.tp == 2
    with pytest.raises(UsageError, match="--workers 3 is more than --tp 2"):
        reshard_checkpoint(converted("mixed", 4), tmp_path / "three", tp=2, workers=3)
