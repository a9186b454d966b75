"""The converter: bit-exact round trips through torch's own DCP readers, each rank's file holding exactly
its slices, the mesh layout, plans, --dtype, and the CLI's one-line errors.

Expected slices are computed here by hand from the styles' definitions in docs/design.md (never with
preshard's own slicing code), and every read of the converted files goes through torch or raw bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import assert_one_line, cli_runner, console_script
from multiproc import init_gloo, run_ranks
from oracle import (
    TINY_RULES,
    assert_same,
    hand_slices,
    load_source,
    raw_bytes,
    read_data_range,
    read_record,
    reassemble,
    rule_for,
)
from safetensors.torch import save_file

from preshard.cli import convert_checkpoint_command, main
from preshard.converter.convert import convert_checkpoint
from preshard.errors import PreshardError
from preshard.format.manifest import read_manifest
from preshard.units import human_bytes

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

MIN_SEARCH_BYTES = 32  # chunks at least this long are also looked for by content in every data file


def check_rank_files(out: Path, source: dict[str, torch.Tensor], rules, tp: int) -> None:
    """Every chunk of every rank against the hand slice, by raw bytes and by torch.load of its record."""
    manifest = read_manifest(out)
    assert [f.name for f in manifest.files] == [f"__{r}_0.distcp" for r in range(tp)]
    file_rank = {f"__{r}_0.distcp": r for r in range(tp)}
    contents = {name: (out / name).read_bytes() for name in file_rank}
    assert set(manifest.tensors) == set(source)
    for name, w in source.items():
        record = manifest.tensors[name]
        layout = record.layout
        style, blocks = rule_for(name, rules)
        param = name.rpartition(".")[2]
        assert layout.shape == tuple(w.shape), name
        assert layout.dtype is layout.source_dtype and layout.dtype.torch == w.dtype, name
        assert layout.style.name == style, name
        expected_by_rank = {r: hand_slices(w, style, param, blocks, tp, r) for r in range(tp)}
        if expected_by_rank[0] is None:  # kept whole: one chunk, stored once, owned by no TP rank
            assert layout.shard_dim is None, name
            assert len(record.chunks) == 1, f"{name} is stored {len(record.chunks)} times"
            expected = {None: [((0,) * w.dim(), w)]}
        else:
            if style.startswith("packed"):
                dim = 0 if style == "packed_colwise" else 1
                assert sum(layout.blocks) == w.shape[dim] and len(layout.blocks) == (
                    blocks if isinstance(blocks, int) else len(blocks)
                ), name
            expected = expected_by_rank
        assert len(record.chunks) == sum(len(v) for v in expected.values()), name
        for owner, want in expected.items():
            chunks = sorted((c for c in record.chunks if c.owner == owner), key=lambda c: c.offsets)
            assert [tuple(c.offsets) for c in chunks] == [o for o, _ in want], f"{name} rank {owner}"
            for chunk, (_, piece) in zip(chunks, want):
                what = f"{name} chunk {chunk.offsets} of tp rank {owner}"
                if owner is not None:
                    assert file_rank[chunk.file] == owner, f"{what} is in {chunk.file}"
                assert chunk.sizes == tuple(piece.shape), what
                assert chunk.data_length == piece.numel() * piece.element_size(), what
                path = out / chunk.file
                raw = read_data_range(path, chunk.data_offset, chunk.data_length, piece.dtype, chunk.sizes)
                assert_same(raw, piece, f"{what} (raw bytes)")
                assert_same(read_record(path, chunk.offset, chunk.framing.length), piece, f"{what} (record)")
                needle = raw_bytes(piece)
                if len(needle) >= MIN_SEARCH_BYTES:  # by content: in its own file once, nowhere else
                    counts = {f: data.count(needle) for f, data in contents.items()}
                    assert counts == {f: int(f == chunk.file) for f in contents}, f"{what}: found {counts}"
    # Nothing else is in the files: each file is exactly the records the manifest lists, back to back.
    for file_name, data in contents.items():
        spans = sorted(
            (c.offset, c.offset + c.framing.length)
            for t in manifest.tensors.values()
            for c in t.chunks
            if c.file == file_name
        )
        position = 0
        for start, end in spans:
            assert start == position, f"{file_name}: gap or overlap at byte {position}"
            position = end
        assert position == len(data) == manifest.file(file_name).size, file_name


# ---------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tiny_src(tiny_sources) -> Path:
    """The tiny MiniMax-H3, mixed fp32/bf16, as a sharded diffusers folder (>= 3 files + index)."""
    folder = tiny_sources("mixed")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def tiny_state(tiny_src) -> dict[str, torch.Tensor]:
    state = load_source(tiny_src)
    assert {t.dtype for t in state.values()} == {torch.float32, torch.bfloat16}
    return state


@pytest.fixture(scope="module")
def mixed(converted):
    """mixed(tp, **mesh) -> a conversion of the mixed tiny model (done once per session)."""
    return lambda tp, **kwargs: converted("mixed", tp, **kwargs)


# The synthetic checkpoint covers what the tiny model lacks: biases of colwise, rowwise, packed and
# replicated_input_rowwise layers, packed blocks given as an explicit (uneven) list, packed_rowwise.
SYNTH_RULES = [
    (r"layers\.0\.col", "colwise", None),
    (r"layers\.0\.row", "rowwise", None),
    (r"layers\.0\.pack", "packed_colwise", 2),
    (r"layers\.0\.pack_list", "packed_colwise", [16, 48]),
    (r"layers\.0\.rir", "replicated_input_rowwise", None),
    (r"layers\.0\.prow", "packed_rowwise", [8, 24]),
]
SYNTH_PLAN = {
    "name": "synthetic",
    "linear": [
        {"match": "layers.*.col", "style": "colwise"},
        {"match": "layers.*.row", "style": "rowwise"},
        {"match": "layers.*.pack", "style": "packed_colwise", "blocks": 2},
        {"match": "layers.*.pack_list", "style": "packed_colwise", "blocks": [16, 48]},
        {"match": "layers.*.rir", "style": "replicated_input_rowwise"},
        {"match": "layers.*.prow", "style": "packed_rowwise", "blocks": [8, 24]},
    ],
}


def _synthetic_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen).to(dtype)

    return {
        "layers.0.col.weight": rnd(32, 24),
        "layers.0.col.bias": rnd(32),
        "layers.0.row.weight": rnd(24, 32, dtype=torch.bfloat16),
        "layers.0.row.bias": rnd(24, dtype=torch.bfloat16),
        "layers.0.pack.weight": rnd(64, 24, dtype=torch.bfloat16),
        "layers.0.pack.bias": rnd(64, dtype=torch.bfloat16),
        "layers.0.pack_list.weight": rnd(64, 24),
        "layers.0.pack_list.bias": rnd(64),
        "layers.0.rir.weight": rnd(40, 32, dtype=torch.bfloat16),
        "layers.0.rir.bias": rnd(40, dtype=torch.bfloat16),
        "layers.0.prow.weight": rnd(24, 32, dtype=torch.bfloat16),
        "layers.0.prow.bias": rnd(24, dtype=torch.bfloat16),
        "layers.0.norm.weight": rnd(24),
        "embed.weight": rnd(16, 24, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("synthetic")
    state = _synthetic_state()
    src = root / "model.safetensors"
    save_file(state, str(src))
    plan = root / "plan.json"
    plan.write_text(json.dumps(SYNTH_PLAN))
    return src, plan, state


# ---------------------------------------------------------------------------------------------------
# Round trip and per-rank contents


@pytest.mark.parametrize(
    "tp, mesh",
    [(1, {"cp": 2}), (2, {"cp": 2}), (4, {"ring": 2})],
    ids=["tp1-cp2", "tp2-cp2", "tp4-ring2"],
)
def test_round_trip_through_dcp_to_torch_save_is_bit_exact(mixed, tiny_state, tmp_path, tp, mesh):
    out = mixed(tp, **mesh)
    back = reassemble(out, tmp_path)
    assert set(back) == set(tiny_state)
    for name, want in tiny_state.items():
        assert back[name].dtype == want.dtype, name
        assert torch.equal(back[name], want), name
        assert raw_bytes(back[name]) == raw_bytes(want), name
    assert json.loads((out / "config.json").read_text())["_class_name"] == "MiniMaxH3Transformer3DModel"


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_file_holds_exactly_its_slices_tiny_model(mixed, tiny_state, tp):
    check_rank_files(mixed(tp), tiny_state, TINY_RULES, tp)
    styles = {t.layout.style.name for t in read_manifest(mixed(tp)).tensors.values()}
    assert styles == {"colwise", "rowwise", "packed_colwise", "replicated_input_rowwise", "replicate"}


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_file_holds_exactly_its_slices_with_biases(synthetic, tmp_path, tp):
    src, plan, state = synthetic
    out = tmp_path / "out"
    manifest = convert_checkpoint(src, out, tp=tp, plan=plan, progress=False)
    assert manifest.tensors["layers.0.pack_list.weight"].layout.blocks == (16, 48)
    assert manifest.tensors["layers.0.pack.weight"].layout.blocks == (32, 32)
    assert manifest.tensors["layers.0.prow.weight"].layout.blocks == (8, 24)
    check_rank_files(out, state, SYNTH_RULES, tp)
    back = reassemble(out, tmp_path)
    assert set(back) == set(state)
    for name, want in state.items():
        assert_same(back[name], want, name)


def _dcp_load_rank(rank: int, world_size: int, checkpoint: str, specs: dict) -> dict[str, torch.Tensor]:
    init_gloo()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world_size)))
    state = {}
    for name, (how, shape, dtype) in specs.items():
        if how == "shard0":  # a colwise weight, laid out by torch from a full tensor
            state[name] = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)])
        elif how == "shard1":  # a rowwise weight, from this rank's local piece
            local = torch.zeros(shape[0], shape[1] // world_size, dtype=dtype)
            state[name] = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
        else:  # a replicated tensor as a plain tensor
            state[name] = torch.zeros(shape, dtype=dtype)
    dcp.load(state, checkpoint_id=checkpoint)
    return {n: (t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in state.items()}


def test_four_gloo_ranks_load_their_shards_with_dcp_load(mixed, tiny_state):
    tp = 4
    out = mixed(tp)
    q, o = "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_out.0.weight"
    ff, rep = "transformer_blocks.1.ff.net.0.proj.weight", "proj_in.weight"
    specs = {
        q: ("shard0", tuple(tiny_state[q].shape), tiny_state[q].dtype),
        o: ("shard1", tuple(tiny_state[o].shape), tiny_state[o].dtype),
        # A packed weight read as a plain Shard(0): the metadata holds the true global tensor, so DCP
        # serves rows [r*n/T, (r+1)*n/T) of it from the overlapping packed chunks.
        ff: ("shard0", tuple(tiny_state[ff].shape), tiny_state[ff].dtype),
        rep: ("full", tuple(tiny_state[rep].shape), tiny_state[rep].dtype),
    }
    results = run_ranks(_dcp_load_rank, tp, str(out), specs, timeout=120)
    for r, got in enumerate(results):
        (_, want_q), *_ = hand_slices(tiny_state[q], "colwise", "weight", None, tp, r)
        (_, want_o), *_ = hand_slices(tiny_state[o], "rowwise", "weight", None, tp, r)
        (_, want_ff), *_ = hand_slices(tiny_state[ff], "colwise", "weight", None, tp, r)
        assert_same(got[q], want_q, f"rank {r} {q}")
        assert_same(got[o], want_o, f"rank {r} {o}")
        assert_same(got[ff], want_ff, f"rank {r} {ff}")
        assert_same(got[rep], tiny_state[rep], f"rank {r} {rep}")


# ---------------------------------------------------------------------------------------------------
# Mesh layout


def _files_of_tp_rank(manifest, tp_rank: int) -> list[str]:
    names = {c.file for t in manifest.tensors.values() for c in t.chunks if c.owner in (None, tp_rank)}
    return sorted(names)


@pytest.mark.parametrize(
    "args, mesh, coords",
    [
        (
            ["--tp", "2", "--cp", "2"],
            {"tp": 2, "ring": 1, "ulysses": 2, "order": ["tp", "ring", "ulysses"]},
            [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)],
        ),
        (
            ["--tp", "2", "--ring", "2", "--ulysses", "2", "--order", "ulysses,ring,tp"],
            {"tp": 2, "ring": 2, "ulysses": 2, "order": ["ulysses", "ring", "tp"]},
            [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)],
        ),
    ],
    ids=["tp2-cp2", "tp2-ring2-ulysses2-order"],
)
def test_manifest_records_the_mesh_layout(tiny_src, tmp_path, args, mesh, coords):
    out = tmp_path / "out"
    result = cli_runner().invoke(convert_checkpoint_command, [str(tiny_src), str(out), *args, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "mesh tp=2" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mesh"] == mesh
    assert [r["rank"] for r in manifest["ranks"]] == list(range(len(coords)))
    typed = read_manifest(out)
    for record, (tp, ring, ulysses) in zip(manifest["ranks"], coords):
        assert record["coords"] == {"tp": tp, "ring": ring, "ulysses": ulysses}, record
        assert f"__{tp}_0.distcp" in record["files"]
        assert sorted(record["files"]) == _files_of_tp_rank(typed, tp)


# ---------------------------------------------------------------------------------------------------
# Plans


def test_builtin_plan_is_picked_from_config_class_name(mixed, tiny_src, tmp_path):
    manifest = read_manifest(mixed(2))
    assert manifest.plan.name == "minimax-h3"
    assert manifest.tensors["transformer_blocks.0.attn.to_q.weight"].layout.style.name == "colwise"
    # With another class name (or no config.json) there is no plan to pick: a one-line error.
    other = tmp_path / "other"
    shutil.copytree(tiny_src, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_class_name": "SomeOtherModel"}))
    with pytest.raises(PreshardError, match="no built-in plan for model class SomeOtherModel"):
        convert_checkpoint(other, tmp_path / "out", tp=2, progress=False)
    assert not (tmp_path / "out").exists()


def _write_plan(path: Path, linear: list[dict], name: str = "user") -> Path:
    path.write_text(json.dumps({"name": name, "linear": linear}))
    return path


def test_user_plan_file_gives_its_styles(tiny_src, tiny_state, tmp_path):
    plan = _write_plan(
        tmp_path / "plan.json",
        [
            {"match": "transformer_blocks.*.attn.to_q", "style": "colwise"},
            {"match": "transformer_blocks.*.attn.to_out.0", "style": "rowwise"},
        ],
        name="tiny-user",
    )
    out = tmp_path / "out"
    convert_checkpoint(tiny_src, out, tp=2, plan=plan, progress=False)
    manifest = read_manifest(out)
    assert manifest.plan.name == "tiny-user"
    expected = {
        "transformer_blocks.*.attn.to_q.weight": "colwise",
        "transformer_blocks.*.attn.to_out.0.weight": "rowwise",
    }
    for name, record in manifest.tensors.items():
        generic = re.sub(r"^transformer_blocks\.\d+\.", "transformer_blocks.*.", name)
        assert record.layout.style.name == expected.get(generic, "replicate"), name
    rules = [
        (r"transformer_blocks\.\d+\.attn\.to_q", "colwise", None),
        (r"transformer_blocks\.\d+\.attn\.to_out\.0", "rowwise", None),
    ]
    check_rank_files(out, tiny_state, rules, 2)


def test_packed_blocks_as_explicit_list(tiny_src, tiny_state, tmp_path):
    ff = "transformer_blocks.*.ff.net.0.proj"
    plan = _write_plan(tmp_path / "plan.json", [{"match": ff, "style": "packed_colwise", "blocks": [64, 64]}])
    out = tmp_path / "out"
    convert_checkpoint(tiny_src, out, tp=4, plan=plan, progress=False)
    record = read_manifest(out).tensors["transformer_blocks.1.ff.net.0.proj.weight"]
    assert record.layout.style.name == "packed_colwise" and record.layout.blocks == (64, 64)
    for r in range(4):  # rows [16r, 16r+16) of the gate and [64+16r, 64+16r+16) of the up block
        offsets = sorted(c.offsets[0] for c in record.chunks if c.owner == r)
        assert offsets == [16 * r, 64 + 16 * r]
    check_rank_files(out, tiny_state, [(r"transformer_blocks\.\d+\.ff\.net\.0\.proj", "packed_colwise", [64, 64])], 4)
    bad = _write_plan(tmp_path / "bad.json", [{"match": ff, "style": "packed_colwise", "blocks": [64, 32]}])
    with pytest.raises(PreshardError, match=r"packed blocks \[64, 32\] add up to 96, not 128"):
        convert_checkpoint(tiny_src, tmp_path / "bad", tp=2, plan=bad, progress=False)


def test_plan_rule_matching_no_tensor_is_an_error(tiny_src, tmp_path):
    plan = _write_plan(
        tmp_path / "plan.json",
        [
            {"match": "transformer_blocks.*.attn.to_q", "style": "colwise"},
            {"match": "transformer_blocks.*.attn.to_qkv", "style": "colwise"},
        ],
    )
    with pytest.raises(PreshardError, match=r"rule 'transformer_blocks\.\*\.attn\.to_qkv' matches no tensor"):
        convert_checkpoint(tiny_src, tmp_path / "out", tp=2, plan=plan, progress=False)
    assert not (tmp_path / "out").exists()


def test_tp_that_does_not_divide_lists_working_degrees(tiny_src, tmp_path):
    with pytest.raises(PreshardError, match=r"--tp 3 does not divide .*TP degrees that work .*: 1, 2, 4$"):
        convert_checkpoint(tiny_src, tmp_path / "out", tp=3, progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# --dtype


def test_dtype_bf16_casts_floating_tensors(tiny_src, tiny_state, tmp_path):
    out = tmp_path / "out"
    manifest = convert_checkpoint(tiny_src, out, tp=2, dtype="bf16", progress=False)
    assert manifest.dtype.torch == torch.bfloat16
    back = reassemble(out, tmp_path)
    assert set(back) == set(tiny_state)
    fp32 = [n for n, t in tiny_state.items() if t.dtype == torch.float32]
    assert "proj_in.weight" in fp32 and "time_embedder.linear_2.weight" in fp32
    for name, source in tiny_state.items():
        record = manifest.tensors[name]
        assert record.layout.dtype.torch == torch.bfloat16, name
        assert record.layout.source_dtype.torch == source.dtype, name
        assert_same(back[name], source.to(torch.bfloat16), name)
        assert sum(c.data_length for c in record.chunks) == source.numel() * 2, name


def test_dtype_keeps_int_and_float8_tensors(tmp_path):
    gen = torch.Generator().manual_seed(2)
    state = {
        "lin.weight": torch.randn(16, 8, generator=gen),
        "lin.bias": torch.randn(16, generator=gen).to(torch.float16),
        "q8.weight": (torch.randn(16, 8, generator=gen) * 4).to(torch.float8_e4m3fn),
        "quant.scale": torch.rand(4, generator=gen, dtype=torch.float64),
        "step": torch.randint(-(2**40), 2**40, (4,), generator=gen, dtype=torch.int64),
    }
    folder = tmp_path / "hand"  # no config.json: the plan has to be given
    folder.mkdir()
    save_file(state, str(folder / "weights.safetensors"))
    plan = _write_plan(
        tmp_path / "plan.json",
        [{"match": "lin", "style": "colwise"}, {"match": "q8", "style": "colwise"}],
        name="hand",
    )
    with pytest.raises(PreshardError, match="no config.json naming its model class; pass --plan"):
        convert_checkpoint(folder / "weights.safetensors", tmp_path / "none", tp=2, progress=False)
    out = tmp_path / "out"
    manifest = convert_checkpoint(folder / "weights.safetensors", out, tp=2, plan=plan, dtype="bf16", progress=False)
    assert manifest.config is None and not (out / "config.json").exists()
    dtypes = {n: (t.layout.dtype.torch, t.layout.source_dtype.torch) for n, t in manifest.tensors.items()}
    assert dtypes == {
        "lin.weight": (torch.bfloat16, torch.float32),
        "lin.bias": (torch.bfloat16, torch.float16),
        "q8.weight": (torch.float8_e4m3fn, torch.float8_e4m3fn),
        "quant.scale": (torch.bfloat16, torch.float64),
        "step": (torch.int64, torch.int64),
    }
    back = reassemble(out, tmp_path)
    want = {
        "lin.weight": state["lin.weight"].to(torch.bfloat16),
        "lin.bias": state["lin.bias"].to(torch.bfloat16),
        "q8.weight": state["q8.weight"],
        "quant.scale": state["quant.scale"].to(torch.bfloat16),
        "step": state["step"],
    }
    for name, value in want.items():
        assert_same(back[name], value, name)
    # The kept-as-is tensors, chunk by chunk: the float8 weight is sharded colwise, the int64 stored once.
    records = manifest.tensors
    for r in range(2):
        (chunk,) = [c for c in records["q8.weight"].chunks if c.owner == r]
        piece = read_data_range(out / chunk.file, chunk.data_offset, chunk.data_length, torch.float8_e4m3fn, [8, 8])
        assert_same(piece, state["q8.weight"][8 * r : 8 * r + 8], f"q8.weight rank {r}")
    (chunk,) = records["step"].chunks
    assert chunk.owner is None
    assert_same(read_record(out / chunk.file, chunk.offset, chunk.framing.length), state["step"], "step")


# ---------------------------------------------------------------------------------------------------
# CLI


def _error_cases(tiny_src: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    text = tmp / "weights.txt"
    text.write_text("not a checkpoint\n")
    occupied = tmp / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine\n")
    no_match = _write_plan(tmp / "nomatch.json", [{"match": "transformer_blocks.*.attn.to_qkv", "style": "colwise"}])
    src, out = str(tiny_src), str(tmp / "out")
    return {
        "source missing": ([str(tmp / "missing"), out, "--tp", "2"], "does not exist"),
        "source not safetensors": ([str(text), out, "--tp", "2"], "is not a .safetensors file"),
        "output exists": ([src, str(occupied), "--tp", "2"], "already exists and is not a preshard checkpoint"),
        "unknown plan": ([src, out, "--tp", "2", "--plan", "no-such-plan"], "unknown plan 'no-such-plan'"),
        "tp zero": ([src, out, "--tp", "0"], "'--tp': 0 is not in the range x>=1"),
        "tp not a number": ([src, out, "--tp", "abc"], "'--tp': 'abc' is not a valid integer"),
        "ring zero": ([src, out, "--tp", "2", "--ring", "0"], "'--ring': 0 is not in the range x>=1"),
        "empty order": ([src, out, "--tp", "2", "--order", ""], "must name each of tp, ring, ulysses"),
        "unknown dtype": ([src, out, "--tp", "2", "--dtype", "int8"], "--dtype 'int8' is not supported"),
        "tp not dividing": ([src, out, "--tp", "3"], "TP degrees that work for this checkpoint: 1, 2, 4"),
        "rule matches nothing": ([src, out, "--tp", "2", "--plan", str(no_match)], "matches no tensor"),
    }


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def _assert_one_line_error(exit_code: int, stdout: str, stderr: str, needle: str) -> None:
    assert_one_line(exit_code, stderr, 2, needle, stdout=stdout)


CASE_NAMES = [
    "source missing",
    "source not safetensors",
    "output exists",
    "unknown plan",
    "tp zero",
    "tp not a number",
    "ring zero",
    "empty order",
    "unknown dtype",
    "tp not dividing",
    "rule matches nothing",
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_cli_errors_are_one_line_and_leave_nothing(tiny_src, tmp_path, case):
    args, needle = _error_cases(tiny_src, tmp_path)[case]
    before = _snapshot(tmp_path)
    result = cli_runner().invoke(convert_checkpoint_command, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    _assert_one_line_error(result.exit_code, result.stdout, result.stderr, needle)
    assert _snapshot(tmp_path) == before  # no output, no partial folder, the occupied folder untouched
    assert not list(tmp_path.rglob("manifest.json"))


def test_cli_error_in_a_real_process(tiny_src, tmp_path):
    args, needle = _error_cases(tiny_src, tmp_path)["tp not dividing"]
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [console_script("convert-checkpoint"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, needle)
    assert _snapshot(tmp_path) == before


def test_cli_overwrite_replaces_an_existing_output(tiny_src, tmp_path):
    out = tmp_path / "out"
    runner = cli_runner()
    first = runner.invoke(convert_checkpoint_command, [str(tiny_src), str(out), "--tp", "2", "--no-progress"])
    assert first.exit_code == 0, first.output
    (out / "stray.txt").write_text("left over\n")
    again = runner.invoke(convert_checkpoint_command, [str(tiny_src), str(out), "--tp", "4", "--no-progress"])
    _assert_one_line_error(again.exit_code, again.stdout, again.stderr, "already exists; pass --overwrite")
    assert read_manifest(out).tp == 2 and (out / "stray.txt").exists()
    replaced = runner.invoke(
        convert_checkpoint_command, [str(tiny_src), str(out), "--tp", "4", "--overwrite", "--no-progress"]
    )
    assert replaced.exit_code == 0, replaced.output
    assert read_manifest(out).tp == 4
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".metadata", "config.json", "manifest.json"] + [f"__{r}_0.distcp" for r in range(4)]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing retired or partial left behind


@pytest.mark.parametrize("dry", [False, True], ids=["convert", "dry-run"])
def test_cli_overwrite_refuses_a_folder_that_is_not_a_checkpoint(tiny_src, tmp_path, dry):
    """A mistyped OUT naming someone's folder must not be deleted by --overwrite: only a checkpoint is replaced."""
    out = tmp_path / "models"
    (out / "sub").mkdir(parents=True)
    (out / "weights.safetensors").write_bytes(b"precious")
    (out / "sub" / "notes.txt").write_text("keep me\n")
    (out / "manifest.json").write_text('{"format": "another-tool"}')  # a manifest, but not a preshard one
    before = _snapshot(tmp_path)
    args = [str(tiny_src), str(out), "--tp", "2", "--overwrite", "--no-progress"] + (["--dry-run"] if dry else [])
    refused = cli_runner().invoke(convert_checkpoint_command, args)
    _assert_one_line_error(refused.exit_code, refused.stdout, refused.stderr, "is not a preshard checkpoint")
    assert "manifest.json" in refused.stderr and "remove the folder yourself" in refused.stderr
    assert _snapshot(tmp_path) == before  # nothing written, not even a lock file


def test_inspect_prints_mesh_files_and_bytes_per_rank(mixed):
    out = mixed(2, cp=2)
    manifest = read_manifest(out)
    result = cli_runner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "tp=2 x ring=1 x ulysses=2" in text and "world size 4" in text
    for f in manifest.files:
        line = next(line for line in text.splitlines() if line.startswith(f.name))
        assert human_bytes(f.size) in line and f.xxh3_128 in line
    ranks_of = {0: "0,1", 1: "2,3"}
    for r in range(2):
        own = sum(c.data_length for t in manifest.tensors.values() for c in t.chunks if c.owner == r)
        shared = sum(c.data_length for t in manifest.tensors.values() for c in t.chunks if c.owner is None)
        assert own > 0 and shared > 0
        row = [line.split() for line in text.splitlines() if line.split()[:1] == [str(r)]]
        assert row, text
        joined = " ".join(row[-1])
        # the reads: own + replicated data and each record's framing header, as plan and the load report count them
        framing = sum(len(c.framing.header) for cs in manifest.chunks_for_tp_rank(r).values() for c in cs)
        for amount in (own, shared, own + shared + framing):
            assert human_bytes(amount) in joined, (amount, joined)
        assert joined.endswith(ranks_of[r])
