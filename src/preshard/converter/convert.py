"""convert_checkpoint: a source checkpoint -> per-TP-rank DCP shards + manifest, atomically and resumably.

The whole output layout (every record's file and offset) is derived from the plan and the source headers
before anything is written (`preshard.format.layout`). Then the source is read once, front to back, in
bands; each band is cut into the pieces of its chunks (`slicer`) and appended to the rank files
(`writer`), which hash what they write. The working folder, lock, journal and commit are `workdir`'s.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from preshard.converter.signals import StopFlag, deferred_signals
from preshard.converter.workdir import (
    Journal,
    OutputLock,
    check_output,
    commit,
    open_workdir,
    partial_dir,
    read_journal,
)
from preshard.converter.writer import RecordFileWriter
from preshard.errors import CorruptCheckpointError, OutputError, SourceError, UsageError
from preshard.format.dcp_metadata import write_dcp_metadata
from preshard.format.dtypes import dtype_name, parse_cast
from preshard.format.fileio import byte_view
from preshard.format.jsonio import fsync_file, write_json_atomic
from preshard.format.layout import ChunkRecord, FileLayout, TensorLayout, data_file_name, place_records
from preshard.format.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    Source,
    SourceFile,
    TensorRecord,
    file_digest,
)
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan, resolve_plan
from preshard.format.slicing import BufferPool, tensor_pieces
from preshard.format.torch_record import RECORD_FRAMING_VERSION
from preshard.plans.from_model import check_plan_against_model
from preshard.plans.registry import choose_plan
from preshard.progress import Progress
from preshard.sources import CheckpointSource, open_source
from preshard.sources.reader import SourceReader

# Journal (so fsync) about 64 times per conversion, at least every 16 MiB: a crash loses at most that much.
SYNC_MIN_BYTES, SYNC_ROUNDS = 16 << 20, 64
# Tests replace this to act between tensors (e.g. to crash there); never used otherwise.
_after_tensor_hook = None


def resolve_mesh(
    mesh: MeshSpec | None,
    tp: int | None,
    cp: int | None,
    ring: int | None,
    ulysses: int | None,
    order: str | tuple[str, ...] | None,
    default: MeshSpec | None = None,
) -> MeshSpec:
    """A `MeshSpec` or the keywords, not both; with neither, `default` (or tp is required)."""
    keywords = (tp, cp, ring, ulysses, order)
    if mesh is not None:
        if any(k is not None for k in keywords):
            raise UsageError("pass either mesh=MeshSpec(...) or tp/cp/ring/ulysses/order, not both")
        if not isinstance(mesh, MeshSpec):
            raise UsageError(f"mesh must be a preshard.MeshSpec, not {type(mesh).__name__}")
        return mesh
    if tp is None and default is None:
        raise UsageError("the TP degree is required: pass --tp N (or tp=N / mesh=MeshSpec(tp=N, ...))")
    return MeshSpec.build(tp, cp, ring, ulysses, order, default=default)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything decided before writing: source, plan, mesh, cast, every tensor's layout and every record's place."""

    source: CheckpointSource
    plan: Plan
    mesh: MeshSpec
    cast: torch.dtype | None
    layouts: dict[str, TensorLayout]
    files: FileLayout
    write_order: list[str]

    @property
    def output_bytes(self) -> int:
        return sum(self.files.file_sizes)


