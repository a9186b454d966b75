"""The conversion's write loop as a pipeline: reading, cutting, copying, hashing and writing overlap.

Threads (numpy copies, xxhash and positional file I/O all release the GIL):

- a reader reads the source in bands of rows, in file order, up to `BANDS_IN_FLIGHT` band buffers ahead of
  the writers (the band budget: memory is that many bands, whatever the tensor sizes). Small bands (at most
  `SMALL_BAND_BYTES`: the tensors of a checkpoint of many small ones) are read one after another into one
  band buffer, a slab, and handed on together: the budget, the hand-offs between threads and the buffers
  then count slabs, not tensors, and 100 000 tiny tensors cost what a few hundred bands do;
- the calling thread cuts each band into pieces (views, no copies; a cast makes one copy) and hands
  each writer its pieces of a band (or slab) at once; it also collects what the writers report and checks
  for SIGINT/SIGTERM between bands;
- one writer per data file writes that file's records in file order (a stream of pieces, bounded by the
  band budget); a band (slab) goes back to the pool when every writer is done with its pieces;
- a journal thread claims finished tensors: at each sync point (a position in the write order, the same
  in every process) every writer makes its file durable, then the point is exchanged with the other
  processes (if any) and the lowest rank appends the tensors to the journal. Nothing is claimed before
  its bytes are on disk.

On an error or a signal the reader stops, the writers stop writing (what they have not written is never
claimed), every thread is joined, and the error is raised in the calling thread: no thread outlives the
call and no traceback comes from a thread.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from preshard.converter.writer import RecordFileWriter
from preshard.errors import ResourceError
from preshard.format.layout import ChunkRecord, TensorLayout
from preshard.format.slicing import SMALL_BAND_BYTES, Band, BufferPool, cast_band, cut_band, source_row_bytes
from preshard.sources.reader import band_buffer_bytes

BANDS_IN_FLIGHT = 4
READS_AHEAD = 2  # bands being read at once (a cold read keeps the device busy across band boundaries)
POLL_S = 0.1  # how often a waiting thread looks at the stop flag
SLAB_BANDS = 512  # small bands per slab at most, so that the writers start before a slab of tiny tensors is full
_STOP = object()


@dataclass
class TensorWork:
    """One tensor this process reads: its chunks in this process's files, and the bands to read."""

    index: int  # position in the write order
    layout: TensorLayout
    all_chunks: list[ChunkRecord]  # every chunk of the tensor, canonical order
    chunks: list[ChunkRecord]  # those in this process's files
    bands: list[Band]


@dataclass(frozen=True)
class _Marker:
    point: int  # index into the sync points


@dataclass
class _BandRef:
    """A band's (slab's) buffers, given back once every list of pieces cut from it is written (or dropped)."""

    remaining: int
    release: Callable[[], None]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self) -> None:
        with self.lock:
            self.remaining += 1

    def done(self) -> None:
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.release()


@dataclass
class _Batch:
    """What the reader hands on: one large band, or the small bands of one slab, read into `buffer`."""

    items: list[tuple[TensorWork, Band, np.ndarray]]  # (tensor, band, the band's rows)
    buffer: np.ndarray
    small: bool


