"""Checksums of the chunks a rank reads, computed beside the read so that verifying costs little.

Why: a checkpoint whose data file holds other bytes of the right length (another conversion's file, a damaged
cache blob) frames correctly and loads wrong weights with no error, so every load checks each chunk's xxh3_64
by default. Hashed after the read, the check would be a second pass over the rank's bytes from memory (about
8 GB/s here, against 25 GB/s from the cache a piece has just been read into). So the reader reads a large chunk
in small pieces (PIECE_BYTES, which stay in the reading core's L2 cache) and hands each one on as soon as it has
landed in its parameter; a hashing thread hashes it while the next piece is read (xxhash releases the GIL). When
that thread falls more than MAX_PENDING pieces behind (no spare core: the machine is busy), the reader hashes the
oldest waiting pieces itself, while they are still in cache, instead of leaving them to be hashed from memory
after the read; and at the end it hashes whatever is left rather than wait. Pieces are hashed strictly in the
order they were handed on, one at a time (a lock), by whichever thread takes them, so each chunk's running digest
sees its bytes in order. Small chunks are hashed where they were read: a hand-off would cost more than the hash.

The first mismatch is raised by `finish()`, after the reads, as the `ChecksumMismatch` the reader would have
raised; the hashing thread never raises into the reader.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

INLINE_BYTES = 1 << 20  # below this a chunk is hashed on the reading thread
PIECE_BYTES = 1 << 20  # the reader reads (and hands on) a large chunk in pieces of this size
MAX_PENDING = 2  # pieces the hashing thread may fall behind before the reader hashes the oldest itself

_Check = Callable[[str], None]  # compares a finished digest with the manifest's, raising on a difference


@dataclass
class HashCounts:
    """Who hashed the pieces handed on (what the tests count)."""

    handed_on: int = 0  # pieces handed on by the reader
    by_thread: int = 0  # of those, hashed on the hashing thread
    by_reader: int = 0  # hashed by the reader itself (the thread behind, or left at the end)
    bytes: int = 0  # bytes of the pieces handed on


class ChunkHasher:
    """Hashes chunks beside the read, on a hashing thread or, when it is behind, on the reader's; a context manager.

    `begin()` starts a chunk and returns its running digest; `update(digest, view)` hands on a piece whose bytes
    must not change until `finish()`; `end(digest, check)` queues the comparison. `finish()` hashes what is left and
    raises the first mismatch (in read order).

    Args:
        max_pending: pieces the thread may have waiting before the reader hashes the oldest itself.
        thread: False hashes every piece on the reader (in `update` once `max_pending` are waiting, and in
            `finish`): what happens when the hashing thread never gets a core.
    """

    def __init__(self, max_pending: int = MAX_PENDING, *, thread: bool = True) -> None:
        # Items in hand-off order: (digest, piece, None) or (digest, None, check). One token per item in `_tokens`:
        # whoever takes a token pops and processes one item under `_lock`, so items are processed in order.
        self._items: collections.deque = collections.deque()
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_pending = max_pending
        self._errors: list[BaseException] = []
        self.counts = HashCounts()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="preshard-chunk-hash", daemon=True)
            self._thread.start()

    def __enter__(self) -> ChunkHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @staticmethod
    def begin() -> xxhash.xxh3_64:
        """A new chunk's running digest."""
        return xxhash.xxh3_64()

    def update(self, digest: xxhash.xxh3_64, view: memoryview) -> None:
        """Hand on the chunk's next piece; hash the oldest waiting ones here if the thread is behind."""
        self.counts.handed_on += 1
        self.counts.bytes += len(view)
        self._put((digest, view, None))
        while len(self._items) > self._max_pending and self._take(block=False, by_reader=True):
            pass

    def end(self, digest: xxhash.xxh3_64, check: _Check) -> None:
        """Queue the chunk's comparison, made once all its pieces are hashed."""
        self._put((digest, None, check))

    def finish(self) -> None:
        """Hash every piece still waiting (on this thread, not waiting for the other) and raise the first mismatch."""
        while self._take(block=False, by_reader=True):
            pass
        self._stop()
        if self._errors:
            raise self._errors[0]

    def _put(self, item: tuple) -> None:
        self._items.append(item)
        self._tokens.put(True)

    def _take(self, *, block: bool, by_reader: bool) -> bool:
        """Process the oldest item if there is one (True); False when none is left, or on the stop token."""
        try:
            token = self._tokens.get(block=block)
        except queue.Empty:
            return False
        if token is None:
            return False
        with self._lock:
            digest, view, check = self._items.popleft()
            try:
                if view is not None:
                    digest.update(view)
                    if by_reader:
                        self.counts.by_reader += 1
                    else:
                        self.counts.by_thread += 1
                elif check is not None:
                    check(digest.hexdigest())
            except BaseException as exc:  # raised by finish(), on the reader's thread
                self._errors.append(exc)
        return True

    def _stop(self) -> None:
        if self._thread is not None:
            self._tokens.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while self._take(block=True, by_reader=False):
            pass


__all__ = ["INLINE_BYTES", "MAX_PENDING", "PIECE_BYTES", "ChunkHasher", "HashCounts"]