def plan_conversion(
    source: str | Path | CheckpointSource,
    *,
    mesh: MeshSpec,
    plan: str | Path | Plan | None = None,
    dtype: str | torch.dtype | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> ConversionPlan:
    """Resolve source, plan, mesh and layout without writing anything (what a dry run shows)."""
    cast = parse_cast(dtype)
    if isinstance(source, CheckpointSource):
        src = source
    else:
        src = open_source(source, subfolder=subfolder, revision=revision, token=token)
    chosen = choose_plan(plan, src.config)
    shapes = {name: (entry.shape, entry.dtype) for name, entry in src.tensors.items()}
    layouts = resolve_plan(chosen, shapes, mesh.tp, cast=cast, config=src.config or {})
    check_plan_against_model(chosen, src.config, mesh.tp)
    order = [entry.name for entry in src.in_file_order()]
    files = place_records([layouts[name] for name in order], mesh.tp)
    return ConversionPlan(src, chosen, mesh, cast, layouts, files, order)


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    plan: str | Path | Plan | None = None,
    dtype: str | torch.dtype | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
) -> Manifest:
    """Convert a safetensors checkpoint into per-TP-rank DCP shards and a manifest, in `output`.

    Args:
        source: a `.safetensors` file, a diffusers weights folder (with or without `*.safetensors.index.json`),
            or a Hugging Face Hub repo id (a local path of the same spelling wins).
        output: the folder to create. Written atomically: it appears complete or not at all.
        mesh: the TP x CP mesh; or give `tp` (required) and `cp` (= Ulysses degree) or `ring`/`ulysses`, `order`.
        plan: a built-in plan name, a plan JSON file, or a `Plan`; default: from config.json's `_class_name`
            (a built-in plan, else the diffusers class's own `_tp_plan`).
        dtype: cast 16/32/64-bit floating tensors to bf16/fp16/fp32 (a string or torch dtype); default: keep each.
        subfolder, revision, token: for Hub repos (`subfolder` also for a local folder).
        overwrite: replace an existing `output`.
        wait: wait for another conversion into the same `output` to finish instead of failing at once.
        progress: show progress (default: when stderr is a terminal).

    Returns:
        The manifest written to `output/manifest.json`.

    Raises:
        UsageError: a bad mesh or dtype. SourceError: a missing, malformed or changing source.
        PlanError: a plan that does not fit the checkpoint or the TP degree. OutputError: an output that
        cannot be written (exists, locked, too little disk space). Interrupted: SIGINT/SIGTERM (the finished
        part is kept for a resume).
    """
    mesh = resolve_mesh(mesh, tp, cp, ring, ulysses, order)
    job = plan_conversion(
        source, mesh=mesh, plan=plan, dtype=dtype, subfolder=subfolder, revision=revision, token=token
    )
    output = Path(output)
    check_output(output, [h.path for h in job.source.files], overwrite)
    with OutputLock(output, wait=wait), deferred_signals() as stop:
        check_output(output, [h.path for h in job.source.files], overwrite)  # again, now that we hold the lock
        return _convert_locked(job, output, stop, progress)


def _job_key(job: ConversionPlan) -> str:
    """What must match for a partial conversion to be resumed (cheap: sizes, mtimes, headers, plan, mesh)."""
    h = hashlib.sha256()
    for header in job.source.files:
        stat = header.path.stat()
        h.update(f"{header.path.name}:{stat.st_size}:{stat.st_mtime_ns}:{header.text}".encode())
    h.update(json.dumps(job.plan.to_dict(), sort_keys=True).encode())
    h.update(f"tp={job.mesh.tp}:cast={job.cast}:records={RECORD_FRAMING_VERSION}".encode())
    return h.hexdigest()


def _fingerprint(src: CheckpointSource) -> dict[Path, tuple[int, int, str]]:
    return {h.path: (h.path.stat().st_size, h.path.stat().st_mtime_ns, h.text) for h in src.files}


def _check_source_unchanged(src: CheckpointSource, before: dict[Path, tuple[int, int, str]]) -> None:
    """The source files are still what was read: same size, mtime and header (else the output would mix versions)."""
    from preshard.sources.safetensors_file import read_header

    for path, (size, mtime, text) in before.items():
        try:
            stat = path.stat()
            same = (stat.st_size, stat.st_mtime_ns) == (size, mtime) and read_header(path).text == text
        except (OSError, SourceError):
            same = False
        if not same:
            raise SourceError(
                f"source file {path.name} changed while it was being converted; nothing was committed: re-run the "
                "command once the source is no longer being written"
            )


