"""Offline verification of a converted checkpoint (`preshard verify OUT [--source SRC]`).

What is checked, each failure reported as one line that names the file and, where there is one, the
tensor that is damaged:

- every data file is present, has the recorded size and the recorded whole-file xxh3_128;
- every chunk's bytes match its xxh3_64 (one pass per file computes both hashes), so damage is
  reported against the tensor it hits; damage outside any tensor's bytes (the torch.save framing
  that torch's own `dcp.load` reads) is located by checking each record's zip CRCs;
- coverage, by box arithmetic without allocating anything: every chunk lies inside its tensor, no two
  chunks overlap, their volumes add up to the tensor's element count, each chunk's byte length fits its
  shape and dtype, each TP rank holds exactly the chunks the tensor's style gives it (which is what the
  runtime reader assumes) and the records of each data file tile it;
- `.metadata` exists, unpickles with torch's DCP classes only (a restricted unpickler: verify never
  runs code from the checkpoint) and describes the same chunks at the same byte ranges;
- `config.json` exists and is JSON when the manifest names one;
- with a source: its files have the sizes and hashes the manifest recorded, and every tensor equals
  the source bit for bit (after the `--dtype` cast the conversion applied), one tensor in memory at a
  time.

Why xxh3: it hashes at memory bandwidth (tens of GB/s per core) where sha256 manages well under
2 GB/s, so checking a 66 GB checkpoint costs about the time it takes to read it. Corruption (bit rot,
truncation, a torn copy, a disk that lies) is random, not adversarial, and a 64-bit hash per chunk
plus a 128-bit hash per file miss it with negligible probability. xxh3 is not cryptographic: it
does not protect against deliberate tampering; someone who can rewrite the data files can rewrite
the manifest's checksums too. Use a signed sha256 of the manifest if that matters.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
import xxhash

from preshard.converter.safetensors_file import dtype_from_name, dtype_name, read_bytes_into, tensor_bytes
from preshard.errors import PreshardError
from preshard.manifests.io import read_manifest
from preshard.manifests.report import human_bytes
from preshard.manifests.schema import DCP_METADATA_NAME, ChunkRecord, Manifest, TensorRecord

SCAN_BLOCK = 8 << 20
MAX_SHOWN = 20


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
            f"{self.tensors} tensors, {self.chunks} chunks, {self.files} data files "
            f"({human_bytes(self.bytes_hashed)} hashed)"
        )
        if self.source is not None:
            what += f"; {self.source_tensors} tensors equal to the source bit for bit"
        if self.ok:
            return f"OK {self.checkpoint}: {what}"
        return f"FAILED {self.checkpoint}: {len(self.problems)} problems; checked {what}"

    def report_lines(self, limit: int = MAX_SHOWN) -> list[str]:
        lines = list(self.problems[:limit])
        if len(self.problems) > limit:
            lines.append(f"... and {len(self.problems) - limit} more")
        return lines


def verify_checkpoint(
    checkpoint: str | Path, *, source: str | Path | None = None, progress: bool = False
) -> VerifyResult:
    """Check a converted checkpoint's files, checksums, chunk coverage, `.metadata` and config (and the source).

    A checkpoint that cannot be verified at all (no such folder, no readable manifest, a manifest of a
    newer format, a source that does not open) raises PreshardError; everything else is a problem in
    the returned result.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise PreshardError(f"checkpoint {path} does not exist; pass the folder convert-checkpoint wrote")
    if not path.is_dir():
        raise PreshardError(f"checkpoint {path} is not a folder; pass the folder convert-checkpoint wrote")
    manifest = read_manifest(path)
    src = None
    if source is not None:
        from preshard.converter.sources import open_source

        src = open_source(source)
    result = VerifyResult(str(path), source=str(source) if source is not None else None)
    result.tensors = len(manifest.tensors)
    result.chunks = sum(len(t.chunks) for t in manifest.tensors.values())

    total = sum(f.size for f in manifest.files) + (src.total_bytes if src is not None else 0)
    bar = _bar(total, progress)
    try:
        _check_mesh(manifest, result)
        for tensor in manifest.tensors.values():
            for problem in tensor_layout_problems(manifest, tensor):
                result.add(problem)
        _check_file_tiling(manifest, result)
        bad_chunks = _check_data_files(path, manifest, result, bar)
        _check_dcp_metadata(path, manifest, result)
        _check_config(path, manifest, result)
        if src is not None:
            _check_source(path, manifest, src, result, bad_chunks, bar)
    finally:
        bar.close()
    return result


