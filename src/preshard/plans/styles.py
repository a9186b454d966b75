"""The sharding styles of a Linear layer (DESIGN.md), and which chunk of a tensor each TP rank keeps.

A chunk is `(offsets, sizes)` in the coordinates of the global tensor, as torch DCP describes them.
"""

from __future__ import annotations

from enum import Enum

Chunk = tuple[tuple[int, ...], tuple[int, ...]]


class Style(str, Enum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    PACKED_COLWISE = "packed_colwise"
    REPLICATED_INPUT_ROWWISE = "replicated_input_rowwise"
    REPLICATE = "replicate"

    @property
    def input_sharded(self) -> bool:
        """Styles whose weight is split along the input features (dim 1) and need an all-reduce."""
        return self in (Style.ROWWISE, Style.REPLICATED_INPUT_ROWWISE)


# (style, parameter name) -> dimension that is split; absent means kept whole.
SHARD_DIM = {
    (Style.COLWISE, "weight"): 0,
    (Style.COLWISE, "bias"): 0,
    (Style.PACKED_COLWISE, "weight"): 0,
    (Style.PACKED_COLWISE, "bias"): 0,
    (Style.ROWWISE, "weight"): 1,
    (Style.REPLICATED_INPUT_ROWWISE, "weight"): 1,
}


def rank_chunks(
    shape: tuple[int, ...], shard_dim: int | None, blocks: list[int] | None, tp: int, tp_rank: int
) -> list[Chunk]:
    """The chunks TP rank `tp_rank` keeps: its 1/tp of `shard_dim`, separately inside each packed block."""
    if shard_dim is None:
        return [((0,) * len(shape), tuple(shape))]
    block_sizes = blocks or [shape[shard_dim]]
    chunks = []
    start = 0
    for block in block_sizes:
        local = block // tp
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[shard_dim] = start + tp_rank * local
        sizes[shard_dim] = local
        chunks.append((tuple(offsets), tuple(sizes)))
        start += block
    return chunks


def local_shape(shape: tuple[int, ...], shard_dim: int | None, tp: int) -> tuple[int, ...]:
    if shard_dim is None:
        return tuple(shape)
    out = list(shape)
    out[shard_dim] //= tp
    return tuple(out)
