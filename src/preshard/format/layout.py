"""Where every byte of a converted checkpoint lies, derived from the plan and the tensor shapes alone.

`TensorLayout` is one tensor's resolved plan: its style, the dimension that style splits, the packed
block sizes, its global shape and dtypes. From it follow the chunks (`Box`es) each TP rank keeps, the
local shape, and where each chunk sits in the rank's local tensor.

`place_records` then decides, before a byte is written, which data file holds each chunk and at which
offset: each TP rank's chunks go to that rank's file; a replicated tensor is stored once, in the file
holding the fewest bytes so far. Records are torch.save framings of known length, so every offset and
every file size is known up front. That is what lets parallel writers fill their files independently,
a resume trust nothing but checksums, and a dry run report exact sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from preshard.errors import PlanError
from preshard.format.dtypes import UINT8, DType, as_dtype
from preshard.format.quant import QUANTIZED_DTYPES, layout_role
from preshard.format.styles import REPLICATE, Box, Style
from preshard.format.torch_record import RecordFraming, record_framing

DATA_FILE_PATTERN = "__{}_0.distcp"
INT64_MAX = (1 << 63) - 1


def fits_int64(shape: Iterable[int], itemsize: int) -> bool:
    """Whether torch can hold a tensor of `shape`: its contiguous strides (a zero-size dim counts as 1, as torch
    computes them) and its byte size fit int64. Checked before anything iterates over or allocates a shape read from
    a file, so a hostile header costs one line, not memory or time."""
    span = max(itemsize, 1)
    for size in shape:
        if size < 0:
            return False
        span *= max(size, 1)
        if span > INT64_MAX:
            return False
    return True


def data_file_name(tp_rank: int) -> str:
    """torch DCP's own naming (`__<rank>_<index>.distcp`), one file per TP rank."""
    return DATA_FILE_PATTERN.format(tp_rank)


@dataclass(frozen=True)
class TensorLayout:
    """One tensor's resolved plan. Build it with `TensorLayout.make`, which derives and checks the rest."""

    name: str
    style: Style
    shard_dim: int | None
    blocks: tuple[int, ...] | None  # absolute block sizes along shard_dim (one block unless packed)
    shape: tuple[int, ...]
    dtype: DType  # as stored (after any --dtype cast)
    source_dtype: DType

    @classmethod
    def make(
        cls, name: str, style: Style, shape: tuple[int, ...], dtype: DType | Any, source_dtype: DType | Any
    ) -> TensorLayout:
        """Derive the shard dim and blocks of `name` under `style` (dtypes: `DType`s or torch's).

        Raises:
            PlanError: the style names a tensor that is not what it cuts: a Linear weight `[out, in]` or bias
                `[out]` (a norm's, an embedding's or an experts module's tensors for those styles).
        """
        shape, dtype, source_dtype = tuple(shape), as_dtype(dtype), as_dtype(source_dtype)
        if style.name == REPLICATE.name:
            return cls(name, style, None, None, shape, dtype, source_dtype)
        param = layout_role(name, shape)
        if len(shape) != style.param_ndim(param):
            if style.module_kind == "experts":
                raise PlanError(
                    f"{style.name} names {name} of shape {list(shape)}, which is not an experts parameter "
                    "[experts, ...] (3-D); point the rule at modules of expert weights only"
                )
            if style.module_kind == "norm":
                raise PlanError(
                    f"{style.name} names {name} of shape {list(shape)}, which is not a norm weight or bias "
                    "[features]; point the rule at RMSNorm modules only"
                )
            if style.module_kind == "embedding":
                raise PlanError(
                    f"{style.name} names {name} of shape {list(shape)}, which is not an Embedding weight "
                    "[vocab, dim]; point the rule at Embedding modules only"
                )
            raise PlanError(
                f"{style.name} names {name} of shape {list(shape)}, which is not a Linear weight [out, in] or "
                "bias [out]; point the rule at Linear modules only"
            )
        dim = style.shard_dim(param)
        if dim is None or shape[dim] == 0:  # a rowwise bias, or nothing to split
            return cls(name, style, None, None, shape, dtype, source_dtype)
        blocks = style.block_sizes(shape[dim], f"{name} dim {dim}")
        return cls(name, style, dim, blocks, shape, dtype, source_dtype)

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None

    @property
    def quantizes(self) -> bool:
        """Whether a floating source tensor is stored quantized (`--quantize`; a `--dtype` cast never makes
        float8/int8): its rows are quantized by their own scales as they are cut (`slicing.cast_band`)."""
        source = self.source_dtype
        return self.dtype.name in QUANTIZED_DTYPES and source.is_floating_point and source.itemsize > 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def shape_bytes(self, source: bool = False) -> int:
        """Bytes of the whole tensor as stored (or, with `source`, in its source dtype)."""
        return math.prod(self.shape) * (self.source_dtype if source else self.dtype).itemsize

    def split_sizes(self) -> list[tuple[str, int]]:
        """What must divide by the TP degree: (description, size) of each block of the split dimension."""
        if self.shard_dim is None:
            return []
        where = f"{self.name} dim {self.shard_dim}" + (" block" if len(self.blocks or ()) > 1 else "")
        return [(where, b) for b in self.blocks or ()]

    def boxes(self, tp: int, tp_rank: int) -> list[Box]:
        """The chunks TP rank `tp_rank` keeps: its 1/tp of the split dimension, separately inside each block."""
        if self.shard_dim is None:
            return [((0,) * len(self.shape), self.shape)]
        d, chunks, start = self.shard_dim, [], 0
        for block in self.blocks or ():
            local = block // tp
            offsets, sizes = [0] * len(self.shape), list(self.shape)
            offsets[d], sizes[d] = start + tp_rank * local, local
            chunks.append((tuple(offsets), tuple(sizes)))
            start += block
        return chunks

    def all_boxes(self, tp: int) -> list[tuple[int | None, Box]]:
        """Every chunk with its owning TP rank (None: replicated), in canonical order (by offsets)."""
        return list(_all_boxes(self.shard_dim, self.blocks, self.shape, tp))

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.shard_dim is None:
            return self.shape
        out = list(self.shape)
        out[self.shard_dim] //= tp
        return tuple(out)

    def local_start(self, box: Box, tp: int) -> int:
        """Where chunk `box` starts along the shard dim of its rank's local tensor (its blocks, in order)."""
        if self.shard_dim is None:
            return 0
        d = self.shard_dim
        start = position = 0
        for block in self.blocks or ():
            local = block // tp
            if start <= box[0][d] < start + block:
                return position
            start += block
            position += local
        raise ValueError(f"{self.name}: chunk {box} lies in no block")


