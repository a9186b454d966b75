"""The synthetic real-width MiniMax-H3 checkpoints the benchmarks run on are what they claim to be.

A benchmark on a checkpoint with wrong shapes, dtypes or a broken header would measure something else
than the real model, so these check the full-size tensor list against the published model's counts,
that the safetensors library itself reads both data modes, and that the converter accepts the output.
"""

import importlib.util
import json
import math

import pytest
from safetensors import safe_open

from preshard.examples.minimax_h3 import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, tiny_config
from preshard.examples.synthetic import (
    BUFFER_BYTES,
    minimax_h3_tensors,
    random_buffer,
    total_nbytes,
    write_safetensors_checkpoint,
)

# Without importing diffusers at collection (the unit tier's collection imports no diffusers).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")


def _convert(src, out, tp):
    """The one call into the converter (its module may move; only this helper needs to follow)."""
    from preshard.converter.convert import convert_checkpoint

    return convert_checkpoint(src, out, tp=tp, progress=False)


def _headers(paths):
    """{name: (dtype code, shape)} as the safetensors library reads the files' headers."""
    found = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                found[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return found


@pytest.fixture(scope="module")
def full():
    return minimax_h3_tensors()


def test_full_size_tensor_list_is_the_real_model(full):
    tensors, config = full
    assert len(tensors) == 638
    assert sum(math.prod(shape) for _, shape in tensors.values()) == 33_122_992_896
    assert config["_class_name"] == "MiniMaxH3Transformer3DModel"
    assert (config["hidden_size"], config["num_attention_heads"], config["ffn_dim"]) == (5376, 56, 14336)
    assert (config["num_layers"], config["num_refiner_layers"]) == (50, 2)
    json.dumps(config)  # config.json material: no tuples or other non-JSON values left
    assert tensors["transformer_blocks.0.adaln_proj.linear.weight"] == ("BF16", (96768, 2688))
    assert tensors["proj_in.weight"][0] == "F32"
    assert tensors["time_embedder.linear_2.weight"][0] == "F32"
    assert tensors["audio_proj_out.weight"][0] == "F32"
    assert tensors["context_embedder.weight"][0] == "BF16"
    assert "rope.inv_freq" not in tensors  # a non-persistent buffer: not in the checkpoint
    largest = max(tensors.values(), key=lambda s: math.prod(s[1]))
    assert largest == ("BF16", (96768, 2688))


def test_layer_counts_and_overrides():
    tensors, config = minimax_h3_tensors(num_layers=2, num_refiner_layers=1)
    assert config["num_layers"] == 2 and config["num_refiner_layers"] == 1
    assert not any(n.startswith("transformer_blocks.2.") for n in tensors)
    assert any(n.startswith("transformer_blocks.1.") for n in tensors)
    assert not any(n.startswith("token_refiner.refiner_blocks.1.") for n in tensors)
    with pytest.raises(Exception, match="unknown"):
        minimax_h3_tensors(no_such_key=1)


def test_hole_mode_full_size_reads_headers_only(full, tmp_path):
    tensors, config = full
    total = total_nbytes(tensors)
    assert total > 60 * 2**30
    paths = write_safetensors_checkpoint(tmp_path, tensors, config, data="hole", max_shard_bytes=10 * 2**30)
    assert len(paths) == 7  # greedy 10 GiB shards of a 61.7 GiB model
    assert _headers(paths) == tensors
    # sparse: the files are their full size but hold (almost) no data blocks
    assert sum(p.stat().st_size for p in paths) > total
    assert sum(p.stat().st_blocks * 512 for p in paths) < 64 * 2**20
    index = json.loads((tmp_path / WEIGHTS_INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(tensors)
    assert json.loads((tmp_path / "config.json").read_text()) == config


def test_header_layout_matches_the_safetensors_library(tmp_path):
    tensors, config = minimax_h3_tensors(**tiny_config())
    (path,) = write_safetensors_checkpoint(tmp_path, tensors, config, data="hole")
    assert path.name == WEIGHTS_NAME
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    text = raw[8 : 8 + n].decode()
    assert len(text) - len(text.rstrip(" ")) < 8  # padded with spaces only, and only to the next multiple of 8
    header = json.loads(text)
    assert list(header)[0] == "__metadata__" and header["__metadata__"] == {"format": "pt"}
    entries = list(header.items())[1:]
    # data laid out widest dtype first, then by name, contiguous from 0: what safetensors' serializer does
    assert [name for name, _ in entries] == sorted(tensors, key=lambda k: (tensors[k][0] != "F32", k))
    end = 0
    for _, e in entries:
        assert e["data_offsets"][0] == end
        end = e["data_offsets"][1]
    assert len(raw) == 8 + n + end == 8 + n + total_nbytes(tensors)


def test_random_mode_reads_back_and_converts(tmp_path):
    tensors, config = minimax_h3_tensors(**tiny_config())
    src = tmp_path / "src"
    paths = write_safetensors_checkpoint(src, tensors, config, data="random", max_shard_bytes=100_000, seed=3)
    assert len(paths) > 1
    assert _headers(paths) == tensors
    total = total_nbytes(tensors)
    expected = random_buffer(min(BUFFER_BYTES, total), seed=3)
    for path in paths:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8 + n :]
        assert data == expected[: len(data)]  # each file starts the repeated block anew
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert tuple(t.shape) == tensors[name][1]
    assert random_buffer(64, seed=3) != random_buffer(64, seed=4)

    manifest = _convert(src, tmp_path / "out", tp=2)
    assert set(manifest.tensors) == set(tensors)
    assert len(list((tmp_path / "out").glob("*.distcp"))) == 2
