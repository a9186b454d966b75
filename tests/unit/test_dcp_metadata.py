""".metadata without torch: the pickle made from the stand-ins is the pickle of torch's own DCP objects, dtypes and
sizes (byte for byte under 64 KiB, the same opcodes in frames that may end elsewhere above), for every kind of
manifest (dtypes, styles, TP degrees, tensor counts at the pickler's batch boundaries, offsets past 2**31, names
containing a stand-in's module name), and reading it back needs no torch either."""

from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preshard.format import _dcp_filesystem_classes, _dcp_metadata_classes, dcp_metadata
from preshard.format.layout import ChunkRecord, TensorLayout, place_records
from preshard.format.manifest import TensorRecord
from preshard.format.styles import make_style

STYLES = ["colwise", "rowwise", "packed_colwise", "replicated_input_rowwise", "replicate"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn]


def _manifest(specs: list[tuple[str, str, tuple[int, ...], torch.dtype]], tp: int, base: int = 0) -> SimpleNamespace:
    """What dcp_metadata reads of a manifest (its tensors), for tensors (name, style, shape, dtype); every record
    offset moved by `base` (past 2**31 and 2**32 for the pickler's wider integer codes)."""
    layouts = []
    for name, style, shape, dtype in specs:
        blocks = 2 if style == "packed_colwise" else None
        layouts.append(TensorLayout.make(name, make_style(style, blocks), shape, dtype, dtype))
    files = place_records(layouts, tp)
    tensors = {}
    for layout in layouts:
        chunks = tuple(
            ChunkRecord(c.tensor, c.owner, c.box, c.file, c.offset + base, c.framing, "0" * 16)
            for c in files.chunks[layout.name]
        )
        tensors[layout.name] = TensorRecord(layout, chunks)
    return SimpleNamespace(tensors=tensors)


def _torch_pickle(manifest) -> bytes:
    return pickle.dumps(dcp_metadata.dcp_metadata(manifest), protocol=dcp_metadata.PICKLE_PROTOCOL)


def _unframed(data: bytes) -> list[tuple[str, object]]:
    """The pickle's opcodes and arguments without its FRAME headers (where 64 KiB frames end depends on byte counts
    only)."""
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data) if op.name != "FRAME"]


def assert_torchs_pickle(manifest) -> None:
    ours, theirs = dcp_metadata.dcp_metadata_bytes(manifest), _torch_pickle(manifest)
    if len(theirs) < 64 << 10:  # one frame
        assert ours == theirs
    else:
        assert _unframed(ours) == _unframed(theirs)
    assert pickle.loads(ours).state_dict_metadata.keys() == manifest.tensors.keys()  # torch's own unpickler


def test_stand_in_modules_are_named_as_long_as_torchs_and_hold_its_class_names():
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    for stand_in, real in ((_dcp_metadata_classes, md), (_dcp_filesystem_classes, fs)):
        assert stand_in.TORCH_MODULE == real.__name__
        assert len(stand_in.__name__) == len(real.__name__)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex"):
        assert getattr(_dcp_metadata_classes, name).__qualname__ == getattr(md, name).__qualname__
    assert _dcp_filesystem_classes._StorageInfo.__qualname__ == fs._StorageInfo.__qualname__


@pytest.mark.parametrize("count", [1, 2, 999, 1000, 1001, 2000])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_pickle_is_torchs_at_the_picklers_batch_boundaries(count, tp):
    """The pickler writes dicts and lists in batches of 1000 (an empty batch after a multiple of 1000 for dicts)
    and frames of 64 KiB: both land mid-tensor somewhere in these."""
    specs = [
        (f"blocks.{i}.{'q' if i % 3 == 0 else 'o' if i % 3 == 1 else 'n'}.weight",
         ("colwise", "rowwise", "replicate")[i % 3], (8, 4 * (1 + i % 2)), DTYPES[i % len(DTYPES)])
        for i in range(count)
    ]  # fmt: skip
    manifest = _manifest(specs, tp)
    assert_torchs_pickle(manifest)


