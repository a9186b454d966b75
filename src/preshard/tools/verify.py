"""Offline verification of a converted checkpoint (`preshard verify OUT [--source SRC]`).

What is checked, each failure one line naming the file and, where there is one, the damaged tensor:

- the manifest parses: its digest, and every fact re-derived from the others (layout coverage, chunk
  ownership, record tiling, styles against the embedded plan; see `preshard.format.manifest`);
- every file is read inside the checkpoint folder, and only if it is a regular file
  (`preshard.format.folder`): a link out of the folder or a FIFO is a problem line, never followed or waited on;
- every data file is present, of the recorded size and whole-file xxh3_128; in the same single pass,
  every chunk's bytes match its xxh3_64 and every record's torch.save framing (header and trailer) is
  byte for byte what the chunk's dtype and shape give, so damage torch's own `dcp.load` would trip on
  is found and named too;
- `.metadata` has the size and hash the manifest records (manifests written before that record: not
  checked), unpickles with torch's DCP classes only (verify never runs code from the checkpoint) and
  describes the same chunks at the same byte ranges;
- `config.json` has the recorded size and hash;
- with a source: its files have the recorded sizes and hashes, and every tensor equals the source bit
  for bit (after the `--dtype` cast the conversion applied), one band of rows in memory at a time.

Why xxh3: it hashes at memory bandwidth where sha256 manages well under 2 GB/s, so checking a 66 GB
checkpoint costs about the time it takes to read it. Corruption is random, not adversarial; a 64-bit
hash per chunk plus a 128-bit hash per file miss it with negligible probability. xxh3 is not
cryptographic: someone who can rewrite the data files can rewrite the manifest's checksums and
digest too. Use a signed sha256 of the manifest if that matters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from preshard.errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestVersionError, UsageError
from preshard.format.dcp_metadata import dcp_metadata_problems
from preshard.format.fileio import byte_view, pread_into
from preshard.format.folder import CheckpointFolder, read_fd
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    Manifest,
    describe_chunk,
    file_digest,
    read_manifest,
)
from preshard.format.slicing import BufferPool, tensor_pieces
from preshard.progress import Progress
from preshard.units import human_bytes, plural

SCAN_BLOCK = 8 << 20
MAX_SHOWN = 20
# What to do about any problem verify finds: the checkpoint's files no longer are what was converted.
FIX = (
    "copy the checkpoint folder again from a good copy (a Hub repo: delete the damaged files from the HF cache), or "
    "convert the source again with --overwrite"
)


def verdict(checkpoint: str, problems: list[str], what: str) -> str:
    """A verification's summary line: OK, or FAILED with the count of problems, what was checked and the fix."""
    if not problems:
        return f"OK {checkpoint}: {what}"
    return f"FAILED {checkpoint}: {plural(len(problems), 'problem')}; checked {what}; {FIX}"


def shown_problems(problems: list[str], limit: int = MAX_SHOWN) -> list[str]:
    """The first `limit` problems, and a line counting the rest."""
    lines = list(problems[:limit])
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more")
    return lines


@dataclass
class VerifyResult:
    """What `verify_checkpoint` found: `problems` (one line each, empty when all is well) and counters."""

    checkpoint: str
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes_hashed: int = 0
    tensors: int = 0
    chunks: int = 0
    damaged_tensors: list[str] = field(default_factory=list)
    source: str | None = None
    source_files: int = 0
    source_tensors: int = 0  # tensors compared with the source bit for bit and found equal
    lora_tensors: int = 0  # tensors a LoRA fused at conversion changed: not compared with the source
    quantize_scales: int = 0  # scales computed at conversion (--quantize): checked by checksum, not against the source

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        self.problems.append(" ".join(problem.split()))

    def damaged(self, tensor: str) -> None:
        if tensor not in self.damaged_tensors:
            self.damaged_tensors.append(tensor)

    def summary(self) -> str:
        what = (
            f"{plural(self.tensors, 'tensor')}, {plural(self.chunks, 'chunk')}, {plural(self.files, 'data file')} "
            f"({human_bytes(self.bytes_hashed)} hashed)"
        )
        if self.source is not None:
            what += f"; {plural(self.source_tensors, 'tensor')} equal to the source bit for bit"
            if self.lora_tensors:
                what += f" ({self.lora_tensors} changed by the LoRAs fused at conversion, not compared)"
            if self.quantize_scales:
                what += f" ({self.quantize_scales} scales computed at conversion, not compared)"
        return verdict(self.checkpoint, self.problems, what)

    def report_lines(self, limit: int = MAX_SHOWN) -> list[str]:
        return shown_problems(self.problems, limit)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint, "ok": self.ok, "problems": list(self.problems),
            "damaged_tensors": list(self.damaged_tensors), "files": self.files, "bytes_hashed": self.bytes_hashed,
            "tensors": self.tensors, "chunks": self.chunks, "source": self.source,
            "source_files": self.source_files, "source_tensors": self.source_tensors,
            "lora_tensors": self.lora_tensors, "quantize_scales": self.quantize_scales,
            "fix": None if self.ok else FIX,
        }  # fmt: skip


