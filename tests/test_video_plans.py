"""The video families with built-in plans: Wan (T2V, I2V, each Wan 2.2 expert), SkyReels-V2, ChronoEdit, Wan VACE and
LTX-2 (video and audio) convert with no --plan and, loaded on 2 gloo ranks (and on tp=2 x ulysses=2 and tp=2 x ring=2),
compute the unsharded model's function; the q/k norms across all heads run as tp_rms_norm, and without its all-reduce
the output is wrong; a compiled (fullgraph) tp=2 Wan equals eager; and what cannot work is refused at conversion in
one line naming the module or the TP degrees that do.

Under CP every family also runs at lengths the CP size does not divide: 9 video tokens (3 x 1 x 3) for the Wan
family (SkyReels-V2 also with diffusion forcing's per-frame timesteps), and for LTX-2 15 video and 7 audio tokens
with per-token timesteps, so the audio-to-video and video-to-audio attentions attend between sequences of
different lengths, each padded on its own (LTX-2.3 also with spatio-temporal guidance, whose perturbed blocks skip
attention). Negative control: with the padded key rows kept, LTX-2's output is wrong."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
from multiproc import error_of, init_gloo, run_ranks
from tiny_diffusers import VIDEO_TOKENS, build, save

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError, SourceError
from preshard.format.manifest import read_manifest

TOL = 1e-5  # float32; measured max abs diff ~1e-6
MODELS = ["wan", "wan_i2v", "skyreels_v2", "chronoedit", "wan_vace", "ltx2", "ltx23"]
EXPERTS = {"transformer": 1, "transformer_2": 2}  # Wan 2.2 A14B: two experts, same class, their own weights
BLOCKS = 2


def _save_i2v(model, folder):
    """As the published Wan I2V checkpoints: with an all-zero norm_added_q per block that the class no longer has
    (diffusers skips it: _keys_to_ignore_on_load_unexpected)."""
    from safetensors.torch import save_file

    save(model, folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.update({f"blocks.{i}.attn2.norm_added_q.weight": torch.zeros(32) for i in range(BLOCKS)})
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("video-plans")
    out = {}
    for name in MODELS:
        model = build(name)[0]
        source = _save_i2v(model, root / f"src-{name}") if name == "wan_i2v" else save(model, root / f"src-{name}")
        convert_checkpoint(source, root / name, tp=2, progress=False)  # no plan: the built-in one for the class
        out[name] = str(root / name)
    pipeline = root / "wan22"  # a pipeline folder holding both experts
    for sub, seed in EXPERTS.items():
        save(build("wan", seed=seed)[0], pipeline / sub)
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    for sub in EXPERTS:
        convert_checkpoint(pipeline, root / f"wan22-{sub}", subfolder=sub, tp=2, progress=False)
        out[f"wan22-{sub}"] = str(root / f"wan22-{sub}")
    out["pipeline"] = str(pipeline)
    return out


def _outputs(model, inputs) -> tuple[torch.Tensor, ...]:
    return tuple(model(**inputs, return_dict=False))


def _diff(got, want) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def _result(net, out, reference) -> dict:
    report = net.preshard_report
    return {
        "diff": _diff(out, reference),
        "shapes": [tuple(o.shape) for o in out] == [tuple(r.shape) for r in reference],
        "hooks": {m: list(h) for m, h in report.hooks.items()},
        "rows": dict(report.attention_rows),
    }


def _rank_tp(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    from tiny_diffusers import build

    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import ParallelNorm

    init_gloo()
    results = {}
    runs = [(name, name, 0) for name in MODELS] + [(f"wan22-{sub}", "wan", seed) for sub, seed in EXPERTS.items()]
    for key, name, seed in runs:
        model, inputs = build(name, seed=seed)
        with torch.no_grad():
            reference = _outputs(model, inputs)
            net = load_sharded(type(model), checkpoints[key])
            results[key] = _result(net, _outputs(net, inputs), reference)
        if key == "wan":
            norms = [m for m in net.modules() if isinstance(m, ParallelNorm)]
            groups = [m.tp_group for m in norms]
            for m in norms:  # negative control: the norms without their all-reduce
                m.tp_group = None
            with torch.no_grad():
                results["wan-no-norm-reduce"] = {"diff": _diff(_outputs(net, inputs), reference), "norms": len(norms)}
            for m, group in zip(norms, groups):
                m.tp_group = group
            try:  # compiled whole (fullgraph: no graph break anywhere, the TP norm included) equals eager
                eager = _outputs(net, inputs)
                compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
                results["compiled"] = {"diff": _diff(_outputs(compiled, inputs), eager), "error": None}
            except Exception:
                results["compiled"] = {"diff": None, "error": traceback.format_exc()}
    return results


UNEVEN_VIDEO = (3, 2, 6)  # Wan family: latent frames, height, width -> 3 x 1 x 3 = 9 tokens (patch 1, 2, 2)
UNEVEN_TOKENS = 9
LTX_UNEVEN = (15, 7)  # LTX-2 video tokens (1 x 3 x 5) and audio tokens


def uneven(name: str, inputs: dict, variant: str = "") -> dict:
    """`inputs` at lengths CP size 2 does not divide; variants: "df" (SkyReels-V2 diffusion forcing, a timestep
    per frame), "stg" (LTX-2.3 spatio-temporal guidance at block 0: its self-attentions skip SDPA)."""
    g = torch.Generator().manual_seed(60)
    out = dict(inputs)
    if name.startswith("ltx"):
        video, audio = LTX_UNEVEN
        out.update(
            hidden_states=torch.randn(1, video, 4, generator=g),
            audio_hidden_states=torch.randn(1, audio, 4, generator=g),
            timestep=1000 * torch.rand(1, video, generator=g), audio_timestep=1000 * torch.rand(1, audio, generator=g),
            num_frames=1, height=3, width=5, audio_num_frames=audio,
        )  # fmt: skip
        if variant == "stg":
            out["spatio_temporal_guidance_blocks"] = [0]
        return out
    out["hidden_states"] = torch.randn(1, inputs["hidden_states"].shape[1], *UNEVEN_VIDEO, generator=g)
    if "control_hidden_states" in inputs:
        out["control_hidden_states"] = torch.randn(1, 6, *UNEVEN_VIDEO, generator=g)
    if variant == "df":
        out.update(timestep=torch.tensor([[500.0, 400.0, 300.0]]), enable_diffusion_forcing=True)
    return out


UNEVEN_VARIANTS = {"skyreels_v2": ("", "df"), "ltx23": ("", "stg")}


def _keeping_padded_keys():
    """Negative control: CP attention that lets the padded key rows into the softmax."""
    from preshard.runtime import cp, cp_attention

    def attention(query, key, value, *, groups, key_layout, scale=None, key_masks=None):
        return cp_attention._cp_attention(
            query, key, value, groups=groups, layout=tuple(key_layout), scale=scale, local_attention=None,
            drop_padding=False, key_masks=key_masks,
        )  # fmt: skip

    original, cp.cp_attention = cp.cp_attention, attention
    return lambda: setattr(cp, "cp_attention", original)


def _rank_cp(rank: int, world: int, checkpoints: dict[str, str], runs: list[tuple[str, int, int]]) -> dict:
    from tiny_diffusers import build

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for name, ulysses, ring in runs:
        model, inputs = build(name)
        with torch.no_grad():
            reference = _outputs(model, inputs)
            net = load_sharded(type(model), checkpoints[name], ulysses=ulysses, ring=ring)
            results[(name, ulysses, ring)] = _result(net, _outputs(net, inputs), reference)
            for variant in UNEVEN_VARIANTS.get(name, ("",)):
                odd = uneven(name, inputs, variant)
                results[(name, ulysses, ring, "uneven", variant)] = _result(
                    net, _outputs(net, odd), _outputs(model, odd)
                )
            if name == "ltx2":
                odd = uneven(name, inputs)
                restore = _keeping_padded_keys()
                try:
                    results[(name, ulysses, ring, "padded keys")] = _diff(_outputs(net, odd), _outputs(model, odd))
                finally:
                    restore()
            if name == "skyreels_v2":  # asynchronous diffusion forcing: a mask by query and key position
                for m in (model, net):
                    m._set_ar_attention(2)
                results[(name, ulysses, ring, "causal")] = error_of(
                    lambda net=net, inputs=inputs: _outputs(net, inputs)
                )
                assert _outputs(model, inputs)  # the unsharded model runs it
    return results


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return run_ranks(_rank_tp, 2, checkpoints, timeout=600)


CP_RUNS = [
    ("wan", 2, 1), ("wan_i2v", 2, 1), ("chronoedit", 2, 1), ("skyreels_v2", 2, 1), ("wan_vace", 2, 1),
    ("ltx2", 2, 1), ("ltx23", 2, 1), ("wan", 1, 2), ("skyreels_v2", 1, 2), ("ltx2", 1, 2),
]  # fmt: skip


@pytest.fixture(scope="module")
def tp2_cp2(checkpoints):
    return run_ranks(_rank_cp, 4, checkpoints, CP_RUNS, timeout=600)


def _hooks(result: dict, module: str) -> list[str]:
    return result["hooks"].get(module, [])


@pytest.mark.parametrize("name", [*MODELS, *(f"wan22-{sub}" for sub in EXPERTS)])
def test_tp2_forward_equals_unsharded(tp2, name):
    for rank in tp2:
        result = rank[name]
        assert result["shapes"] and result["diff"] <= TOL, result["diff"]
        for block in range(BLOCKS):
            ltx = name.startswith("ltx")
            prefix = f"transformer_blocks.{block}" if ltx else f"blocks.{block}"
            attn = f"{prefix}.audio_to_video_attn" if ltx else f"{prefix}.attn1"
            assert any("tp_rms_norm" in h for h in _hooks(result, f"{attn}.norm_q")), sorted(result["hooks"])
            assert any("rowwise" in h for h in _hooks(result, f"{attn}.to_out.0"))


def test_the_plans_come_from_the_builtin_files_with_the_norms_split_like_the_heads(checkpoints, tp2):
    wan = read_manifest(checkpoints["wan"])
    assert wan.plan.name == "wan"
    norm = wan.tensors["blocks.0.attn1.norm_q.weight"].layout
    assert norm.style.name == "tp_rms_norm" and norm.shard_dim == 0 and norm.local_shape(2) == (16,)
    i2v = read_manifest(checkpoints["wan_i2v"])
    for leaf in ("add_k_proj.weight", "add_v_proj.weight", "norm_added_k.weight"):
        assert i2v.tensors[f"blocks.0.attn2.{leaf}"].layout.shard_dim == 0, leaf
    assert i2v.tensors["blocks.0.attn2.norm_added_q.weight"].layout.style.name == "replicate"  # kept, not loaded
    assert read_manifest(checkpoints["skyreels_v2"]).plan.name == "skyreels-v2"
    assert read_manifest(checkpoints["chronoedit"]).plan.name == "wan"
    vace = read_manifest(checkpoints["wan_vace"])
    assert vace.plan.name == "wan-vace" and vace.tensors["vace_blocks.1.attn1.to_q.weight"].layout.shard_dim == 0
    ltx2 = read_manifest(checkpoints["ltx2"])
    assert ltx2.plan.name == "ltx2"
    assert ltx2.tensors["transformer_blocks.0.audio_ff.net.2.weight"].layout.style.name == "rowwise"
    ltx23 = read_manifest(checkpoints["ltx23"])  # LTX-2.3's per-head gates: split with the heads (optional rule)
    assert ltx23.plan.name == "ltx2" and "transformer_blocks.0.attn1.to_gate_logits.weight" not in ltx2.tensors
    assert ltx23.tensors["transformer_blocks.0.attn1.to_gate_logits.weight"].layout.style.name == "colwise"
    for rank in tp2:  # each rank keeps its heads of the (whole-model) rotary tables
        for rope in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
            assert _hooks(rank["ltx2"], rope) == ["tp: keep this rank's slice of output 0 dim 1, output 1 dim 1"]
        norms = [m for m in rank["wan"]["hooks"] if m.endswith(("norm_q", "norm_k"))]
        assert len(norms) == 2 * 2 * BLOCKS  # q and k, self- and cross-attention


def test_wan22_experts_in_one_pipeline_folder_convert_each_and_a_whole_pipeline_folder_says_how(checkpoints, tp2):
    first, second = (read_manifest(checkpoints[f"wan22-{sub}"]) for sub in EXPERTS)
    assert first.plan.name == second.plan.name == "wan"
    assert first.source.path.endswith("wan22/transformer") and second.source.path.endswith("wan22/transformer_2")
    for rank in tp2:  # each loads its own weights: built from different seeds, each equal to its own model
        assert rank["wan22-transformer"]["diff"] <= TOL and rank["wan22-transformer_2"]["diff"] <= TOL
    with pytest.raises(
        SourceError,
        match=r"is a pipeline folder, not one model's weights; convert each model you need separately, into its own "
        r"output: --subfolder transformer and --subfolder transformer_2",
    ):
        convert_checkpoint(checkpoints["pipeline"], checkpoints["pipeline"] + "-out", tp=2, progress=False)


def test_without_the_norm_all_reduce_the_wan_output_is_wrong(tp2):
    for rank in tp2:
        control = rank["wan-no-norm-reduce"]
        assert control["norms"] == 2 * 2 * BLOCKS
        assert control["diff"] > 1e-2, control["diff"]  # the tolerance the real run meets is 1e-5
        assert rank["wan"]["diff"] <= TOL


def test_torch_compile_fullgraph_of_tp2_wan_equals_eager(tp2):
    for rank in tp2:
        assert rank["compiled"]["error"] is None, rank["compiled"]["error"]
        assert rank["compiled"]["diff"] <= TOL, rank["compiled"]["diff"]


@pytest.mark.parametrize("run", CP_RUNS, ids=lambda r: f"{r[0]}-ulysses{r[1]}-ring{r[2]}")
def test_tp2_cp2_forward_equals_unsharded_with_the_cp_hooks_in_place(tp2_cp2, run):
    name, ulysses, ring = run
    axis = "ulysses" if ulysses > 1 else "ring"
    for rank in tp2_cp2:
        result = rank[run]
        assert result["shapes"] and result["diff"] <= TOL, result["diff"]
        if name.startswith("ltx"):
            cp_attention = ["attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn"]
            local = ["attn2", "audio_attn2"]  # keys from the whole text: plain attention on this rank's rows
            prefix = "transformer_blocks.0"
        else:
            cp_attention, local, prefix = ["attn1"], ["attn2"], "blocks.0"
        for attn in cp_attention:
            assert any(h.startswith(f"cp: attention {axis}") for h in _hooks(result, f"{prefix}.{attn}")), attn
            assert result["rows"][f"{prefix}.{attn}"] == VIDEO_TOKENS // 2  # this rank's half of the rows
        for attn in local:
            assert not any(h.startswith("cp: attention") for h in _hooks(result, f"{prefix}.{attn}")), attn
        gathered = "norm_out" if name == "skyreels_v2" else "proj_out"  # before SkyReels' per-token modulation
        assert any(h.startswith("cp: all-gather output") for h in _hooks(result, gathered))


@pytest.mark.parametrize("run", CP_RUNS, ids=lambda r: f"{r[0]}-ulysses{r[1]}-ring{r[2]}")
def test_tp2_cp2_at_lengths_the_cp_size_does_not_divide(tp2_cp2, run):
    name, ulysses, ring = run
    for rank in tp2_cp2:
        for variant in UNEVEN_VARIANTS.get(name, ("",)):
            result = rank[(*run, "uneven", variant)]
            assert result["shapes"] and result["diff"] <= TOL, (variant, result["diff"])
            rows = result["rows"]
            if name.startswith("ltx"):  # queries: this rank's 8 of 15 video rows, or its 4 of 7 audio rows
                video, audio = (-(-n // 2) for n in LTX_UNEVEN)
                want = {n: video if n.endswith((".attn1", ".audio_to_video_attn")) else audio for n in rows}
                assert len(rows) == 4 * BLOCKS and rows == want, rows
            else:
                assert set(rows.values()) == {-(-UNEVEN_TOKENS // 2)}, rows
                assert len(rows) == BLOCKS * (2 if name == "wan_vace" else 1)  # VACE: its control blocks too


def test_ltx2_with_the_padded_key_rows_kept_is_wrong(tp2_cp2):
    for rank in tp2_cp2:
        for run in [r for r in CP_RUNS if r[0] == "ltx2"]:
            assert rank[(*run, "padded keys")] > 1e-3, rank[(*run, "padded keys")]
            assert rank[(*run, "uneven", "")]["diff"] <= TOL


def test_skyreels_causal_blocks_are_refused_under_cp_in_one_line(tp2_cp2):
    for rank in tp2_cp2:
        for run in [r for r in CP_RUNS if r[0] == "skyreels_v2"]:
            error = rank[(*run, "causal")]
            assert error is not None and error.startswith("UsageError") and "\n" not in error, error
            assert "blocks.0.attn1 got an attention mask of shape (1, 1, 8, 8)" in error, error


# ---------------------------------------------------------------------------------------------------------
# What cannot work is refused at conversion, in one line


def _plan_file(tmp_path, name: str, drop: tuple[str, ...]) -> str:
    from preshard.plans.registry import load_plan

    data = load_plan(name).to_dict()
    data["linear"] = [r for r in data["linear"] if not r["match"].endswith(drop)]
    path = tmp_path / f"{name}-edited.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_tp_degree_the_heads_do_not_allow_names_the_degrees_that_work(tmp_path):
    for name in ("wan", "ltx2"):
        source = save(build(name)[0], tmp_path / name)
        with pytest.raises(
            PlanError,
            match=r"--tp 3 does not divide config num_attention_heads \(size 4\); TP degrees that work for this "
            r"checkpoint: 1, 2, 4$",
        ):
            convert_checkpoint(source, tmp_path / f"{name}-out", tp=3, progress=False)
        assert not (tmp_path / f"{name}-out").exists()


def test_a_plan_that_leaves_a_norm_across_heads_or_a_head_projection_whole_is_refused_naming_it(tmp_path):
    wan = save(build("wan")[0], tmp_path / "wan")
    with pytest.raises(
        PlanError,
        match=r"blocks\.0\.attn1\.norm_q normalises across all 32 features of the column-split blocks\.0\.attn1\.to_q "
        r'\(every head at once\), .*shard it with the tp_rms_norm style: add \{"match": "blocks\.\*\.attn1\.norm_q"',
    ):
        convert_checkpoint(wan, tmp_path / "out", tp=2, plan=_plan_file(tmp_path, "wan", ("norm_q",)), progress=False)
    i2v = save(build("wan_i2v")[0], tmp_path / "i2v")
    with pytest.raises(
        PlanError,
        match=r"blocks\.0\.attn2\.add_k_proj is a Linear inside blocks\.0\.attn2, whose heads the plan divides by the "
        r"TP degree, but no rule shards it",
    ):
        convert_checkpoint(
            i2v, tmp_path / "out", tp=2, plan=_plan_file(tmp_path, "wan", ("add_k_proj",)), progress=False
        )
    assert not (tmp_path / "out").exists()


def test_an_ltx2_variant_the_plan_is_not_made_for_is_refused_with_it_and_passed_over_without(tmp_path):
    from diffusers import LTX2VideoTransformer3DModel

    from preshard.format.manifest import read_manifest

    model = build("ltx2")[0]
    interleaved = LTX2VideoTransformer3DModel.from_config({**model.config, "rope_type": "interleaved"})
    source = save(interleaved, tmp_path / "ltx2-interleaved")
    with pytest.raises(PlanError, match=r"built-in plan ltx2 is made for config rope_type = 'split', but the "
                       r"checkpoint's config.json has 'interleaved'; write a plan file"):  # fmt: skip
        convert_checkpoint(source, tmp_path / "out", tp=2, plan="ltx2", progress=False)
    assert not (tmp_path / "out").exists()
    convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)  # no --plan: the next source, saying why
    plan = read_manifest(tmp_path / "out").plan
    assert plan.name == "inferred-LTX2VideoTransformer3DModel"
    assert "(passed over: built-in plan ltx2 is made for config rope_type = 'split'" in plan.description


def test_a_class_without_any_plan_converts_with_the_plan_inferred_from_its_modules(tmp_path):
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1, text_embed_dim=16,
        time_embed_dim=8, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
    )  # fmt: skip
    source = save(model, tmp_path / "cogvideox")
    convert_checkpoint(source, tmp_path / "out", tp=2, progress=False)
    plan = read_manifest(tmp_path / "out").plan
    assert plan.name == "inferred-CogVideoXTransformer3DModel"
    assert {r.match: r.style.name for r in plan.linear}["transformer_blocks.*.attn1.to_q"] == "colwise"


def test_skyreels_and_vace_have_cp_plans_of_their_own(checkpoints):
    sky = read_manifest(checkpoints["skyreels_v2"]).plan
    assert sky.cp_plan and "norm_out" in sky.cp_plan and sky.cp_plan["blocks.*"].split_inputs["temb"].dim == 2
    vace = read_manifest(checkpoints["wan_vace"]).plan
    assert vace.cp_plan and "control_hidden_states" in vace.cp_plan["vace_blocks.0"].split_inputs