@pytest.mark.parametrize("base", [2**31 - 100, 2**32 + 5, 2**40])
def test_offsets_past_the_picklers_small_integers(base):
    manifest = _manifest(
        [("a.weight", "rowwise", (4, 8), torch.bfloat16), ("s", "replicate", (), torch.float32)], 2, base
    )
    assert_torchs_pickle(manifest)


@pytest.mark.parametrize(
    "name",
    [
        _dcp_metadata_classes.__name__,  # a tensor named after a stand-in's module: torch's classes are used
        f"x.{_dcp_filesystem_classes.__name__}.weight",
        "Ë" * 40 + ".weight",  # non-ASCII
        "w" * 70_000,  # a name too long for a frame (the pickler writes it outside frames)
        "size",  # an interned field name as a tensor name
        "t",  # a one-character name (a shared string object in CPython)
    ],
)
def test_any_tensor_name_gives_torchs_pickle(name):
    manifest = _manifest([(name, "replicate", (3,), torch.float32), ("b.weight", "colwise", (4, 2), torch.float16)], 2)
    assert_torchs_pickle(manifest)


@st.composite
def manifests(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    count = draw(st.integers(1, 40))
    specs = []
    for i in range(count):
        style = draw(st.sampled_from(STYLES))
        dtype = draw(st.sampled_from(DTYPES))
        if style == "replicate":
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=5)))
            name = f"m{i}.{draw(st.sampled_from(['weight', 'bias', 'scale']))}"
        else:
            split = tp * draw(st.integers(1, 3)) * (2 if style == "packed_colwise" else 1)
            other = draw(st.integers(1, 4))
            shape = (split, other) if style in ("colwise", "packed_colwise") else (other, split)
            name = f"m{i}.weight"
        specs.append((name, style, shape, dtype))
    return specs, tp


@settings(max_examples=60, deadline=None)
@given(case=manifests())
def test_random_manifests_give_torchs_pickle(case):
    specs, tp = case
    manifest = _manifest(specs, tp)
    assert_torchs_pickle(manifest)


def test_a_conversion_imports_no_torch_and_its_metadata_reads_back(tiny_sources, tmp_path):
    """In a fresh process: convert, then check `.metadata` as verify does; torch is never imported."""
    code = (
        "import sys\n"
        "from preshard.converter.convert import convert_checkpoint\n"
        "from preshard.format.dcp_metadata import dcp_metadata_problems\n"
        "m = convert_checkpoint(sys.argv[1], sys.argv[2], tp=2, cp=2, progress=False)\n"
        "raw = (__import__('pathlib').Path(sys.argv[2]) / '.metadata').read_bytes()\n"
        "assert dcp_metadata_problems(raw, m) == []\n"
        "assert 'torch' not in sys.modules, 'imported torch'\n"
        "assert 'diffusers' not in sys.modules, 'imported diffusers'\n"
    )
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", code, str(tiny_sources("mixed")), str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    from preshard.format.manifest import read_manifest

    assert (out / ".metadata").read_bytes() == _torch_pickle(read_manifest(out))


def test_the_restricted_reader_gives_back_stand_ins_with_torchs_fields(tiny_sources, tmp_path):
    from preshard.converter.convert import convert_checkpoint

    manifest = convert_checkpoint(tiny_sources("mixed"), tmp_path / "out", tp=2, progress=False)
    meta = dcp_metadata.read_dcp_metadata(Path(tmp_path / "out" / ".metadata"))
    assert type(meta) is _dcp_metadata_classes.Metadata
    name, record = next(iter(manifest.tensors.items()))
    md = meta.state_dict_metadata[name]
    assert md.properties.dtype == record.layout.dtype and md.properties.memory_format == str(torch.contiguous_format)
    assert tuple(md.size) == record.layout.shape
    key = next(k for k in meta.storage_data if k.fqn == name and k.index == 0)
    info = meta.storage_data[key]
    assert (info.relative_path, info.offset, info.length) == (
        record.chunks[0].file, record.chunks[0].offset, record.chunks[0].framing.length
    )  # fmt: skip