def verify_checkpoint(
    checkpoint: str | Path,
    *,
    source: str | Path | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    progress: bool | None = False,
) -> VerifyResult:
    """Check a converted checkpoint's manifest, files, checksums, framing, `.metadata`, config (and the source).

    Args:
        checkpoint: the folder `convert-checkpoint` wrote.
        source: the source checkpoint (local path or Hub repo id) to compare every tensor with, bit for bit.
        subfolder, revision, token: for a Hub source.
        progress: show progress (None: when stderr is a terminal).

    Returns:
        A `VerifyResult`; `result.ok` is False with one line per problem when anything is wrong.

    Raises:
        PreshardError: the checkpoint cannot be verified at all (no such folder, a manifest of a newer
            format), or the source cannot be opened.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; pass the folder convert-checkpoint wrote")
    if not path.is_dir():
        raise UsageError(f"checkpoint {path} is not a folder; pass the folder convert-checkpoint wrote")
    if not (path / MANIFEST_NAME).is_file():
        read_manifest(path)  # raises: not a (complete) preshard checkpoint
    result = VerifyResult(str(path), source=str(source) if source is not None else None)
    try:
        manifest = read_manifest(path)
    except ManifestVersionError:
        raise  # not damage: another format, which this verify cannot judge
    except CorruptCheckpointError as exc:
        result.add(str(exc))
        return result
    src = None
    if source is not None:
        from preshard.sources import open_source

        src = open_source(source, subfolder=subfolder, revision=revision, token=token)
    folder = CheckpointFolder(path)
    result.tensors = len(manifest.tensors)
    result.chunks = sum(len(t.chunks) for t in manifest.tensors.values())
    total = sum(f.size for f in manifest.files) + (src.total_bytes if src is not None else 0)
    bar = Progress(total, "verifying", progress)
    try:
        bad = _check_data_files(folder, manifest, result, bar)
        metadata = _read_small(folder, DCP_METADATA_NAME, result)
        if metadata is not False:
            for problem in dcp_metadata_problems(metadata, manifest):
                result.add(problem)
        _check_config(folder, manifest, result)
        if src is not None:
            _check_source(folder, manifest, src, result, bad, bar)
    finally:
        bar.close()
    return result


def verify_folder(
    checkpoint: str | Path,
    *,
    source: str | Path | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    progress: bool | None = False,
) -> VerifyResult | PipelineVerifyResult:
    """`preshard verify`: a converted pipeline folder (it holds `preshard_pipeline.json` and no manifest) by
    `verify_pipeline`, anything else by `verify_checkpoint` (same arguments).

    Raises:
        UsageError: `source` given for a pipeline folder. As `verify_checkpoint` otherwise.
    """
    path = Path(checkpoint)
    if is_converted_pipeline(path) and not os.path.lexists(path / MANIFEST_NAME):
        if source is not None:
            raise UsageError(
                f"--source compares one checkpoint with its source; {path} is a converted pipeline: verify it without "
                f"--source, or one sharded component with verify {path}/NAME --source SOURCE --subfolder NAME"
            )
        return verify_pipeline(path, progress=progress)
    return verify_checkpoint(
        checkpoint, source=source, subfolder=subfolder, revision=revision, token=token, progress=progress
    )


# ---------------------------------------------------------------------------------------------------------
# Data files: one sequential pass each for the file hash, every chunk's hash and every record's framing


def _check_data_files(folder: CheckpointFolder, manifest: Manifest, result: VerifyResult, bar: Progress) -> set[int]:
    """Returns the ids of the chunks that are damaged or missing (already reported)."""
    by_file: dict[str, list[ChunkRecord]] = {f.name: [] for f in manifest.files}
    for record in manifest.tensors.values():
        for c in record.chunks:
            by_file[c.file].append(c)
    bad: set[int] = set()
    for record in manifest.files:
        chunks = sorted(by_file[record.name], key=lambda c: c.offset)
        fd, why = _open(folder, record.name)
        if fd is None:
            names = _tensor_names(chunks)
            result.add(why or f"data file {record.name} is missing ({plural(len(chunks), 'chunk')} of {names})")
            for c in chunks:
                bad.add(id(c))
                result.damaged(c.tensor)
            continue
        result.files += 1
        try:
            size = os.fstat(fd).st_size
            if size != record.size:
                result.add(
                    f"data file {record.name} is {size} bytes, the manifest says {record.size}: truncated/damaged"
                )
            digest, hashed = _scan(fd, Path(record.name), chunks, size, result, bad, bar)
        except OSError as exc:
            result.add(f"data file {record.name} cannot be read: {exc.strerror or exc}")
            continue
        finally:
            os.close(fd)
        result.bytes_hashed += hashed
        if digest != record.xxh3_128 and size == record.size and not any(id(c) in bad for c in chunks):
            result.add(f"data file {record.name} fails its xxh3_128 checksum although every record in it is intact")
    return bad


def _tensor_names(chunks: list[ChunkRecord], limit: int = 3) -> str:
    names = list(dict.fromkeys(c.tensor for c in chunks))
    if not names:
        return "no tensor"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more tensors" if len(names) > limit else "")


def _open(folder: CheckpointFolder, name: str) -> tuple[int | None, str | None]:
    """(descriptor, None), or (None, why) for a file out of bounds or not regular, or (None, None) if missing."""
    try:
        return folder.open(name), None
    except FileNotFoundError:
        return None, None
    except CorruptCheckpointError as exc:
        return None, str(exc)


def _read_small(folder: CheckpointFolder, name: str, result: VerifyResult) -> bytes | None | bool:
    """The bytes of a small file (None: missing; False: refused, and reported)."""
    fd, why = _open(folder, name)
    if fd is None:
        if why is not None:
            result.add(why)
            return False
        return None
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


def _scan(
    fd: int, path: Path, chunks: list[ChunkRecord], size: int, result: VerifyResult, bad: set[int], bar: Progress
) -> tuple[str, int]:
    """Read the file front to back once: file hash, each record's header, data hash and trailer."""
    digest = file_digest()
    buffer = bytearray(SCAN_BLOCK)
    hashed = 0

    def read(offset: int, length: int, sink) -> bool:
        """Feed `length` bytes at `offset` to the file digest and `sink`; False if the file ends first."""
        nonlocal hashed
        while length:
            view = memoryview(buffer)[: min(length, SCAN_BLOCK)]
            try:
                pread_into(fd, offset, [view], path.name)
            except CorruptCheckpointError:
                return False
            digest.update(view)
            sink(view)
            hashed += len(view)
            bar.update(len(view))
            offset += len(view)
            length -= len(view)
        return True

    for c in chunks:
        where = f"tensor {c.tensor}: {describe_chunk(c)} in {path.name}"
        if c.end > size:
            result.add(f"{where} (bytes {c.offset}..{c.end}) lies past the end of the file ({size} bytes)")
            bad.add(id(c))
            result.damaged(c.tensor)
            continue
        framing = bytearray()
        chunk_hash = xxhash.xxh3_64()
        read(c.offset, len(c.framing.header), framing.extend)
        read(c.data_offset, c.data_length, chunk_hash.update)
        read(c.data_offset + c.data_length, len(c.framing.trailer), framing.extend)
        framing_ok = framing == c.framing.header + c.framing.trailer
        if chunk_hash.hexdigest() != c.xxh3_64:
            result.add(
                f"{where} (bytes {c.data_offset}..{c.data_offset + c.data_length}) fails its xxh3_64 checksum: "
                "the tensor's data is damaged"
            )
        elif not framing_ok:
            result.add(
                f"{where}: its torch.save record framing is damaged (the tensor's bytes are intact, but "
                "torch's dcp.load would fail on the record)"
            )
        else:
            continue
        bad.add(id(c))
        result.damaged(c.tensor)
    end = max((c.end for c in chunks), default=0)
    if size > end:
        read(end, size - end, lambda v: None)
    return digest.hexdigest(), hashed