# ---------------------------------------------------------------------------------------------------------
# Layout: pure arithmetic over the manifest


def _prod(values: Iterable[int]) -> int:
    return math.prod(values)


def _boxes_overlap(a: ChunkRecord, b: ChunkRecord) -> bool:
    return all(max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _where(chunk: ChunkRecord) -> str:
    return f"chunk at offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"


def tensor_layout_problems(manifest: Manifest, tensor: TensorRecord) -> list[str]:
    """Coverage and plan checks of one tensor's chunks: every element stored exactly once, each rank's share."""
    name, shape, problems = tensor.name, list(tensor.shape), []
    tp = manifest.tp
    file_ranks = {f.name: f.tp_rank for f in manifest.files}
    try:
        itemsize = dtype_from_name(tensor.dtype).itemsize
    except PreshardError:
        problems.append(f"tensor {name}: unknown dtype {tensor.dtype!r}")
        itemsize = None
    boxes: list[ChunkRecord] = []
    rejected = False
    for chunk in tensor.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            problems.append(f"tensor {name}: {_where(chunk)} does not have the tensor's {len(shape)} dimensions")
            rejected = True
            continue
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
            problems.append(f"tensor {name}: {_where(chunk)} lies outside its shape {shape}")
            rejected = True
            continue
        volume = _prod(chunk.sizes)
        if itemsize is not None and chunk.data_length != volume * itemsize:
            problems.append(
                f"tensor {name}: {_where(chunk)} holds {chunk.data_length} bytes, its shape needs {volume * itemsize}"
            )
        if chunk.tp_rank is not None and not 0 <= chunk.tp_rank < tp:
            problems.append(f"tensor {name}: {_where(chunk)} belongs to tp rank {chunk.tp_rank}, outside tp={tp}")
        elif chunk.tp_rank is not None and file_ranks.get(chunk.file) != chunk.tp_rank:
            problems.append(
                f"tensor {name}: {_where(chunk)} of tp rank {chunk.tp_rank} is stored in {chunk.file}, "
                f"the file of tp rank {file_ranks.get(chunk.file)}"
            )
        if volume:
            boxes.append(chunk)
    overlap = _first_overlap(boxes)
    if overlap is not None:
        problems.append(f"tensor {name}: {_where(overlap[0])} overlaps {_where(overlap[1])}")
    elif not rejected:
        stored = sum(_prod(c.sizes) for c in boxes)
        if stored != _prod(shape):
            problems.append(f"tensor {name}: its chunks hold {stored} of its {_prod(shape)} elements")
    if not problems:
        problems += _plan_problems(tensor, tp)
    return problems


def _first_overlap(boxes: list[ChunkRecord]) -> tuple[ChunkRecord, ChunkRecord] | None:
    """A sweep along dim 0 (only boxes whose dim-0 intervals intersect are compared)."""
    if boxes and not boxes[0].offsets:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    ordered = sorted(boxes, key=lambda c: c.offsets[0])
    active: list[ChunkRecord] = []
    for box in ordered:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > box.offsets[0]]
        for other in active:
            if _boxes_overlap(box, other):
                return other, box
        active.append(box)
    return None


