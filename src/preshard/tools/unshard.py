"""`preshard unshard IN OUT`: the original safetensors checkpoint, rebuilt from a converted one.

Why: the chunks hold every byte of the source tensors, and the manifest records each source file's name,
size, xxh3_128 and exact header text, the safetensors index and config.json. So the source can be rebuilt in
its own layout, byte for byte, without keeping it: the same file names, each file's header as it was (tensor
order and offsets, `__metadata__`, padding), the index, `config.json`. Tensors are streamed band by band from
the chunks (`preshard.sources.presharded`, which checks every chunk's framing and checksum), so memory is
one band, not a tensor.

Nothing is trusted to have worked: every rebuilt file's size and xxh3_128 must equal the source's recorded
ones before the output is committed (atomically: a hidden partial folder renamed into place).

At disk speed: the files are rebuilt in parallel (one thread each, `FILE_THREADS` at once), and in each file a
reader thread assembles the next bands while the file's thread hashes and writes the last one, through the
converter's own writer (a page-aligned stage written with `O_DIRECT` where the file system takes it: writing
through the page cache cost more CPU than everything else unshard does). Assembling a band is a positional
read per chunk, plus one strided copy per chunk for a column split: no work per row in Python.

A `--dtype` cast is undone only where it lost nothing (a widening, e.g. bf16 stored as fp32: the stored value
is the source value). A narrowing cast (fp32 stored as bf16) rounded the weights, so the source cannot be
rebuilt: unshard refuses, naming the cast and a tensor it rounded. (Writing the cast tensors into new
safetensors files instead would give a different checkpoint under the source's name; convert the original
again, or load the converted checkpoint as it is.)
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from preshard.converter.workdir import SAFETENSORS_FOLDER, check_output, check_space, commit, fresh_workdir
from preshard.converter.writer import RecordFileWriter, stage_bytes
from preshard.errors import CorruptCheckpointError, UsageError
from preshard.format.dtypes import cast_is_lossless, dtype_name
from preshard.format.publish import fsync_dir
from preshard.progress import Progress
from preshard.sources.presharded import PreshardedRows, PreshardedSource, open_presharded
from preshard.sources.safetensors_file import SafetensorsHeader
from preshard.tools.dry_run import WriteDryRun, disk_space, probe_rates
from preshard.tools.estimate import Work, estimate, input_cached
from preshard.units import plural

FILE_THREADS = 4  # files rebuilt at once
BAND_BYTES = 16 << 20  # rows assembled at a time; each file holds READ_AHEAD + 1 bands
READ_AHEAD = 2
POLL_S = 0.1


def unshard_checkpoint(
    input: str | Path,
    output: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
) -> list[Path]:
    """Rebuild the source checkpoint `input` was converted from, bit for bit, in the folder `output`.

    Args:
        input: a converted (or resharded) checkpoint folder, or a Hub repo id of one.
        output: the folder to create, atomically: the source's safetensors files (same names and headers),
            its `*.safetensors.index.json` if it had one, and `config.json`.
        subfolder, revision, token: for a Hub repo.
        overwrite: replace an existing `output` if it is what this command writes (any other folder is refused).
        wait: wait for another run writing `output` to finish instead of failing at once.
        progress: show progress (default: when stderr is a terminal).

    Returns:
        The files written, inside `output`.

    Raises:
        UsageError: the checkpoint was converted with a `--dtype` cast that lost precision.
        CorruptCheckpointError / ChecksumMismatch: the input is damaged, or a rebuilt file does not match the
            source's recorded hash (nothing is committed).
        OutputError, SourceError, Interrupted: as `convert_checkpoint`.
    """
    source = open_presharded(input, subfolder=subfolder, revision=revision, token=token)
    refuse_quantized_at_conversion(source)  # first: it is why the cast check would also refuse
    refuse_lossy_cast(source)
    refuse_fused_loras(source)
    headers = source.source_headers()
    plan = small_files(source, headers)
    output = Path(output)
    needed = sum(f.size for f in source.manifest.source.files) + sum(len(b) for b in plan.values()) + (1 << 20)
    kind = SAFETENSORS_FOLDER  # --overwrite replaces only a folder of safetensors files
    with fresh_workdir(output, source.input_paths(), overwrite=overwrite, wait=wait, kind=kind) as (work, stop):
        check_space(output, work, needed)
        identity = source.identity()
        reader = source.open_reader()
        bar = Progress(source.total_bytes, "unsharding", progress)
        try:
            _write_files(work, headers, source.manifest.source.files, reader, bar, stop)
        finally:
            bar.close()
            reader.close()
        for name, data in plan.items():
            _write_bytes(work / name, data)
        source.check_unchanged(identity)
        fsync_dir(work)
        stop.check()
        commit(work, output)
    return [output / f.name for f in source.manifest.source.files] + [output / name for name in plan]


def refuse_fused_loras(source: PreshardedSource) -> None:
    """Raises UsageError when `source` has LoRAs fused into its weights (the source cannot be rebuilt)."""
    loras = source.manifest.source.loras
    if loras:
        raise UsageError(
            f"{source.given} was converted with {plural(len(loras), 'LoRA')} fused (--lora {loras[0].name}), "
            f"which changed {plural(len(source.manifest.source.lora_tensors()), 'tensor')}; the source cannot be "
            "rebuilt bit for bit: use the original checkpoint, or a conversion made without --lora"
        )


def refuse_quantized_at_conversion(source: PreshardedSource) -> None:
    """Raises UsageError when `source` was converted with --quantize (its floating weights cannot be rebuilt)."""
    made = source.manifest.quantized_at_conversion()
    if made:
        raise UsageError(
            f"{source.given} was quantized at conversion (--quantize, {plural(len(made), 'weight')} stored as "
            f"{source.manifest.quantize}): the source's floating weights cannot be rebuilt bit for bit; use the "
            "original checkpoint, or a conversion made without --quantize"
        )


def refuse_lossy_cast(source: PreshardedSource) -> None:
    """Raises UsageError when `source` was converted with a --dtype that lost precision (no bit-for-bit rebuild)."""
    lossy = [
        r.layout
        for r in source.manifest.tensors.values()
        if not cast_is_lossless(r.layout.source_dtype, r.layout.dtype)
    ]
    if lossy:
        first = sorted(lossy, key=lambda layout: layout.name)[0]
        raise UsageError(
            f"{source.given} was converted with --dtype {dtype_name(source.manifest.dtype)}, which lost precision in "
            f"{plural(len(lossy), 'tensor')} (e.g. {first.name}: {dtype_name(first.source_dtype)} stored as "
            f"{dtype_name(first.dtype)}); the source cannot be rebuilt bit for bit: use the original checkpoint, "
            "or a conversion made without a narrowing --dtype"
        )


def small_files(source: PreshardedSource, headers: list[SafetensorsHeader]) -> dict[str, bytes]:
    """The small files besides the weights (index, config.json), after checking the recorded source fits the chunks.

    Raises:
        CorruptCheckpointError: a file name that is not a plain name or repeats, or headers that do not describe
            exactly the checkpoint's tensors with their shapes and source dtypes.
    """
    manifest = source.manifest
    small: dict[str, bytes] = {}
    if manifest.source.index_name is not None:
        small[manifest.source.index_name] = (manifest.source.index_text or "").encode("utf-8")
    config = source.config_bytes()
    if config is not None and manifest.config is not None:
        small[manifest.config.name] = config
    names = [f.name for f in manifest.source.files] + list(small)
    for name in names:
        if not name or Path(name).name != name or name in (".", ".."):
            raise CorruptCheckpointError(f"{source.given}: the manifest names source file {name!r}, not a plain name")
    if len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{source.given}: the manifest names a source file twice")
    seen: set[str] = set()
    for header in headers:
        for name, entry in header.tensors.items():
            record = manifest.tensors.get(name)
            if record is None or name in seen:
                raise CorruptCheckpointError(
                    f"{source.given}: source file {header.path.name} holds {name}, "
                    + ("twice" if name in seen else "which the checkpoint does not")
                )
            if (entry.shape, entry.dtype) != (record.layout.shape, record.layout.source_dtype):
                raise CorruptCheckpointError(
                    f"{source.given}: tensor {name} is {list(record.layout.shape)} {record.layout.source_dtype} in "
                    f"the checkpoint, {list(entry.shape)} {entry.dtype} in the recorded source header"
                )
            seen.add(name)
    missing = sorted(set(manifest.tensors) - seen)
    if missing:
        raise CorruptCheckpointError(f"{source.given}: tensor {missing[0]} is in no recorded source file")
    return small


class _Stopped(Exception):
    """A file's thread stopped because another failed (or a signal came): not an error of its own."""