def _check_config(folder: CheckpointFolder, manifest: Manifest, result: VerifyResult) -> None:
    record = manifest.config
    if record is None:
        return
    raw = _read_small(folder, record.name, result)
    if raw is False:
        return
    if raw is None:
        result.add(f"{record.name} is missing; load_sharded(ModelClass, ...) builds the model from it")
        return
    if not record.matches(raw):
        result.add(f"{record.name} differs from the config the checkpoint was converted with (size or xxh3_128)")


# ---------------------------------------------------------------------------------------------------------
# Source: provenance and bit-for-bit equality


def _check_source(folder: CheckpointFolder, manifest: Manifest, src, result: VerifyResult, bad: set[int], bar) -> None:
    """Every tensor against the source, band by band (read once, in file order, which also yields file hashes)."""
    from preshard.sources.reader import SourceReader

    made = set(manifest.quantized_at_conversion().values())  # --quantize's scales: no source tensor, checksums only
    result.quantize_scales = len(made)
    for name in sorted(set(manifest.tensors) - set(src.tensors) - made):
        result.add(f"tensor {name} is in the checkpoint but not in the source")
    for name in sorted(set(src.tensors) - set(manifest.tensors)):
        result.add(f"tensor {name} is in the source but not in the checkpoint")
    fds: dict[str, int] = {}
    reader = SourceReader(src)
    pool = BufferPool()
    fused = manifest.source.lora_tensors()
    try:
        for f in manifest.files:
            fd, _ = _open(folder, f.name)  # a file refused here was reported with the data files
            if fd is not None:
                fds[f.name] = fd
        for entry in src.in_file_order():
            record = manifest.tensors.get(entry.name)
            layout = record.layout if record is not None else None
            if entry.name in fused:  # read (for the file hash), not compared: a LoRA changed it
                reader.read_into(entry, entry.start, np.empty(entry.nbytes, dtype=np.uint8))
                bar.update(entry.nbytes)
                result.lora_tensors += 1
                continue
            if layout is None or layout.shape != entry.shape or layout.source_dtype != entry.dtype:
                if layout is not None:
                    result.add(
                        f"tensor {entry.name} is {list(layout.shape)} {layout.source_dtype} in the manifest, "
                        f"{list(entry.shape)} {entry.dtype} in the source"
                    )
                reader.read_into(entry, entry.start, np.empty(entry.nbytes, dtype=np.uint8))
                bar.update(entry.nbytes)
                continue

            def read_rows(start: int, count: int, out: np.ndarray, entry=entry) -> None:
                reader.read_into(entry, entry.start + start * entry.row_bytes, out)
                bar.update(out.size)

            equal = True
            position = {id(c): 0 for c in record.chunks}
            for pieces in tensor_pieces(layout, list(record.chunks), read_rows, pool):
                for piece in pieces:
                    c = piece.chunk
                    want = byte_view(piece.data)
                    at = position[id(c)]
                    position[id(c)] += len(want)
                    if id(c) in bad or c.file not in fds:
                        equal = False  # already reported
                        continue
                    stored = bytearray(len(want))
                    pread_into(fds[c.file], c.data_offset + at, [stored], c.file)
                    if stored != want:  # bytearray against memoryview: one memcmp
                        if equal:
                            result.add(f"tensor {c.tensor}: {describe_chunk(c)} in {c.file} differs from the source")
                            result.damaged(c.tensor)
                        equal = False
            result.source_tensors += equal
        _check_source_files(manifest, src, reader, result)
    finally:
        reader.close()
        for fd in fds.values():
            os.close(fd)


