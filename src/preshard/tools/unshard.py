"""`preshard unshard IN OUT`: the original safetensors checkpoint, rebuilt from a converted one.

Why: the chunks hold every byte of the source tensors, and the manifest records each source file's name,
size, xxh3_128 and exact header text, the safetensors index and config.json. So the source can be rebuilt in
its own layout, byte for byte, without keeping it: the same file names, each file's header as it was (tensor
order and offsets, `__metadata__`, padding), the index, `config.json`. Tensors are streamed band by band from
the chunks (`preshard.sources.presharded`, which checks every chunk's framing and checksum), so memory is
one band, not a tensor.

Nothing is trusted to have worked: every rebuilt file's size and xxh3_128 must equal the source's recorded
ones before the output is committed (atomically: a hidden partial folder renamed into place).

A `--dtype` cast is undone only where it lost nothing (a widening, e.g. bf16 stored as fp32: the stored value
is the source value). A narrowing cast (fp32 stored as bf16) rounded the weights, so the source cannot be
rebuilt: unshard refuses, naming the cast and a tensor it rounded. (Writing the cast tensors into new
safetensors files instead would give a different checkpoint under the source's name; convert the original
again, or load the converted checkpoint as it is.)
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from preshard.converter.workdir import SAFETENSORS_FOLDER, check_space, commit, fresh_workdir
from preshard.errors import CorruptCheckpointError, UsageError
from preshard.format.dtypes import cast_is_lossless, dtype_name
from preshard.format.fileio import byte_view
from preshard.format.jsonio import fsync_dir
from preshard.format.manifest import file_digest
from preshard.format.slicing import BAND_BYTES
from preshard.progress import Progress
from preshard.sources.presharded import PreshardedRows, PreshardedSource, open_presharded
from preshard.sources.safetensors_file import SafetensorsHeader
from preshard.units import plural


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
            for header, record in zip(headers, source.manifest.source.files):
                _write_file(work / record.name, header, record.size, record.xxh3_128, reader, bar, stop)
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


def _write_file(
    path: Path, header: SafetensorsHeader, size: int, xxh3_128: str, reader: PreshardedRows, bar: Progress, stop
) -> None:
    """One safetensors file: its recorded header, then every tensor in offset order, band by band; then check it."""
    raw_header = header.text.encode("utf-8")
    digest = file_digest()
    written = 0
    with open(path, "wb") as f:

        def put(data) -> None:
            nonlocal written
            f.write(data)
            digest.update(data)
            written += len(data)

        put(struct.pack("<Q", len(raw_header)) + raw_header)
        buffer = torch.empty(0, dtype=torch.uint8)
        for entry in sorted(header.tensors.values(), key=lambda t: t.start):
            rows = entry.shape[0] if entry.shape else 1
            row_bytes = entry.row_bytes if entry.shape else entry.nbytes
            if not entry.nbytes:
                continue
            step = max(1, BAND_BYTES // max(1, row_bytes))
            for start in range(0, rows, step):
                count = min(step, rows - start)
                if buffer.numel() < count * row_bytes:
                    buffer = torch.empty(count * row_bytes, dtype=torch.uint8)
                out = buffer[: count * row_bytes]
                reader.read_rows(entry.name, start, count, out)
                put(byte_view(out))
                bar.update(out.numel())
                stop.check()
        f.flush()
        os.fsync(f.fileno())
    if written != size or digest.hexdigest() != xxh3_128:
        raise CorruptCheckpointError(
            f"the rebuilt {path.name} ({written} bytes) differs from the source file the checkpoint was converted "
            f"from ({size} bytes, recorded xxh3_128); nothing was written: run preshard verify on the checkpoint"
        )


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


__all__ = ["unshard_checkpoint"]