def _write_files(work: Path, headers: list[SafetensorsHeader], records, reader: PreshardedRows, bar: Progress, stop):
    """Rebuild every file, in parallel; the calling thread watches for a signal and for a thread's failure (then
    the others stop at their next band). Raises the failure of the first file, in file order, that failed."""
    abort = threading.Event()
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            bar.update(n)

    jobs = list(zip(headers, records))
    threads = max(1, min(len(jobs), FILE_THREADS))
    stage = stage_bytes(threads)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="unshard")
    futures: list[Future] = []
    try:
        for header, record in jobs:
            path = work / record.name
            futures.append(pool.submit(_write_file, path, header, record, reader, progress, abort, stage))
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                break
            stop.check()
    finally:
        abort.set()  # (when all went well, nothing is left to stop)
        pool.shutdown(wait=True, cancel_futures=True)
    for f in futures:  # in file order: the first real failure
        failure = None if f.cancelled() else f.exception()
        if failure is not None and not isinstance(failure, _Stopped):
            raise failure
    stop.check()


def _bands(header: SafetensorsHeader) -> list[tuple[str, int, int, int]]:
    """(tensor, first row, rows, bytes) of every band of the file, in offset order."""
    bands = []
    for entry in sorted(header.tensors.values(), key=lambda t: t.start):
        if not entry.nbytes:
            continue
        rows = entry.shape[0] if entry.shape else 1
        row_bytes = entry.row_bytes if entry.shape else entry.nbytes
        step = max(1, BAND_BYTES // max(1, row_bytes))
        for start in range(0, rows, step):
            count = min(step, rows - start)
            bands.append((entry.name, start, count, count * row_bytes))
    return bands


def _write_file(path: Path, header: SafetensorsHeader, record, reader: PreshardedRows, progress, abort, stage: int):
    """One safetensors file: its recorded header, then every tensor in offset order, band by band (assembled on a
    reader thread, READ_AHEAD bands ahead); then check its size and hash against the source's.

    Raises:
        _Stopped: `abort` was set (another file failed, or a signal came).
        CorruptCheckpointError / ChecksumMismatch: a damaged input, or a rebuilt file that is not the source's.
    """
    bands = _bands(header)
    free: queue.SimpleQueue = queue.SimpleQueue()
    filled: queue.SimpleQueue = queue.SimpleQueue()
    largest = max((b[3] for b in bands), default=0)
    for _ in range(min(READ_AHEAD + 1, len(bands))):
        free.put(np.empty(largest, dtype=np.uint8))
    finished = threading.Event()  # the file's thread is done (or failed): the reader stops

    def read() -> None:
        try:
            for name, start, count, nbytes in bands:
                buffer = None
                while buffer is None:
                    if abort.is_set() or finished.is_set():
                        return
                    try:
                        buffer = free.get(timeout=POLL_S)
                    except queue.Empty:
                        pass
                out = buffer[:nbytes]
                reader.read_rows(name, start, count, out)
                filled.put((buffer, out))
            filled.put(None)
        except BaseException as exc:  # noqa: BLE001 - raised by the file's thread
            filled.put(exc)

    helper = threading.Thread(target=read, name=f"read {path.name}", daemon=True)
    writer = RecordFileWriter(path, stage=stage)
    try:
        raw_header = header.text.encode("utf-8")
        writer.append(struct.pack("<Q", len(raw_header)) + raw_header)
        helper.start()
        while True:
            try:
                item = filled.get(timeout=POLL_S)
            except queue.Empty:
                item = False
            if abort.is_set():
                raise _Stopped()
            if item is False:
                continue
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            buffer, out = item
            writer.append(out)
            free.put(buffer)
            progress(out.size)
        written = writer.position
        digest = writer.close()
    except BaseException:
        writer.abandon()
        raise
    finally:
        finished.set()
        if helper.ident is not None:
            helper.join()
    if written != record.size or digest != record.xxh3_128:
        raise CorruptCheckpointError(
            f"the rebuilt {path.name} ({written} bytes) differs from the source file the checkpoint was converted "
            f"from ({record.size} bytes, recorded xxh3_128); nothing was written: run preshard verify on the checkpoint"
        )


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def unshard_dry_run(
    checkpoint: str | Path,
    output: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    start_seconds: float = 0.0,
) -> WriteDryRun:
    """What `unshard_checkpoint` would write (the source's files, exact sizes), the space and a time estimate.

    Raises:
        As `unshard_checkpoint`, before writing (a lossy cast is refused; too little space is in `space_error`).
    """
    source = open_presharded(checkpoint, subfolder=subfolder, revision=revision, token=token)
    refuse_quantized_at_conversion(source)  # first: it is why the cast check would also refuse
    refuse_lossy_cast(source)
    refuse_fused_loras(source)
    manifest = source.manifest
    extra = [(name, len(data)) for name, data in small_files(source, source.source_headers()).items()]
    output = Path(output)
    check_output(output, source.input_paths(), overwrite, kind=SAFETENSORS_FOLDER)
    files = [(f.name, f.size) for f in manifest.source.files]
    out_bytes = sum(size for _, size in files)
    needed = out_bytes + sum(size for _, size in extra) + (1 << 20)
    free, space_error = disk_space(output, needed)
    inputs = [source.folder / f.name for f in manifest.files]
    work = Work.unshard(sum(f.size for f in manifest.files), input_cached(inputs), out_bytes)
    measured = estimate(work, probe_rates(inputs, output, space_error), start_seconds=start_seconds)
    return WriteDryRun(
        "unshard", str(checkpoint), output, None, files + extra, False, needed, free, space_error, measured
    )


__all__ = ["unshard_checkpoint", "unshard_dry_run"]
