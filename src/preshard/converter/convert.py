"""convert_checkpoint: source checkpoint -> per-TP-rank DCP shards + manifest, atomically and resumably.

Everything is written into a hidden sibling `.<out>.partial/`. A journal there records each finished
tensor; a re-run of the same job checks the recorded chunks against their checksums, keeps what is
intact and redoes the rest. Only when every file is complete, flushed and fsynced, and the manifest
is written last, is the folder renamed into place. A crash at any moment therefore leaves no output
or the previous complete one, never something that loads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from tqdm.auto import tqdm

from preshard.converter.dcp_writer import RankFileWriter, write_dcp_metadata
from preshard.converter.safetensors_file import dtype_from_name, dtype_name
from preshard.converter.slicer import cast_dtype, iter_rank_chunks
from preshard.converter.sources import CheckpointSource, SourceReader, open_source
from preshard.errors import PreshardError
from preshard.manifests.io import write_manifest
from preshard.manifests.schema import (
    CONFIG_NAME,
    ChunkRecord,
    FileRecord,
    Manifest,
    RankRecord,
    SourceFileRecord,
    SourceRecord,
    TensorRecord,
    data_file_name,
)
from preshard.mesh import MeshSpec
from preshard.plans.plan import Plan, load_plan, plan_for_class
from preshard.plans.resolve import TensorPlan, resolve_plan

JOURNAL_NAME = "journal.jsonl"
JOB_NAME = "job.json"
DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}  # fmt: skip


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def parse_dtype(text: str | None) -> torch.dtype | None:
    if text is None:
        return None
    name = DTYPE_ALIASES.get(str(text).lower())
    if name is None:
        raise PreshardError(f"--dtype {text} is not supported; use one of bf16, fp16, fp32")
    return dtype_from_name(name)


def choose_plan(source: CheckpointSource, plan: str | Path | Plan | None) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan is not None:
        return load_plan(plan)
    found = plan_for_class(source.class_name)
    if found is None:
        what = f"model class {source.class_name}" if source.class_name else "this checkpoint (no config.json)"
        raise PreshardError(f"no built-in plan for {what}; pass --plan NAME or --plan plan.json")
    return found


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    tp: int,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    plan: str | Path | Plan | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_tensor_written: Callable[[str], None] | None = None,
) -> Manifest:
    """Convert `source` (a .safetensors file or a diffusers weights folder) into `output`."""
    mesh = MeshSpec.from_cli(tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order)
    cast = parse_dtype(dtype)
    src = open_source(source)
    chosen = choose_plan(src, plan)
    shapes = {n: (e.shape, dtype_name(e.dtype)) for n, e in src.tensors.items()}
    resolved = resolve_plan(chosen, shapes, mesh.tp, src.config)
    output = Path(output)
    _check_output(src, output, overwrite)

    work = partial_dir(output)
    job = _job_key(src, chosen, mesh, cast)
    done = _resume_state(work, job)
    writers = {}
    reader = SourceReader(src)
    try:
        writers = _open_writers(work, mesh.tp, done)
        records = _write_tensors(src, resolved, mesh.tp, cast, reader, writers, work, done, progress, on_tensor_written)
        checksums = {r: w.close() for r, w in writers.items()}
        source_hashes = {h.path.name: reader.file_hash(h.path) for h in src.files}
    finally:
        reader.close()
        for w in writers.values():
            if not w.file.closed:
                w.file.close()
    manifest = _manifest(src, chosen, mesh, cast, records, work, checksums, source_hashes)
    write_dcp_metadata(work, records)
    if src.config_path is not None:
        shutil.copyfile(src.config_path, work / CONFIG_NAME)
        _fsync_file(work / CONFIG_NAME)
    (work / JOURNAL_NAME).unlink(missing_ok=True)
    (work / JOB_NAME).unlink(missing_ok=True)
    write_manifest(work, manifest)
    _fsync_dir(work)
    _commit(work, output)
    return manifest


def _check_output(src: CheckpointSource, output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise PreshardError(f"output {output} is a file; pass a directory path for the converted checkpoint")
    out, source = output.resolve(), src.path.resolve()
    if out == source or out in source.parents or source in out.parents:
        raise PreshardError(f"output {output} overlaps the source {src.path}; write the conversion elsewhere")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise PreshardError(f"output {output} already exists; pass --overwrite to replace it")
    if not output.parent.exists():
        raise PreshardError(f"the parent folder of {output} does not exist; create it first")


def _job_key(src: CheckpointSource, plan: Plan, mesh: MeshSpec, cast: torch.dtype | None) -> str:
    """What must match for a partial conversion to be resumed (cheap: sizes, mtimes, headers)."""
    h = hashlib.sha256()
    for header in src.files:
        stat = header.path.stat()
        h.update(f"{header.path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(header.path, "rb") as f:
            h.update(f.read(header.header_bytes))
    h.update(json.dumps(plan.to_dict(), sort_keys=True).encode())
    h.update(f"tp={mesh.tp}:dtype={cast}".encode())
    return h.hexdigest()


@dataclasses.dataclass
class ResumeState:
    """Tensors an earlier run of the same job finished (chunks re-checked), and the file lengths after them."""

    records: dict[str, TensorRecord] = dataclasses.field(default_factory=dict)
    lengths: dict[str, int] = dataclasses.field(default_factory=dict)


def _resume_state(work: Path, job: str) -> ResumeState:
    """What an earlier run of this same job left intact; a partial folder of another job is discarded."""
    done = ResumeState()
    if work.is_dir():
        try:
            same_job = json.loads((work / JOB_NAME).read_text()).get("job") == job
        except (OSError, ValueError, AttributeError):
            same_job = False
        if same_job:
            done = _read_journal(work)
        else:
            shutil.rmtree(work)
    if not work.is_dir():
        work.mkdir()
        (work / JOB_NAME).write_text(json.dumps({"job": job}))
    return done


def _read_journal(work: Path) -> ResumeState:
    from preshard.manifests.io import _build

    done = ResumeState()
    try:
        lines = (work / JOURNAL_NAME).read_text().splitlines()
    except OSError:
        return done
    for line in lines:
        try:
            entry = json.loads(line)
            record = _build(TensorRecord, entry["tensor"], "journal")
        except (ValueError, KeyError, TypeError, PreshardError):
            break  # a line cut short by the crash: everything after it is redone
        if not all(_chunk_intact(work, c) for c in record.chunks):
            break
        done.records[record.name] = record
        done.lengths = entry["files"]
    return done


def _chunk_intact(work: Path, chunk: ChunkRecord) -> bool:
    path = work / chunk.file
    try:
        with open(path, "rb") as f:
            f.seek(chunk.data_offset)
            data = f.read(chunk.data_length)
    except OSError:
        return False
    return len(data) == chunk.data_length and xxhash.xxh3_64_hexdigest(data) == chunk.xxh3_64


def _open_writers(work: Path, tp: int, done: ResumeState) -> dict[int, RankFileWriter]:
    writers = {}
    for r in range(tp):
        path = work / data_file_name(r)
        keep = done.lengths.get(path.name, 0) if path.exists() else 0
        writers[r] = RankFileWriter(path, r, resume_from=keep)
    return writers


def _write_tensors(
    src: CheckpointSource,
    resolved: dict[str, TensorPlan],
    tp: int,
    cast: torch.dtype | None,
    reader: SourceReader,
    writers: dict[int, RankFileWriter],
    work: Path,
    done: ResumeState,
    progress: bool,
    on_tensor_written: Callable[[str], None] | None,
) -> dict[str, TensorRecord]:
    entries = src.in_file_order()
    records: dict[str, TensorRecord] = {}
    # Replicated tensors are stored once; each goes to the rank file that holds the fewest bytes so far.
    load = {r: 0 for r in range(tp)}
    out_bytes = {e.name: e.nbytes * cast_dtype(e.dtype, cast).itemsize // e.dtype.itemsize for e in entries}
    for name in [e.name for e in entries if e.name in done.records]:
        records[name] = done.records[name]
        for c in records[name].chunks:
            load[c.tp_rank if c.tp_rank is not None else _rank_of(c.file, writers)] += c.data_length
    bar = tqdm(
        total=sum(out_bytes.values()), unit="B", unit_scale=True, unit_divisor=1024,
        desc="converting", disable=not progress,
    )  # fmt: skip
    bar.update(sum(out_bytes[n] for n in records))
    try:
        with open(work / JOURNAL_NAME, "a") as journal:
            for entry in entries:
                if entry.name in records:
                    continue
                plan = resolved[entry.name]
                out_dtype = cast_dtype(entry.dtype, cast)
                record = TensorRecord(
                    name=entry.name, style=plan.style.value, shard_dim=plan.shard_dim,
                    blocks=list(plan.blocks) if plan.blocks else None, shape=list(entry.shape),
                    dtype=dtype_name(out_dtype), source_dtype=dtype_name(entry.dtype),
                )  # fmt: skip
                replica_rank = min(load, key=lambda r: (load[r], r))
                for tp_rank, offsets, chunk in iter_rank_chunks(reader, entry, plan, tp, out_dtype):
                    writer = writers[replica_rank if tp_rank is None else tp_rank]
                    record.chunks.append(writer.write_chunk(chunk, offsets, tp_rank))
                    load[writer.tp_rank] += record.chunks[-1].data_length
                    bar.update(record.chunks[-1].data_length)
                    # Drop the chunk before the slicer reads the next one: a loop variable would otherwise
                    # keep the last chunk of this tensor alive while the next tensor is read.
                    del chunk
                records[entry.name] = record
                for w in writers.values():
                    w.flush()
                line = {
                    "tensor": dataclasses.asdict(record),
                    "files": {w.path.name: w.position for w in writers.values()},
                }
                journal.write(json.dumps(line) + "\n")
                journal.flush()
                if on_tensor_written is not None:
                    on_tensor_written(entry.name)
    finally:
        bar.close()
    return records


def _rank_of(file_name: str, writers: dict[int, RankFileWriter]) -> int:
    return next(r for r, w in writers.items() if w.path.name == file_name)


def _manifest(
    src: CheckpointSource,
    plan: Plan,
    mesh: MeshSpec,
    cast: torch.dtype | None,
    records: dict[str, TensorRecord],
    work: Path,
    checksums: dict[int, str],
    source_hashes: dict[str, str],
) -> Manifest:
    from preshard import __version__

    files = [
        FileRecord(name=data_file_name(r), tp_rank=r, size=(work / data_file_name(r)).stat().st_size, xxh3_128=c)
        for r, c in sorted(checksums.items())
    ]
    source = SourceRecord(
        kind=src.kind,
        path=str(src.path),
        files=[SourceFileRecord(h.path.name, h.size, source_hashes[h.path.name]) for h in src.files],
        index=src.extra.get("index"),
    )
    manifest = Manifest(
        source=source,
        mesh=mesh.to_dict(),
        plan=plan.to_dict(),
        tensors={name: records[name] for name in sorted(records)},
        files=files,
        ranks=[],
        config=CONFIG_NAME if src.config_path is not None else None,
        dtype=dtype_name(cast) if cast is not None else None,
        preshard_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    manifest.ranks = [
        RankRecord(rank=rank, coords=mesh.coords(rank), files=manifest.files_for_tp_rank(mesh.coords(rank)["tp"]))
        for rank in range(mesh.world_size)
    ]
    return manifest


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _commit(work: Path, output: Path) -> None:
    """Rename the finished folder into place. An existing output is swapped out atomically where the system
    can (so a crash leaves the old or the new checkpoint at `output`, never neither), else moved aside first;
    either way the old one is then removed."""
    if output.exists() and _exchange(work, output):
        shutil.rmtree(work)  # now the previous output; a crash before this is cleaned up by the next run
    elif output.exists():
        retired = output.parent / f".{output.name}.replaced"
        if retired.exists():
            shutil.rmtree(retired)
        os.rename(output, retired)
        os.rename(work, output)
        shutil.rmtree(retired)
    else:
        os.rename(work, output)
    _fsync_dir(output.parent)
