"""A sharded model's state_dict(), load_state_dict() and save_pretrained() are in full tensors: save_pretrained on
every rank of a tp=2 (and tp2 x ulysses2) job writes, from rank 0 only, the folder the unsharded model's own
save_pretrained writes, byte for byte (config.json, every safetensors file, the index), for the mixed-precision
MiniMax-H3 (packed colwise, replicated-input rowwise) and Flux (packed rowwise); state_dict() equals the source
checkpoint bit for bit on every rank; load_state_dict takes full tensors; a parameter added after loading is
refused in one line with nothing written; a failed write fails every rank and leaves nothing half-written."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks
from oracle import load_source, raw_bytes
from torch import nn

from preshard.examples.minimax_h3 import make_inputs, tiny_config

SMALL_SHARDS = "20KB"  # several files and an index for the tiny models
pytestmark = pytest.mark.timeout(1200)  # the spawned ranks run every case first

TOL = 1e-5


def _bitwise_mismatches(state: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(state) ^ set(source))
    for name, t in state.items():
        want = source.get(name)
        if want is not None and (t.dtype != want.dtype or t.shape != want.shape or raw_bytes(t) != raw_bytes(want)):
            bad.append(name)
    return bad


def _forward(net, inputs):
    with torch.no_grad():
        return net(**inputs, return_dict=False)


def _rank(rank: int, world: int, ckpt: dict, src: dict, out: str, ulysses: int) -> dict:
    from diffusers import FluxTransformer2DModel
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime import saving
    from preshard.runtime.load import load_sharded

    init_gloo()
    out = Path(out)
    res: dict = {}
    net = load_sharded(H3, ckpt["mixed"], ulysses=ulysses)
    source = load_source(Path(src["mixed"]))
    res["state_dict"] = _bitwise_mismatches(net.state_dict(), source)
    with saving.local_state_dict(net):
        local = net.state_dict()
    res["local_shapes"] = {k: tuple(v.shape) for k, v in local.items()}
    net.save_pretrained(out / f"h3-small-{rank}", max_shard_size=SMALL_SHARDS)
    net.save_pretrained(out / f"h3-default-{rank}")
    net.save_pretrained(out / f"h3-bin-{rank}", safe_serialization=False, variant="v1", max_shard_size=SMALL_SHARDS)
    net.save_pretrained(out / f"h3-resaved-{rank}", max_shard_size=SMALL_SHARDS)
    net.save_pretrained(out / f"h3-resaved-{rank}")  # again, into the same folder, as one file

    # A parameter preshard did not load: refused before anything is gathered or written.
    extra = net.get_submodule("transformer_blocks.0.attn")
    extra.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    res["refused"] = []
    for call in (lambda: net.save_pretrained(out / f"refused-{rank}"), net.state_dict):
        try:
            call()
            res["refused"].append(None)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            res["refused"].append(f"{type(exc).__name__}: {exc}")
    res["refused_wrote"] = (out / f"refused-{rank}").exists()
    del extra._parameters["extra"]

    # A write that fails on rank 0: every rank raises, the folder keeps no half-written file.
    real = saving._write_file

    def failing(path, tensors, safe):
        raise OSError("No space left on device (simulated)")

    saving._write_file = failing if rank == 0 else real
    try:
        net.save_pretrained(out / "failed", max_shard_size=SMALL_SHARDS)
        res["failed"] = None
    except OSError as exc:
        res["failed"] = str(exc)
    saving._write_file = real
    res["failed_left"] = sorted(os.listdir(out / "failed")) if rank == 0 and (out / "failed").exists() else []

    # Full tensors in: load_state_dict slices them, the same change as in the unsharded model.
    net32 = load_sharded(H3, ckpt["float32"], ulysses=ulysses)
    full = load_source(Path(src["float32"]))
    g = torch.Generator().manual_seed(5)
    for name in ("transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.1.adaln_proj.linear.weight"):
        full[name] = full[name] + 0.1 * torch.randn(full[name].shape, generator=g)
    net32.load_state_dict(full, strict=True)
    res["loaded_state"] = _bitwise_mismatches(net32.state_dict(), full)
    res["loaded_output"] = [t.clone() for t in _forward(net32, make_inputs(tiny_config(), 37))]

    flux = load_sharded(FluxTransformer2DModel, ckpt["flux"], ulysses=ulysses)
    flux.save_pretrained(out / f"flux-{rank}", max_shard_size=SMALL_SHARDS)
    res["flux_state_dict"] = _bitwise_mismatches(flux.state_dict(), load_source(Path(src["flux"])))
    return res


@pytest.fixture(scope="module")
def sources(tiny_sources, tmp_path_factory) -> dict[str, Path]:
    from tiny_diffusers import build, save

    flux = save(build("flux")[0], tmp_path_factory.mktemp("flux") / "transformer")
    return {"mixed": tiny_sources("mixed"), "float32": tiny_sources("float32"), "flux": flux}


@pytest.fixture(scope="module")
def checkpoints(sources, converted, tmp_path_factory) -> dict[str, str]:
    from preshard.converter.convert import convert_checkpoint

    flux = tmp_path_factory.mktemp("flux-tp2") / "out"
    convert_checkpoint(sources["flux"], flux, tp=2, progress=False)
    return {"mixed": str(converted("mixed", 2)), "float32": str(converted("float32", 2)), "flux": str(flux)}


@pytest.fixture(scope="module")
def unsharded(tiny_models, sources, tmp_path_factory) -> Path:
    """What the unsharded models' own save_pretrained writes, with the same options."""
    from tiny_diffusers import build

    root = tmp_path_factory.mktemp("unsharded")
    model = tiny_models("mixed")
    model.save_pretrained(root / "h3-small", max_shard_size=SMALL_SHARDS)
    model.save_pretrained(root / "h3-default")
    model.save_pretrained(root / "h3-bin", safe_serialization=False, variant="v1", max_shard_size=SMALL_SHARDS)
    build("flux")[0].save_pretrained(root / "flux", max_shard_size=SMALL_SHARDS)  # the model the source holds
    return root


