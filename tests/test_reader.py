"""The shard reader's staged path (host buffers, a reader thread ahead of the device copies), exercised on the
CPU: with buffers far smaller than a chunk, so chunks arrive in many pieces, and with a load-time cast, it must
give exactly what the direct path gives; damage found on the reader thread surfaces as the same one-line error
on the caller's, with the thread gone."""

from __future__ import annotations

import threading

import pytest
import torch

from preshard.errors import ChecksumMismatch, CorruptCheckpointError
from preshard.format.manifest import read_manifest
from preshard.runtime import reader as reader_module
from preshard.runtime.reader import ShardReader

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it


def _read(checkpoint, tp_rank: int, *, staged: bool, dtype=None, verify=False) -> dict[str, torch.Tensor]:
    manifest = read_manifest(checkpoint)
    targets = {}
    for name, record in manifest.tensors.items():
        layout = record.layout
        shape = layout.local_shape(manifest.tp)
        if staged and len(shape) == 2:  # a transposed view is not contiguous: its chunks go through staging
            targets[name] = torch.empty(tuple(reversed(shape)), dtype=dtype or layout.dtype.torch).T
        else:
            targets[name] = torch.empty(shape, dtype=dtype or layout.dtype.torch)
    with ShardReader(checkpoint, manifest, tp_rank, verify=verify, pin=False) as reader:
        reader.read_all(targets)
    return targets


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_staged_pieces_equal_the_direct_read(converted, monkeypatch, tp_rank):
    checkpoint = converted("mixed", 2)
    direct = _read(checkpoint, tp_rank, staged=False)
    monkeypatch.setattr(reader_module, "STAGING_BYTES", 512)  # chunks of up to ~100 KiB arrive in many pieces
    pieces = []
    real = ShardReader._pieces

    def spy(self, jobs, slots):
        for piece in real(self, jobs, slots):
            pieces.append(piece.chunk.tensor)
            yield piece

    monkeypatch.setattr(ShardReader, "_pieces", spy)
    staged = _read(checkpoint, tp_rank, staged=True, verify=True)
    assert len(pieces) > 10 * len({p for p in pieces})  # the staged path ran, each chunk in many pieces
    assert set(staged) == set(direct)
    for name in direct:
        assert torch.equal(staged[name].contiguous().view(torch.uint8), direct[name].view(torch.uint8)), name
    assert not [t for t in threading.enumerate() if t.name == "preshard-shard-reader"]


def test_a_load_time_cast_goes_through_staging(converted):
    checkpoint = converted("float32", 2)
    direct = _read(checkpoint, 1, staged=False)
    cast = _read(checkpoint, 1, staged=False, dtype=torch.bfloat16)
    for name in direct:
        assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], direct[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("where", ["data", "framing"])
def test_damage_found_on_the_reader_thread_is_one_error_on_the_callers(converted, private_copy, monkeypatch, where):
    checkpoint = private_copy(converted("mixed", 2))
    manifest = read_manifest(checkpoint)
    chunk = manifest.tensors["transformer_blocks.1.ff.net.2.weight"].chunks[1]
    position = chunk.data_offset + 7 if where == "data" else chunk.offset + 40
    with open(checkpoint / chunk.file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x20]))
    monkeypatch.setattr(reader_module, "STAGING_BYTES", 512)
    error = ChecksumMismatch if where == "data" else CorruptCheckpointError
    with pytest.raises(error, match=r"transformer_blocks\.1\.ff\.net\.2\.weight"):
        _read(checkpoint, 1, staged=True, verify=True)
    assert not [t for t in threading.enumerate() if t.name == "preshard-shard-reader" and t.is_alive()]