def _check_space(output: Path, work: Path, needed: int) -> None:
    """Refuse up front when the output's file system cannot hold the conversion."""
    present = sum(f.stat().st_size for f in work.glob("*.distcp")) if work.is_dir() else 0
    stat = os.statvfs(output.parent)
    free = stat.f_bavail * stat.f_frsize
    missing = needed - present
    if missing > free:
        from preshard.units import human_bytes

        raise OutputError(
            f"the conversion needs {human_bytes(missing)} more on the file system of {output.parent}, which has "
            f"{human_bytes(free)} free; free space or write elsewhere"
        )


def _convert_locked(job: ConversionPlan, output: Path, stop: StopFlag, progress: bool | None) -> Manifest:
    src = job.source
    work = partial_dir(output)
    config_bytes = src.config_path.read_bytes() if src.config_path is not None else None
    _check_space(output, work, job.output_bytes + len(config_bytes or b"") + (1 << 20))
    fingerprint = _fingerprint(src)
    resuming = open_workdir(work, _job_key(job))
    done, writers = _resume(work, job) if resuming else ({}, _open_writers(work, job, {}))
    reader = SourceReader(src)
    bar = Progress(job.output_bytes, "converting", progress, initial=sum(_bytes_of(job, done)))
    try:
        records = _write_tensors(job, work, reader, writers, done, stop, bar)
        checksums = [writers[r].close() for r in range(job.mesh.tp)]
        source_hashes = {h.path.name: reader.file_hash(h.path) for h in src.files}
    finally:
        bar.close()
        reader.close()
        for w in writers.values():
            w.abandon()
    stop.check()
    _check_source_unchanged(src, fingerprint)
    manifest = _manifest(job, records, checksums, source_hashes, config_bytes)
    if config_bytes is not None:
        (work / CONFIG_NAME).write_bytes(config_bytes)
        fsync_file(work / CONFIG_NAME)
    write_dcp_metadata(work, manifest)
    for name in ("journal.jsonl", "job.json"):
        (work / name).unlink(missing_ok=True)
    write_json_atomic(work / MANIFEST_NAME, manifest.to_dict())
    stop.check()
    commit(work, output)
    return manifest


def _bytes_of(job: ConversionPlan, done: dict[str, list[ChunkRecord]]):
    for chunks in done.values():
        for c in chunks:
            yield c.framing.length


def _open_writers(work: Path, job: ConversionPlan, done: dict[str, list[ChunkRecord]]) -> dict[int, RecordFileWriter]:
    """One writer per rank file, each adopting (and re-checking) the records of `done`."""
    writers = {r: RecordFileWriter(work / data_file_name(r)) for r in range(job.mesh.tp)}
    kept: dict[str, list[ChunkRecord]] = {data_file_name(r): [] for r in range(job.mesh.tp)}
    for chunks in done.values():
        for c in chunks:
            kept[c.file].append(c)
    try:
        for r, writer in writers.items():
            writer.keep(sorted(kept[data_file_name(r)], key=lambda c: c.offset))
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    return writers


def _resume(work: Path, job: ConversionPlan) -> tuple[dict[str, list[ChunkRecord]], dict[int, RecordFileWriter]]:
    """The journalled tensors that are still intact (a prefix of the write order), and writers positioned after them."""
    entries = read_journal(work)
    done: dict[str, list[ChunkRecord]] = {}
    for name, entry in zip(job.write_order, entries):
        planned = job.files.chunks[name]
        sums = entry.get("chunks")
        if entry.get("tensor") != name or not isinstance(sums, list) or len(sums) != len(planned):
            break
        if not all(isinstance(s, str) for s in sums):
            break
        done[name] = [
            ChunkRecord(c.tensor, c.owner, c.box, c.file, c.offset, c.framing, s) for c, s in zip(planned, sums)
        ]
    while True:
        try:
            return done, _open_writers(work, job, done)
        except CorruptCheckpointError as exc:
            # Keep only the tensors written before the damaged one, and redo the rest.
            damaged = next((n for n in done if f" {n} " in f" {exc} "), None)
            names = list(done)
            cut = names.index(damaged) if damaged in names else max(0, len(names) - 1)
            done = {n: done[n] for n in names[:cut]}


