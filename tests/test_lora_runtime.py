"""LoRA adapters on a sharded model (2 gloo ranks, tp=2): `model.load_lora_adapter(...)` and a pipeline's
`load_lora_weights` slice each adapter by its base layer's style, so the forward equals the unsharded model's with the
same LoRA (Flux: colwise, rowwise, packed rowwise; MiniMax-H3: packed colwise, replicated-input rowwise), and so do
fusing, unfusing and unloading; what cannot work (hotswap, add_adapter, DoRA) is refused in one line naming --lora."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks
from safetensors.torch import load_file, save_file
from tiny_diffusers import build, save
from tiny_lora import make_lora

from preshard.converter.convert import convert_checkpoint

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

TOL = 1e-5  # float32


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_sources, tiny_models) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-runtime")
    flux, _ = build("flux")
    out = {
        "flux": str(save(flux, root / "flux-src")),
        "flux every": str(make_lora(flux, root / "every.safetensors", seed=1, bias=True)),
        "flux attn": str(make_lora(flux, root / "attn.safetensors", pattern=r".*attn\..*", rank=3, alpha=6.0, seed=2)),
        "flux rowwise": str(make_lora(flux, root / "rows.safetensors", pattern=r".*(to_out\.0|ff\.net\.2|proj_out)")),
        "h3 every": str(make_lora(tiny_models("float32"), root / "h3.safetensors", seed=3)),
    }
    dora = load_file(out["flux attn"])
    for key in [k for k in dora if k.endswith(".lora_B.weight")]:
        dora[key.replace(".lora_B.weight", ".lora_magnitude_vector")] = torch.ones(dora[key].shape[0])
    save_file(dora, str(root / "dora.safetensors"))
    out["flux dora"] = str(root / "dora.safetensors")
    convert_checkpoint(out["flux"], root / "flux-tp2", tp=2, progress=False)
    convert_checkpoint(tiny_sources("float32"), root / "h3-tp2", tp=2, progress=False)
    out["flux tp2"], out["h3 tp2"] = str(root / "flux-tp2"), str(root / "h3-tp2")
    return out


def _flux_state(path: str):
    from diffusers.loaders import FluxLoraLoaderMixin

    return FluxLoraLoaderMixin.lora_state_dict(path, return_alphas=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _flux_rank(rank: int, world: int, files: dict[str, str]) -> dict:
    from tiny_diffusers import build

    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import ParallelLinear, unparallelize_linear

    init_gloo()
    result: dict = {}
    model, inputs = build("flux")

    def run(net) -> torch.Tensor:
        with torch.no_grad():
            return net(**inputs, return_dict=False)[0]

    base = run(model)
    for name, lora in (("every", files["flux every"]), ("attn", files["flux attn"])):
        state, alphas = _flux_state(lora)
        model.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name=name)
    model.set_adapters(["every", "attn"], [0.5, -1.5])
    reference = run(model)

    net = load_sharded(type(model), files["flux tp2"])
    sharded_base = run(net)
    for name, lora in (("every", files["flux every"]), ("attn", files["flux attn"])):
        state, alphas = _flux_state(lora)
        net.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name=name)
    net.set_adapters(["every", "attn"], [0.5, -1.5])
    result["effect"] = _max_diff(reference, base)
    result["adapters"] = _max_diff(run(net), reference)
    hooks = net.preshard_report.hooks
    result["reduced A"] = sorted(m for m, h in hooks.items() if ".lora_A." in m and any("all-reduce" in d for d in h))
    to_q = net.get_submodule("transformer_blocks.0.attn.to_q")
    result["to_q shapes"] = [tuple(to_q.lora_A["every"].weight.shape), tuple(to_q.lora_B["every"].weight.shape)]
    out = net.get_submodule("transformer_blocks.0.attn.to_out.0")
    result["to_out shapes"] = [tuple(out.lora_A["every"].weight.shape), tuple(out.lora_B["every"].weight.shape)]

    # Negative control: without the all-reduce of the rowwise layers' A, the output is wrong.
    reduced = [m for n, m in net.named_modules() if ".lora_A." in n and isinstance(m, ParallelLinear)]
    styles = [(m, m.preshard_style, m.preshard_forward) for m in reduced]
    for m in reduced:
        unparallelize_linear(m)
    result["without reduce"] = _max_diff(run(net), reference)
    for m, style, forward in styles:
        m.__class__, m.preshard_style, m.preshard_forward = ParallelLinear, style, forward

    model.fuse_lora(adapter_names=["every", "attn"])
    net.fuse_lora(adapter_names=["every", "attn"])
    result["fused"] = _max_diff(run(net), run(model))
    net.unfuse_lora()
    net.unload_lora()
    result["unloaded"] = _max_diff(run(net), sharded_base)
    result["unloaded class"] = type(net.get_submodule("transformer_blocks.0.attn.to_out.0")).__name__

    # FluxPipeline: diffusers resizes layers to the LoRA's shapes before handing it over. A LoRA on rowwise layers
    # only (which it replaces by zero-padded copies) loads: the sharded layers are put back first.
    from diffusers import FluxPipeline

    model, _ = build("flux")  # the other model has the LoRAs fused into it
    state, alphas = _flux_state(files["flux rowwise"])
    model.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="rows")
    rows_reference = run(model)
    net = load_sharded(type(model), files["flux tp2"])
    pipe = FluxPipeline(None, None, None, None, None, None, transformer=net)
    pipe.load_lora_weights(files["flux rowwise"], adapter_name="rows")
    result["pipeline rowwise"] = _max_diff(run(net), rows_reference)
    result["overwritten"] = getattr(net, "_overwritten_params", None)
    # ... a LoRA on colwise layers fails inside diffusers (it cannot resize them), before the model sees it:
    try:
        pipe.load_lora_weights(files["flux attn"], adapter_name="attn")
        result["pipeline colwise"] = "loaded"
    except RuntimeError as exc:
        result["pipeline colwise"] = str(exc).splitlines()[0]
    result["after the failure"] = _max_diff(run(net), rows_reference)

    # Refused, one line each, and the model unchanged
    from preshard.errors import UsageError

    refusals = {}
    state, alphas = _flux_state(files["flux attn"])
    for what, call in {
        "hotswap": lambda: net.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="rows", hotswap=True),
        "add_adapter": lambda: net.add_adapter(__import__("peft").LoraConfig(r=4, target_modules=["to_q"])),
        "dora": lambda: net.load_lora_adapter(files["flux dora"], adapter_name="dora"),
        "save": lambda: net.save_lora_adapter(files["flux"] + "-saved", adapter_name="rows"),
    }.items():
        try:
            call()
            refusals[what] = None
        except UsageError as exc:
            refusals[what] = str(exc)
    result["refusals"] = refusals
    result["adapters left"] = sorted(getattr(net, "peft_config", {}))
    result["after refusals"] = _max_diff(run(net), rows_reference)
    return result


@pytest.fixture(scope="module")
def flux_ranks(files):
    return run_ranks(_flux_rank, 2, files, timeout=400)


def test_flux_adapters_on_a_sharded_model_equal_the_unsharded_model_with_them(flux_ranks):
    for r in flux_ranks:
        assert r["effect"] > 0.05  # the LoRAs change the output ...
        assert r["adapters"] <= TOL, r["adapters"]  # ... and the sharded model's as they change the unsharded one's
        assert r["fused"] <= TOL and r["unloaded"] <= TOL
        assert r["unloaded class"] == "ParallelLinear"  # the base layer, back as it was loaded


def test_each_factor_is_sliced_by_its_base_layers_style_with_the_reduce_where_a_row_split_needs_it(flux_ranks):
    for r in flux_ranks:
        assert r["to_q shapes"] == [(4, 64), (32, 4)]  # colwise: B's rows split, A whole
        assert r["to_out shapes"] == [(4, 32), (64, 4)]  # rowwise: A's columns split, B whole
        assert "transformer_blocks.0.attn.to_out.0.lora_A.every" in r["reduced A"]
        assert "single_transformer_blocks.0.proj_out.lora_A.attn" not in r["reduced A"]  # attn LoRA: not on proj_out
        assert "single_transformer_blocks.0.proj_out.lora_A.every" in r["reduced A"]  # packed rowwise
        assert not any(".to_q." in m for m in r["reduced A"])
        assert r["without reduce"] > 1e-3  # the negative control: the reduce is what makes it right


def test_flux_pipeline_load_lora_weights(flux_ranks):
    for r in flux_ranks:
        assert r["pipeline rowwise"] <= TOL and not r["overwritten"]
        assert r["pipeline colwise"].startswith("Error(s) in loading state_dict for Linear")  # diffusers' own, README
        assert r["after the failure"] <= TOL  # nothing was changed by it


def test_what_cannot_work_on_a_sharded_model_is_refused_in_one_line_naming_lora(flux_ranks, files):
    for r in flux_ranks:
        for what, message in r["refusals"].items():
            assert message is not None and "\n" not in message, what
            assert what == "save" or "convert-checkpoint SRC OUT --lora FILE" in message, message
        assert "this rank's slices" in r["refusals"]["save"]
        assert "is a DoRA" in r["refusals"]["dora"] and r["adapters left"] == ["rows"]
        assert r["after refusals"] <= TOL
    assert not Path(files["flux"] + "-saved").exists()


def _h3_rank(rank: int, world: int, files: dict[str, str]) -> dict:
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    from preshard.examples.minimax_h3 import build_model, make_inputs, reference_forward, tiny_config
    from preshard.runtime.load import load_sharded

    init_gloo()
    model = build_model(dtype="float32", seed=0)
    inputs = make_inputs(tiny_config(), 37)
    base = reference_forward(model, inputs)[0]
    state = MiniMaxH3LoraLoaderMixin.lora_state_dict(files["h3 every"])
    alphas = {k: state.pop(k) for k in [k for k in state if k.endswith(".alpha")]}
    model.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="a")
    reference = reference_forward(model, inputs)[0]
    net = load_sharded(type(model), files["h3 tp2"])
    net.load_lora_adapter(dict(state), network_alphas=alphas, adapter_name="a")
    hooks = net.preshard_report.hooks
    adaln = net.get_submodule("transformer_blocks.0.adaln_proj.linear")
    ff = net.get_submodule("transformer_blocks.0.ff.net.0.proj")
    return {
        "effect": _max_diff(reference, base),
        "diff": _max_diff(reference_forward(net, inputs)[0], reference),
        "adaln A": tuple(adaln.lora_A["a"].weight.shape),
        "adaln in": adaln.base_layer.in_features,
        "adaln hook": hooks.get("transformer_blocks.0.adaln_proj.linear.lora_A.a", []),
        "ff B": ff.lora_B["a"].weight.detach().clone(),
    }


def test_h3_adapters_on_packed_and_replicated_input_layers_equal_the_unsharded_model(files):
    results = run_ranks(_h3_rank, 2, files, timeout=400)
    lora = load_file(files["h3 every"])
    full_a = lora["transformer.transformer_blocks.0.adaln_proj.linear.lora_A.weight"]
    full_b = lora["transformer.transformer_blocks.0.ff.net.0.proj.lora_B.weight"]
    gate, up = full_b.chunk(2)
    for rank, r in enumerate(results):
        assert r["effect"] > 0.05 and r["diff"] <= TOL, r
        assert r["adaln A"] == (full_a.shape[0], full_a.shape[1] // 2) == (4, r["adaln in"])  # A's columns split ...
        assert any("slice replicated input" in h for h in r["adaln hook"])  # ... and sliced from the full input
        half = gate.shape[0] // 2  # packed colwise: this rank's rows of each block
        assert torch.equal(
            r["ff B"], torch.cat([gate[rank * half : (rank + 1) * half], up[rank * half : (rank + 1) * half]])
        )