@functools.lru_cache(maxsize=4096)
def _all_boxes(
    shard_dim: int | None, blocks: tuple[int, ...] | None, shape: tuple[int, ...], tp: int
) -> tuple[tuple[int | None, Box], ...]:
    """`TensorLayout.all_boxes`, computed once per distinct split (the tensors of a model share a few)."""
    layout = TensorLayout("", REPLICATE, shard_dim, blocks, shape, UINT8, UINT8)
    if shard_dim is None:
        return ((None, layout.boxes(tp, 0)[0]),)
    owned = [(r, box) for r in range(tp) for box in layout.boxes(tp, r)]
    return tuple(sorted(owned, key=lambda item: item[1][0]))


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk and where its torch.save record lies: file, byte offset, framing (hence length), checksum."""

    tensor: str
    owner: int | None  # TP rank, or None for a replicated tensor (read by every rank)
    box: Box
    file: str
    offset: int
    framing: RecordFraming
    xxh3_64: str = ""  # of the chunk's raw bytes; empty until written

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box[0]

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.box[1]

    @property
    def data_offset(self) -> int:
        return self.offset + self.framing.data_offset

    @property
    def data_length(self) -> int:
        return self.framing.data_length

    @property
    def end(self) -> int:
        return self.offset + self.framing.length

    @property
    def load_bytes(self) -> int:
        """The bytes a rank reads of this record at load: its framing header (checked against the manifest at every
        load) and its data; the trailer is never read. The one definition of "bytes read at load" that `plan`,
        `--dry-run`, `inspect` and the load report use (JSON key `read_bytes_per_rank`)."""
        return self.framing.data_offset + self.framing.data_length


@dataclass(frozen=True)
class FileLayout:
    """Every record of every data file, decided before anything is written."""

    tp: int
    chunks: dict[str, list[ChunkRecord]]  # tensor -> its chunks in canonical order
    file_sizes: list[int]  # by TP rank

    def by_file(self) -> dict[str, list[ChunkRecord]]:
        """Each file's records in file order."""
        files: dict[str, list[ChunkRecord]] = {data_file_name(r): [] for r in range(self.tp)}
        for chunks in self.chunks.values():
            for c in chunks:
                files[c.file].append(c)
        return {name: sorted(records, key=lambda c: c.offset) for name, records in files.items()}


def place_records(layouts: Iterable[TensorLayout], tp: int) -> FileLayout:
    """Place every chunk of `layouts` (in the order they will be written) in the TP rank files."""
    sizes = [0] * tp
    placed: dict[str, list[ChunkRecord]] = {}
    for layout in layouts:
        replica_file = sizes.index(min(sizes))  # the lowest rank among the smallest files
        chunks = []
        for owner, box in layout.all_boxes(tp):
            rank = replica_file if owner is None else owner
            framing = record_framing(layout.dtype, box[1])
            chunks.append(ChunkRecord(layout.name, owner, box, data_file_name(rank), sizes[rank], framing))
            sizes[rank] += framing.length
        placed[layout.name] = chunks
    return FileLayout(tp, placed, sizes)
