"""Edges: numeric options bounded (`plan --devices 10**15`, `--device-memory inf`) with one line and bounded work
(the divisors of a count in O(sqrt n) steps), paths that are empty, only whitespace or not UTF-8 refused before
they reach the file system, and manifests of a past or future format version a CorruptCheckpointError."""

from __future__ import annotations

import json
import os

import pytest

from preshard.errors import CorruptCheckpointError, OutputError, UsageError
from preshard.format.manifest import MANIFEST_NAME, Manifest
from preshard.format.path_text import check_path_text
from preshard.tools import planner
from preshard.tools.planner import plan_meshes

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"devices": 10**15}, "--devices must be a whole number in 1..1048576"),
        ({"devices": 0}, "--devices"),
        ({"device_memory_gib": float("inf")}, "--device-memory must be a number of GiB"),
        ({"device_memory_gib": float("nan")}, "--device-memory"),
        ({"device_memory_gib": True}, "--device-memory"),
    ],
)
def test_numeric_plan_options_out_of_range_are_one_line(tiny_sources, kwargs, fragment):
    with pytest.raises(UsageError, match=fragment.replace(".", r"\.")):
        plan_meshes(tiny_sources("float32"), **kwargs)


def test_divisors_take_square_root_steps(monkeypatch):
    steps = []
    real_range = range

    def counted(*args):
        r = real_range(*args)
        steps.append(len(r))
        return r

    monkeypatch.setattr(planner, "range", counted, raising=False)
    n = 1 << 20
    assert planner._divisors(n) == [1 << k for k in range(21)]
    assert sum(steps) <= 1025  # sqrt(2**20) + 1, not 2**20
    assert planner._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]


@pytest.mark.parametrize(
    "text, fragment",
    [("", "empty"), (" ", "only whitespace"), ("a/ /b", "name of only whitespace"), (os.fsdecode(b"w\xff"), "UTF-8")],
)
def test_paths_that_cannot_be_right_are_refused(text, fragment):
    with pytest.raises(OutputError, match=fragment):
        check_path_text(text, "output", OutputError)
    check_path_text("a b/c", "output", OutputError)  # a space inside a name is a name


def test_a_convert_into_a_whitespace_output_is_one_line(tiny_sources, tmp_path, monkeypatch):
    from preshard.converter.convert import convert_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="only whitespace"):
        convert_checkpoint(tiny_sources("float32"), " ", tp=1, progress=False)
    assert not (tmp_path / " ").exists()


@pytest.mark.parametrize("version, fragment", [(1, "no longer loads"), (99, "newer than")])
def test_manifests_of_other_versions_are_corrupt_checkpoint_errors(converted, version, fragment):
    data = json.loads((converted("float32", 1) / MANIFEST_NAME).read_text())
    data["version"] = version
    with pytest.raises(CorruptCheckpointError, match=fragment):
        Manifest.from_dict(data)


def _a_float32_tensor(data: dict) -> str:
    return next(name for name, t in data["tensors"].items() if t["dtype"] == t["source_dtype"] == "float32")


def test_a_manifest_whose_dtype_disagrees_with_the_source_header_is_refused(converted, private_copy):
    from manifests import edit_manifest

    from preshard.format.manifest import read_manifest

    folder = private_copy(converted("float32", 1))
    read_manifest(folder)  # negative control: the conversion's own manifest is read

    def to_int32(data: dict) -> None:
        tensor = data["tensors"][_a_float32_tensor(data)]
        tensor["dtype"] = tensor["source_dtype"] = "int32"  # the same size: the data files still tile

    edit_manifest(folder, to_int32)  # the digest re-sealed
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(folder)
    message = str(info.value)
    assert "\n" not in message and "int32" in message and "float32" in message and "source header" in message


def test_a_null_config_record_beside_a_config_json_is_refused(converted, private_copy):
    from manifests import edit_manifest

    from preshard.format.manifest import read_manifest

    folder = private_copy(converted("float32", 1))
    assert (folder / "config.json").is_file()
    edit_manifest(folder, lambda data: data.update(config=None))
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(folder)
    message = str(info.value)
    assert "\n" not in message and "records no config.json" in message and "remove config.json" in message
    (folder / "config.json").unlink()  # as a conversion from a source without a config writes it: read
    assert read_manifest(folder).config is None
