"""A converted pipeline is untrusted input (issue 36, items 2 and 3): no code from data, a sealed record, every byte
verified at load and by `preshard verify`, and the ranks of a job agreeing on all of it.

- No module a pipeline's index or record names is imported: a library other than diffusers or transformers is
  refused in one line at conversion (`--component NAME:tp=2`) and at load (a record edited and even re-sealed), and
  the module's import-time marker file never appears.
- `preshard_pipeline.json` is sealed and lists every file no manifest covers: each tamper of the issue (the VAE's
  weights changed at the same size, its config, the scheduler's config, the tokenizer, the text encoder's weights,
  the record itself, a treatment edited to `skipped`, an unlisted weights file in a component kept whole) is
  refused by `load_pipeline` by default and by `preshard verify OUT`, each naming the file; the untampered control
  loads and verifies, each listed file hashed once.
- On two gloo ranks: one rank's VAE file differs, one rank lacks its VAE folder, one rank's VAE config is garbage
  under `verify=False` (diffusers' own error), `components=` differs (scheduler shift 3.0 against 9.0), the ranks see
  different records: every rank fails with one preshard line and the ranks stay in step (a control load after them);
  a rank killed while reading its shard fails the other with one line, not gloo's raw error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xxhash
from clitools import assert_one_line, cli_runner
from multiproc import error_of, init_gloo, run_ranks

pytestmark = pytest.mark.timeout(600)

MARKER_MODULE = "preshard_marker_module"


def _wan_case():
    from tiny_pipelines import CASES

    return CASES["wan"]()


@pytest.fixture(scope="module")
def wan_source(tmp_path_factory) -> Path:
    wan = _wan_case()
    folder = tmp_path_factory.mktemp("records-source") / "wan"
    wan.pipeline(wan.transformer(), wan.components()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def converted(wan_source, tmp_path_factory) -> dict[int, Path]:
    from preshard.converter.pipeline_folder import convert_pipeline

    root = tmp_path_factory.mktemp("records-converted")
    out = {}
    for tp in (1, 2):
        convert_pipeline(wan_source, root / f"wan-tp{tp}", tp=tp, progress=False)
        out[tp] = root / f"wan-tp{tp}"
    return out


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    """A module on sys.path whose import writes a marker file: it must never be imported."""
    modules = tmp_path / "modules"
    modules.mkdir()
    flag = tmp_path / "imported.flag"
    (modules / f"{MARKER_MODULE}.py").write_text(f"open({str(flag)!r}, 'w').write('ran')\nclass X: pass\n")
    monkeypatch.syspath_prepend(str(modules))
    return flag


def _copy(folder: Path, where: Path) -> Path:
    shutil.copytree(folder, where)
    return where


def _edit_record(folder: Path, edit, reseal: bool) -> None:
    from preshard.format.jsonio import canonical_json

    path = folder / "preshard_pipeline.json"
    data = json.loads(path.read_text())
    edit(data)
    if reseal:  # as a hostile editor who knows the format would (xxh3 is not a signature)
        body = {k: v for k, v in data.items() if k != "digest"}
        data["digest"] = xxhash.xxh3_128_hexdigest(canonical_json(body))
    path.write_text(json.dumps(data, indent=1))


def _flip_byte(path: Path, at: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- no code from data


@pytest.mark.quick
@pytest.mark.parametrize(
    "component,choice",
    [("transformer", ["--component", "transformer:tp=2"]), ("vae", [])],
    ids=["sharded-by-choice", "whole-by-default"],
)
def test_a_module_the_index_names_is_never_imported_at_conversion(wan_source, tmp_path, marker, component, choice):
    from preshard.cli import convert_checkpoint_command

    source = _copy(wan_source, tmp_path / "src")
    index = json.loads((source / "model_index.json").read_text())
    index[component] = [MARKER_MODULE, "X"]
    (source / "model_index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    run = cli_runner().invoke(
        convert_checkpoint_command, [str(source), str(out), "--tp", "2", "--no-progress", *choice]
    )
    assert_one_line(run.exit_code, run.stderr, 2, MARKER_MODULE, "diffusers or transformers", component)
    assert not marker.exists() and not out.exists()


@pytest.mark.quick
def test_what_diffusers_allows_is_what_a_record_may_name():
    """A sharded component: diffusers or transformers only; a whole one also a module of diffusers.pipelines (as
    diffusers itself resolves `["stable_diffusion", "StableDiffusionSafetyChecker"]`); never another module, nor a
    class name that is not a plain identifier."""
    from preshard.format.pipeline_record import library_problem

    assert library_problem("t", "diffusers", "WanTransformer3DModel", "sharded") is None
    assert library_problem("e", "transformers", "UMT5EncoderModel", "sharded") is None
    assert library_problem("s", "stable_diffusion", "StableDiffusionSafetyChecker", "whole") is None
    assert library_problem("s", "stable_diffusion", "StableDiffusionSafetyChecker", "sharded") is not None
    for library in ("os", "anymodule", "diffusers.pipelines", "../x", "", None, "onnxruntime.training"):
        assert library_problem("c", library, "X", "whole") is not None, library
    for name in ("__class__", "os.path", "_private", "", None, "X Y"):
        assert library_problem("c", "diffusers", name, "sharded") is not None, name


@pytest.mark.quick
@pytest.mark.parametrize("reseal", [True, False], ids=["resealed", "unsealed"])
def test_a_record_naming_a_module_is_refused_at_load(converted, tmp_path, marker, reseal):
    from preshard.errors import CorruptCheckpointError
    from preshard.runtime.pipeline_load import load_pipeline

    out = _copy(converted[1], tmp_path / "out")
    _edit_record(out, lambda d: d["components"]["transformer"].update(library=MARKER_MODULE), reseal)
    with pytest.raises(CorruptCheckpointError) as info:
        load_pipeline(out)
    message = str(info.value)
    assert "\n" not in message
    assert (MARKER_MODULE in message and "diffusers or transformers" in message) if reseal else "digest" in message
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- tampers


def _shift(path: Path) -> None:
    config = json.loads(path.read_text())
    config["shift"] = 9.0
    path.write_text(json.dumps(config, indent=2))


TAMPERS = {
    "vae-weights-same-size": ("vae/diffusion_pytorch_model.safetensors", _flip_byte),
    "vae-config": ("vae/config.json", lambda p: p.write_text(p.read_text().replace('"z_dim"', '"z_dim" ', 1))),
    "scheduler-config": ("scheduler/scheduler_config.json", _shift),
    "tokenizer": ("tokenizer/tokenizer.json", lambda p: _flip_byte(p, 40)),
    "text-encoder-weights": ("text_encoder/model.safetensors", _flip_byte),
    "model-index": ("model_index.json", lambda p: p.write_text(p.read_text().replace("AutoencoderKLWan", "X"))),
    "unlisted-weights": ("vae/diffusion_pytorch_model.bin", lambda p: p.write_bytes(b"\0" * 64)),
}


def _tamper(out: Path, name: str) -> str:
    """Apply tamper `name` to `out`; the file a refusal must name."""
    if name == "record":
        _edit_record(out, lambda d: d.update(source=d["source"] + "x"), reseal=False)
        return "preshard_pipeline.json"
    if name == "treatment-skipped":
        _edit_record(out, lambda d: d["components"]["vae"].update(treatment="skipped"), reseal=False)
        return "preshard_pipeline.json"
    relative, edit = TAMPERS[name]
    edit(out / relative)
    return str(out / relative)


ALL_TAMPERS = [*TAMPERS, "record", "treatment-skipped"]


@pytest.mark.quick
@pytest.mark.parametrize("tamper", ALL_TAMPERS)
def test_every_tamper_is_refused_at_load_and_by_verify(converted, tmp_path, tamper):
    from preshard.cli import main
    from preshard.errors import CorruptCheckpointError
    from preshard.runtime.pipeline_load import load_pipeline

    out = _copy(converted[1], tmp_path / "out")
    named = _tamper(out, tamper)
    with pytest.raises(CorruptCheckpointError) as info:
        load_pipeline(out)
    assert named in str(info.value) and "\n" not in str(info.value), str(info.value)
    run = cli_runner().invoke(main, ["verify", str(out)])
    assert run.exit_code == 1, (run.stdout, run.stderr)
    assert any(named in line for line in run.stdout.splitlines()[:-1]), run.stdout
    assert run.stdout.splitlines()[-1].startswith("FAILED"), run.stdout


@pytest.mark.quick
def test_the_untampered_pipeline_loads_verifies_and_inspects(converted, tmp_path, monkeypatch):
    """The control: it loads (each listed file hashed exactly once), verifies (exit 0) and inspect names every
    component with its treatment and checks; a file outside the components' folders that the record does not list
    (a Hub upload's .gitattributes) is not read and not refused."""
    from preshard.cli import main
    from preshard.format import pipeline_files
    from preshard.format.pipeline_record import read_pipeline_record
    from preshard.runtime.pipeline_load import load_pipeline

    out = _copy(converted[1], tmp_path / "out")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    record = read_pipeline_record(out)
    assert record is not None and len(record.files) == 8
    hashed: list[str] = []
    original = pipeline_files.hash_file
    monkeypatch.setattr(pipeline_files, "hash_file", lambda f, n, c=None: hashed.append(n) or original(f, n, c))
    pipe = load_pipeline(out)
    assert sorted(hashed) == sorted(f.name for f in record.files)  # each once, none twice
    assert pipe.vae is not None and "transformer" in pipe.preshard_sharded_components
    run = cli_runner().invoke(main, ["verify", str(out)])
    assert run.exit_code == 0 and run.stdout.startswith("OK ") and "transformer sharded tp=1" in run.stdout, run.stdout
    run = cli_runner().invoke(main, ["inspect", str(out)])
    assert run.exit_code == 0, run.stderr
    for name, treatment in [("vae", "whole"), ("transformer", "sharded"), ("scheduler", "whole")]:
        assert any(line.split()[:2] == [name, treatment] for line in run.stdout.splitlines()), run.stdout
    run = cli_runner().invoke(main, ["inspect", str(out), "--json"])
    data = json.loads(run.stdout)
    assert data["kind"] == "pipeline" and data["digest"] == record.digest
    assert {c["name"]: c["treatment"] for c in data["components"]}["transformer"] == "sharded"


@pytest.mark.quick
def test_verify_false_skips_the_hashing_but_not_the_seal_or_the_sizes(converted, tmp_path, monkeypatch):
    from preshard.errors import CheckpointFileMissingError, CorruptCheckpointError
    from preshard.format import pipeline_files
    from preshard.runtime.pipeline_load import load_pipeline

    hashed: list[str] = []
    monkeypatch.setattr(pipeline_files, "hash_file", lambda *a: hashed.append(a[1]) or (0, ""))
    out = _copy(converted[1], tmp_path / "out")
    _flip_byte(out / "vae/diffusion_pytorch_model.safetensors")  # same size: the user vouched for the storage
    load_pipeline(out, verify=False)
    assert hashed == []
    _edit_record(out, lambda d: d["components"]["vae"].update(treatment="skipped"), reseal=False)
    with pytest.raises(CorruptCheckpointError, match="does not match its digest"):
        load_pipeline(out, verify=False)
    missing = _copy(converted[1], tmp_path / "missing")
    shutil.rmtree(missing / "vae")
    with pytest.raises(CheckpointFileMissingError, match="vae/config.json is missing"):
        load_pipeline(missing, verify=False)


@pytest.mark.quick
def test_an_older_record_is_one_line_and_converted_again_with_overwrite(wan_source, converted, tmp_path):
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.errors import CorruptCheckpointError
    from preshard.runtime.pipeline_load import load_pipeline

    out = _copy(converted[1], tmp_path / "out")
    path = out / "preshard_pipeline.json"
    data = json.loads(path.read_text())
    data["format_version"] = 1
    del data["digest"], data["files"], data["checksums"]
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="format version 1.*before records were sealed.*--overwrite"):
        load_pipeline(out)
    run = cli_runner().invoke(__import__("preshard.cli").cli.main, ["verify", str(out)])
    assert run.exit_code == 1 and "format version 1" in run.stdout
    record = convert_pipeline(wan_source, out, tp=1, overwrite=True, progress=False)
    assert record.digest and load_pipeline(out).vae is not None