def _plan_problems(tensor: TensorRecord, tp: int) -> list[str]:
    """Each TP rank holds exactly the chunks that the tensor's shard dim and blocks give it."""
    from preshard.plans.styles import rank_chunks

    name, shape, d = tensor.name, list(tensor.shape), tensor.shard_dim
    if d is None:
        if len(tensor.chunks) != 1 or tensor.chunks[0].tp_rank is not None:
            return [f"tensor {name} is replicated but is not stored as one chunk shared by every tp rank"]
        return []
    if not 0 <= d < len(shape):
        return [f"tensor {name}: shard dim {d} is not a dimension of shape {shape}"]
    blocks = tensor.blocks or [shape[d]]
    if sum(blocks) != shape[d] or any(b < 0 or b % tp for b in blocks):
        return [f"tensor {name}: blocks {blocks} of dim {d} do not split into tp={tp} equal parts of {shape[d]}"]
    problems = []
    for r in range(tp):
        want = sorted((list(o), list(s)) for o, s in rank_chunks(tuple(shape), d, blocks, tp, r))
        have = sorted((list(c.offsets), list(c.sizes)) for c in tensor.chunks if c.tp_rank == r)
        if want != have:
            problems.append(f"tensor {name}: tp rank {r} holds chunks {have}, its {tensor.style} slice is {want}")
    if any(c.tp_rank is None for c in tensor.chunks):
        problems.append(f"tensor {name} is sharded on dim {d} but has a chunk marked replicated")
    return problems


def rank_layout_problems(manifest: Manifest, tp_rank: int) -> list[str]:
    """What the runtime reader assumes of one TP rank's chunks: that they tile its local tensor exactly.

    The reader places each chunk at its position along the shard dim among this rank's chunks; a
    missing, duplicated or misshapen chunk would leave part of a parameter uninitialised.
    """
    problems = []
    tp = manifest.tp
    for name, chunks in manifest.chunks_for_tp_rank(tp_rank).items():
        tensor = manifest.tensors[name]
        shape, d = list(tensor.shape), tensor.shard_dim
        if d is None:
            if len(chunks) != 1 or list(chunks[0].sizes) != shape or any(chunks[0].offsets):
                problems.append(f"tensor {name}: tp rank {tp_rank} does not have the whole replicated tensor")
            continue
        if not 0 <= d < len(shape) or shape[d] % tp:
            problems.append(f"tensor {name}: shard dim {d} of shape {shape} does not split into tp={tp} parts")
            continue
        whole = all(c.sizes[k] == shape[k] and c.offsets[k] == 0 for c in chunks for k in range(len(shape)) if k != d)
        starts = [c.offsets[d] for c in chunks]
        if not whole or len(set(starts)) != len(starts) or sum(c.sizes[d] for c in chunks) != shape[d] // tp:
            problems.append(f"tensor {name}: the chunks of tp rank {tp_rank} do not tile its local slice exactly")
    return problems


def check_rank_layout(manifest: Manifest, tp_rank: int) -> None:
    """Raise a one-line PreshardError when this rank's chunks would not fill its tensors (for load(verify=True))."""
    problems = rank_layout_problems(manifest, tp_rank)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PreshardError(f"{problems[0]}{more}; the manifest is damaged, convert the checkpoint again")


def _check_mesh(manifest: Manifest, result: VerifyResult) -> None:
    from preshard.manifests.schema import data_file_name
    from preshard.mesh import MeshSpec

    try:
        mesh = MeshSpec.from_dict(manifest.mesh)
    except (PreshardError, KeyError, TypeError):
        result.add(f"the manifest's mesh {manifest.mesh} is not valid")
        return
    names = [f.name for f in manifest.files]
    if len(set(names)) != len(names):
        result.add("the manifest lists a data file twice")
    for f in manifest.files:
        if not 0 <= f.tp_rank < mesh.tp or f.name != data_file_name(f.tp_rank):
            result.add(f"data file {f.name} is recorded for tp rank {f.tp_rank}, which does not fit tp={mesh.tp}")
    ranks = {r.rank: r for r in manifest.ranks}
    for rank in range(mesh.world_size):
        record = ranks.get(rank)
        coords = mesh.coords(rank)
        if record is None:
            result.add(f"the manifest has no entry for rank {rank} of the mesh {mesh.describe()}")
        elif record.coords != coords or sorted(record.files) != sorted(manifest.files_for_tp_rank(coords["tp"])):
            result.add(f"the manifest's entry for rank {rank} disagrees with the mesh and the chunks it reads")
    if set(ranks) - set(range(mesh.world_size)):
        result.add(f"the manifest lists ranks outside the mesh's world size {mesh.world_size}")