def _write_tensors(
    job: ConversionPlan,
    work: Path,
    reader: SourceReader,
    writers: dict[int, RecordFileWriter],
    done: dict[str, list[ChunkRecord]],
    stop: StopFlag,
    bar: Progress,
) -> dict[str, list[ChunkRecord]]:
    records = dict(done)
    journal = Journal(work, keep_lines=len(done))
    by_file = {data_file_name(r): writers[r] for r in writers}
    pool = BufferPool()
    pending: list[dict] = []
    unsynced = 0
    try:
        for name in job.write_order:
            if name in records:
                continue
            layout = job.layouts[name]
            entry = job.source.tensors[name]
            planned = job.files.chunks[name]
            written: dict[int, ChunkRecord] = {}

            def read_rows(start: int, count: int, out: torch.Tensor, entry=entry) -> None:
                offset = entry.start + start * entry.row_bytes
                reader.read_into(entry, offset, out)

            for pieces in tensor_pieces(layout, planned, read_rows, pool):
                for piece in pieces:
                    writer = by_file[piece.chunk.file]
                    if piece.first:
                        writer.begin(piece.chunk)
                    writer.write(byte_view(piece.data))
                    if piece.last:
                        written[id(piece.chunk)] = writer.end()
                        bar.update(piece.chunk.framing.length)
                stop.check()
            records[name] = [written[id(c)] for c in planned]
            pending.append({"tensor": name, "chunks": [c.xxh3_64 for c in records[name]]})
            unsynced += layout.nbytes
            if unsynced >= max(SYNC_MIN_BYTES, job.output_bytes // SYNC_ROUNDS):
                _sync(writers, journal, pending)
                unsynced = 0
            if _after_tensor_hook is not None:
                _after_tensor_hook(name)
        _sync(writers, journal, pending)
    finally:
        journal.close()
    return records


def _sync(writers: dict[int, RecordFileWriter], journal: Journal, pending: list[dict]) -> None:
    """Make the written records durable, then claim them in the journal."""
    for writer in writers.values():
        writer.sync()
    journal.append(pending)
    pending.clear()


def _manifest(
    job: ConversionPlan,
    records: dict[str, list[ChunkRecord]],
    checksums: list[str],
    source_hashes: dict[str, str],
    config_bytes: bytes | None,
) -> Manifest:
    from preshard import __version__

    src = job.source
    hub = src.hub
    source = Source(
        kind=src.kind,
        path=src.given or str(src.path),
        files=tuple(SourceFile(h.path.name, h.size, source_hashes[h.path.name], h.text) for h in src.files),
        index_name=src.index_name,
        index_text=src.index_text,
        repo_id=getattr(hub, "repo_id", None),
        subfolder=getattr(hub, "subfolder", None),
        revision=getattr(hub, "revision", None),
        commit=getattr(hub, "commit", None),
    )
    config = None
    if config_bytes is not None:
        digest = file_digest()
        digest.update(config_bytes)
        config = FileRecord(CONFIG_NAME, len(config_bytes), digest.hexdigest())
    tensors = {name: TensorRecord(job.layouts[name], tuple(records[name])) for name in sorted(records)}
    files = tuple(FileRecord(data_file_name(r), job.files.file_sizes[r], checksums[r]) for r in range(job.mesh.tp))
    return Manifest(
        source=source,
        mesh=job.mesh,
        plan=job.plan,
        tensors=tensors,
        files=files,
        config=config,
        dtype=job.cast,
        preshard_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    ).sealed()


__all__ = ["ConversionPlan", "convert_checkpoint", "dtype_name", "plan_conversion", "resolve_mesh"]