def _check_source_files(manifest: Manifest, src, reader, result: VerifyResult) -> None:
    recorded = {f.name: f for f in manifest.source.files}
    actual = {h.path.name: h for h in src.files}
    for name in sorted(set(recorded) - set(actual)):
        result.add(f"source file {name}, recorded in the manifest, is not part of {src.path}")
    for name in sorted(set(actual) - set(recorded)):
        result.add(f"source file {name} is not one the checkpoint was converted from")
    for name in sorted(set(actual) & set(recorded)):
        result.source_files += 1
        if actual[name].size != recorded[name].size:
            result.add(f"source file {name} is {actual[name].size} bytes, the manifest recorded {recorded[name].size}")
        elif reader.file_hash(actual[name].path) != recorded[name].xxh3_128:
            result.add(f"source file {name} has changed since the conversion (its xxh3_128 differs)")


# ---------------------------------------------------------------------------------------------------------
# A converted pipeline folder: its sealed record, every file it lists, each sharded component as a checkpoint


@dataclass
class PipelineVerifyResult:
    """What `verify_pipeline` found: `problems` (one line each, naming the file) and, per component, its checks."""

    checkpoint: str
    problems: list[str] = field(default_factory=list)
    components: dict[str, dict] = field(default_factory=dict)  # name -> {treatment, tp, files, ok, ...}
    files: int = 0
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        self.problems.append(" ".join(problem.split()))

    def summary(self) -> str:
        parts = []
        for name, c in self.components.items():
            what = c["treatment"] + (f" tp={c['tp']}" if c.get("tp") else "")
            parts.append(f"{name} {what}" + ("" if c["ok"] else " (damaged)"))
        what = (
            f"pipeline of {plural(len(self.components), 'component')} ({', '.join(parts)}); "
            f"{plural(self.files, 'file')} of the record ({human_bytes(self.bytes_hashed)} hashed)"
        )
        return verdict(self.checkpoint, self.problems, what)

    def report_lines(self, limit: int = MAX_SHOWN) -> list[str]:
        return shown_problems(self.problems, limit)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint, "kind": "pipeline", "ok": self.ok, "problems": list(self.problems),
            "components": self.components, "files": self.files, "bytes_hashed": self.bytes_hashed,
            "fix": None if self.ok else FIX,
        }  # fmt: skip