def _check_file_tiling(manifest: Manifest, result: VerifyResult) -> None:
    """The torch.save records of each data file follow each other with no gap, overlap or trailing bytes."""
    records: dict[str, list[tuple[int, int, str]]] = {f.name: [] for f in manifest.files}
    for tensor in manifest.tensors.values():
        for c in tensor.chunks:
            records.setdefault(c.file, []).append((c.blob_offset, c.blob_offset + c.blob_length, tensor.name))
    for f in manifest.files:
        position = 0
        for start, end, name in sorted(records[f.name]):
            if start != position:
                what = (
                    "overlaps the record before it" if start < position else f"follows unused bytes {position}..{start}"
                )
                result.add(f"{f.name}: the record of tensor {name} {what}")
                break
            position = end
        else:
            if position != f.size:
                result.add(f"{f.name}: the manifest's records end at byte {position}, the file is {f.size} bytes")


# ---------------------------------------------------------------------------------------------------------
# Data files: one pass each for the file hash and every chunk's hash


def _check_data_files(checkpoint: Path, manifest: Manifest, result: VerifyResult, bar) -> set[tuple[str, int]]:
    """Returns the (file, data_offset) of every chunk that is damaged or missing."""
    by_file: dict[str, list[tuple[str, ChunkRecord]]] = {f.name: [] for f in manifest.files}
    for tensor in manifest.tensors.values():
        for c in tensor.chunks:
            by_file.setdefault(c.file, []).append((tensor.name, c))
    bad: set[tuple[str, int]] = set()
    for record in manifest.files:
        path = checkpoint / record.name
        chunks = by_file[record.name]
        if not path.is_file():
            result.add(f"data file {record.name} is missing ({len(chunks)} chunks of {_tensor_names(chunks)})")
            for name, c in chunks:
                bad.add((c.file, c.data_offset))
                result.damaged(name)
            continue
        result.files += 1
        size = path.stat().st_size
        if size != record.size:
            result.add(f"data file {record.name} is {size} bytes, the manifest says {record.size}: truncated/damaged")
        try:
            file_digest, chunk_digests, hashed = _scan(path, [c for _, c in chunks], bar)
        except OSError as exc:
            result.add(f"data file {record.name} cannot be read: {exc.strerror or exc}")
            continue
        result.bytes_hashed += hashed
        damaged_here = []
        for i, (name, c) in enumerate(chunks):
            digest = chunk_digests.get(i)
            if digest is None:
                result.add(
                    f"tensor {name}: {_where(c)} lies past the end of {record.name} "
                    f"(bytes {c.data_offset}..{c.data_offset + c.data_length}, file is {size} bytes)"
                )
            elif digest != c.xxh3_64:
                result.add(
                    f"tensor {name}: {_where(c)} in {record.name} "
                    f"(bytes {c.data_offset}..{c.data_offset + c.data_length}) fails its xxh3_64 checksum: "
                    "the tensor's data is damaged"
                )
            else:
                continue
            bad.add((c.file, c.data_offset))
            result.damaged(name)
            damaged_here.append(name)
        if file_digest != record.xxh3_128 and not damaged_here and size == record.size:
            located = _locate_framing_damage(path, chunks)
            result.add(
                f"data file {record.name} fails its xxh3_128 checksum although every tensor's bytes are intact: "
                + (
                    f"the torch.save record of tensor {located} is damaged (torch's dcp.load would fail on it)"
                    if located
                    else "the damage is in the torch.save record framing (torch's dcp.load reads it)"
                )
            )
    return bad


def _tensor_names(chunks: list[tuple[str, ChunkRecord]], limit: int = 3) -> str:
    names = list(dict.fromkeys(name for name, _ in chunks))
    if not names:
        return "no tensor"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more tensors" if len(names) > limit else "")