def _run(world: int, ulysses: int, checkpoints, sources, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"saved-world{world}")
    src = {k: str(v) for k, v in sources.items()}
    return out, run_ranks(_rank, world, checkpoints, src, str(out), ulysses, timeout=600)


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["tp2", "tp2-uly2"])
def saved(request, checkpoints, sources, tmp_path_factory):
    world, ulysses = request.param
    return _run(world, ulysses, checkpoints, sources, tmp_path_factory)


def _same_folder(got: Path, want: Path) -> None:
    names = sorted(os.listdir(want))
    assert sorted(os.listdir(got)) == names
    for name in names:
        assert filecmp.cmp(got / name, want / name, shallow=False), f"{name} differs"


def test_save_pretrained_writes_the_unsharded_models_folder_byte_for_byte(saved, unsharded):
    out, _ = saved
    for kind in ("h3-small", "h3-default", "flux"):
        _same_folder(out / f"{kind}-0", unsharded / kind)
    assert len(os.listdir(unsharded / "h3-small")) > 3  # several files and an index: the split is exercised
    assert "diffusion_pytorch_model.safetensors.index.json" in os.listdir(out / "flux-0")


def test_only_rank0_writes(saved):
    out, runs = saved
    for rank in range(1, len(runs)):
        for kind in ("h3-small", "h3-default", "h3-bin", "h3-resaved", "flux"):
            assert not (out / f"{kind}-{rank}").exists()
    assert not [p for p in os.listdir(out / "h3-default-0") if p.startswith(".")]  # no staging folder left


def test_torch_save_files_hold_the_source_tensors(saved, sources, unsharded):
    out, _ = saved
    names = sorted(os.listdir(out / "h3-bin-0"))
    assert names == sorted(os.listdir(unsharded / "h3-bin"))
    assert "diffusion_pytorch_model.bin.index.v1.json" in names
    state = {}
    for name in names:
        if name.endswith(".bin"):
            state.update(torch.load(out / "h3-bin-0" / name, weights_only=True))
    assert _bitwise_mismatches(state, load_source(sources["mixed"])) == []


def test_saving_again_replaces_the_earlier_files(saved, unsharded):
    out, _ = saved
    _same_folder(out / "h3-resaved-0", unsharded / "h3-default")  # the numbered files and their index are gone


def test_state_dict_is_the_source_on_every_rank(saved, checkpoints):
    from preshard.format.manifest import read_manifest

    _, runs = saved
    manifest = read_manifest(checkpoints["mixed"])
    for run in runs:
        assert run["state_dict"] == [] and run["flux_state_dict"] == []
        local = run["local_shapes"]  # local_state_dict: this rank's slices, named as such
        for name, record in manifest.tensors.items():
            assert local[name] == record.layout.local_shape(2)
        assert sum(local[n] != manifest.tensors[n].layout.shape for n in local) > 10


def test_a_parameter_added_after_loading_is_refused_in_one_line(saved):
    _, runs = saved
    for run in runs:
        for message in run["refused"]:
            assert message is not None and "\n" not in message
            assert message.startswith("UsageError: MiniMaxH3Transformer3DModel:")
            assert "transformer_blocks.0.attn.extra was added after load_sharded" in message
        assert not run["refused_wrote"]


