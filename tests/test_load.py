"""load_sharded on the real diffusers MiniMax-H3: every TP degree computes the unsharded model's function.

The tiny seeded model (preshard.examples.minimax_h3) is converted at tp 1, 2 and 4 and loaded in real gloo
process groups (world size = tp; CP is 1 here; world size 1 needs no group and runs in this process). Each
multi-rank spawn does many loads at once and hands back plain values (outputs, shapes, reports,
/proc/self/io deltas); the tests below assert on them. The mismatch and damage errors need no process
group either: tp=1 checkpoints load in this process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks
from safetensors.torch import load_file, save_file
from torch import nn

from preshard.converter.convert import convert_checkpoint
from preshard.errors import ChecksumMismatch, PreshardError
from preshard.examples.minimax_h3 import (
    WEIGHTS_NAME,
    build_model,
    make_inputs,
    tiny_config,
)
from preshard.format.layout import data_file_name
from preshard.format.manifest import CONFIG_NAME, MANIFEST_NAME, read_manifest
from preshard.runtime.construct import parameters_on_meta
from preshard.runtime.load import _load_sharded, check_placement, load_sharded
from preshard.runtime.tp import ParallelLinear, unparallelize_linear

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

SEQ_LEN = 37  # odd, so no split of the packed sequence comes out even by accident
FP32_TOL = 1e-5
# bf16 (every parameter bfloat16, compared with the unsharded bf16 model on the same inputs): the
# sharded model sums partial products in another order (per-rank matmuls, all-reduce, then the bias added
# after the reduce instead of inside one addmm), and each difference is rounded to bf16's 8-bit mantissa and
# carried through 3 blocks. Measured max abs diff on outputs of magnitude ~3.5 (video and audio alike):
# tp=1 0.0156, tp=2 0.0195, tp=4 0.0156, i.e. 1-2.5 ulp of bf16 at 2..4 (the mixed checkpoint at tp=2: 0.0185).
# 0.05 leaves 2.5x margin over the worst and is still 4x below what dropping one all-reduce does (0.21).
BF16_TOL = 0.05
# /proc/self/io rchar counts every read() of the process: besides the shard's data chunks and each chunk's record
# framing (read in the same call, ~600 bytes each), load_sharded reads manifest.json and config.json (counted
# separately below) plus the gloo store/pair traffic of the
# new process groups it creates. Measured extra beyond chunks + manifest + config: ~100 bytes at world 1,
# ~1.1 KiB at tp=2, ~3 KiB at tp=4; 16 KiB is a generous bound that is still far less than one shard
# (~240 KiB at tp=4).
READ_OVERHEAD = 16 * 1024

BROKEN_MODULE = "transformer_blocks.0.attn.to_out.0"


# --------------------------------------------------------------------------------------------------
# Fixtures: seeded models, their diffusers checkpoints, conversions, unsharded reference outputs


@pytest.fixture(scope="module")
def inputs(tiny_inputs):
    return tiny_inputs


@pytest.fixture(scope="module")
def models(tiny_models):
    return {dtype: tiny_models(dtype) for dtype in ("float32", "bfloat16", "mixed")}


@pytest.fixture(scope="module")
def references(references):
    return {dtype: references(dtype) for dtype in ("float32", "bfloat16", "mixed")}


class _Checkpoints:
    """checkpoints[(dtype, tp)]: the session's conversion of that tiny source."""

    def __init__(self, converted):
        self.converted = converted

    def __getitem__(self, key: tuple[str, int]) -> Path:
        return self.converted(key[0], key[1])


@pytest.fixture(scope="module")
def checkpoints(converted) -> _Checkpoints:
    return _Checkpoints(converted)


def _max_diff(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    assert [g.shape for g in got] == [w.shape for w in want]
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))


def _assert_outputs_close(got, want, tol: float) -> None:
    """Both outputs (video sample, audio sample) within `tol` of the unsharded model's."""
    for what, g, w in zip(("video", "audio"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        diff = (g.float() - w.float()).abs().max().item()
        assert diff <= tol, f"{what} output differs from the unsharded model by {diff:.3g} > {tol:g}"


# --------------------------------------------------------------------------------------------------
# What each rank does (top-level functions: run_ranks pickles them by reference)


def _proc_io() -> dict[str, int]:
    if not os.path.exists("/proc/self/io"):  # Linux only: the byte counts are then skipped
        return {"rchar": 0, "read_bytes": 0}
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "read_bytes")}


