"""Checksums of the chunks a rank reads, computed beside the read so that verifying costs almost nothing.

Why: a checkpoint whose data file holds other bytes of the right length (another conversion's file, a damaged
cache blob) frames correctly and loads wrong weights with no error, so every load checks each chunk's xxh3_64
by default. Hashed after the read, the check would add a second pass over the rank's bytes; here each piece of
a chunk is handed, as soon as it has landed in its parameter, to a hashing thread that runs while the reader
reads the next piece (xxhash releases the GIL for large buffers). A chunk goes to one thread whole, pieces in
order, so its running digest needs no ordering between threads. Small chunks are hashed where they were read:
a hand-off would cost more than the hash.

The first mismatch is raised by `finish()`, after the reads, as the `ChecksumMismatch` the reader would have
raised; the hashing threads never raise into the reader.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import xxhash

INLINE_BYTES = 1 << 20  # below this a chunk is hashed on the reading thread
PIECE_BYTES = 8 << 20  # the reader reads (and hands on) a large chunk in pieces of this size
MAX_THREADS = 2

_Check = Callable[[str], None]  # compares a finished digest with the manifest's, raising on a difference


def hashing_threads() -> int:
    """One hashing thread per spare core, at most MAX_THREADS (the reader keeps one core)."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 2) - 1))


class ChunkHasher:
    """Hashes chunks on background threads as their pieces arrive; use as a context manager.

    `begin()` starts a chunk and returns its key; `update(key, view)` hands on a piece whose bytes must not change
    until `finish()`; `end(key, check)` queues the comparison. `finish()` waits for every queued piece and raises
    the first mismatch (in read order per thread).
    """

    def __init__(self, threads: int | None = None) -> None:
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads or hashing_threads())]
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._next = 0
        self.handed_on = 0  # pieces hashed on a hashing thread (what the tests count)
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name="preshard-chunk-hash", daemon=True) for q in self._queues
        ]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> ChunkHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def begin(self) -> tuple[int, xxhash.xxh3_64]:
        """A new chunk's key: the thread that hashes it and its running digest."""
        lane = self._next % len(self._queues)
        self._next += 1
        return lane, xxhash.xxh3_64()

    def update(self, key: tuple[int, xxhash.xxh3_64], view: memoryview) -> None:
        self.handed_on += 1
        self._queues[key[0]].put((key[1], view, None))

    def end(self, key: tuple[int, xxhash.xxh3_64], check: _Check) -> None:
        self._queues[key[0]].put((key[1], None, check))

    def finish(self) -> None:
        """Wait for every piece handed on and raise the first mismatch found."""
        self._stop()
        if self._errors:
            raise self._errors[0]

    def _stop(self) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _run(self, pieces: queue.SimpleQueue) -> None:
        while True:
            item = pieces.get()
            if item is None:
                return
            digest, view, check = item
            try:
                if view is not None:
                    digest.update(view)
                elif check is not None:
                    check(digest.hexdigest())
            except BaseException as exc:  # raised by finish(), on the reader's thread
                with self._lock:
                    self._errors.append(exc)


__all__ = ["INLINE_BYTES", "PIECE_BYTES", "ChunkHasher", "hashing_threads"]