def is_converted_pipeline(path: str | Path) -> bool:
    """Whether `path` is a converted pipeline (it holds `preshard_pipeline.json`, readable or not)."""
    from preshard.format.pipeline_record import PIPELINE_RECORD_NAME

    return Path(path).is_dir() and os.path.lexists(Path(path) / PIPELINE_RECORD_NAME)


def verify_pipeline(checkpoint: str | Path, *, progress: bool | None = False) -> PipelineVerifyResult:
    """Check a converted pipeline: the record's seal, every file it lists (size and xxh3_128), no file unlisted in
    a component kept whole, and each sharded component as `verify_checkpoint` does, its manifest the one recorded.

    Args:
        checkpoint: the folder `convert-checkpoint PIPELINE OUT` wrote.
        progress: show progress of each sharded component's check (None: when stderr is a terminal).

    Returns:
        A `PipelineVerifyResult`; `result.ok` is False with one line per problem, naming the file.

    Example:
        >>> verify_pipeline("wan-tp4").ok  # doctest: +SKIP
        True
    """
    from preshard.format.pipeline_files import check_files, unlisted_files, unlisted_problem
    from preshard.format.pipeline_record import PIPELINE_RECORD_NAME, parse_pipeline_record

    path = Path(checkpoint)
    result = PipelineVerifyResult(str(path))
    folder = CheckpointFolder(path)
    try:
        record = parse_pipeline_record(folder.read_bytes(PIPELINE_RECORD_NAME), folder.where(PIPELINE_RECORD_NAME))
    except (CorruptCheckpointError, OSError) as exc:
        result.add(str(exc))
        return result
    by_component: dict[str, list[str]] = {}
    check = check_files(folder, record.files)
    names = unlisted_files(path, record.files, [c.name for c in record.whole()])
    problems = check.problems + [unlisted_problem(folder.where(n), n.split("/")[0]) for n in names]
    for problem in problems:
        result.add(problem)
    result.files, result.bytes_hashed = len(record.files), check.hashed_bytes
    for f in record.files:
        by_component.setdefault(f.name.split("/")[0] if "/" in f.name else "", []).append(f.name)
    for c in record.components.values():
        mine = by_component.get(c.name, [])
        damaged = [p for p in problems if f"{path / c.name}/" in p]
        entry: dict = {"library": c.library, "class": c.class_name, "treatment": c.treatment, "tp": c.tp}
        if c.treatment == "sharded":
            sub = verify_checkpoint(path / c.name, progress=progress)
            for problem in sub.problems:
                result.add(f"component {c.name}: {problem}")
            try:
                digest = read_manifest(path / c.name).digest
            except CorruptCheckpointError:
                digest = None  # reported by its verify
            if digest is not None and digest != c.manifest_digest:
                result.add(
                    f"{path / c.name / MANIFEST_NAME} is not the manifest {PIPELINE_RECORD_NAME} records (digest "
                    f"{digest[:12]}, recorded {c.manifest_digest}): the component was replaced after conversion"
                )
                sub.add("manifest not the one recorded")
            result.bytes_hashed += sub.bytes_hashed
            entry.update(
                ok=sub.ok and not damaged, manifest_digest=c.manifest_digest, tensors=sub.tensors,
                data_files=sub.files, other_files=len(mine),
            )  # fmt: skip
        else:
            entry.update(ok=not damaged, files=len(mine))
        result.components[c.name] = entry
    return result