def _forward(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = model(**inputs, return_dict=False)
    return video.clone(), audio.clone()


def _describe(model: nn.Module) -> dict:
    params = dict(model.named_parameters())
    return {
        "shapes": {name: list(p.shape) for name, p in params.items()},
        "dtypes": {name: str(p.dtype) for name, p in params.items()},
        "devices": sorted({str(t.device) for t in [*params.values(), *model.buffers()]}),
        "heads": {name: m.heads for name, m in model.named_modules() if type(m).__name__ == "MiniMaxH3Attention"},
        "inv_freq": (str(model.rope.inv_freq.device), str(model.rope.inv_freq.dtype)),
        "row_parallel": sorted(n for n, m in model.named_modules() if isinstance(m, ParallelLinear)),
        "report": model.preshard_report,
    }


def _rank_loads(rank: int, world_size: int, ckpts: dict[str, str], seq_len: int, everything: bool) -> dict:
    """Load the fp32 checkpoint (class, twice: the second read is measured) and the bf16 one; with
    `everything`, also via a factory and two kinds of instance, the mixed checkpoint, and the negative
    control with one all-reduce removed."""
    from diffusers import MiniMaxH3Transformer3DModel as H3

    if world_size > 1:
        init_gloo()
    inputs = make_inputs(tiny_config(), seq_len)
    out: dict = {}

    # A first load imports and warms whatever load_sharded touches, so the second counts only its reads.
    load_sharded(H3, ckpts["float32"])
    before = _proc_io()
    model = load_sharded(H3, ckpts["float32"])
    after = _proc_io()
    out["io"] = {k: after[k] - before[k] for k in before}
    out["class"] = _forward(model, inputs)
    out["class_info"] = _describe(model)
    out["bf16"] = _forward(load_sharded(H3, ckpts["bfloat16"]), inputs)
    if not everything:
        return out

    out["factory"] = _forward(load_sharded(lambda: H3(**tiny_config()), ckpts["float32"]), inputs)
    normal = build_model(dtype="float32", seed=1)  # other weights: every one must be replaced
    out["instance"] = _forward(load_sharded(normal, ckpts["float32"]), inputs)
    with parameters_on_meta():
        meta_built = H3(**tiny_config())
    out["meta_instance"] = _forward(load_sharded(meta_built, ckpts["float32"]), inputs)
    mixed = load_sharded(H3, ckpts["mixed"])
    out["mixed"] = _forward(mixed, inputs)
    out["mixed_info"] = _describe(mixed)

    # Negative control: every rank drops the same all-reduce (else the ranks' collectives fall out of step).
    unparallelize_linear(model.get_submodule(BROKEN_MODULE))
    out["broken_class"] = type(model.get_submodule(BROKEN_MODULE)).__name__
    out["broken"] = _forward(model, inputs)
    return out


@pytest.fixture(scope="module")
def tp1_results(checkpoints):
    # World size 1 needs no process group (load_sharded makes none for single-rank groups): run it here and
    # save a spawn (each costs seconds, mostly importing diffusers).
    ckpts = {dtype: str(checkpoints[(dtype, 1)]) for dtype in ("float32", "bfloat16")}
    return [_rank_loads(0, 1, ckpts, SEQ_LEN, False)]


@pytest.fixture(scope="module")
def tp2_results(checkpoints):
    ckpts = {dtype: str(checkpoints[(dtype, 2)]) for dtype in ("float32", "bfloat16", "mixed")}
    return run_ranks(_rank_loads, 2, ckpts, SEQ_LEN, True)


@pytest.fixture(scope="module")
def tp4_results(checkpoints):
    ckpts = {dtype: str(checkpoints[(dtype, 4)]) for dtype in ("float32", "bfloat16")}
    return run_ranks(_rank_loads, 4, ckpts, SEQ_LEN, False)


@pytest.fixture
def results(request):
    """Per-rank results of the `tp` the test is parametrized with (only that spawn runs for it)."""
    return request.getfixturevalue(f"tp{request.node.callspec.params['tp']}_results")


# --------------------------------------------------------------------------------------------------
# Same function as the unsharded model


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp32_output_equals_unsharded(tp, results, references):
    for rank, res in enumerate(results):
        assert res["class_info"]["report"].rank == rank
        _assert_outputs_close(res["class"], references["float32"], FP32_TOL)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_output_within_tolerance(tp, results, references):
    for res in results:
        assert res["bf16"][0].dtype == torch.bfloat16
        _assert_outputs_close(res["bf16"], references["bfloat16"], BF16_TOL)


@pytest.mark.parametrize("how", ["factory", "instance", "meta_instance"])
def test_factory_and_instance_give_the_same_result(how, tp2_results, references):
    for res in tp2_results:
        _assert_outputs_close(res[how], references["float32"], FP32_TOL)
        assert _max_diff(res[how], res["class"]) <= FP32_TOL


def test_mixed_checkpoint_keeps_per_tensor_dtypes(tp2_results, references, models):
    for res in tp2_results:
        dtypes = res["mixed_info"]["dtypes"]
        assert dtypes["proj_in.weight"] == "torch.float32"
        assert dtypes["transformer_blocks.0.attn.to_q.weight"] == "torch.bfloat16"
        want = {name: str(p.dtype) for name, p in models["mixed"].named_parameters()}
        assert dtypes == want
        _assert_outputs_close(res["mixed"], references["mixed"], BF16_TOL)


# --------------------------------------------------------------------------------------------------
# Local shapes, heads, buffers, hooks


def test_local_shapes_and_heads_at_tp2(tp2_results, models):
    full = {name: list(p.shape) for name, p in models["float32"].named_parameters()}
    cfg = tiny_config()
    inner, ffn, heads = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"], 12
    for res in tp2_results:
        shapes = res["class_info"]["shapes"]
        block = "transformer_blocks.0."
        assert shapes[block + "attn.to_q.weight"] == [inner // 2, cfg["hidden_size"]]
        assert shapes[block + "attn.to_out.0.weight"] == [cfg["hidden_size"], inner // 2]
        out_, in_ = full[block + "adaln_proj.linear.weight"]
        assert shapes[block + "adaln_proj.linear.weight"] == [out_, in_ // 2]
        assert shapes[block + "ff.net.0.proj.weight"] == [2 * ffn // 2, cfg["hidden_size"]]
        assert shapes[block + "ff.net.2.weight"] == [cfg["hidden_size"], ffn // 2]
        assert shapes["proj_in.weight"] == full["proj_in.weight"]  # replicated
        assert set(res["class_info"]["heads"].values()) == {heads // 2}
        assert len(res["class_info"]["heads"]) == cfg["num_layers"] + cfg["num_refiner_layers"]
        assert res["class_info"]["devices"] == ["cpu"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rope_buffer_placed_on_the_rank_device(tp, results):
    for res in results:
        info = res["class_info"]
        assert info["inv_freq"] == ("cpu", "torch.float32")
        assert "rope.inv_freq" in info["report"].buffers_placed


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_report_lists_every_row_parallel_module_and_nothing_else(tp, results, checkpoints):
    manifest = read_manifest(checkpoints[("float32", tp)])
    expected = sorted(
        name.removesuffix(".weight")
        for name, t in manifest.tensors.items()
        if name.endswith(".weight") and t.layout.style.reduces_output
    )
    cfg = tiny_config()
    # to_out.0 and ff.net.2 of every block and refiner block, adaln_proj.linear of every block.
    assert len(expected) == 3 * cfg["num_layers"] + 2 * cfg["num_refiner_layers"]
    assert f"token_refiner.refiner_blocks.{cfg['num_refiner_layers'] - 1}.ff.net.2" in expected
    assert f"transformer_blocks.{cfg['num_layers'] - 1}.adaln_proj.linear" in expected
    for res in results:
        report = res["class_info"]["report"]
        assert sorted(report.hooks) == expected
        assert report.modules_with("all-reduce") == expected
        assert report.modules_with("slice replicated input") == [m for m in expected if "adaln_proj" in m]
        assert res["class_info"]["row_parallel"] == expected


def test_removing_one_all_reduce_breaks_the_output(tp2_results, references):
    for res in tp2_results:
        assert res["broken_class"] == "Linear"
        assert _max_diff(res["broken"], references["float32"]) > 2 * BF16_TOL  # measured 0.21 and 0.24
        with pytest.raises(AssertionError, match="differs from the unsharded model"):
            _assert_outputs_close(res["broken"], references["float32"], FP32_TOL)


# --------------------------------------------------------------------------------------------------
# Each rank reads only its shard


def _rank_chunk_bytes(checkpoint: Path, tp_rank: int) -> tuple[int, int]:
    """Own slices plus every replicated tensor (stored once, in whichever rank file was emptiest), and the
    record framing read before each of them (checked against the manifest at every load)."""
    chunks = [c for cs in read_manifest(checkpoint).chunks_for_tp_rank(tp_rank).values() for c in cs]
    return sum(c.data_length for c in chunks), sum(len(c.framing.header) for c in chunks)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_each_rank_reads_only_its_shard(tp, results, checkpoints):
    checkpoint = checkpoints[("float32", tp)]
    manifest = read_manifest(checkpoint)
    data_bytes = sum(f.size for f in manifest.files)
    metadata_bytes = (checkpoint / MANIFEST_NAME).stat().st_size + (checkpoint / CONFIG_NAME).stat().st_size
    for rank, res in enumerate(results):
        report = res["class_info"]["report"]
        expected, framing = _rank_chunk_bytes(checkpoint, rank)
        assert report.bytes_read == expected + framing  # as plan and inspect count it: header and data
        assert report.to_dict()["read_bytes_per_rank"] == expected + framing
        rchar = res["io"]["rchar"]
        assert expected + framing <= rchar <= expected + framing + metadata_bytes + READ_OVERHEAD, (
            rchar,
            expected,
            framing,
            metadata_bytes,
        )
        if tp == 4:
            assert rchar < 0.5 * data_bytes, (rchar, data_bytes)
            assert expected < 0.4 * data_bytes


# --------------------------------------------------------------------------------------------------
# Mismatches and damage: tp=1 checkpoints loaded in this process (world size 1, no process group)


def _error(fn, cls=PreshardError) -> str:
    with pytest.raises(cls) as info:
        fn()
    return str(info.value)


def _h3():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel


@pytest.fixture(scope="module")
def tp1(checkpoints) -> Path:
    return checkpoints[("float32", 1)]


def test_in_process_load_matches(tp1, references, inputs):
    model = load_sharded(_h3(), tp1)
    _assert_outputs_close(_forward(model, inputs), references["float32"], FP32_TOL)


def test_tensor_the_checkpoint_lacks(tp1):
    def factory():
        model = _h3()(**tiny_config())
        model.extra = nn.Linear(3, 3)
        return model

    message = _error(lambda: load_sharded(factory, tp1))
    assert "lacks 2 tensors" in message and "extra.weight" in message and "extra.bias" in message


def test_tensor_the_model_lacks(tp1):
    def factory():
        model = _h3()(**tiny_config())
        model.norm_out.linear = nn.Linear(*reversed(model.norm_out.linear.weight.shape), bias=False)
        return model

    message = _error(lambda: load_sharded(factory, tp1))
    assert "has 1 tensor the model lacks" in message and "norm_out.linear.bias" in message


def test_shape_mismatch(tp1):
    message = _error(lambda: load_sharded(lambda: _h3()(**tiny_config(hidden_size=64)), tp1))
    assert "shapes disagree" in message
    assert "proj_in.weight (model [64, 16], checkpoint [48, 16])" in message


def test_dtype_kind_mismatch(tmp_path, models):
    source = tmp_path / "src"
    source.mkdir()
    models["float32"].save_config(source)
    state = {k: v.contiguous() for k, v in models["float32"].state_dict().items()}
    state["norm_out.linear.bias"] = torch.arange(state["norm_out.linear.bias"].numel(), dtype=torch.int32)
    save_file(state, str(source / WEIGHTS_NAME))
    convert_checkpoint(source, tmp_path / "out", tp=1, progress=False)
    message = _error(lambda: load_sharded(_h3(), tmp_path / "out"))
    assert "dtypes disagree" in message and "norm_out.linear.bias (model float32, checkpoint int32)" in message


def test_world_size_mismatch(checkpoints):
    message = _error(lambda: load_sharded(_h3(), checkpoints[("float32", 2)]))
    assert "runs alone" in message and "needs 2 ranks" in message and "torchrun --nproc-per-node 2" in message


def _copy(tp1: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tp1, tmp_path / "copy"))


def test_missing_data_file(tp1, tmp_path):
    checkpoint = _copy(tp1, tmp_path)
    (checkpoint / data_file_name(0)).unlink()
    message = _error(lambda: load_sharded(_h3(), checkpoint))
    assert data_file_name(0) in message and "missing" in message


def test_truncated_data_file(tp1, tmp_path):
    checkpoint = _copy(tp1, tmp_path)
    path = checkpoint / data_file_name(0)
    os.truncate(path, path.stat().st_size - 100)
    message = _error(lambda: load_sharded(_h3(), checkpoint))
    assert data_file_name(0) in message and "truncated" in message


def test_flipped_byte_caught_by_default_and_loaded_only_with_verify_off(tp1, tmp_path, models):
    checkpoint = _copy(tp1, tmp_path)
    chunk = read_manifest(checkpoint).tensors["proj_in.weight"].chunks[0]
    with open(checkpoint / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + 5)
        byte = f.read(1)[0]
        f.seek(chunk.data_offset + 5)
        f.write(bytes([byte ^ 0x40]))
    message = _error(lambda: load_sharded(_h3(), checkpoint), ChecksumMismatch)  # verify=True is the default
    assert chunk.file in message and "proj_in.weight" in message
    # The negative control: verify=False hashes nothing, so the damaged weight loads silently (the file-size and
    # framing checks still run, so truncation is always caught; bit rot only with the checksums).
    model = load_sharded(_h3(), checkpoint, verify=False)
    assert model.preshard_report.verified is False
    assert not torch.equal(model.proj_in.weight, models["float32"].proj_in.weight)


# --------------------------------------------------------------------------------------------------
# Placement: nothing may stay on meta


_DEFAULTS = dict(mesh=None, cp=None, ring=None, ulysses=None, order=None, device=None, dtype=None, verify=False,
                 revision=None, token=None)  # fmt: skip


def _meta_rope_factory():
    model = _h3()(**tiny_config())
    model.rope.inv_freq = model.rope.inv_freq.to("meta")
    return model


@pytest.mark.parametrize("place_buffers", [False, True])
def test_buffer_left_on_meta_is_named(tp1, place_buffers):
    message = _error(lambda: _load_sharded(_meta_rope_factory, tp1, **_DEFAULTS, place_buffers=place_buffers))
    assert "rope.inv_freq (meta)" in message


def test_meta_device_instance_is_named(tp1):
    with torch.device("meta"):  # computes rope.inv_freq on meta too: no value to place
        model = _h3()(**tiny_config())
    assert "rope.inv_freq" in _error(lambda: load_sharded(model, tp1))


def test_check_placement_catches_meta_buffers_and_parameters():
    model = _meta_rope_factory()
    message = _error(lambda: check_placement(model, torch.device("cpu")))
    assert "1 tensor is not on" in message and "rope.inv_freq (meta)" in message
    with parameters_on_meta():
        on_meta = _h3()(**tiny_config())
    n_params = len(list(on_meta.parameters()))
    message = _error(lambda: check_placement(on_meta, torch.device("cpu")))
    assert f"{n_params} tensors" in message and "proj_in.weight (meta)" in message and "more" in message
    check_placement(build_model(dtype="float32"), torch.device("cpu"))  # a real model passes


def test_loaded_weights_are_the_checkpoints(tp1, models):
    model = load_sharded(_h3(), tp1)
    state = load_file(str(Path(read_manifest(tp1).source.path) / WEIGHTS_NAME))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.quick
def test_a_class_is_built_in_eval_mode_as_from_pretrained_leaves_it_and_a_factory_as_it_comes(tmp_path):
    import diffusers

    from preshard.runtime.construct import build_model

    config = {"_class_name": "T5FilmDecoder", "d_model": 16, "num_layers": 1, "num_heads": 2, "d_kv": 8, "d_ff": 32}
    built = build_model(diffusers.T5FilmDecoder, tmp_path, config)
    assert not any(m.training for m in built.modules())  # its dropout (0.1) off
    factory = build_model(lambda: diffusers.T5FilmDecoder(d_model=16, num_layers=1, num_heads=2), tmp_path, None)
    assert factory.training  # the caller's own module, untouched
