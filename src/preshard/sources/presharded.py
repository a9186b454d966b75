"""A converted (pre-sharded) checkpoint as a conversion source: what `preshard reshard` and `unshard` read.

Why: a checkpoint converted for one TP degree is tied to it, and the original safetensors are often gone
(deleted after converting, or never local: they came from the Hub). Every byte of the original tensors
is in the chunks, so the converter can read a converted checkpoint as it reads safetensors: rows of a
tensor, band by band, assembled from its chunks.

- A dim-0 split (colwise, packed colwise) and a replicated tensor: the rows of a band are contiguous runs
  of chunk bytes, read straight into the caller's buffer with positional reads.
- A dim-1 split (rowwise, packed rowwise, replicated-input rowwise): every chunk holds all rows of some
  columns; the band's rows of each chunk are one contiguous run, read into a small scratch buffer (the
  band's share of one chunk) and copied into their columns. Memory is the band, never the tensor.
- Rows come in each tensor's *source* dtype, as a safetensors source gives them, and the plan is made
  with the input's own `--dtype` cast: the resharded layout (stored and source dtypes, the manifest's
  `dtype`) is then exactly what a direct conversion with the same cast gives, byte for byte, and
  `verify --source` and `unshard` still know the original dtypes. Where the input was cast, rows are
  cast back to the source dtype and the cast is re-applied to check that it gives the stored bytes
  again (it does for every value a cast can produce), so nothing silently changes.
- Nothing read is trusted: every chunk's torch.save framing is compared with what its dtype and shape
  give, and its xxh3_64 is computed while streaming (each chunk's bytes are read once, in order) and
  compared when its last byte has been read, before the converter moves to the next tensor. A damaged
  input stops the run with a one-line error naming the tensor and file; no output is committed.

The source record of the output manifest is the *original* source's (from the input manifest), so
`preshard verify OUT --source ORIGINAL` and `unshard` work on a resharded checkpoint; `derived_from`
records the input checkpoint, its mesh and its manifest digest. The read order is the original source's
file order (from the headers recorded in the manifest), so a resharded checkpoint lays its records out
exactly as a direct conversion at the new degree does.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from preshard.errors import CheckpointNotFoundError, ChecksumMismatch, CorruptCheckpointError, SourceError
from preshard.format.dtypes import DType
from preshard.format.fileio import HASH_BLOCK, byte_view, pread_into
from preshard.format.folder import CheckpointFolder
from preshard.format.jsonio import parse_json_text
from preshard.format.layout import ChunkRecord
from preshard.format.locate import local_path
from preshard.format.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    Manifest,
    Provenance,
    Source,
    TensorRecord,
    describe_chunk,
    read_manifest,
)
from preshard.sources.safetensors_file import SafetensorsHeader, parse_header

CAST_CHECK_ELEMS = 1 << 20


class PreshardedSource:
    """A converted checkpoint folder, read as a `preshard.sources.ConversionSource`.

    Attributes:
        folder: the checkpoint folder (for a Hub repo: its snapshot in the local HF cache).
        manifest: its parsed and validated manifest.
        given: the checkpoint as the user named it (a path or a Hub repo id).
        config: config.json parsed (None when the checkpoint has none).
        derived_from: the provenance a checkpoint written from this source records.
    """

    def __init__(self, folder: str | Path, *, given: str | None = None, manifest: Manifest | None = None) -> None:
        """Open a local checkpoint folder.

        Raises:
            CorruptCheckpointError: no complete checkpoint there, a damaged manifest or config.json, a data file
                missing or of the wrong size.
        """
        self.folder = Path(folder)
        self.files = CheckpointFolder(self.folder)  # every open stays inside the folder (or the HF cache it is in)
        self.manifest = manifest if manifest is not None else read_manifest(self.folder)
        self.given = given if given is not None else str(folder)
        self._config_bytes, self.config = self._read_config()
        for f in self.manifest.files:
            try:
                size = self.files.size(f.name)
            except FileNotFoundError:
                size = None
            if size != f.size:
                what = "is missing" if size is None else f"is {size} bytes, the manifest says {f.size}"
                raise CorruptCheckpointError(
                    f"{self.given}: data file {f.name} {what}; the checkpoint is incomplete or damaged: restore it, "
                    "or convert it again"
                )
        self.derived_from = Provenance(
            kind="reshard", checkpoint=self.given, mesh=self.manifest.mesh.to_dict(), digest=self.manifest.digest
        )

    def _read_config(self) -> tuple[bytes | None, dict[str, Any] | None]:
        """config.json's bytes and parsed content, checked against the manifest's record of it."""
        record = self.manifest.config
        if record is None:
            return None, None
        try:
            raw = self.files.read_bytes(record.name, limit=record.size + 1)
        except FileNotFoundError:
            raw = None
        if raw is None or not record.matches(raw):
            raise CorruptCheckpointError(
                f"{self.given}: {record.name} is missing or differs from the one the checkpoint was converted with; "
                "restore it from the source, or convert again"
            )
        config = parse_json_text(raw, f"{self.given}: {record.name}", CorruptCheckpointError, "restore it")
        if not isinstance(config, dict):
            raise CorruptCheckpointError(f"{self.given}: {record.name} is not a JSON object; restore it")
        return raw, config

    # -- the original source's layout, from the headers recorded in the manifest

    @functools.cached_property
    def _source_headers(self) -> tuple[SafetensorsHeader, ...]:
        headers = []
        for f in self.manifest.source.files:
            try:
                headers.append(parse_header(Path(f.name), f.size, f.header.encode("utf-8")))
            except SourceError as exc:
                raise CorruptCheckpointError(
                    f"{self.given}: the manifest's record of source file {f.name} is not usable ({exc})"
                ) from None
        return tuple(headers)

    def source_headers(self) -> list[SafetensorsHeader]:
        """Each original source file's header (parsed once from the manifest's copy), in the source's file order.

        Raises:
            CorruptCheckpointError: a recorded header that is not a valid safetensors header for its file size.
        """
        return list(self._source_headers)

    # -- what the converter asks of any source (see preshard.sources.ConversionSource)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        """Every tensor's global shape and *source* dtype (the plan re-applies the input's own cast)."""
        return {name: (r.layout.shape, r.layout.source_dtype) for name, r in self.manifest.tensors.items()}

    def read_order(self) -> list[str]:
        """The original source's order (file, then byte offset), as a direct conversion reads it."""
        order: list[str] = []
        for header in self.source_headers():
            order += [t.name for t in sorted(header.tensors.values(), key=lambda t: t.start)]
        known = set(self.manifest.tensors)
        order = [name for name in dict.fromkeys(order) if name in known]
        return order + sorted(known - set(order))

    def input_paths(self) -> list[Path]:
        return [self.folder]

    def config_bytes(self) -> bytes | None:
        return self._config_bytes

    def identity(self) -> str:
        """The manifest's digest and each file's size and mtime: what must not change for a resume (no data read)."""
        h = hashlib.sha256(self.manifest.digest.encode())
        names = [f.name for f in self.manifest.files] + [MANIFEST_NAME]
        if self.manifest.config is not None:
            names.append(self.manifest.config.name)
        for name in names:
            try:
                stat = (self.folder / name).stat()
                h.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            except OSError:
                h.update(f"{name}:missing".encode())
        return h.hexdigest()

    def check_unchanged(self, identity: str) -> None:
        """Raises SourceError when the input checkpoint changed since `identity` was taken."""
        if self.identity() != identity:
            raise SourceError(
                f"the checkpoint {self.given} changed while it was being read; nothing was committed: re-run the "
                "command once it is no longer being written"
            )

    def open_reader(self) -> PreshardedRows:
        return PreshardedRows(self)

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        """The original source's record, as the input manifest has it (the input's own files are not the source)."""
        return self.manifest.source

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor in its source dtype (what unsharding writes, headers aside)."""
        return sum(math.prod(r.layout.shape) * r.layout.source_dtype.itemsize for r in self.manifest.tensors.values())


@dataclass
class _ChunkRead:
    """How far one chunk's data has been read, and its streaming xxh3_64 while the reads come in order."""

    position: int = 0  # next in-order data byte
    read: int = 0  # data bytes read in all
    digest: Any = field(default_factory=xxhash.xxh3_64)
    in_order: bool = True
    checked: bool = False


