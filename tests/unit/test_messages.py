"""Messages a person reads: each names a fix they can apply where they are (the world-size error in terms of
torchrun's --nproc-per-node, never a CP layout that cannot work), plurals right, numbers rounded for people, and an
output inside a source folder refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from preshard.converter.workdir import check_output
from preshard.errors import OutputError
from preshard.format.mesh import MeshSpec
from preshard.runtime.load import world_size_message
from preshard.sources.local import open_local
from preshard.tools.estimate import human_seconds
from preshard.tools.planner import _memory
from preshard.units import plural


def test_the_world_size_error_says_how_to_launch():
    alone = world_size_message(MeshSpec(tp=2), 1)
    assert "this process runs alone (not under torchrun)" in alone and "torchrun --nproc-per-node 2" in alone
    assert "pass cp" not in alone and "multiple" not in alone  # no CP layout can make tp=2 run on one rank
    bigger = world_size_message(MeshSpec(tp=2, ulysses=2), 8)
    assert "needs 4 ranks but the job has 8 ranks" in bigger and "pass cp=4" in bigger
    odd = world_size_message(MeshSpec(tp=4), 6)
    assert "torchrun --nproc-per-node 4" in odd and "a multiple of 4 ranks" in odd and "cp=" not in odd


def test_plurals_and_rounding():
    assert (plural(1, "data file"), plural(2, "data file"), plural(0, "problem")) == ("1 data file", "2 data files",
                                                                                    "0 problems")  # fmt: skip
    assert _memory(24 << 30) == "24 GiB" and _memory(int(0.5 * (1 << 30))) == "0.5 GiB"
    assert _memory(int(0.001 * (1 << 30))) == "1.02 MiB"  # not "0.000999999 GiB"
    assert (
        human_seconds(0.004) == "under 0.1 s" and human_seconds(3.14) == "3.1 s" and human_seconds(75) == "1 min 15 s"
    )


def test_an_output_inside_the_source_folder_is_refused(tiny_sources, tmp_path):
    import shutil

    source = Path(shutil.copytree(tiny_sources("float32"), tmp_path / "model"))
    paths = open_local(source).input_paths()
    with pytest.raises(OutputError, match="overlaps the source"):
        check_output(source / "tp2", paths, overwrite=False)
    assert not (source / "tp2").exists()
    check_output(tmp_path / "tp2", paths, overwrite=False)  # beside it is fine
    single = next(source.glob("*.safetensors"))
    check_output(source / "out", open_local(single).input_paths(), overwrite=False)  # a file source: its folder is not