def _scan(path: Path, chunks: list[ChunkRecord], bar) -> tuple[str, dict[int, str], int]:
    """Whole-file xxh3_128 and the xxh3_64 of every chunk's data range that lies inside the file, in one pass."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i].data_offset)
    digests: dict[int, str] = {}
    for i in order:
        if chunks[i].data_length == 0:
            digests[i] = xxhash.xxh3_64_hexdigest(b"")
    pending = [i for i in order if chunks[i].data_length]
    file_hash = xxhash.xxh3_128()
    active: list[tuple[int, xxhash.xxh3_64]] = []
    nxt = 0
    position = 0
    buffer = bytearray(SCAN_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            block = view[:n]
            end = position + n
            file_hash.update(block)
            while nxt < len(pending) and chunks[pending[nxt]].data_offset < end:
                active.append((pending[nxt], xxhash.xxh3_64()))
                nxt += 1
            still = []
            for i, h in active:
                c = chunks[i]
                lo, hi = max(c.data_offset, position), min(c.data_offset + c.data_length, end)
                if hi > lo:
                    h.update(block[lo - position : hi - position])
                if c.data_offset + c.data_length <= end:
                    digests[i] = h.hexdigest()
                else:
                    still.append((i, h))
            active = still
            position = end
            bar.update(n)
    return file_hash.hexdigest(), digests, position


def _locate_framing_damage(path: Path, chunks: list[tuple[str, ChunkRecord]]) -> str | None:
    """The tensor whose torch.save record (a zip archive) no longer reads back with correct CRCs."""
    with open(path, "rb") as f:
        for name, c in chunks:
            f.seek(c.blob_offset)
            blob = f.read(c.blob_length)
            try:
                with zipfile.ZipFile(io.BytesIO(blob)) as archive:
                    if archive.testzip() is not None:
                        return name
            except Exception:  # any way a damaged zip fails to parse
                return name
    return None


# ---------------------------------------------------------------------------------------------------------
# .metadata and config.json


_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class _DcpUnpickler(pickle.Unpickler):
    """Unpickles torch DCP metadata and nothing else: no other global can be named, so no code runs."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch's DCP metadata")


def read_dcp_metadata(path: Path):
    with open(path, "rb") as f:
        return _DcpUnpickler(f).load()


def _check_dcp_metadata(checkpoint: Path, manifest: Manifest, result: VerifyResult) -> None:
    path = checkpoint / DCP_METADATA_NAME
    if not path.is_file():
        result.add(f"{DCP_METADATA_NAME} is missing (torch's dcp.load and dcp_to_torch_save need it)")
        return
    try:
        meta = read_dcp_metadata(path)
        tensors = meta.state_dict_metadata
        storage = {(k.fqn, tuple(k.offset)): v for k, v in meta.storage_data.items()}
        if not isinstance(tensors, dict):
            raise TypeError
    except Exception as exc:  # a damaged pickle fails in many ways; all mean the same here
        result.add(f"{DCP_METADATA_NAME} cannot be read ({type(exc).__name__}); torch's dcp.load would fail")
        return
    missing = sorted(set(manifest.tensors) - set(tensors))
    extra = sorted(set(tensors) - set(manifest.tensors))
    if missing:
        result.add(f"{DCP_METADATA_NAME} lacks {len(missing)} tensors of the manifest, e.g. {missing[0]}")
    if extra:
        result.add(f"{DCP_METADATA_NAME} has {len(extra)} tensors the manifest lacks, e.g. {extra[0]}")
    for name, tensor in manifest.tensors.items():
        if name not in tensors:
            continue
        try:
            md = tensors[name]
            same = (
                list(md.size) == list(tensor.shape)
                and dtype_name(md.properties.dtype) == tensor.dtype
                and sorted((list(c.offsets), list(c.sizes)) for c in md.chunks)
                == sorted((list(c.offsets), list(c.sizes)) for c in tensor.chunks)
            )
            for c in tensor.chunks:
                info = storage.get((name, tuple(c.offsets)))
                same = same and info is not None
                same = same and (info.relative_path, info.offset, info.length) == (
                    c.file,
                    c.blob_offset,
                    c.blob_length,
                )
        except Exception:
            same = False
        if not same:
            result.add(f"{DCP_METADATA_NAME} disagrees with the manifest about tensor {name}")


def _check_config(checkpoint: Path, manifest: Manifest, result: VerifyResult) -> None:
    if manifest.config is None:
        return
    path = checkpoint / manifest.config
    if Path(manifest.config).name != manifest.config or not path.is_file():
        result.add(f"{manifest.config} is missing; load_sharded(ModelClass, ...) builds the model from it")
        return
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        result.add(f"{manifest.config} is not valid JSON ({type(exc).__name__})")


