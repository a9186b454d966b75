"""Checksums on every load by default, hashed beside the read: a large chunk read straight into its parameter is
read in pieces, each handed to a hashing thread while the next is read; the result is the unverified read's, a
damaged piece anywhere in a chunk is the one-line ChecksumMismatch naming it, and no hashing thread outlives the
read."""

from __future__ import annotations

import inspect
import re
import threading

import pytest
import torch

from preshard.errors import ChecksumMismatch
from preshard.format.manifest import read_manifest
from preshard.runtime import reader as reader_module
from preshard.runtime.chunk_hashing import ChunkHasher
from preshard.runtime.load import load_sharded
from preshard.runtime.reader import ShardReader

pytestmark = pytest.mark.quick
LARGE = "transformer_blocks.1.ff.net.2.weight"


def _read(checkpoint, tp_rank: int, *, verify: bool) -> dict[str, torch.Tensor]:
    manifest = read_manifest(checkpoint)
    targets = {
        name: torch.empty(r.layout.local_shape(manifest.tp), dtype=r.layout.dtype.torch)
        for name, r in manifest.tensors.items()
    }
    with ShardReader(checkpoint, manifest, tp_rank, verify=verify, pin=False) as reader:
        reader.read_all(targets)
    return targets


@pytest.fixture()
def small_pieces(monkeypatch):
    """Thresholds scaled to the tiny model: chunks over 1 KiB are hashed on the threads, in 512-byte pieces."""
    monkeypatch.setattr(reader_module, "INLINE_BYTES", 1024)
    monkeypatch.setattr(reader_module, "PIECE_BYTES", 512)
    handed: list[int] = []
    real = ChunkHasher.update

    def counted(self, key, view):
        handed.append(len(view))
        real(self, key, view)

    monkeypatch.setattr(ChunkHasher, "update", counted)
    return handed


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "preshard-chunk-hash" and t.is_alive()]


def test_verify_is_load_shardeds_default():
    assert inspect.signature(load_sharded).parameters["verify"].default is True


def test_pieces_hashed_on_threads_give_the_unverified_read(converted, small_pieces):
    checkpoint = converted("mixed", 2)
    manifest = read_manifest(checkpoint)
    plain = _read(checkpoint, 1, verify=False)
    assert small_pieces == []  # verify=False hands nothing on
    verified = _read(checkpoint, 1, verify=True)
    large = [c for chunks in manifest.chunks_for_tp_rank(1).values() for c in chunks if c.data_length >= 1024]
    # Every large chunk's bytes went to the hashing threads, in pieces of at most 512 bytes.
    assert sum(small_pieces) == sum(c.data_length for c in large)
    assert max(small_pieces) <= 512 and len(small_pieces) > len(large)
    for name in plain:
        assert torch.equal(plain[name].view(torch.uint8), verified[name].view(torch.uint8)), name
    assert not _hash_threads()


@pytest.mark.parametrize("where", ["first piece", "middle piece", "last byte"])
def test_damage_in_any_piece_is_one_checksum_error(converted, private_copy, small_pieces, where):
    checkpoint = private_copy(converted("mixed", 2))
    chunk = read_manifest(checkpoint).tensors[LARGE].chunks[1]
    assert chunk.data_length > 3 * 512
    position = {"first piece": 3, "middle piece": 512 + 100, "last byte": chunk.data_length - 1}[where]
    with open(checkpoint / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + position)
        byte = f.read(1)[0]
        f.seek(chunk.data_offset + position)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(ChecksumMismatch, match=re.escape(LARGE) + ".*damaged"):
        _read(checkpoint, 1, verify=True)
    assert small_pieces  # found by the hashing threads, not inline
    assert not _hash_threads()
    _read(checkpoint, 1, verify=False)  # the negative control: unverified, the damage goes unseen