def test_a_failed_write_fails_every_rank_and_leaves_nothing(saved):
    _, runs = saved
    assert runs[0]["failed"] == "No space left on device (simulated)"
    for run in runs[1:]:
        assert "failed on rank 0" in run["failed"]
    assert runs[0]["failed_left"] == []


def test_load_state_dict_takes_full_tensors(saved, sources):
    """The same change in the unsharded model gives the same output: the full tensors were sliced right."""
    from diffusers import MiniMaxH3Transformer3DModel as H3

    _, runs = saved
    full = load_source(sources["float32"])
    g = torch.Generator().manual_seed(5)
    for name in ("transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.1.adaln_proj.linear.weight"):
        full[name] = full[name] + 0.1 * torch.randn(full[name].shape, generator=g)
    model = H3.from_pretrained(sources["float32"]).eval()
    original = _forward(model, make_inputs(tiny_config(), 37))
    model.load_state_dict(full)
    changed = _forward(model, make_inputs(tiny_config(), 37))
    assert max((a - b).abs().max().item() for a, b in zip(original, changed, strict=True)) > 1e-2
    for run in runs:
        assert run["loaded_state"] == []
        for got, want in zip(run["loaded_output"], changed, strict=True):
            assert (got - want).abs().max().item() <= TOL


def test_the_saved_folder_loads_with_from_pretrained(saved, tiny_models):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    out, _ = saved
    loaded = H3.from_pretrained(out / "h3-small-0").state_dict()  # diffusers loads it in float32
    want = tiny_models("mixed").state_dict()
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[n].to(w.dtype), w) for n, w in want.items())  # bf16 -> fp32 -> bf16 is exact


def test_one_process_without_a_process_group(converted, tiny_models, tmp_path):
    """tp=1 in this process (no torch.distributed): save_pretrained writes the same folder, no exchange needed."""
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    net = load_sharded(H3, converted("mixed", 1), device="cpu")
    net.save_pretrained(tmp_path / "got", max_shard_size=SMALL_SHARDS)
    tiny_models("mixed").save_pretrained(tmp_path / "want", max_shard_size=SMALL_SHARDS)
    _same_folder(tmp_path / "got", tmp_path / "want")


def test_a_save_that_fails_part_way_leaves_the_earlier_save_whole(converted, tiny_models, tmp_path, monkeypatch):
    """A second save_pretrained into the same folder (one file this time, so the earlier numbered files and index
    are to go) fails at its weights file, or at the publish: the folder is still the first save, file for file."""
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.format import publish
    from preshard.runtime import saving
    from preshard.runtime.load import load_sharded

    net = load_sharded(H3, converted("mixed", 1), device="cpu")
    net.save_pretrained(tmp_path / "got", max_shard_size=SMALL_SHARDS)
    (tmp_path / "got" / "notes.txt").write_text("the user's")  # not preshard's: carried over by every save
    tiny_models("mixed").save_pretrained(tmp_path / "want", max_shard_size=SMALL_SHARDS)
    (tmp_path / "want" / "notes.txt").write_text("the user's")

    def full_disk(path, tensors, safe):
        raise OSError("No space left on device (simulated)")

    def broken_rename(a, b):
        raise OSError("Input/output error (simulated)")

    for module, name, fake in ((saving, "_write_file", full_disk), (publish, "exchange", broken_rename)):
        with monkeypatch.context() as patch, pytest.raises(OSError, match="simulated"):
            patch.setattr(module, name, fake)
            net.save_pretrained(tmp_path / "got")
        _same_folder(tmp_path / "got", tmp_path / "want")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["got", "want"]  # no staged folder left
    net.save_pretrained(tmp_path / "got")  # and the same save, not failing, replaces the set
    tiny_models("mixed").save_pretrained(tmp_path / "one-file")
    (tmp_path / "one-file" / "notes.txt").write_text("the user's")
    _same_folder(tmp_path / "got", tmp_path / "one-file")  # the numbered files and their index are gone


# ---------------------------------------------------------------- tensor-parallel norms and LoRA adapters


