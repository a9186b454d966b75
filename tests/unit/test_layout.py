"""Styles, chunk layout and slicing against the hand-written oracle (tests/support/oracle.py).

For every style, random shapes, TP degrees and packed blocks: `TensorLayout` gives each rank exactly the
boxes the oracle computes from docs/design.md, the local shape is the concatenation of its boxes along the
split dimension, `place_records` tiles every file, and the band slicer (with bands small enough that a
tensor takes many) produces exactly the oracle's bytes, with and without a dtype cast.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import hand_slices, raw_bytes

from preshard.errors import PlanError
from preshard.format.layout import TensorLayout, data_file_name, place_records
from preshard.format.slicing import BufferPool, tensor_pieces
from preshard.format.styles import STYLES, make_style

STYLE_NAMES = [
    "colwise", "rowwise", "packed_colwise", "packed_rowwise", "replicated_input_rowwise", "replicate", "tp_rms_norm",
    "tp_layer_norm",
]  # fmt: skip


@st.composite
def cases(draw):
    style = draw(st.sampled_from(STYLE_NAMES))
    param = draw(st.sampled_from(["weight", "bias"]))
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    blocks = None
    if style.startswith("packed"):
        n = draw(st.integers(1, 3))
        blocks = draw(st.one_of(st.just(n), st.lists(st.integers(1, 3).map(lambda k: k * tp), min_size=1, max_size=3)))
    split = tp * draw(st.integers(1, 3))  # the split dimension's size, before blocks
    if blocks is not None:
        split = tp * n * draw(st.integers(1, 2)) if isinstance(blocks, int) else sum(blocks)
    other = draw(st.integers(1, 5))
    # a norm's weight is [features], like a bias
    if param == "weight" and style not in ("tp_rms_norm", "tp_layer_norm"):
        shape = (split, other) if style in ("colwise", "packed_colwise", "replicate") else (other, split)
    else:
        shape = (split,)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16]))
    return style, param, tp, blocks, shape, dtype


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_boxes_local_shape_and_placement_match_the_oracle(case):
    style_name, param, tp, blocks, shape, dtype = case
    style = make_style(style_name, blocks)
    layout = TensorLayout.make(f"m.{param}", style, shape, dtype, dtype)
    w = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    for r in range(tp):
        want = hand_slices(w, style_name, param, blocks, tp, r)
        if want is None:
            assert layout.shard_dim is None
            assert layout.boxes(tp, r) == [((0,) * len(shape), shape)]
            continue
        got = layout.boxes(tp, r)
        assert [box[0] for box in got] == [offsets for offsets, _ in want]
        assert [box[1] for box in got] == [tuple(piece.shape) for _, piece in want]
        local = torch.cat([piece for _, piece in want], dim=layout.shard_dim)
        assert layout.local_shape(tp) == tuple(local.shape)
        starts = [layout.local_start(box, tp) for box in got]
        assert starts == [sum(p.shape[layout.shard_dim] for _, p in want[:i]) for i in range(len(want))]
    placed = place_records([layout], tp)
    for chunk in placed.chunks[layout.name]:
        assert chunk.file == data_file_name(chunk.owner if chunk.owner is not None else 0)


def test_records_tile_each_file_and_replicas_go_to_the_emptiest():
    big = TensorLayout.make("a.weight", make_style("colwise"), (8, 4), torch.float32, torch.float32)
    rep1 = TensorLayout.make("b.weight", make_style("replicate"), (64, 4), torch.float32, torch.float32)
    rep2 = TensorLayout.make("c.weight", make_style("replicate"), (2, 2), torch.float32, torch.float32)
    placed = place_records([big, rep1, rep2], tp=2)
    assert [c.file for c in placed.chunks["b.weight"]] == [data_file_name(0)]  # tie: the lowest rank
    assert [c.file for c in placed.chunks["c.weight"]] == [data_file_name(1)]  # rank 0 now holds more
    for name, records in placed.by_file().items():
        position = 0
        for c in records:
            assert c.offset == position
            position = c.end
        assert position == placed.file_sizes[int(name[2])]


@pytest.mark.parametrize("style", ["colwise", "rowwise", "packed_colwise", "packed_rowwise", "replicate"])
@pytest.mark.parametrize("cast", [None, torch.float32])
@pytest.mark.parametrize("band_bytes", [1, 40, 1 << 20])
def test_slicer_bytes_match_the_oracle_in_any_number_of_bands(style, cast, band_bytes):
    tp, blocks = 2, (4, 8) if style.startswith("packed") else None
    shape = (12, 6) if style in ("colwise", "packed_colwise", "replicate") else (6, 12)
    source = torch.randn(shape).to(torch.bfloat16)
    stored = cast or torch.bfloat16
    layout = TensorLayout.make("m.weight", make_style(style, blocks), shape, stored, torch.bfloat16)
    chunks = place_records([layout], tp).chunks["m.weight"]
    flat = source.reshape(-1).view(torch.uint8)
    row = flat.numel() // shape[0]

    def read_rows(start, count, out):
        out[:] = flat[start * row : (start + count) * row].numpy()

    got = {id(c): b"" for c in chunks}
    seen_first, seen_last = set(), set()
    for pieces in tensor_pieces(layout, chunks, read_rows, BufferPool(), band_bytes=band_bytes):
        for p in pieces:
            assert (id(p.chunk) not in got or got[id(p.chunk)] == b"") or not p.first
            if p.first:
                seen_first.add(id(p.chunk))
            if p.last:
                seen_last.add(id(p.chunk))
            got[id(p.chunk)] += p.data.tobytes()
    assert seen_first == seen_last == set(got)
    for c in chunks:
        want = hand_slices(source, style, "weight", list(blocks) if blocks else None, tp, c.owner or 0)
        piece = dict(want)[c.offsets] if want is not None else source
        assert got[id(c)] == raw_bytes(piece.to(stored)), (style, c.box)


@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (3, 0)])
def test_slicer_handles_scalars_and_empty_tensors(shape):
    layout = TensorLayout.make("x.scale", make_style("replicate"), shape, torch.float32, torch.float32)
    chunks = place_records([layout], 1).chunks["x.scale"]
    value = torch.full(shape, 2.5)

    def read_rows(start, count, out):
        out[:] = value.reshape(-1).view(torch.uint8)[: out.size].numpy()

    pieces = [p for band in tensor_pieces(layout, chunks, read_rows, BufferPool()) for p in band]
    assert pieces[0].first and pieces[-1].last
    assert b"".join(p.data.tobytes() for p in pieces) == raw_bytes(value)


def test_a_style_on_a_tensor_that_is_not_a_linear_weight_or_bias_is_refused():
    with pytest.raises(PlanError, match="not a Linear weight"):
        TensorLayout.make("m.scale", make_style("colwise"), (4,), torch.float32, torch.float32)
    with pytest.raises(PlanError, match="not a Linear weight"):
        TensorLayout.make("m.weight", make_style("colwise"), (4, 4, 4), torch.float32, torch.float32)
    with pytest.raises(PlanError, match=r"not a norm weight or bias \[features\]; point the rule at RMSNorm"):
        TensorLayout.make("m.weight", make_style("tp_rms_norm"), (4, 4), torch.float32, torch.float32)


def test_every_style_is_registered_once_with_its_dims():
    assert set(STYLES) == {
        *STYLE_NAMES,
        "kv_head_select",
        "colwise_gather",
        "vocab_parallel",
        "split_experts",
    }
    dims = {name: (cls().shard_dim("weight"), cls().shard_dim("bias")) for name, cls in STYLES.items()}
    assert dims == {
        "replicate": (None, None),
        "colwise": (0, 0),
        "packed_colwise": (0, 0),
        "rowwise": (1, None),
        "packed_rowwise": (1, None),
        "replicated_input_rowwise": (1, None),
        "tp_rms_norm": (0, 0),
        "tp_layer_norm": (0, 0),
        "kv_head_select": (None, None),
        "colwise_gather": (0, 0),
        "vocab_parallel": (0, None),
        "split_experts": (0, 0),  # every parameter of an experts module by its experts (dim 0)
    }


@pytest.mark.parametrize("band_bytes", [64, 1 << 20])
def test_split_experts_slices_each_rank_s_whole_experts_in_any_number_of_bands(band_bytes):
    source = torch.randn(4, 3, 5)  # [experts, in, out]
    layout = TensorLayout.make(
        "m.experts.down_proj", make_style("split_experts"), (4, 3, 5), torch.float32, torch.float32
    )
    chunks = place_records([layout], 2).chunks["m.experts.down_proj"]
    flat = source.reshape(-1).view(torch.uint8)
    row = flat.numel() // 4

    def read_rows(start, count, out):
        out[:] = flat[start * row : (start + count) * row].numpy()

    got = {c.owner: b"" for c in chunks}
    for pieces in tensor_pieces(layout, chunks, read_rows, BufferPool(), band_bytes=band_bytes):
        for p in pieces:
            got[p.chunk.owner] += p.data.tobytes()
    assert got == {0: raw_bytes(source[:2]), 1: raw_bytes(source[2:])}  # experts 0-1 on rank 0, 2-3 on rank 1


def test_kv_head_select_is_stored_once_and_each_rank_computes_the_kv_head_its_query_heads_share():
    from preshard.format.style_forwards import kv_head_select_forward

    style = make_style("kv_head_select", 2)  # 2 KV heads of 3 features, at tp=4
    layout = TensorLayout.make("m.weight", style, (6, 5), torch.float32, torch.float32)
    assert layout.shard_dim is None and layout.local_shape(4) == (6, 5)
    assert [owner for owner, _ in layout.all_boxes(4)] == [None]
    linear = torch.nn.Linear(5, 6)
    linear.preshard_style = style
    x = torch.randn(2, 5)
    full = linear(x)
    for rank, head in zip(range(4), (0, 0, 1, 1)):
        got = kv_head_select_forward(linear, x, rank, 4, None)
        torch.testing.assert_close(got, full[:, 3 * head : 3 * head + 3], rtol=0, atol=1e-6)  # another head: O(1)
