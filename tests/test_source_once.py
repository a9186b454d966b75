"""One read of every source file: config.json and the index are read once, when the source is opened, and those
bytes are what the checkpoint commits, so a config.json edited, or swapped for a FIFO, after planning cannot reach
the output (nor hang the conversion); a dangling config.json link, a FIFO config and an index that names no tensor
are one-line SourceErrors before anything is written."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from preshard.converter.convert import convert_checkpoint
from preshard.errors import SourceError
from preshard.sources import open_source

pytestmark = pytest.mark.quick
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture()
def source(tiny_sources, tmp_path):
    return shutil.copytree(tiny_sources("mixed"), tmp_path / "src")


@pytest.mark.parametrize("change", ["edited", "fifo"])
def test_config_changed_after_planning_is_not_what_is_committed(source, tmp_path, monkeypatch, change):
    config = source / "config.json"
    original = config.read_bytes()
    done = []

    def change_config(name: str) -> None:
        if done:
            return
        done.append(name)
        edited = {**json.loads(original), "_class_name": "SomethingElse", "num_attention_heads": 3}
        config.unlink()
        if change == "edited":
            config.write_text(json.dumps(edited))
        else:
            os.mkfifo(config)  # opened for reading, this would block until a writer came

    out = tmp_path / "out"
    convert_checkpoint(source, out, tp=2, progress=False, on_tensor=change_config)
    assert done  # the config changed while the tensors were written
    assert (out / "config.json").read_bytes() == original


def test_the_index_bytes_committed_are_the_ones_read(source, tmp_path, monkeypatch):
    index = source / INDEX
    original = index.read_bytes()
    opened = open_source(source)
    index.write_text(json.dumps({"weight_map": {}, "edited": True}))
    assert opened.index_text.encode() == original


def test_a_dangling_config_link_is_refused(source, tmp_path):
    (source / "config.json").unlink()
    (source / "config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(SourceError, match=r"config\.json next to the weights is a link to .*nowhere\.json.*does not"):
        open_source(source)


def test_a_fifo_config_is_refused_before_it_is_opened(source):
    (source / "config.json").unlink()
    os.mkfifo(source / "config.json")
    with pytest.raises(SourceError, match="config.json"):
        open_source(source)


@pytest.mark.parametrize("index", [{}, {"weight_map": {}}])
def test_an_empty_index_is_refused(source, tmp_path, index):
    for f in source.glob("*.safetensors"):
        f.unlink()
    (source / INDEX).write_text(json.dumps(index))
    with pytest.raises(SourceError, match=rf"{INDEX}.*(names no tensor|not a valid safetensors index)"):
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    assert not (tmp_path / "out").exists()
