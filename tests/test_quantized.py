"""Quantized checkpoints (format/quant.py, runtime/quant.py): each published layout of fp8/int8 weights with their
scales converts with the built-in plan, loads quantized on 2 gloo ranks, and computes the unsharded model with the
dequantized weights; what preshard does not handle is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from safetensors.torch import load_file, save_file
from tiny_builtin import build as build_builtin
from tiny_diffusers import build

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.examples.minimax_h3 import build_model as build_h3

FP8_MAX = 448.0
BLOCK = 16  # the tiny models' sharded widths are whole 16-blocks at tp=2; tp=4 would cut some (refused)
QUANTIZED_MODULES = ("blocks.", "transformer_blocks.", "single_transformer_blocks.", "token_refiner.")


def _linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    """The transformer blocks' Linear weights, as the published fp8 files quantize (the embedders stay: Wan casts
    the timestep to its time embedder's weight dtype)."""
    return [k for k, v in state.items() if k.startswith(QUANTIZED_MODULES) and k.endswith(".weight") and v.dim() == 2]


def _all_linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    """Every 2-D weight, as a plain `fp8_e4m3fn` cast of a whole model stores it (the issue's failing case)."""
    return [k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2]


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().float() / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn), scale


def _per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).float() / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = w.reshape(rows // block, block, cols // block, block).abs().amax(dim=(1, 3)).float() / FP8_MAX
    full = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (w / full).to(torch.float8_e4m3fn), grid


def quantized_state(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`state` (a float32 Wan) stored the way one published layout stores it."""
    out = dict(state)
    for name in _linear_weights(state) if layout != "plain_fp8" else _all_linear_weights(state):
        prefix, w = name[: -len("weight")], state[name]
        if layout in ("comfy_scale_weight", "comfy_weight_scale", "modelopt"):
            q, scale = _per_tensor(w)
            old_spelling = layout == "comfy_scale_weight"
            weight_key, input_key = ("scale_weight", "scale_input") if old_spelling else ("weight_scale", "input_scale")
            out[name] = q
            out[prefix + weight_key] = scale.reshape(()) if layout == "comfy_weight_scale" else scale.reshape(1)
            out[prefix + input_key] = torch.ones(() if layout == "comfy_weight_scale" else (1,))
        elif layout == "plain_fp8":  # a whole-model cast: the embedders too (see _all_linear_weights)
            out[name] = w.to(torch.float8_e4m3fn)
        elif layout == "int8_channel":
            q, scale = _per_channel_int8(w)
            out[name] = q  # LightX2V: [out]; ModelOpt-style [out, 1] on every other weight
            out[prefix + "weight_scale"] = scale if len(out) % 2 else scale[:, None].contiguous()
        elif layout == "block_fp8":
            if w.shape[0] % BLOCK or w.shape[1] % BLOCK:
                continue
            out[name], out[prefix + "weight_scale_inv"] = _blocks(w, BLOCK)
    if layout.startswith("comfy"):
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def dequantized(state: dict[str, torch.Tensor], apply_scales: bool = True) -> dict[str, torch.Tensor]:
    """The float32 model a quantized state computes (what `--apply_scales False` leaves out: a negative control)."""
    out = {}
    for name, value in state.items():
        leaf = name.rpartition(".")[2]
        if leaf in ("weight_scale", "scale_weight", "input_scale", "scale_input", "weight_scale_inv", "scaled_fp8"):
            continue
        if leaf == "weight" and value.dtype in (torch.float8_e4m3fn, torch.int8):
            w = value.float()
            prefix = name[: -len("weight")]
            for key in ("weight_scale", "scale_weight"):
                if apply_scales and prefix + key in state:
                    s = state[prefix + key].float()
                    w = w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
            if apply_scales and prefix + "weight_scale_inv" in state:
                grid = state[prefix + "weight_scale_inv"]
                w = w * grid.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            value = w
        out[name] = value
    return out


H3_LAYOUTS = ("block_fp8", "int8_channel")
HV_LAYOUTS = ("block_fp8", "comfy_weight_scale")  # HunyuanVideo: packed_rowwise single-stream proj_out
LAYOUTS = ("comfy_scale_weight", "comfy_weight_scale", "modelopt", "plain_fp8", "int8_channel", "block_fp8")


def _config(model) -> dict:
    return {"_class_name": type(model).__name__, **{k: v for k, v in model.config.items() if not k.startswith("_")}}


def _save(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


def _with_block(config: dict, layout: str, block: int = BLOCK) -> dict:
    if layout != "block_fp8":
        return config
    return {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [block, block]}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    model, _ = build("wan")
    config = _config(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    made = {"dense": str(_save(root / "dense", config, state))}  # the float32 original, for the plan's figures
    for layout in LAYOUTS:  # block FP8 states its block size, as every release does (the shapes cannot tell)
        source = _save(root / layout, _with_block(config, layout), quantized_state(state, layout))
        convert_checkpoint(source, root / f"{layout}-tp2", tp=2, progress=False)
        made[layout] = str(source)
    h3 = build_h3(dtype="float32", seed=0)
    h3_state = {k: v.contiguous() for k, v in h3.state_dict().items()}
    for layout in H3_LAYOUTS:  # block FP8 with its block size in config.json, as DeepSeek-style releases state it
        extra = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}
        source = _save(root / f"h3-{layout}", {**_config(h3), **extra}, quantized_state(h3_state, layout))
        convert_checkpoint(source, root / f"h3-{layout}-tp2", tp=2, progress=False)
        made[f"h3-{layout}"] = str(source)
    hv, _ = build_builtin("hunyuanvideo")
    hv_state = {k: v.contiguous() for k, v in hv.state_dict().items()}
    for layout in HV_LAYOUTS:
        source = _save(root / f"hv-{layout}", _with_block(_config(hv), layout), quantized_state(hv_state, layout))
        convert_checkpoint(source, root / f"hv-{layout}-tp2", tp=2, progress=False)
        made[f"hv-{layout}"] = str(source)
    return made


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def _quantized(net: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in net.modules() if getattr(m, "preshard_compute_dtype", None) is not None]


def _family(key: str):
    """(fresh float32 model, inputs, forward returning the first output) of the checkpoint `key`."""
    if key.startswith("h3-"):
        from preshard.examples.minimax_h3 import make_inputs, reference_forward, tiny_config

        return (
            build_h3(dtype="float32", seed=0),
            make_inputs(tiny_config(), 37),
            lambda m, x: reference_forward(m, x)[0],
        )
    model, inputs = build_builtin("hunyuanvideo") if key.startswith("hv-") else build("wan")
    return model, inputs, lambda m, x: m(**x, return_dict=False)[0]


def _compare(key: str, source: str, converted: str, **load) -> tuple[dict, torch.nn.Module, dict, object]:
    from preshard.runtime.load import load_sharded

    state = load_file(str(Path(source) / "diffusion_pytorch_model.safetensors"))
    reference, inputs, forward = _family(key)
    reference.load_state_dict(dequantized(state))
    unscaled, _, _ = _family(key)
    unscaled.load_state_dict(dequantized(state, apply_scales=False))
    net = load_sharded(type(reference), converted, **load)
    with torch.no_grad():
        out, want, without_scales = forward(net, inputs), forward(reference, inputs), forward(unscaled, inputs)
    quant_hooks = {m: h for m, hooks in net.preshard_report.hooks.items() for h in hooks if h.startswith("quant")}
    result = {
        "diff": (out - want).abs().max().item(),
        "scale": want.abs().max().item(),
        "unscaled_diff": (without_scales - want).abs().max().item(),
        "weight_bytes": sorted({p.dtype.itemsize for n, p in net.named_parameters() if n.endswith(".weight")}),
        "formats": sorted({str(getattr(m, "preshard_weight_format", m.weight.dtype)) for m in _quantized(net)}),
        "quant_hooks": len(quant_hooks),
        "cp_hooks": sum("cp" in h for hooks in net.preshard_report.hooks.values() for h in hooks),
    }
    return result, net, inputs, (forward, out, state)


def _rank(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    from tiny_lora import make_lora

    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import unparallelize_linear

    results: dict = {}
    for key, source in checkpoints.items():
        result, net, inputs, (forward, out, state) = _compare(key, source, source + "-tp2")
        results[key] = result
        if key in ("int8_channel", "comfy_scale_weight"):  # the stored tensors, dtypes and scales, in full
            full = net.state_dict()
            results[f"state_dict_equal {key}"] = sorted(full) == sorted(state) and all(
                full[k].dtype == state[k].dtype and torch.equal(_bits(full[k]), _bits(state[k])) for k in state
            )
        if key == "comfy_scale_weight":  # save_pretrained writes what the source stored, float8 and scales
            saved = Path(source).parent / "saved"
            net.save_pretrained(saved)
            written = load_file(str(saved / "diffusion_pytorch_model.safetensors"))
            results["saved_equal"] = sorted(written) == sorted(state) and all(
                written[k].dtype == state[k].dtype and torch.equal(_bits(written[k]), _bits(state[k])) for k in state
            )
        if key == "comfy_scale_weight":  # fullgraph: any graph break is an error
            compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
            with torch.no_grad():
                results["compiled_diff"] = (compiled(**inputs, return_dict=False)[0] - out).abs().max().item()
        if key == "h3-int8_channel":  # dtype=: the compute dtype; scales stay as stored
            bf16 = load_sharded(type(net), source + "-tp2", dtype="bfloat16")
            with torch.no_grad():
                got = forward(
                    bf16, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
                )
            adaln = bf16.get_submodule("transformer_blocks.0.adaln_proj.linear")
            results["bf16"] = {
                "relative": ((got.float() - out).abs().max() / out.abs().max()).item(),
                "scale_dtype": str(adaln.weight_scale.dtype),
                "compute": str(adaln.preshard_compute_dtype),
            }
        if key == "int8_channel":
            # Negative control: the row-parallel to_out without its scale's dequantization computes another model.
            to_out = net.get_submodule("blocks.0.attn1.to_out.0")
            results["to_out_hook"] = net.preshard_report.hooks["blocks.0.attn1.to_out.0"]
            to_out.preshard_scale_name = None
            with torch.no_grad():
                results["no_scale_diff"] = (net(**inputs, return_dict=False)[0] - out).abs().max().item()
            unparallelize_linear(to_out)
        if key == "h3-block_fp8":  # a LoRA at run time on the FP8 shards: separate adapters, as on the unsharded model
            from diffusers.loaders import MiniMaxH3LoraLoaderMixin

            reference, _, _ = _family(key)
            reference.load_state_dict(dequantized(state))
            path = make_lora(reference, Path(source).parent / f"lora-{rank}.safetensors", seed=3)
            lora = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path))
            alphas = {k: lora.pop(k) for k in [k for k in lora if k.endswith(".alpha")]}
            reference.load_lora_adapter(dict(lora), network_alphas=alphas, adapter_name="a")
            net.load_lora_adapter(dict(lora), network_alphas=alphas, adapter_name="a")
            with torch.no_grad():
                want = forward(reference, inputs)
                results["lora_diff"] = (forward(net, inputs) - want).abs().max().item()
                results["lora_effect"] = (want - out).abs().max().item()
    return results


def _rank_cp(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    return {key: _compare(key, source, source + "-tp2", ulysses=2)[0] for key, source in checkpoints.items()}


@pytest.fixture(scope="module")
def tp2(checkpoints) -> list[dict]:
    return run_ranks(_rank, 2, {k: v for k, v in checkpoints.items() if k != "dense"}, timeout=600)


@pytest.fixture(scope="module")
def tp2_ulysses2(checkpoints) -> list[dict]:
    chosen = {k: checkpoints[k] for k in ("comfy_scale_weight", "int8_channel", "h3-block_fp8")}
    return run_ranks(_rank_cp, 4, chosen, timeout=600)


def _check(got: dict, key: str) -> None:
    assert got["diff"] <= 1e-5 * max(1.0, got["scale"]), got
    assert 1 in got["weight_bytes"], got  # kept quantized in memory
    assert got["formats"] == (["torch.int8"] if "int8" in key else ["torch.float8_e4m3fn"]), got
    assert got["quant_hooks"] > 0, got
    if key != "plain_fp8":  # negative control: the scales matter, so the comparison can tell
        assert got["unscaled_diff"] > 1e-2, got


@pytest.mark.parametrize(
    "key", [*LAYOUTS, *(f"h3-{layout}" for layout in H3_LAYOUTS), *(f"hv-{layout}" for layout in HV_LAYOUTS)]
)
def test_each_layout_loads_quantized_and_equals_the_dequantized_unsharded_model(tp2, key):
    for rank in tp2:
        _check(rank[key], key)


@pytest.mark.parametrize("key", ["comfy_scale_weight", "int8_channel", "h3-block_fp8"])
def test_tp2_ulysses2_equals_the_dequantized_unsharded_model_with_the_cp_hooks_in_place(tp2_ulysses2, key):
    for rank in tp2_ulysses2:
        _check(rank[key], key)
        assert rank[key]["cp_hooks"] > 0


def test_state_dict_and_save_pretrained_give_the_stored_tensors_compile_has_no_break_and_scales_matter(tp2):
    for rank in tp2:
        assert rank["state_dict_equal int8_channel"] and rank["state_dict_equal comfy_scale_weight"]
        assert rank["saved_equal"]
        assert rank["compiled_diff"] <= 1e-5
        assert any(h.startswith("quant: int8, channel scale") for h in rank["to_out_hook"]), rank["to_out_hook"]
        assert rank["no_scale_diff"] > 1e-2


def test_a_bf16_compute_dtype_keeps_the_float32_scales(tp2):
    for rank in tp2:
        got = rank["bf16"]
        assert got["scale_dtype"] == "torch.float32" and got["compute"] == "torch.bfloat16", got
        assert got["relative"] < 5e-2, got


def test_a_runtime_lora_on_fp8_shards_equals_the_unsharded_model_with_the_same_lora(tp2):
    for rank in tp2:
        assert rank["lora_effect"] > 1e-2 and rank["lora_diff"] <= 1e-5, rank


def test_verify_and_unshard_keep_the_quantized_bytes_and_scales(checkpoints, tmp_path):
    from preshard.tools.reshard import reshard_checkpoint
    from preshard.tools.unshard import unshard_checkpoint
    from preshard.tools.verify import verify_checkpoint

    for layout in ("comfy_scale_weight", "int8_channel", "block_fp8"):
        source = Path(checkpoints[layout])
        assert verify_checkpoint(str(source) + "-tp2", source=source).ok
        resharded = tmp_path / f"{layout}-tp1"
        reshard_checkpoint(str(source) + "-tp2", resharded, tp=1, progress=False)
        assert verify_checkpoint(resharded, source=source).ok
        out = tmp_path / layout
        unshard_checkpoint(resharded, out, progress=False)
        name = "diffusion_pytorch_model.safetensors"
        assert (out / name).read_bytes() == (source / name).read_bytes()


def test_preshard_plan_counts_the_quantized_bytes_each_rank_reads(checkpoints):
    from preshard.format.manifest import read_manifest
    from preshard.tools.planner import plan_meshes

    for key in ("comfy_scale_weight", "int8_channel", "block_fp8", "h3-block_fp8"):
        report = plan_meshes(checkpoints[key])
        tp2 = next(m for m in report.meshes if m.tp == 2)
        manifest = read_manifest(checkpoints[key] + "-tp2")
        assert tp2.read_bytes_per_rank == max(manifest.read_bytes(r) for r in range(2)), key
    dense = plan_meshes(checkpoints["dense"])
    quantized = plan_meshes(checkpoints["comfy_scale_weight"])
    # the split Linear weights: float32 to float8 plus a scale each (the replicated embedders and norms stay)
    assert quantized.meshes[1].own_bytes_per_rank < 0.3 * dense.meshes[1].own_bytes_per_rank


@pytest.mark.quick
def test_a_block_grid_the_tp_degree_would_cut_names_the_degrees_that_work(tmp_path):
    model, _ = build("wan")
    config = _config(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    name = "blocks.0.attn1.to_q.weight"
    w, grid = _blocks(state[name], 16)  # 32 rows: two 16-row blocks, which tp=4 would cut
    scales = {name: w, "blocks.0.attn1.to_q.weight_scale_inv": grid}
    source = _save(tmp_path / "src", _with_block(config, "block_fp8"), {**state, **scales})
    with pytest.raises(PlanError, match=r"weight_scale_inv dim 0 .*TP degrees that work for this checkpoint: 1, 2$"):
        convert_checkpoint(source, tmp_path / "out", tp=4, progress=False)


@pytest.mark.quick
@pytest.mark.parametrize(
    "extra, message",
    [
        ({"blocks.0.attn1.to_q.weight_scale_2": torch.ones(1)}, "NVFP4"),
        ({"blocks.0.attn1.to_q.SCB": torch.ones(32)}, "bitsandbytes"),
        ({"blocks.0.attn1.to_q.qweight": torch.ones(4, dtype=torch.int32)}, "GPTQ"),
        ({"blocks.0.attn1.to_q.weight_scale": torch.ones(3)}, "fits no scale granularity"),
        ({"blocks.0.attn1.to_k.weight_scale": torch.ones(1)}, "not an fp8/int8 Linear weight"),
        ({"condition_embedder.time_proj.weight_scale": torch.ones(3)}, "fits no scale granularity"),  # replicated
        ({"blocks.0.attn1.to_q.weight_scale": torch.ones(1, dtype=torch.int32)}, "a weight scale is stored in"),
    ],
)
def test_layouts_and_scales_preshard_does_not_handle_are_refused_in_one_line(tmp_path, extra, message):
    model, _ = build("wan")
    config = _config(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in ("blocks.0.attn1.to_q.weight", "condition_embedder.time_proj.weight"):
        state[name] = state[name].to(torch.float8_e4m3fn)
    source = _save(tmp_path / "src", config, {**state, **extra})
    with pytest.raises(PlanError, match=message) as info:
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_math_reference_is_itself_right():
    """The test's own dequantization agrees with a direct computation (so a bug in both cannot hide)."""
    w = torch.randn(16, 16)
    q, grid = _blocks(w, BLOCK)
    back = q.float() * grid.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert (back - w).abs().max() <= w.abs().max() * 2**-3 + 1e-6
    assert math.isclose(float(grid[0, 0]), float(w[:BLOCK, :BLOCK].abs().max()) / FP8_MAX, rel_tol=1e-6)


@pytest.mark.parametrize("layout", ["comfy_weight_scale", "int8_channel"])
def test_a_lora_is_not_fused_into_quantized_weights_at_conversion(checkpoints, tmp_path, layout):
    """Fusing would need each weight's scales recomputed: refused in one line naming the weight and its stored dtype,
    before anything is written. The dense checkpoint takes the same LoRA (the control)."""
    from tiny_lora import make_lora

    from preshard.errors import MismatchError

    model, _ = build("wan")
    lora = make_lora(model, tmp_path / "lora.safetensors", pattern=r".*attn1\.to_q", seed=3)
    out = tmp_path / "out"
    with pytest.raises(MismatchError, match=r"targets blocks\.0\.attn1\.to_q\.weight, stored as (float8_e4m3fn|int8)"):
        convert_checkpoint(checkpoints[layout], out, tp=2, progress=False, loras=[(lora, 1.0)])
    assert not out.exists()
    convert_checkpoint(checkpoints["dense"], tmp_path / "dense", tp=2, progress=False, loras=[(lora, 1.0)])


# ---------------------------------------------------------------------------------------------------------
# Quantized files are not guessed (issue 36): an ambiguous block size, non-finite scales, a scale beside a float weight


def _ragged_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of `w` with `block`-square blocks, the last ones ragged."""
    rows, cols = w.shape
    g0, g1 = -(-rows // block), -(-cols // block)
    grid = torch.stack([
        torch.stack([w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max() for j in range(g1)])
        for i in range(g0)
    ]).float() / FP8_MAX  # fmt: skip
    full = grid.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), grid


def _one_quantized(tmp_path: Path, extra: dict, config_extra: dict | None = None, name: str = "to_q") -> Path:
    """A tiny Wan with `blocks.0.attn1.<name>` replaced by `extra`'s tensors (weight and scale)."""
    model, _ = build("wan")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return _save(tmp_path / "src", {**_config(model), **(config_extra or {})}, {**state, **extra})


@pytest.mark.quick
def test_a_block_size_the_shapes_do_not_determine_is_refused_asking_for_weight_block_size(tmp_path):
    """A 32x64 weight in 17-blocks has a [2, 4] grid, which 16-blocks also have: 16 was guessed (0.077 off)."""
    w = torch.randn(32, 64)
    q, grid = _ragged_blocks(w, 17)
    assert list(grid.shape) == [2, 4]
    model, _ = build("wan")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    # the Wan tiny's to_q is 32x32: use a model-free check of the format rules on the exact shapes
    from preshard.format.quant import recognise

    shapes = {"m.weight": ((32, 64), torch.float8_e4m3fn), "m.weight_scale_inv": ((2, 4), torch.float32)}
    with pytest.raises(PlanError, match=r"m\.weight_scale_inv: its \[2, 4\] grid .* fits blocks of 16 to 31 .*"
                       r"weight_block_size") as info:  # fmt: skip
        recognise(shapes)
    assert "\n" not in str(info.value)
    config = {"quantization_config": {"weight_block_size": [17, 17]}}
    assert recognise(shapes, config)["m.weight"].block == (17, 17)  # stated: used as stated
    determined = {"m.weight": ((2, 64), torch.float8_e4m3fn), "m.weight_scale_inv": ((2, 1), torch.float32)}
    assert recognise(determined)["m.weight"].block == (1, 64)  # one size fits each dimension: not a guess
    # end to end: a conversion of a Wan block-FP8 to_q without the config entry is refused, nothing written
    name = "blocks.0.attn1.to_q.weight"
    q, grid = _ragged_blocks(state[name], 17)  # 32x32 in 17-blocks: [2, 2], which 16 to 31 fit
    source = _save(tmp_path / "src", _config(model), {**state, name: q, name + "_scale_inv": grid})
    with pytest.raises(PlanError, match="weight_block_size"):
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    assert not (tmp_path / "out").exists()


def _nonfinite_cases() -> list[tuple[str, str, float]]:
    return [(g, kind, v) for g in ("tensor", "channel", "block") for kind, v in (("nan", math.nan), ("inf", math.inf),
            ("-inf", -math.inf))]  # fmt: skip


def _scaled(state: dict[str, torch.Tensor], granularity: str, value: float) -> dict[str, torch.Tensor]:
    name = "blocks.0.attn1.to_q.weight"
    w = state[name]
    if granularity == "tensor":
        q, scale = _per_tensor(w)
        scale, key = scale.reshape(1).clone(), "weight_scale"
        scale[0] = value
    elif granularity == "channel":
        q, scale = _per_channel_int8(w)
        scale, key = scale.clone(), "weight_scale"
        scale[3] = value
    else:
        q, scale = _blocks(w, BLOCK)
        scale, key = scale.clone(), "weight_scale_inv"
        scale[1, 0] = value
    return {**state, name: q, f"blocks.0.attn1.to_q.{key}": scale}


@pytest.mark.quick
@pytest.mark.parametrize("granularity, kind, value", _nonfinite_cases())
def test_a_nan_or_inf_weight_scale_is_refused_at_conversion_naming_it(tmp_path, granularity, kind, value):
    model, _ = build("wan")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = _with_block(_config(model), "block_fp8" if granularity == "block" else "")
    source = _save(tmp_path / "src", config, _scaled(state, granularity, value))
    from preshard.errors import SourceError

    with pytest.raises(SourceError, match=r"weight scale blocks\.0\.attn1\.to_q\.weight_scale(_inv)? holds NaN") as e:
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    finite = _save(tmp_path / "ok", config, _scaled(state, granularity, 0.01))  # the control converts
    convert_checkpoint(finite, tmp_path / "ok-out", tp=2, progress=False)


def _load_rank(rank: int, world: int, folder: str) -> str:
    from preshard.runtime.load import load_sharded

    model, _ = build("wan")
    try:
        load_sharded(type(model), folder)
    except Exception as exc:  # noqa: BLE001 - the test compares the lines
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_nan_or_inf_weight_scale_in_a_converted_checkpoint_is_refused_at_load_on_every_rank(tmp_path):
    """A checkpoint converted before the check existed (the conversion check switched off here) is refused at load
    naming the scale, on every rank (a per-channel scale's NaN is in one rank's slice only)."""
    model, _ = build("wan")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = _config(model)
    results = {}
    from preshard.converter import quantize as quantize_module

    for granularity, value in (("channel", math.nan), ("tensor", math.inf), ("block", -math.inf)):
        cfg = _with_block(config, "block_fp8" if granularity == "block" else "")
        folder = tmp_path / granularity
        source = _save(folder / "s", cfg, _scaled(state, granularity, value))
        with pytest.MonkeyPatch.context() as patch:  # an older preshard: no check at conversion
            patch.setattr(quantize_module, "with_scale_checks", lambda src: src)
            convert_checkpoint(source, folder / "out", tp=2, progress=False)
        results[granularity] = run_ranks(_load_rank, 2, str(folder / "out"), timeout=300)
    for lines in results.values():
        assert all(line.startswith("CorruptCheckpointError") and "\n" not in line for line in lines), lines
        assert all("blocks.0.attn1.to_q.weight_scale" in line and "NaN or Inf" in line for line in lines), lines


@pytest.mark.quick
@pytest.mark.parametrize("scale", ["weight_scale", "scale_weight", "weight_scale_inv"])
def test_a_weight_scale_beside_a_float_linear_the_plan_keeps_whole_is_refused(tmp_path, scale):
    """Wan's condition embedder is replicated: a scale beside its float32 weight was left unapplied, silently."""
    model, _ = build("wan")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    name = "condition_embedder.time_proj"
    shape = (2, 2) if scale == "weight_scale_inv" else (1,)
    source = _save(tmp_path / "src", _config(model), {**state, f"{name}.{scale}": torch.full(shape, 0.5)})
    with pytest.raises(PlanError, match=rf"{name}\.{scale} is a weight scale, but its module has a float32 weight"):
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# Quantized weights computed where they are (issue 39): no full-precision copy of a weight, at any moment


class _Sizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest floating (2+ bytes per element) tensor any op makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype.itemsize > 1:
                self.largest = max(self.largest, t.numel())
        return out


def _quantized_linear(fmt: str, granularity: str, rows: int = 1536, cols: int = 1024):
    from preshard.format.quant import QuantSpec
    from preshard.runtime.quant import attach

    torch.manual_seed(0)
    w = torch.randn(rows, cols)
    linear = torch.nn.Linear(cols, rows)
    state = {"weight": w}
    if granularity == "block":
        q, grid = _blocks(w, 128)
        state = {"weight": q, "weight_scale_inv": grid}
        spec = QuantSpec("m.weight", "float8_e4m3fn", "block", "m.weight_scale_inv", "float32", (128, 128))
    elif fmt == "int8":
        q, scale = _per_channel_int8(w)
        state = {"weight": q, "weight_scale": scale}
        spec = QuantSpec("m.weight", "int8", "channel", "m.weight_scale", "float32")
    else:
        q, scale = _per_tensor(w)
        state = {"weight": q, "weight_scale": scale.reshape(1)}
        spec = QuantSpec("m.weight", "float8_e4m3fn", "tensor", "m.weight_scale", "float32")
    linear.weight = torch.nn.Parameter(state.pop("weight"), requires_grad=False)
    for name, value in state.items():
        linear.register_buffer(name, value)
    net = torch.nn.Module()
    net.m = linear
    attach(net, {"m.weight": spec}, torch.float32)
    if granularity == "block":
        reference = q.float() * grid.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        reference = dequantized({"m.weight": q, **{f"m.{k}": v for k, v in state.items()}})["m.weight"]
    return net.m, reference


@pytest.mark.quick
@pytest.mark.parametrize("fmt, granularity", [("int8", "channel"), ("fp8", "tensor"), ("fp8", "block")])
def test_a_quantized_linear_never_makes_a_full_precision_copy_of_its_weight_and_equals_the_dequantized_one(
    fmt, granularity
):
    linear, weight = _quantized_linear(fmt, granularity)
    tensors_before = {n: (t.dtype, t.numel()) for n, t in [*linear.named_parameters(), *linear.named_buffers()]}
    for rows in (1, 64, 200):  # (the output, rows x 1536, stays under half the weight)
        x = torch.randn(2, rows, weight.shape[1])
        with torch.no_grad(), _Sizes() as sizes:
            got = linear(x)
        want = torch.nn.functional.linear(x, weight, linear.bias)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (fmt, granularity, rows)
        # no op made a floating tensor the weight's size: the largest is a tile or the output
        assert sizes.largest < weight.numel() // 2, (sizes.largest, weight.numel())
    tensors_after = {n: (t.dtype, t.numel()) for n, t in [*linear.named_parameters(), *linear.named_buffers()]}
    assert tensors_after == tensors_before  # nothing kept on the module either
    assert linear.weight.dtype == torch.int8
    # negative control: the old forward (the whole weight dequantized) is seen by the same count
    from preshard.format.style_forwards import dequantized_weight

    with torch.no_grad(), _Sizes() as sizes:
        torch.nn.functional.linear(x, dequantized_weight(linear), linear.bias)
    assert sizes.largest >= weight.numel()


@pytest.mark.quick
@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_cpu_float8_decoding_gives_every_byte_its_value(stored):
    """Every finite byte pattern (subnormals, zeros of both signs, the largest) decodes to torch's own cast."""
    from preshard.format.style_forwards import linear_forward

    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8)
    values = codes.view(stored).float()
    finite = torch.isfinite(values)
    eye = torch.eye(256)
    linear = torch.nn.Linear(256, 256, bias=False)
    linear.weight = torch.nn.Parameter(codes.repeat(256, 1).t().contiguous(), requires_grad=False)  # row i: byte i
    linear.preshard_weight_format, linear.preshard_compute_dtype = stored, torch.float32
    linear.preshard_scale_name, linear.preshard_block = None, None
    with torch.no_grad():
        got = linear_forward(linear, eye, None)[0]  # row 0 of x @ Wᵀ: column 0 of W = each byte's value
    assert torch.equal(got[finite], values[finite])