class PreshardedRows:
    """Rows of a converted checkpoint's tensors, assembled from their chunks with positional reads.

    Safe to use from several threads for different tensors (buffers are per thread, chunk state is locked).
    """

    def __init__(self, source: PreshardedSource) -> None:
        self.source = source
        self.manifest = source.manifest
        self.folder = source.folder
        self.fds: dict[str, int] = {}
        try:
            for f in self.manifest.files:
                self.fds[f.name] = source.files.open(f.name)
        except OSError as exc:
            self.close()
            raise CorruptCheckpointError(
                f"{source.given}: data file {exc.filename} cannot be opened ({exc.strerror}); restore it"
            ) from None
        except BaseException:
            self.close()
            raise
        self._states: dict[tuple[str, int], _ChunkRead] = {}
        self._lock = threading.Lock()
        self._read_names: set[str] = set()  # tensors read since the last take_proofs
        self._local = threading.local()
        self._source_file = {name: h.path.name for h in source.source_headers() for name in h.tensors}

    # -- the ConversionSource reader protocol

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None:
        """Fill the flat uint8 `out` with rows `[start, start + count)` of tensor `name`, in its source dtype.

        Raises:
            ChecksumMismatch: a chunk's bytes fail their xxh3_64 (checked once its last byte is read).
            CorruptCheckpointError: a chunk's torch.save framing is damaged, or a data file is truncated.
        """
        record = self.manifest.tensors[name]
        layout = record.layout
        with self._lock:
            self._read_names.add(name)
        if layout.dtype == layout.source_dtype:
            self._read_stored(record, start, count, out)
            return
        stored_bytes = out.size // layout.source_dtype.itemsize * layout.dtype.itemsize
        stored = self._scratch("cast", stored_bytes)
        self._read_stored(record, start, count, stored)
        self._uncast(record, stored, out)

    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> np.ndarray:
        """Rows `[start, start + count)` of `name` into the flat uint8 `buffer` (read at once: the converter's
        pipeline already runs this on its reader thread); returns the view holding them."""
        layout = self.manifest.tensors[name].layout
        row = math.prod(layout.shape[1:]) * layout.source_dtype.itemsize
        view = buffer[: count * row if layout.shape else layout.source_dtype.itemsize]
        self.read_rows(name, start, count, view)
        return view

    def finish_band(self, band: np.ndarray) -> np.ndarray:
        return band

    def file_of(self, name: str) -> str:
        """The original source file the tensor came from (the converter spreads source-file work by it)."""
        return self._source_file.get(name, "")

    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]:
        """Nothing to report: the output manifest's source record is the original source's, not these files."""
        return {}

    def take_proofs(self) -> dict[str, str]:
        """What each tensor read since the last call came from: the input manifest's digest, which fixes every
        chunk's bytes (each is checked against its xxh3_64 as it is read), so it proves the rows to a resume."""
        with self._lock:
            names, self._read_names = self._read_names, set()
        return dict.fromkeys(names, self.manifest.digest)

    def prove(self, kept: list[tuple[str, str | None]], check_stop=None) -> int:
        """How many leading journalled tensors came from this very input (the same manifest digest)."""
        for index, (_, recorded) in enumerate(kept):
            if recorded != self.manifest.digest:
                return index
        return len(kept)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    # -- assembling rows

    def _read_stored(self, record: TensorRecord, start: int, count: int, out: np.ndarray) -> None:
        """Rows `[start, start + count)` in the stored dtype, into the flat uint8 `out`."""
        layout = record.layout
        item = layout.dtype.itemsize
        for index, c in enumerate(record.chunks):
            if c.data_length == 0:
                self._check_empty(record, index, c)
        if not layout.shape:  # a 0-dim tensor: one replicated chunk of one element
            self._read_chunk(record, 0, 0, byte_view(out))
            return
        if layout.shard_dim == 1:
            cols = layout.shape[1]
            rows = out.reshape(count, cols * item) if count * cols else None
            for index, c in enumerate(record.chunks):
                width = c.sizes[1] * item
                if not width or rows is None:
                    continue
                at = start * width
                if c.sizes[1] == cols:  # a single chunk of all columns (tp=1): already in place
                    self._read_chunk(record, index, at, byte_view(out))
                    continue
                scratch = self._scratch("columns", count * width)
                self._read_chunk(record, index, at, byte_view(scratch))
                col = c.offsets[1] * item
                # numpy: single-threaded, GIL released (torch's strided copy took several times the CPU)
                np.copyto(rows[:, col : col + width], scratch.reshape(count, width))
            return
        row_bytes = math.prod(layout.shape[1:]) * item
        view = byte_view(out)
        for index, c in enumerate(record.chunks):  # row runs: replicated (one chunk) or split on dim 0
            first = c.offsets[0] if layout.shard_dim == 0 else 0
            lo, hi = max(start, first), min(start + count, first + c.sizes[0])
            if hi > lo and row_bytes:
                into = view[(lo - start) * row_bytes : (hi - start) * row_bytes]
                self._read_chunk(record, index, (lo - first) * row_bytes, into)

    def _read_chunk(self, record: TensorRecord, index: int, at: int, view: memoryview) -> None:
        """Read `len(view)` data bytes of chunk `index` from data byte `at`, checking framing and hash on the way."""
        c = record.chunks[index]
        fd = self.fds[c.file]
        end = at + len(view)
        if end > c.data_length:
            raise CorruptCheckpointError(f"{self._where(c)}: a read past its data ({end} > {c.data_length} bytes)")
        key = (c.tensor, index)
        with self._lock:
            state = self._states.get(key)
            if state is None or (at == 0 and state.read >= c.data_length):
                state = self._states[key] = _ChunkRead()
        header = bytearray(len(c.framing.header)) if at == 0 else None
        trailer = bytearray(len(c.framing.trailer)) if end == c.data_length else None
        buffers = [b for b in (header, view, trailer) if b is not None]
        pread_into(fd, c.offset if header is not None else c.data_offset + at, buffers, f"{self._name}/{c.file}")
        if header is not None and header != c.framing.header:
            raise self._framing_error(c)
        if trailer is not None and trailer != c.framing.trailer:
            raise self._framing_error(c)
        with self._lock:
            if state.in_order and at == state.position:
                state.digest.update(view)
                state.position = end
            else:
                state.in_order = False
            state.read += len(view)
            complete = state.read >= c.data_length and not state.checked
            if complete:
                state.checked = True
        if complete:
            digest = state.digest.hexdigest() if state.in_order else self._hash_chunk(c)
            if digest != c.xxh3_64:
                raise ChecksumMismatch(
                    f"{self._where(c)} fails its xxh3_64 checksum: the checkpoint is damaged; nothing was written "
                    f"from it (run preshard verify {self._name} to see all damage; restore it, or convert again)"
                )

    def _check_empty(self, record: TensorRecord, index: int, c: ChunkRecord) -> None:
        """A chunk without data bytes: its framing (and the hash of nothing) still has to match."""
        key = (c.tensor, index)
        if key in self._states:
            return
        framing = bytearray(c.framing.length)
        pread_into(self.fds[c.file], c.offset, [framing], f"{self._name}/{c.file}")
        if framing != c.framing.header + c.framing.trailer:
            raise self._framing_error(c)
        if xxhash.xxh3_64_hexdigest(b"") != c.xxh3_64:
            raise ChecksumMismatch(f"{self._where(c)} fails its xxh3_64 checksum: the checkpoint is damaged")
        with self._lock:
            self._states[key] = _ChunkRead(checked=True)

    def _hash_chunk(self, c: ChunkRecord) -> str:
        """A chunk's xxh3_64 in a separate pass (its data was not read front to back)."""
        digest = xxhash.xxh3_64()
        buffer = bytearray(min(HASH_BLOCK, c.data_length))
        for offset in range(0, c.data_length, HASH_BLOCK):
            view = memoryview(buffer)[: min(HASH_BLOCK, c.data_length - offset)]
            pread_into(self.fds[c.file], c.data_offset + offset, [view], f"{self._name}/{c.file}")
            digest.update(view)
        return digest.hexdigest()

    def _uncast(self, record: TensorRecord, stored: np.ndarray, out: np.ndarray) -> None:
        """Stored-dtype bytes back to the source dtype, checking that the input's cast gives the stored bytes again
        (with torch, imported then: only a cast checkpoint needs it)."""
        import torch

        layout = record.layout
        src = torch.from_numpy(stored).view(layout.dtype.torch)
        dst = torch.from_numpy(out).view(layout.source_dtype.torch)
        scratch = self._scratch("recast", min(src.numel(), CAST_CHECK_ELEMS) * layout.dtype.itemsize)
        back = torch.from_numpy(scratch).view(layout.dtype.torch)
        for lo in range(0, src.numel(), CAST_CHECK_ELEMS):
            hi = min(lo + CAST_CHECK_ELEMS, src.numel())
            dst[lo:hi].copy_(src[lo:hi])
            again = back[: hi - lo]
            again.copy_(dst[lo:hi])
            if not torch.equal(again.view(torch.uint8), src[lo:hi].view(torch.uint8)):
                raise CorruptCheckpointError(
                    f"{self._name}: tensor {layout.name} holds {layout.dtype} values that no cast from its source "
                    f"dtype {layout.source_dtype} gives; the checkpoint is damaged: restore it, or convert again"
                )

    def _scratch(self, purpose: str, nbytes: int) -> np.ndarray:
        """A per-thread reusable byte buffer of at least `nbytes` (grown, never shrunk below the largest band)."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        buf = buffers.get(purpose)
        if buf is None or buf.size < nbytes:
            buffers.pop(purpose, None)
            buf = buffers[purpose] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes]

    @property
    def _name(self) -> str:
        return self.source.given

    def _where(self, c: ChunkRecord) -> str:
        return f"{self._name}: tensor {c.tensor}: {describe_chunk(c)} in {c.file}"

    def _framing_error(self, c: ChunkRecord) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self._where(c)}: its torch.save record framing is damaged; the checkpoint is damaged (run preshard "
            f"verify {self._name}; restore it, or convert again)"
        )


def checkpoint_files(manifest: Manifest) -> list[str]:
    """Every file of a converted checkpoint: manifest, DCP metadata, config.json, the data files."""
    names = [MANIFEST_NAME, DCP_METADATA_NAME]
    if manifest.config is not None:
        names.append(manifest.config.name)
    return names + [f.name for f in manifest.files]


def open_presharded(
    checkpoint: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> PreshardedSource:
    """A converted checkpoint from a local folder or, when no such path exists, a Hub repo id.

    From the Hub, `manifest.json` is fetched first, then every file it names (the whole checkpoint: resharding
    and unsharding read every chunk), all from the same commit, into huggingface_hub's cache.

    Raises:
        CorruptCheckpointError: not a complete, intact checkpoint. SourceError: a Hub repo that cannot be fetched.
    """
    path = local_path(checkpoint, subfolder, revision)
    if path is not None:
        return PreshardedSource(path, given=str(checkpoint))
    from preshard.sources import hub

    if isinstance(checkpoint, str) and hub.is_repo_id(checkpoint):
        first = hub.download_files(checkpoint, [MANIFEST_NAME], revision=revision, token=token, subfolder=subfolder)
        manifest = read_manifest(first.folder)
        snapshot = hub.download_files(
            checkpoint, checkpoint_files(manifest), revision=first.commit, token=token, subfolder=subfolder
        )
        return PreshardedSource(snapshot.folder, given=checkpoint, manifest=manifest)
    raise CheckpointNotFoundError(
        f"checkpoint {checkpoint} does not exist; pass a folder convert-checkpoint wrote, or a Hub repo id (org/name)"
    )


__all__ = ["PreshardedRows", "PreshardedSource", "checkpoint_files", "open_presharded"]