def _norms_and_lora_rank(rank: int, world: int, ckpt: dict, src: dict, out: str) -> dict:
    """Wan and Wan I2V at tp=2 (q/k norms under tp_rms_norm, sharded with the heads) save and gather in full; a
    Flux with LoRA adapters loaded is refused in one line, and after fuse_lora + unload_lora gathers the fused
    weights."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel
    from tiny_diffusers import build
    from tiny_lora import make_lora

    from preshard.errors import UsageError
    from preshard.runtime import saving
    from preshard.runtime.load import load_sharded

    init_gloo()
    out = Path(out)
    res: dict = {}
    for kind in ("wan", "wan_i2v"):
        net = load_sharded(WanTransformer3DModel, ckpt[kind])
        res[kind, "state_dict"] = _bitwise_mismatches(net.state_dict(), load_source(Path(src[kind])))
        with saving.local_state_dict(net):
            res[kind, "local norm"] = tuple(net.state_dict()["blocks.0.attn1.norm_q.weight"].shape)
        net.save_pretrained(out / f"{kind}-{rank}", max_shard_size=SMALL_SHARDS)

    model, _ = build("flux")
    lora = make_lora(model, out / f"lora-{rank}.safetensors", seed=7)
    from diffusers.loaders import FluxLoraLoaderMixin

    state, alphas = FluxLoraLoaderMixin.lora_state_dict(str(lora), return_alphas=True)
    net = load_sharded(FluxTransformer2DModel, ckpt["flux"])
    gathers = []
    real_full = saving.Sharding.full
    saving.Sharding.full = lambda self, *a, **k: gathers.append(a[0]) or real_full(self, *a, **k)
    net.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="steps")
    saving.Sharding.full = real_full
    res["gathers while loading"] = len(gathers)  # diffusers and PEFT read state_dict(): this rank's slices
    model.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="steps")
    with_adapters, want = net.state_dict(), model.state_dict()
    res["with adapters"] = _bitwise_mismatches(with_adapters, want)
    res["factor names"] = sum(".lora_" in k for k in want)
    with saving.local_state_dict(net):
        local = net.state_dict()
    res["local factors split"] = sum(local[k].shape != want[k].shape for k in want if ".lora_" in k)
    try:
        net.save_pretrained(out / f"lora-saved-{rank}")
        res["lora refusal"] = None
    except UsageError as exc:
        res["lora refusal"] = str(exc)
    res["lora wrote"] = (out / f"lora-saved-{rank}").exists()
    for m in (model, net):
        m.fuse_lora()
        m.unload_lora()
    want = model.state_dict()
    got = net.state_dict()
    res["fused keys"] = sorted(set(got) ^ set(want))
    res["fused diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
    res["fused changed"] = max((want[k] - v).abs().max().item() for k, v in build("flux")[0].state_dict().items())
    return res


@pytest.fixture(scope="module")
def norms_and_lora(tmp_path_factory):
    from tiny_diffusers import build, save

    from preshard.converter.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("norms-lora")
    src, ckpt = {}, {}
    for kind in ("wan", "wan_i2v", "flux"):
        src[kind] = str(save(build(kind)[0], root / f"{kind}-src"))
        convert_checkpoint(src[kind], root / f"{kind}-tp2", tp=2, progress=False)
        ckpt[kind] = str(root / f"{kind}-tp2")
        build(kind)[0].save_pretrained(root / f"{kind}-want", max_shard_size=SMALL_SHARDS)
    out = root / "out"
    out.mkdir()
    return root, run_ranks(_norms_and_lora_rank, 2, ckpt, src, str(out), timeout=600)


def test_tensor_parallel_norms_are_gathered_and_saved_byte_for_byte(norms_and_lora):
    root, runs = norms_and_lora
    for run in runs:
        for kind in ("wan", "wan_i2v"):
            assert run[kind, "state_dict"] == []
            assert run[kind, "local norm"] == (16,)  # the norm weight really is split (32 wide, tp=2)
    for kind in ("wan", "wan_i2v"):
        _same_folder(root / "out" / f"{kind}-0", root / f"{kind}-want")
        assert not (root / "out" / f"{kind}-1").exists()


def test_with_lora_adapters_state_dict_is_the_unsharded_models_and_save_pretrained_refuses(norms_and_lora):
    _, runs = norms_and_lora
    for run in runs:
        assert run["gathers while loading"] == 0
        assert run["with adapters"] == [], run["with adapters"]  # base_layer names and factors, bit for bit
        assert run["factor names"] > 10 and run["local factors split"] > 5  # the factors really are sliced
        message = run["lora refusal"]
        assert message is not None and "\n" not in message, message
        assert message.startswith("FluxTransformer2DModel: LoRA adapters are loaded (steps)")
        assert "model.fuse_lora(); model.unload_lora()" in message and "--lora" in message
        assert not run["lora wrote"]
        assert run["fused keys"] == []
        assert run["fused changed"] > 1e-3  # the LoRA changed the weights: the comparison below means something
        assert run["fused diff"] <= 1e-6, run["fused diff"]