# ---------------------------------------------------------------------------------------------------------
# Source: provenance and bit-for-bit equality


def _check_source(checkpoint: Path, manifest: Manifest, src, result: VerifyResult, bad: set, bar) -> None:
    """Every tensor against the source (read once, in file order, which also yields each file's hash)."""
    from preshard.converter.slicer import cast_dtype
    from preshard.converter.sources import SourceReader

    for name in sorted(set(manifest.tensors) - set(src.tensors)):
        result.add(f"tensor {name} is in the checkpoint but not in the source")
    for name in sorted(set(src.tensors) - set(manifest.tensors)):
        result.add(f"tensor {name} is in the source but not in the checkpoint")
    try:
        cast = dtype_from_name(manifest.dtype) if manifest.dtype is not None else None
    except PreshardError:
        result.add(f"the manifest's dtype {manifest.dtype!r} is not a torch dtype")
        cast = None

    checkpoint_fds: dict[str, int] = {}
    reader = SourceReader(src)
    try:
        for f in manifest.files:
            if (checkpoint / f.name).is_file():
                checkpoint_fds[f.name] = os.open(checkpoint / f.name, os.O_RDONLY)
        for entry in src.in_file_order():
            # Every source tensor is read, in order, so that the file hashes come from this same pass.
            value = reader.rows(entry, 0, entry.shape[0] if entry.shape else 1)
            bar.update(entry.nbytes)
            tensor = manifest.tensors.get(entry.name)
            if tensor is None:
                continue
            if list(entry.shape) != list(tensor.shape):
                result.add(f"tensor {entry.name} has shape {tensor.shape}, the source's is {list(entry.shape)}")
                continue
            out_dtype = cast_dtype(entry.dtype, cast)
            if tensor.source_dtype != dtype_name(entry.dtype) or tensor.dtype != dtype_name(out_dtype):
                result.add(
                    f"tensor {entry.name} is {tensor.dtype} (from {tensor.source_dtype}), but the source's "
                    f"{dtype_name(entry.dtype)} converts to {dtype_name(out_dtype)}"
                )
                continue
            if _compare_tensor(value.to(out_dtype), tensor, checkpoint_fds, bad, result):
                result.source_tensors += 1
            del value
        recorded = {f.name: f for f in manifest.source.files}
        actual = {h.path.name: h for h in src.files}
        for name in sorted(set(recorded) - set(actual)):
            result.add(f"source file {name}, recorded in the manifest, is not part of {src.path}")
        for name in sorted(set(actual) - set(recorded)):
            result.add(f"source file {name} is not one the checkpoint was converted from")
        for name in sorted(set(actual) & set(recorded)):
            result.source_files += 1
            if actual[name].size != recorded[name].size:
                result.add(
                    f"source file {name} is {actual[name].size} bytes, the manifest recorded {recorded[name].size}"
                )
            elif reader.file_hash(actual[name].path) != recorded[name].xxh3_128:
                result.add(f"source file {name} has changed since the conversion (its xxh3_128 differs)")
    finally:
        reader.close()
        for fd in checkpoint_fds.values():
            os.close(fd)


def _compare_tensor(value: torch.Tensor, tensor: TensorRecord, fds, bad, result) -> bool:
    """Compare each stored chunk's bytes with the matching slice of the (cast) source tensor `value`."""
    equal = True
    for c in tensor.chunks:
        if (c.file, c.data_offset) in bad or c.file not in fds:
            equal = False  # already reported
            continue
        stored = torch.empty(c.data_length, dtype=torch.uint8)
        try:
            read_bytes_into(fds[c.file], c.data_offset, stored)
        except PreshardError:
            equal = False  # past the end of a truncated file: already reported
            continue
        expected = value[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].contiguous()
        if not numpy.array_equal(stored.numpy(), tensor_bytes(expected)):
            result.add(f"tensor {tensor.name}: {_where(c)} in {c.file} differs from the source")
            result.damaged(tensor.name)
            equal = False
    return equal


def _bar(total: int, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verifying", disable=not progress)
