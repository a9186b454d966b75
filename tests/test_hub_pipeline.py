"""A Hub pipeline in one command (issue 40, item 3): `convert-checkpoint org/Pipeline OUT --tp 2` on a fake Hub
fetches only what the conversion reads, each file once, converts the sharded transformer and copies the rest, and
writes what converting the same pipeline from a local folder writes.

The repo is a tiny Wan pipeline saved by diffusers, plus what a real repo carries that the conversion never reads: a
folder the index does not name, `.bin` weights beside the VAE's safetensors, an fp16 variant of the transformer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clitools import assert_one_line, cli_runner
from fake_hub import FakeHub

REPO = "org/wan-pipeline"
UNREAD = {
    "not_in_index/model.safetensors": b"never fetched",
    "vae/diffusion_pytorch_model.bin": b"never fetched",
    "transformer/diffusion_pytorch_model.fp16.safetensors": b"never fetched",
}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    from tiny_pipelines import CASES

    case = CASES["wan"]()
    folder = tmp_path_factory.mktemp("hub-pipeline") / "wan"
    case.pipeline(case.transformer(), case.components()).save_pretrained(folder)
    return folder


def _convert(*args: str):
    from preshard.cli import convert_checkpoint_command

    return cli_runner().invoke(convert_checkpoint_command, [*args, "--no-progress"])


def test_a_hub_pipeline_converts_in_one_command(wan, fake_hub: FakeHub, tmp_path):
    commit = fake_hub.add_repo(REPO, {**_files(wan), **UNREAD})
    run = _convert(REPO, str(tmp_path / "hub"), "--tp", "2")
    assert run.exit_code == 0, run.stderr
    fetched = fake_hub.downloaded(REPO)
    assert len(fetched) == len(set(fetched))  # each file once
    assert not set(fetched) & set(UNREAD)  # nothing the conversion does not read
    assert set(fetched) == set(_files(wan))  # the pipeline's own files, all of them
    local = _convert(str(wan), str(tmp_path / "local"), "--tp", "2")
    assert local.exit_code == 0, local.stderr
    from preshard.format.manifest import read_manifest
    from preshard.format.pipeline_record import read_pipeline_record

    record = read_pipeline_record(tmp_path / "hub")
    assert record is not None and record.source == REPO
    assert record.components["transformer"].treatment == "sharded" and record.components["vae"].treatment == "whole"
    hub_files, local_files = _files(tmp_path / "hub"), _files(tmp_path / "local")
    assert set(hub_files) == set(local_files)
    for name in hub_files:  # the copies byte for byte, the shards the same bytes
        if not name.endswith(("manifest.json", "preshard_pipeline.json")):
            assert hub_files[name] == local_files[name], name
    hub_manifest, local_manifest = (
        read_manifest(tmp_path / "hub" / "transformer"),
        read_manifest(tmp_path / "local" / "transformer"),
    )
    assert [f.xxh3_128 for f in hub_manifest.files] == [f.xxh3_128 for f in local_manifest.files]
    assert not any(p.is_symlink() for p in (tmp_path / "hub").rglob("*"))  # copies, not links into the cache
    fake_hub.clear_log()
    again = _convert(REPO, str(tmp_path / "hub"), "--tp", "2", "--revision", commit)
    assert again.exit_code == 0, again.stderr
    assert fake_hub.downloaded(REPO) == []  # from the cache: nothing fetched twice


def test_a_skipped_component_is_not_fetched(wan, fake_hub: FakeHub, tmp_path):
    fake_hub.add_repo(REPO, _files(wan))
    run = _convert(REPO, str(tmp_path / "out"), "--tp", "2", "--component", "vae:skip")
    assert run.exit_code == 0, run.stderr
    assert not [p for p in fake_hub.downloaded(REPO) if p.startswith("vae/")]
    assert json.loads((tmp_path / "out" / "model_index.json").read_text())["vae"] == [None, None]


def test_a_hub_pipeline_with_a_hostile_index_or_revision_is_one_line(wan, fake_hub: FakeHub, tmp_path):
    files = _files(wan)
    index = json.loads(files["model_index.json"])
    fake_hub.add_repo(REPO, {**files, "model_index.json": json.dumps({**index, "../x": ["diffusers", "X"]}).encode()})
    run = _convert(REPO, str(tmp_path / "out"), "--tp", "2")
    assert_one_line(run.exit_code, run.stderr, 2, "component name '../x'")
    run = _convert(REPO, str(tmp_path / "out"), "--tp", "2", "--revision", "main/../../x")
    assert_one_line(run.exit_code, run.stderr, 2, "--revision 'main/../../x'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()