# ------------------------------------------------------------------------------------------- two gloo ranks


def _scheduler(shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


def _rank_cases(rank: int, world: int, root: str) -> dict[str, str | None]:
    import os

    from preshard.runtime.pipeline_load import load_pipeline

    init_gloo(120)
    os.chdir(Path(root) / f"r{rank}")  # every rank passes the same relative path; the folders differ per rank
    out = {"control": error_of(lambda: load_pipeline("ok", timeout=60))}
    out["vae-differs"] = error_of(lambda: load_pipeline("vae-differs", timeout=60))
    out["vae-missing"] = error_of(lambda: load_pipeline("vae-missing", timeout=60))
    out["diffusers-error"] = error_of(lambda: load_pipeline("config-garbage", verify=False, timeout=60))
    given = {"scheduler": _scheduler(3.0 if rank == 0 else 9.0)}
    out["components"] = error_of(lambda: load_pipeline("ok", components=given, timeout=60))
    out["records"] = error_of(lambda: load_pipeline("other-record", timeout=60))
    out["after"] = error_of(lambda: load_pipeline("ok", components={"scheduler": _scheduler(3.0)}, timeout=60))
    return out


def test_ranks_fail_together_with_one_line(wan_source, converted, tmp_path):
    from preshard.converter.pipeline_folder import convert_pipeline

    other_source = _copy(wan_source, tmp_path / "other-source")
    for rank in (0, 1):
        base = tmp_path / f"r{rank}"
        for name in ("ok", "vae-differs", "vae-missing", "config-garbage"):
            _copy(converted[2], base / name)
        if rank == 1:
            convert_pipeline(other_source, base / "other-record", tp=2, progress=False)  # another record's digest
        else:
            _copy(converted[2], base / "other-record")
    r1 = tmp_path / "r1"
    _flip_byte(r1 / "vae-differs/vae/diffusion_pytorch_model.safetensors")
    shutil.rmtree(r1 / "vae-missing/vae")
    config = r1 / "config-garbage/vae/config.json"
    config.write_bytes(b"{" * config.stat().st_size)  # the same size: verify=False reads it; diffusers refuses it
    ranks = run_ranks(_rank_cases, 2, str(tmp_path), timeout=500)
    for rank, got in enumerate(ranks):
        assert got["control"] is None and got["after"] is None, (rank, got)
        for case, error in got.items():
            assert error is None or "\n" not in error, (rank, case, error)
        theirs = "" if rank == 1 else "rank 1 of the job failed"
        assert got["vae-differs"].startswith("CorruptCheckpointError") and theirs in got["vae-differs"], got
        assert "vae/diffusion_pytorch_model.safetensors differs" in got["vae-differs"]
        assert (
            got["vae-missing"].startswith("CheckpointFileMissingError")
            and "vae/config.json is missing" in (got["vae-missing"])
        )
        assert theirs in got["vae-missing"]
        assert "could not be loaded" in got["diffusers-error"] and theirs in got["diffusers-error"], got
        assert "OSError" in got["diffusers-error"]
        assert got["components"].startswith("MismatchError: the ranks of this job called load_pipeline with ")
        assert "components=" in got["components"] and "FlowMatchEulerDiscreteScheduler" in got["components"]
        assert got["records"].startswith("MismatchError") and "different checkpoints" in got["records"]
        assert "pipeline record" in got["records"]


KILLED_RANK = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
from preshard.runtime import reader
from preshard.runtime.pipeline_load import load_pipeline
if os.environ["RANK"] == "1":
    reader.ShardReader.read_all = lambda *args, **kwargs: os._exit(7)  # killed in the middle of its read
try:
    load_pipeline(sys.argv[1], timeout=60)
    print("loaded")
except Exception as exc:
    print("caught: " + type(exc).__name__ + ": " + str(exc))
"""


def test_a_rank_killed_while_reading_fails_the_others_with_one_line(converted):
    import os
    import subprocess
    import sys

    from multiproc import free_port

    port, procs = free_port(), []
    try:
        for rank in (0, 1):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            command = [sys.executable, "-c", KILLED_RANK, str(converted[2])]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        (out0, err0), (out1, _) = (p.communicate(timeout=300) for p in procs)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == 7 and not out1
    caught = [line for line in out0.splitlines() if line.startswith("caught: ")]
    assert len(caught) == 1, (out0, err0[-2000:])
    assert caught[0].startswith("caught: JobTimeoutError: another rank of this job left while loading"), caught
    assert "Traceback" not in err0, err0[-2000:]
