"""A rank of a pre-sharded checkpoint in object storage: only its bytes fetched, in parallel ranged reads, verified.

Why: a TP rank needs its own chunks and every replicated tensor, 1/T of the weights plus the small replicated part,
and the manifest says where each of those records lies, to the byte. So a rank (`fetch_rank_checkpoint`):

1. reads `manifest.json` (and config.json) whole: small objects;
2. checks that each data file it reads has the recorded size (a short or mixed upload fails here, by name);
3. reads each of its records' framing and raw bytes (`ChunkRecord.load_bytes`: the trailer is never read) with
   ranged requests, `PRESHARD_OBJECT_WORKERS` (default 8) at a time; a record over 16 MiB in 16 MiB pieces, one
   after the other, hashed as they come, so at most workers x 16 MiB is in memory;
4. checks each record as it lands: its framing against the manifest's and its raw bytes against the manifest's
   xxh3_64 (the same checksum a local load checks), and writes it at its offset into a sparse local file of the
   recorded size, in a rank folder under `PRESHARD_CACHE` (default `$XDG_CACHE_HOME/preshard`, else
   `~/.cache/preshard`): `objects/<hash of the URL>/<manifest digest>-tp<r>-of-<T>`.

That folder loads exactly as a local checkpoint does (a partial copy: only this TP rank's records are in it). It is
built in a staged sibling and renamed into place, so a crash leaves none or a complete one, and a later load of the
same manifest by the same TP rank reuses it without reading any data (hosts with local disks fetch once). The rank
folder holds no credential or endpoint: the URL is hashed, and errors show it without any `user:password@`.

Transient errors (throttling, 5xx, a connection reset, an answer cut short) are retried by the client and by
`format.object_store`; what still fails is one line naming the object.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from preshard.errors import (
    CheckpointNotFoundError,
    ChecksumMismatch,
    CorruptCheckpointError,
    ObjectNotFoundError,
    UsageError,
)
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import MANIFEST_NAME, Manifest, manifest_from_bytes
from preshard.format.object_store import ObjectStore, cache_root, open_store, url_key
from preshard.format.publish import publish_folder, staged_sibling

WORKERS_VAR = "PRESHARD_OBJECT_WORKERS"
DEFAULT_WORKERS = 8
PIECE_BYTES = 16 << 20
COMPLETE_NAME = ".preshard-rank-folder.json"  # written last: which manifest, which files


def fetch_workers() -> int:
    raw = os.environ.get(WORKERS_VAR, "")
    try:
        value = int(raw) if raw else DEFAULT_WORKERS
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{WORKERS_VAR}={raw!r} must be a whole number of parallel reads, 1 or more")
    return value


@dataclass
class FetchStats:
    """What a rank fetched from object storage: data bytes and ranged requests (0 when its folder was cached)."""

    bytes_read: int = 0
    requests: int = 0
    reused: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += 1


@dataclass(frozen=True)
class ObjectRankCheckpoint:
    """What `fetch_rank_checkpoint` made: the local rank folder to load from, its manifest, what was fetched."""

    folder: Path
    manifest: Manifest
    url: str
    stats: FetchStats


def read_remote_manifest(store: ObjectStore) -> tuple[Manifest, bytes]:
    """The manifest at `store` and its bytes.

    Raises:
        CheckpointNotFoundError: there is no manifest.json under the URL (nothing converted there, or an upload
            still running: the manifest is uploaded last).
        CorruptCheckpointError: the manifest is damaged.
    """
    try:
        raw = store.read(MANIFEST_NAME)
    except ObjectNotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint {store.where()} has no {MANIFEST_NAME}; pass the prefix convert-checkpoint wrote (an upload "
            "still in progress has none yet: its manifest is uploaded last)"
        ) from None
    return manifest_from_bytes(raw, store.where(MANIFEST_NAME)), raw


def fetch_rank_checkpoint(
    url: str, *, tp_rank: int | Callable[[Manifest], int] = 0, subfolder: str | None = None
) -> ObjectRankCheckpoint:
    """Fetch what one TP rank of a checkpoint in object storage reads into a local rank folder (module docstring).

    Args:
        url: the prefix `convert-checkpoint` wrote, e.g. "s3://bucket/h3-tp8" (any fsspec URL).
        tp_rank: this rank's TP coordinate, or a function of the manifest giving it.
        subfolder: the prefix below `url` that holds the checkpoint (e.g. "transformer").

    Returns:
        The rank folder (loads like a local checkpoint folder), its manifest, and what was fetched.

    Raises:
        CheckpointNotFoundError: no manifest under the URL. CorruptCheckpointError (ChecksumMismatch): an object
            of the wrong size or with bytes that disagree with the manifest, named. ObjectStoreError: an object
            missing, not allowed, or unreachable after every retry, named. UsageError: a bad URL or setting.

    Example:
        >>> fetched = fetch_rank_checkpoint("s3://bucket/h3-tp8", tp_rank=3)   # doctest: +SKIP
        >>> fetched.folder                                                    # doctest: +SKIP
    """
    store = open_store(url).child(subfolder)
    manifest, raw = read_remote_manifest(store)
    rank = tp_rank(manifest) if callable(tp_rank) else tp_rank
    if not 0 <= rank < manifest.tp:
        raise UsageError(f"TP rank {rank} is outside the checkpoint's tp={manifest.tp}")
    final = cache_root() / "objects" / url_key(store.where()) / f"{manifest.digest[:32]}-tp{rank}-of-{manifest.tp}"
    stats = FetchStats()
    if _complete(final, manifest):
        stats.reused = True
        return ObjectRankCheckpoint(final, manifest, store.where(), stats)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = staged_sibling(final, "tmp")
    try:
        (work / MANIFEST_NAME).write_bytes(raw)
        small = [manifest.config.name] if manifest.config is not None else []
        for name in small:
            store.download(name, work / name)
        files = manifest.files_for_tp_rank(rank)
        _fetch_records(store, manifest, rank, files, work, stats)
        (work / COMPLETE_NAME).write_text(json.dumps({"digest": manifest.digest, "files": small + files}))
        if final.exists() and not _complete(final, manifest):
            shutil.rmtree(final, ignore_errors=True)  # a damaged folder of an earlier run
        if not publish_folder(work, final, replace=False) and not _complete(final, manifest):
            raise OSError(errno.EEXIST, "an incomplete rank folder is in the way", str(final))
        # (False with a complete folder: another rank of this host, of the same TP rank, finished first)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ObjectRankCheckpoint(final, manifest, store.where(), stats)


def _complete(folder: Path, manifest: Manifest) -> bool:
    try:
        done = json.loads((folder / COMPLETE_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(done, dict) or done.get("digest") != manifest.digest:
        return False
    return all((folder / str(name)).is_file() for name in done.get("files", []))


def _fetch_records(
    store: ObjectStore, manifest: Manifest, rank: int, files: list[str], folder: Path, stats: FetchStats
) -> None:
    """Every record TP rank `rank` reads, fetched in parallel ranged reads and checked, into sparse files."""
    for name in files:
        size, recorded = store.size(name), manifest.file(name).size
        if size != recorded:
            raise CorruptCheckpointError(
                f"{store.where(name)} is {size} bytes, the manifest says {recorded}: the upload is incomplete or "
                "mixed; upload the checkpoint folder again"
            )
    fds: dict[str, int] = {}
    try:
        for name in files:
            fds[name] = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.ftruncate(fds[name], manifest.file(name).size)  # sparse: only this rank's records take space
        chunks = sorted(
            (c for cs in manifest.chunks_for_tp_rank(rank).values() for c in cs), key=lambda c: (c.file, c.offset)
        )
        with ThreadPoolExecutor(max_workers=fetch_workers(), thread_name_prefix="preshard-object-read") as pool:
            futures = [pool.submit(_fetch_record, store, c, fds[c.file], stats) for c in chunks]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in pending:
                future.cancel()
            for future in futures:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _fetch_record(store: ObjectStore, chunk: ChunkRecord, fd: int, stats: FetchStats) -> None:
    """One record's framing and raw bytes: read in pieces, checked, written at their offsets."""
    end = chunk.offset + chunk.load_bytes
    digest = xxhash.xxh3_64()
    position = chunk.offset
    while True:
        stop = min(end, position + PIECE_BYTES)
        data = store.read_range(chunk.file, position, stop)
        stats.add(len(data))
        view = memoryview(data)
        if position == chunk.offset:
            header = bytes(view[: chunk.framing.data_offset])
            if header != chunk.framing.header:
                raise CorruptCheckpointError(
                    f"{store.where(chunk.file)}: the record of {chunk.tensor} at byte {chunk.offset} is not framed "
                    "as the manifest says; the object was replaced or damaged: upload the checkpoint folder again"
                )
            digest.update(view[chunk.framing.data_offset :])
        else:
            digest.update(view)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], position + written)
        position = stop
        if position >= end:
            break
    if digest.hexdigest() != chunk.xxh3_64:
        raise ChecksumMismatch(
            f"checksum mismatch in {store.where(chunk.file)} for {chunk.tensor} (bytes {chunk.data_offset}.."
            f"{chunk.data_offset + chunk.data_length}); the object was replaced or damaged: upload the checkpoint "
            "folder again"
        )


__all__ = ["FetchStats", "ObjectRankCheckpoint", "fetch_rank_checkpoint", "read_remote_manifest"]