class _Slab:
    """Small bands read one after another into one band buffer."""

    ALIGN = 64  # every band starts at a multiple of 64 bytes: aligned for any dtype (and for a cast's view)

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.used = 0
        self.items: list[tuple[TensorWork, Band, np.ndarray]] = []

    def room(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.buffer.size and len(self.items) < SLAB_BANDS

    def take(self, nbytes: int) -> np.ndarray:
        view = self.buffer[self.used : self.used + nbytes]
        self.used += nbytes + (-nbytes % self.ALIGN)
        return view


class _Failed(Exception):
    """Carries an error raised in another thread to the calling thread."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _writer_loop(
    writer: RecordFileWriter, inbox: queue.SimpleQueue, events: queue.SimpleQueue, abort: threading.Event
) -> None:
    failed = False
    while True:
        item = inbox.get()
        if item is _STOP:
            return
        if isinstance(item, _Marker):
            if not failed and not abort.is_set():
                try:
                    writer.sync()
                    events.put(("synced", item.point))
                except BaseException as exc:  # noqa: BLE001 - carried to the calling thread
                    failed = True
                    events.put(("error", exc))
            continue
        pieces, ref = item
        written, error = [], None
        try:
            for piece in pieces:
                if failed or abort.is_set():  # once anything failed, nothing more is written
                    break
                if piece.first:
                    writer.begin(piece.chunk)
                writer.write(piece.data)
                if piece.last:
                    written.append(writer.end())
        except BaseException as exc:  # noqa: BLE001
            failed, error = True, exc
        finally:
            if written:
                events.put(("chunks", written))
            if error is not None:
                events.put(("error", error))
            ref.done()


class WritePipeline:
    """Runs one process's share of a conversion; see the module docstring.

    Args:
        start_band, finish_band: `start_band(tensor, start, count, buffer)` starts reading source rows into the
            flat uint8 `buffer` (of `band_buffer_bytes` of their size; for a band of at most `SMALL_BAND_BYTES`,
            exactly its size: such bands are below `DIRECT_MIN_BYTES`, read through the page cache);
            `finish_band(started)` waits for them and returns the view holding them (`SourceReader`; bands are
            finished in the order they were started).
        writers: this process's data files, by file name.
        work: the tensors to read, in write order.
        points: sync points (write-order positions, ascending; the last is the job's last tensor to write).
        exchange: `exchange(point, checksums, error)` runs on the journal thread once point `point` is durable
            here, with the chunk checksums `{tensor: {chunk position: xxh3_64}}` written here since the point
            before; it shares them with the other processes and returns what they all wrote (raises if one
            failed, or with `error`, to tell them this one did).
        journal: `journal(point, gathered)` then claims the point's tensors (the lowest rank writes the journal).
        on_tensor: called with a tensor's name once all its chunks here are written, in write order.
        on_bytes: called with each finished record's length (progress).
        check_stop: raises to stop (SIGINT/SIGTERM).
        bands_in_flight, band_bytes: the band budget (memory), and the band size the bands were planned with.
    """

    def __init__(
        self,
        *,
        start_band: Callable[[str, int, int, np.ndarray], Any],
        finish_band: Callable[[Any], np.ndarray],
        writers: dict[str, RecordFileWriter],
        work: list[TensorWork],
        points: list[int],
        exchange: Callable[[int, dict[str, dict[int, str]], BaseException | None], Any],
        journal: Callable[[int, Any], None],
        on_tensor: Callable[[str], None],
        on_bytes: Callable[[int], None],
        check_stop: Callable[[], None],
        bands_in_flight: int = BANDS_IN_FLIGHT,
        band_bytes: int = 0,
    ) -> None:
        self.start_band, self.finish_band = start_band, finish_band
        self.writers = writers
        self.work = work
        self.points = points
        self.exchange = exchange
        self.journal = journal
        self.on_tensor = on_tensor
        self.on_bytes = on_bytes
        self.check_stop = check_stop
        self.budget = threading.BoundedSemaphore(bands_in_flight)
        self.slab_bytes = band_buffer_bytes(band_bytes)  # a band buffer: fits any band
        self.pool = BufferPool(keep=2 * bands_in_flight, minimum=self.slab_bytes)
        # SimpleQueue: a put and a get cost a tenth of queue.Queue's, and there is one of each per tensor
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.bands: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # points for the journal thread
        self.halt = threading.Event()  # the reader stops
        self.abort = threading.Event()  # the writers stop writing
        self.records: dict[str, dict[int, ChunkRecord]] = {}  # tensor -> chunk position -> written record
        self._where: dict[tuple[str, int], tuple[str, int]] = {}  # (file, offset) -> (tensor, chunk position)
        self._left: dict[str, int] = {}  # tensor -> its chunks here not yet written
        self._index: dict[str, int] = {}
        for t in work:
            for position, c in enumerate(t.all_chunks):
                if c.file in writers:
                    self._where[(c.file, c.offset)] = (t.layout.name, position)
            self._left[t.layout.name] = len(t.chunks)
            self._index[t.layout.name] = t.index
        self._order = deque(t.layout.name for t in work if t.chunks)  # tensors to report, in write order
        self._acks = [0] * len(points)
        self._handed = 0  # points handed to the journal thread
        self._journaled = 0
        self._exchanging = True  # the journal thread still exchanges (no failure exchanged yet)
        self._workers: list[threading.Thread] = []

    # -- threads

    def _read(self) -> None:
        pending: deque = deque()  # large bands being read: up to READS_AHEAD at once, finished in order
        slab: _Slab | None = None  # small bands read so far, not yet handed on
        try:
            for t in self.work:
                row = source_row_bytes(t.layout) if t.layout.shape else t.layout.source_dtype.itemsize
                for band in t.bands:
                    nbytes = (band.count if t.layout.shape else 1) * row if band.count else 0
                    if nbytes <= SMALL_BAND_BYTES:
                        while pending:  # finished in the order they were started
                            self._deliver(*pending.popleft())
                        if slab is not None and not slab.room(nbytes):
                            slab = self._hand_slab(slab)
                        if slab is None:
                            if not self._acquire():
                                return
                            slab = _Slab(self.pool.take(self.slab_bytes))
                        view = slab.take(nbytes)
                        data = self.finish_band(self.start_band(t.layout.name, band.start, band.count, view)) if (
                            band.count
                        ) else view  # fmt: skip
                        if band.chunks:  # (else read only to hash the source file)
                            slab.items.append((t, band, data))
                        continue
                    if slab is not None:
                        slab = self._hand_slab(slab)
                    if not self._acquire():
                        return
                    raw = self.pool.take(band_buffer_bytes(nbytes))
                    pending.append((t, band, raw, self.start_band(t.layout.name, band.start, band.count, raw)))
                    while len(pending) >= READS_AHEAD:
                        self._deliver(*pending.popleft())
            while pending:
                self._deliver(*pending.popleft())
            if slab is not None:
                self._hand_slab(slab)
            self.bands.put(None)
        except BaseException as exc:  # noqa: BLE001 - carried to the calling thread
            self.bands.put(_Failed(exc))

    def _acquire(self) -> bool:
        """Take a band buffer's place in the budget; False when the pipeline is stopping."""
        while not self.budget.acquire(timeout=POLL_S):
            if self.halt.is_set():
                return False
        if self.halt.is_set():
            self.budget.release()
            return False
        return True

    def _hand_slab(self, slab: _Slab) -> None:
        if slab.items:
            self.bands.put(_Batch(slab.items, slab.buffer, small=True))
        else:  # only hashed
            self.pool.give(slab.buffer)
            self.budget.release()

    def _deliver(self, t: TensorWork, band: Band, raw: np.ndarray, started: Any) -> None:
        data = self.finish_band(started)
        if not band.chunks:  # read only to hash the source file
            self.pool.give(raw)
            self.budget.release()
            return
        self.bands.put(_Batch([(t, band, data)], raw, small=False))

    def _journal_loop(self) -> None:
        local_error: BaseException | None = None  # this thread's own failure, to tell the others at the next point
        while True:
            item = self.jobs.get()
            if item is None:
                return
            point, checksums, error = item
            try:
                gathered = self.exchange(point, checksums, error or local_error)
            except BaseException as exc:  # noqa: BLE001 - a failure was exchanged: no more exchanges
                self.events.put(("exchange failed", exc))
                return
            try:
                self.journal(point, gathered)
                self.events.put(("journaled", point))
            except BaseException as exc:  # noqa: BLE001
                local_error = exc
                self.events.put(("error", exc))

    # -- the calling thread

    def run(self) -> dict[str, list[ChunkRecord]]:
        """Convert this process's share; returns `{tensor: [written chunk records]}` (this process's chunks)."""
        queues = {name: queue.SimpleQueue() for name in self.writers}
        writers = [
            threading.Thread(
                target=_writer_loop, args=(w, queues[name], self.events, self.abort), name=f"write {name}", daemon=True
            )
            for name, w in self.writers.items()
        ]
        self._workers = writers
        reader = threading.Thread(target=self._read, name="read", daemon=True)
        journal = threading.Thread(target=self._journal_loop, name="journal", daemon=True)
        self._start((*writers, reader, journal), queues)
        failure: BaseException | None = None
        try:
            self._feed(queues)
            while self._journaled < len(self.points) or self._order:
                self._handle(self._next_event())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once every thread has stopped
            failure = exc.error if isinstance(exc, _Failed) else exc
        finally:
            self.halt.set()
            if failure is not None:
                self.abort.set()
            for q in queues.values():
                q.put(_STOP)
            for thread in (*writers, reader):
                thread.join()
            if failure is not None:
                self._settle()  # claim what became durable before the failure
                if self._exchanging:
                    self.jobs.put((self._handed, {}, failure))
            self.jobs.put(None)
            journal.join()
        if failure is not None:
            raise failure
        return {name: [by_position[i] for i in sorted(by_position)] for name, by_position in self.records.items()}

    def _start(self, threads: tuple[threading.Thread, ...], queues: dict[str, queue.SimpleQueue]) -> None:
        """Start every thread; if one cannot start (a thread or memory limit), stop those that did and say so."""
        started = []
        try:
            for thread in threads:
                thread.start()
                started.append(thread)
        except RuntimeError as exc:
            self.halt.set()
            self.abort.set()
            for q in queues.values():
                q.put(_STOP)
            self.jobs.put(None)
            for thread in started:
                thread.join()
            raise ResourceError.of(exc, "starting the conversion's threads") or exc from None

    def _feed(self, queues: dict[str, queue.SimpleQueue]) -> None:
        """Cut every band the reader delivers and hand the pieces to the writers; sync markers in between."""
        marked = 0
        while True:
            try:
                item = self.bands.get(timeout=POLL_S)
            except queue.Empty:
                self.check_stop()
                self._drain()
                self._check_writers()
                continue
            if item is None:
                break
            if isinstance(item, _Failed):
                raise item
            casts: list[np.ndarray] = []

            def release(buffer=item.buffer, casts=casts) -> None:
                self.pool.give(buffer)
                for cast in casts:
                    self.pool.give(cast)
                self.budget.release()

            ref = _BandRef(1, release)  # this thread's hold, until every list is handed out
            lists: dict[str, list] = {}
            for t, band, data in item.items:
                if marked < len(self.points) and self.points[marked] < t.index:
                    self._hand(queues, lists, ref)
                    while marked < len(self.points) and self.points[marked] < t.index:
                        self._mark(queues, marked)
                        marked += 1
                count = band.count if t.layout.shape else 1
                data, cast = cast_band(t.layout, data, count, None if item.small else self.pool)
                if cast is not None and not item.small:
                    casts.append(cast)
                for piece in cut_band(t.layout, band, data, small=item.small):
                    lists.setdefault(piece.chunk.file, []).append(piece)
            self._hand(queues, lists, ref)
            ref.done()
            self.check_stop()
            self._drain()
        while marked < len(self.points):
            self._mark(queues, marked)
            marked += 1

    @staticmethod
    def _hand(queues: dict[str, queue.SimpleQueue], lists: dict[str, list], ref: _BandRef) -> None:
        """Give each writer its pieces so far (before a sync marker, and at the end of a band or slab)."""
        for name, pieces in lists.items():
            ref.add()
            queues[name].put((pieces, ref))
        lists.clear()

    def _mark(self, queues: dict[str, queue.SimpleQueue], point: int) -> None:
        for q in queues.values():
            q.put(_Marker(point))
        if not queues:
            self._acks[point] = -1  # no files here: nothing to make durable
            self._hand_points()

    def _next_event(self) -> tuple:
        while True:
            self.check_stop()
            try:
                return self.events.get(timeout=POLL_S)
            except queue.Empty:
                self._check_writers()

    def _check_writers(self) -> None:
        if not all(thread.is_alive() for thread in self._workers):  # never: a guard against waiting forever
            raise RuntimeError("a writer thread stopped without a word")

    def _drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)

    def _settle(self) -> None:
        """After a failure: take in what the stopped writers reported, errors aside."""
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if event[0] == "exchange failed":
                self._exchanging = False
            elif event[0] != "error":
                self._handle(event)

    def _handle(self, event: tuple) -> None:
        kind, value = event
        if kind == "chunks":
            for record in value:
                name, position = self._where[(record.file, record.offset)]
                self.records.setdefault(name, {})[position] = record
                self._left[name] -= 1
                self.on_bytes(record.framing.length)
            while self._order and not self._left[self._order[0]]:
                self.on_tensor(self._order.popleft())
        elif kind == "synced":
            self._acks[value] += 1
            self._hand_points()
        elif kind == "journaled":
            self._journaled += 1
        elif kind == "exchange failed":
            self._exchanging = False
            raise _Failed(value)
        else:  # "error"
            raise _Failed(value)

    def _hand_points(self) -> None:
        """Hand every point that is now durable here to the journal thread, in order."""
        while self._handed < len(self.points) and self._acks[self._handed] in (len(self.writers), -1):
            point = self._handed
            low = self.points[point - 1] if point else -1
            checksums = {
                name: {i: r.xxh3_64 for i, r in by_position.items()}
                for name, by_position in self.records.items()
                if low < self._index[name] <= self.points[point]
            }
            self.jobs.put((point, checksums, None))
            self._handed += 1
