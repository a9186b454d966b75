"""Self-checks of the embedded MiniMax-H3 example that the other tests build on."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from preshard.examples.minimax_h3 import (
    build_model,
    make_inputs,
    reference_forward,
    save_checkpoint,
    tiny_config,
)


@pytest.fixture(scope="module")
def mixed_model():
    return build_model(dtype="mixed")


@pytest.fixture(scope="module")
def fp32_model():
    return build_model(dtype="float32")


def test_mixed_dtypes_match_the_real_checkpoint(mixed_model):
    params = dict(mixed_model.named_parameters())
    assert params["proj_in.weight"].dtype == torch.float32
    assert params["audio_proj_in.bias"].dtype == torch.float32
    assert params["time_embedder.linear_2.weight"].dtype == torch.float32
    assert params["proj_out.weight"].dtype == torch.float32
    assert params["audio_proj_out.weight"].dtype == torch.float32
    assert params["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert params["transformer_blocks.0.adaln_proj.linear.weight"].dtype == torch.bfloat16
    assert params["context_embedder.weight"].dtype == torch.bfloat16
    assert params["norm_out.linear.weight"].dtype == torch.bfloat16
    assert mixed_model.rope.inv_freq.dtype == torch.float32
    assert "rope.inv_freq" not in mixed_model.state_dict()


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_uniform_dtypes(dtype, expected):
    model = build_model(dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.rope.inv_freq.dtype == torch.float32


def test_build_is_deterministic_and_no_weight_is_trivial():
    a, b = build_model(seed=3), build_model(seed=3)
    c = build_model(seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert pa.float().std() > 0, f"{name} is constant"


def test_tiny_config_rejects_unknown_keys():
    assert tiny_config(num_layers=3)["num_layers"] == 3
    with pytest.raises(ValueError, match="not_a_key"):
        tiny_config(not_a_key=1)


def _assert_same_state(directory, model, files):
    loaded = {}
    for f in files:
        loaded.update(load_file(str(directory / f)))
    state = model.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_save_single_file(tmp_path, mixed_model):
    out = save_checkpoint(mixed_model, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "MiniMaxH3Transformer3DModel"
    assert config["num_attention_heads"] == 12
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    _assert_same_state(out, mixed_model, ["diffusion_pytorch_model.safetensors"])


def test_save_sharded(tmp_path, mixed_model):
    out = save_checkpoint(mixed_model, tmp_path / "ckpt", max_shard_bytes=100_000)
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(mixed_model.state_dict())
    files = sorted(set(weight_map.values()))
    assert len(files) > 1
    assert files[0] == f"diffusion_pytorch_model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "diffusion_pytorch_model.safetensors").exists()
    total = 0
    for f in files:
        with safe_open(str(out / f), "pt") as handle:
            assert sorted(handle.keys()) == sorted(k for k, v in weight_map.items() if v == f)
            total += sum(handle.get_tensor(k).nbytes for k in handle.keys())
    assert index["metadata"]["total_size"] == total
    _assert_same_state(out, mixed_model, files)


@pytest.mark.parametrize("seq_len", [3, 13, 16, 37])
def test_make_inputs_and_forward(seq_len, fp32_model):
    config = tiny_config()
    inputs = make_inputs(config, seq_len, seed=1, batch_size=2)
    rows = torch.cat([inputs["text_indices"], inputs["video_indices"], inputs["audio_indices"]])
    assert sorted(rows.tolist()) == list(range(seq_len))
    assert inputs["timestep"].shape == (2,) and inputs["timestep"][0] != inputs["timestep"][1]
    assert set(inputs["timestep_indices"].tolist()) == {0, 1}
    assert torch.equal(inputs["position_ids"], inputs["position_ids"].round())
    for key, other in zip(inputs.values(), make_inputs(config, seq_len, seed=1, batch_size=2).values(), strict=True):
        assert torch.equal(key, other)
    video, audio = reference_forward(fp32_model, inputs)
    assert video.shape == (2, len(inputs["video_indices"]), config["in_channels"] * 4)
    assert audio.shape == (2, len(inputs["audio_indices"]), config["audio_in_channels"])
    assert video.dtype == audio.dtype == torch.float32
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()


def test_modalities_are_interleaved():
    inputs = make_inputs(tiny_config(), 37)
    video, audio = inputs["video_indices"], inputs["audio_indices"]
    assert audio.min() < video.max() and audio.max() > video.min()


def test_mixed_forward_is_close_to_fp32(mixed_model, fp32_model):
    inputs = make_inputs(tiny_config(), 16)
    for got, want in zip(reference_forward(mixed_model, inputs), reference_forward(fp32_model, inputs), strict=True):
        assert got.dtype == torch.float32
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() < 0.1


@pytest.mark.parametrize(
    "name, index",
    [
        # row 0 of the AdaLN table is the video rows' shift_msa; in the last block, the text rows' MLP
        # modulation cannot reach any output, so the element is chosen deliberately.
        ("transformer_blocks.1.adaln_proj.linear.weight", (0, 0)),
        ("transformer_blocks.0.ff.net.0.proj.weight", (0, 0)),
        ("transformer_blocks.0.ff.net.0.proj.weight", (64 + 5, 3)),
    ],
)
def test_single_weights_change_the_output(name, index, fp32_model):
    inputs = make_inputs(tiny_config(), 13)
    before = reference_forward(fp32_model, inputs)
    param = dict(fp32_model.named_parameters())[name]
    with torch.no_grad():
        old = param[index].item()
        param[index] += 0.1
        try:
            after = reference_forward(fp32_model, inputs)
        finally:
            param[index] = old
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(after, before, strict=True))
