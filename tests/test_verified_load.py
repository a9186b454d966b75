"""Checksums on every load by default, hashed beside the read: a large chunk read straight into its parameter is
read in pieces, each handed on to be hashed while the next is read (on the hashing thread, or by the reader once the
thread is MAX_PENDING pieces behind); the result is the unverified read's, every byte is hashed once and in order
whoever hashes it, a damaged piece anywhere in a chunk is the one-line ChecksumMismatch naming it, and no hashing
thread outlives the read."""

from __future__ import annotations

import functools
import inspect
import re
import threading

import pytest
import torch
import xxhash

from preshard.errors import ChecksumMismatch
from preshard.format.manifest import read_manifest
from preshard.runtime import reader as reader_module
from preshard.runtime.chunk_hashing import MAX_PENDING, ChunkHasher
from preshard.runtime.load import load_sharded
from preshard.runtime.reader import ShardReader

pytestmark = pytest.mark.quick
LARGE = "transformer_blocks.1.ff.net.2.weight"
PIECE = 640  # does not divide the tiny chunks (3072 bytes): each has a partial last piece


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
    """Thresholds scaled to the tiny model: chunks over 1 KiB are handed on in PIECE-byte pieces."""
    monkeypatch.setattr(reader_module, "INLINE_BYTES", 1024)
    monkeypatch.setattr(reader_module, "PIECE_BYTES", PIECE)
    handed: list[int] = []
    real = ChunkHasher.update

    def counted(self, digest, view):
        handed.append(len(view))
        real(self, digest, view)

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
    # Every large chunk's bytes were handed on, in pieces of at most PIECE bytes.
    assert sum(small_pieces) == sum(c.data_length for c in large)
    assert max(small_pieces) <= PIECE and len(small_pieces) > len(large)
    for name in plain:
        assert torch.equal(plain[name].view(torch.uint8), verified[name].view(torch.uint8)), name
    assert not _hash_threads()


@pytest.fixture()
def hashers(monkeypatch):
    """Every ChunkHasher the reader makes, kept to count who hashed what."""
    made: list[ChunkHasher] = []

    def use(thread: bool) -> None:
        def make():
            made.append(ChunkHasher(thread=thread))
            return made[-1]

        monkeypatch.setattr(reader_module, "ChunkHasher", make)

    return use, made


@pytest.mark.parametrize("thread", [True, False], ids=["hashing thread", "reader only"])
@pytest.mark.parametrize("where", ["first piece", "middle piece", "last partial piece"])
def test_damage_in_any_piece_is_one_checksum_error(converted, private_copy, small_pieces, hashers, where, thread):
    use, made = hashers
    use(thread)
    checkpoint = private_copy(converted("mixed", 2))
    chunk = read_manifest(checkpoint).tensors[LARGE].chunks[1]
    assert chunk.data_length > 3 * PIECE and chunk.data_length % PIECE  # its last piece is a partial one
    last_piece = chunk.data_length - chunk.data_length % PIECE
    position = {"first piece": 3, "middle piece": PIECE + 100, "last partial piece": last_piece + 1}[where]
    with open(checkpoint / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + position)
        byte = f.read(1)[0]
        f.seek(chunk.data_offset + position)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(ChecksumMismatch, match=re.escape(LARGE) + ".*damaged") as caught:
        _read(checkpoint, 1, verify=True)
    assert "\n" not in str(caught.value) and chunk.file in str(caught.value)
    assert small_pieces  # found through the pieces handed on, not by the inline hash of a small chunk
    (hasher,) = made
    assert hasher.counts.by_thread + hasher.counts.by_reader == hasher.counts.handed_on == len(small_pieces)
    if not thread:
        assert hasher.counts.by_thread == 0
    assert not _hash_threads()
    _read(checkpoint, 1, verify=False)  # the negative control: unverified, the damage goes unseen


def test_the_reader_hashes_when_the_thread_is_behind(converted, small_pieces, hashers):
    """With no hashing thread the reader hashes each piece once MAX_PENDING are waiting: every byte once, nothing
    left for after the read but the last MAX_PENDING pieces and the checks."""
    use, made = hashers
    use(False)
    checkpoint = converted("mixed", 2)
    plain = _read(checkpoint, 1, verify=False)
    verified = _read(checkpoint, 1, verify=True)
    (hasher,) = made
    manifest = read_manifest(checkpoint)
    large = [c for chunks in manifest.chunks_for_tp_rank(1).values() for c in chunks if c.data_length >= 1024]
    assert hasher.counts.bytes == sum(c.data_length for c in large) == sum(small_pieces)
    assert hasher.counts.by_reader == hasher.counts.handed_on and hasher.counts.by_thread == 0
    for name in plain:
        assert torch.equal(plain[name].view(torch.uint8), verified[name].view(torch.uint8)), name


def _chunks(count: int, pieces: int, size: int) -> list[bytes]:
    return [bytes((c * 31 + i) % 251 for i in range(pieces * size - size // 2)) for c in range(count)]


@pytest.mark.parametrize("thread", [True, False], ids=["hashing thread", "reader only"])
def test_pieces_are_hashed_in_order_whoever_hashes_them(thread):
    """Chunks handed on piece by piece give each chunk's xxh3_64 of the whole, with the thread or without, and the
    first mismatch (in read order) is the one raised."""
    chunks, size = _chunks(5, 7, 100), 100
    seen: list[tuple[int, str]] = []

    def check(index: int, digest: str) -> None:
        seen.append((index, digest))
        if index in (2, 4):
            raise ChecksumMismatch(f"chunk {index}")

    hasher = ChunkHasher(thread=thread)
    with hasher:
        for index, data in enumerate(chunks):
            digest = hasher.begin()
            for start in range(0, len(data), size):
                hasher.update(digest, memoryview(data)[start : start + size])
            hasher.end(digest, functools.partial(check, index))
        with pytest.raises(ChecksumMismatch, match="chunk 2"):
            hasher.finish()
    assert seen == [(i, xxhash.xxh3_64_hexdigest(data)) for i, data in enumerate(chunks)]
    assert hasher.counts.handed_on == 5 * 7 and hasher.counts.bytes == sum(map(len, chunks))
    assert hasher.counts.by_thread + hasher.counts.by_reader == 5 * 7
    assert not _hash_threads()


def test_without_the_thread_at_most_max_pending_pieces_wait():
    """The reader's share when the thread gets no core: after the n-th piece, all but MAX_PENDING are hashed (the
    negative control: a larger limit leaves more waiting)."""
    data = bytes(range(256)) * 40
    for limit in (MAX_PENDING, MAX_PENDING + 3):
        hasher = ChunkHasher(limit, thread=False)
        digest = hasher.begin()
        for n in range(1, 11):
            hasher.update(digest, memoryview(data)[(n - 1) * 1024 : n * 1024])
            assert hasher.counts.by_reader == max(0, n - limit)
        hasher.end(digest, lambda hexdigest: None)
        hasher.finish()
        assert hasher.counts.by_reader == 10
        assert digest.hexdigest() == xxhash.xxh3_64_hexdigest(data)
