"""Models that declare their own TP plan: diffusers' Flux, Flux.2, QwenImage and QwenImage 2.1 transformers convert
with no --plan (the plan is read from the class, built on the meta device from config.json) and, loaded by 2 gloo
ranks (and Flux/QwenImage by 2 x Ulysses 2), compute the unsharded model's function; and a model that cannot be
sharded as it declares is refused at conversion, naming the module and why."""

from __future__ import annotations

import pytest
import torch
from multiproc import init_gloo, run_ranks
from tiny_diffusers import build, save
from torch import nn

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.format.plan import Plan
from preshard.plans.from_model import plan_from_model, plan_from_model_class

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

TOL = 1e-5  # float32; measured max abs diff is ~1e-6
MODELS = ["flux", "flux2", "qwenimage", "qwenimage21"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("diffusers-plans")
    out = {}
    for name in MODELS:
        source = save(build(name)[0], root / f"src-{name}")
        convert_checkpoint(source, root / name, tp=2, progress=False)  # no plan: the class's own
        out[name] = str(root / name)
    return out


def _rank(rank: int, world: int, checkpoints: dict[str, str], ulysses: int, names: list[str]) -> dict:
    from tiny_diffusers import build

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for name in names:
        model, inputs = build(name)
        with torch.no_grad():
            reference = model(**inputs, return_dict=False)[0]
            net = load_sharded(type(model), checkpoints[name], ulysses=ulysses)
            out = net(**inputs, return_dict=False)[0]
        report = net.preshard_report
        results[name] = {
            "diff": (out - reference).abs().max().item(),
            "shape": tuple(out.shape) == tuple(reference.shape),
            "hooks": {m: list(h) for m, h in report.hooks.items()},
            "rows": dict(report.attention_rows),
        }
    return results


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return run_ranks(_rank, 2, checkpoints, 1, MODELS, timeout=300)


@pytest.fixture(scope="module")
def tp2_ulysses2(checkpoints):
    return run_ranks(_rank, 4, checkpoints, 2, ["flux", "qwenimage"], timeout=300)


def test_the_plan_comes_from_the_class_with_its_packed_blocks(checkpoints):
    flux = read_manifest(checkpoints["flux"])
    assert flux.plan.name == "FluxTransformer2DModel._tp_plan"
    proj_out = flux.tensors["single_transformer_blocks.0.proj_out.weight"].layout
    inner, mlp = 64, 4 * 64  # cat([attn, mlp]) as the model sets _tp_packed_row_blocks in __init__
    assert proj_out.style.name == "packed_rowwise" and proj_out.blocks == (inner, mlp)
    flux2 = read_manifest(checkpoints["flux2"])
    fused = flux2.tensors["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"].layout
    assert fused.style.name == "packed_colwise" and fused.blocks == (64, 64, 64, 192, 192)  # q, k, v, gate, up
    assert flux2.tensors["single_transformer_blocks.0.attn.to_out.weight"].layout.blocks == (64, 192)
    swiglu = flux2.tensors["transformer_blocks.0.ff.linear_in.weight"].layout
    assert swiglu.style.name == "packed_colwise" and swiglu.blocks == (192, 192)  # proportions [1, 1]
    qwen = read_manifest(checkpoints["qwenimage"])
    assert {t.layout.style.name for t in qwen.tensors.values()} == {"colwise", "rowwise", "replicate"}
    for manifest in (flux, flux2, qwen):
        assert manifest.plan.cp_plan and all(rule.context_parallel for rule in manifest.plan.attention)
    qwen21 = read_manifest(checkpoints["qwenimage21"])  # single-stream, SwiGLU in two Linears, no _cp_plan
    assert qwen21.plan.name == "QwenImage21Transformer2DModel._tp_plan" and not qwen21.plan.cp_plan
    assert qwen21.tensors["transformer_blocks.0.img_mlp.gate_layer.weight"].layout.style.name == "colwise"
    assert qwen21.tensors["transformer_blocks.0.img_mlp.out.weight"].layout.style.name == "rowwise"
    assert "" in flux.plan.cp_plan  # Flux splits the root module's own inputs


@pytest.mark.parametrize("name", MODELS)
def test_tp2_forward_equals_unsharded(tp2, name):
    for rank in tp2:
        assert rank[name]["shape"] and rank[name]["diff"] <= TOL, rank[name]["diff"]
        assert any("all-reduce" in h for hooks in rank[name]["hooks"].values() for h in hooks)


@pytest.mark.parametrize("name", ["flux", "qwenimage"])
def test_tp2_ulysses2_forward_equals_unsharded_with_the_cp_hooks_in_place(tp2_ulysses2, name):
    for rank in tp2_ulysses2:
        result = rank[name]
        assert result["diff"] <= TOL, result["diff"]
        hooks = [h for hs in result["hooks"].values() for h in hs]
        assert any(h.startswith("cp: attention ulysses") for h in hooks)
        assert any(h.startswith("cp: all-gather output") for h in hooks)
        if name == "flux":
            assert any(h.startswith("cp: split input hidden_states") for h in result["hooks"][""])
        # Each attention saw this rank's half of its joint (text + image) sequence, not all of it.
        assert result["rows"] and set(result["rows"].values()) <= {4, 6, 10}


# ---------------------------------------------------------------------------------------------------------
# What cannot be sharded as declared is refused, naming the module


class _AcrossHeadsAttention(nn.Module):
    """An attention module (it has a processor) whose QK norm spans all heads, as Wan's rms_norm_across_heads."""

    def __init__(self, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.processor = object()
        self.to_q = nn.Linear(32, heads * head_dim)
        self.to_k = nn.Linear(32, heads * head_dim)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, 32)])
        self.norm_q = nn.RMSNorm(heads * head_dim)

    def set_processor(self, processor) -> None:
        self.processor = processor


class _AcrossHeadsModel(nn.Module):
    _tp_plan = {"blocks.*.to_q": "colwise", "blocks.*.to_k": "colwise", "blocks.*.to_out.0": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_AcrossHeadsAttention()])


def test_a_norm_across_all_heads_is_refused_naming_the_module_and_the_style_to_use():
    with pytest.raises(
        PlanError,
        match=r"blocks\.0\.norm_q normalises across all 32 features of the column-split blocks\.0\.to_q \(every "
        r'head at once\), .* shard it with the tp_rms_norm style: add \{"match": "blocks\.\*\.norm_q", "style": '
        r'"tp_rms_norm"\}',
    ):
        plan_from_model(_AcrossHeadsModel())

    class LayerNormModel(_AcrossHeadsModel):  # a LayerNorm: the style named is tp_layer_norm
        def __init__(self) -> None:
            super().__init__()
            self.blocks[0].norm_q = nn.LayerNorm(32)

    with pytest.raises(PlanError, match=r'shard it with the tp_layer_norm style: add \{"match": "blocks\.\*\.norm_q"'):
        plan_from_model(LayerNormModel())

    class GroupNormModel(_AcrossHeadsModel):  # a norm no TP style splits: refused, saying so
        def __init__(self) -> None:
            super().__init__()
            self.blocks[0].norm_q = nn.GroupNorm(4, 32)

    with pytest.raises(PlanError, match=r"norm_q .* it is a GroupNorm, and the TP norm styles know .* cannot"):
        plan_from_model(GroupNormModel())


def test_a_plan_rule_on_something_else_than_a_linear_is_refused():
    class Model(_AcrossHeadsModel):
        _tp_plan = {"blocks.*.to_out": "rowwise"}  # the ModuleList, not the Linear in it

    with pytest.raises(PlanError, match=r"blocks\.0\.to_out is a ModuleList, not an nn\.Linear"):
        plan_from_model(Model())


def test_classes_without_a_plan_get_one_inferred_and_unknown_classes_say_how_to_give_one():
    assert plan_from_model_class("AutoencoderKL", {}).name == "inferred-AutoencoderKL"  # no _tp_plan: inferred
    with pytest.raises(PlanError, match="has no such model class; pass --plan"):
        plan_from_model_class("NoSuchTransformer", {})


def test_a_cp_mesh_for_a_model_without_any_cp_plan_is_refused_at_conversion(checkpoints, tmp_path):
    """QwenImage 2.1 declares a _tp_plan but no _cp_plan: a CP mesh could never load, so convert and reshard
    refuse it (not every rank at load time) and commit nothing."""
    from click.testing import CliRunner

    from preshard.cli import main
    from preshard.tools.reshard import reshard_checkpoint

    source = save(build("qwenimage21")[0], tmp_path / "src")
    runner = CliRunner()
    for args in (["convert", str(source), str(tmp_path / "out"), "--tp", "2", "--ulysses", "2"],
                 ["convert", str(source), str(tmp_path / "out"), "--tp", "1", "--ring", "2", "--dry-run"]):  # fmt: skip
        refused = runner.invoke(main, [*args, "--no-progress"])
        assert refused.exit_code == 2, refused.output
        assert refused.output.strip().splitlines() == [
            "error: plan QwenImage21Transformer2DModel._tp_plan has no cp_plan and QwenImage21Transformer2DModel "
            "declares no _cp_plan, so no rank could load a context-parallel mesh (ring x ulysses = 2): use ring=1 "
            "and ulysses=1 (--cp 1), or add a cp_plan to a plan file"
        ]
        assert not (tmp_path / "out").exists()
    for tp in (2, 1):  # a CP-only change (relinking) and a TP change
        with pytest.raises(PlanError, match="declares no _cp_plan"):
            reshard_checkpoint(checkpoints["qwenimage21"], tmp_path / "r", tp=tp, ulysses=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "src"]
    # what the refused conversion wrote is resumed by the same conversion without CP
    done = runner.invoke(main, ["convert", str(source), str(tmp_path / "out"), "--tp", "2", "--no-progress"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    # a plan without cp_plan is fine where the class declares one (the runtime then uses the class's)
    from dataclasses import replace

    from preshard.plans.from_model import check_cp_plan

    plan = replace(read_manifest(checkpoints["qwenimage"]).plan, cp_plan=None)
    check_cp_plan(plan, {"_class_name": "QwenImageTransformer2DModel"}, 2)
    check_cp_plan(plan, {"_class_name": "MiniMaxH3Transformer3DModel"}, 4)
    with pytest.raises(PlanError, match="declares no _cp_plan"):
        check_cp_plan(plan, {"_class_name": "QwenImage21Transformer2DModel"}, 2)
    check_cp_plan(plan, {"_class_name": "QwenImage21Transformer2DModel"}, 1)


def test_the_planner_offers_no_cp_split_where_no_cp_plan_exists(tmp_path):
    from preshard.tools.planner import plan_meshes, plan_table

    for name, cp_possible in (("qwenimage21", False), ("qwenimage", True)):
        report = plan_meshes(save(build(name)[0], tmp_path / name), devices=4, device_memory_gib=1)
        assert any(m.ring * m.ulysses > 1 for m in report.meshes) == cp_possible, name
        assert (report.no_cp is None) == cp_possible
        assert report.recommended is not None and report.recommended.world_size == 4
        assert ("no CP splits" in plan_table(report)) != cp_possible


def test_the_builtin_minimax_plan_carries_the_cp_plan_the_class_declares():
    """The built-in plan holds MiniMax-H3's CP plan itself, so a manifest says how CP splits without diffusers'
    help; it must stay what the class declares."""
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.plans.from_model import cp_plan_from_diffusers
    from preshard.plans.registry import load_plan

    assert load_plan("minimax-h3").cp_plan == cp_plan_from_diffusers(MiniMaxH3Transformer3DModel._cp_plan)


def _builtin_plan_cases():
    """(what, plan, class name, model on meta) for every built-in plan and class: the class defaults, every
    published config (`examples.published`: the full-size checkpoints) and the variants the tests build (Wan I2V's
    image attention, SkyReels-V2, ChronoEdit, Wan VACE, LTX-2.3's gates, SD 3.5 Medium's second attention, the
    tiny HunyuanVideo/Image and Cosmos), each config as its checkpoint's config.json gives it."""
    import diffusers
    import tiny_builtin
    import tiny_diffusers

    from preshard.examples.published import PUBLISHED
    from preshard.plans.from_model import build_on_meta
    from preshard.plans.registry import builtin_plan_names, load_plan

    plans = {c: load_plan(n) for n in builtin_plan_names() for c in load_plan(n).model_classes}
    configs = [(e.name, e.class_name, e.config) for e in PUBLISHED if e.class_name in plans]
    configs += [(f"{c} defaults", c, {}) for c in plans if (c, {}) not in [(e[1], e[2]) for e in configs]]
    for builders in (tiny_diffusers.BUILDERS, tiny_builtin.BUILDERS):
        for name, builder in builders.items():
            model = builder()[0]
            if type(model).__name__ in plans:
                configs.append((f"tiny {name}", type(model).__name__, dict(model.config)))
    for what, class_name, config in configs:
        with pytest.MonkeyPatch.context() as patch:  # initialising meta weights is most of building a model
            patch.setattr(nn.Linear, "reset_parameters", lambda self: None)
            model = build_on_meta(getattr(diffusers, class_name), config)
        yield what, plans[class_name], class_name, model


def test_builtin_plans_need_no_model_check_where_their_checkpoints_show_what_it_would(monkeypatch):
    """Conversion skips the check of a plan against the model class (diffusers imported, the model built on the
    meta device: ~2 CPU s) for a built-in plan made for the checkpoint's class whose tensors show nothing that
    check would refuse (`vouched_for`). That is sound because of this: for every built-in plan, class and config
    (`_builtin_plan_cases`), at every TP degree 1-16 and CP 1 or 2 where the checks made from the checkpoint alone
    accept (the plan's splits, its `config_divisible` keys) and `vouched_for` skips, the model check accepts too.
    The skip is not vacuous: it applies to every published checkpoint at every TP degree it converts at."""
    from preshard.format.plan import check_tp, resolve_plan
    from preshard.plans import from_model
    from preshard.plans.registry import vouched_for

    skipped, published = 0, set()
    for what, plan, class_name, model in _builtin_plan_cases():
        monkeypatch.setattr(from_model, "build_on_meta", lambda cls, config, model=model: model)
        config = {"_class_name": class_name, **{k: v for k, v in model.config.items() if not k.startswith("_")}}
        shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        try:
            layouts = resolve_plan(plan, shapes, 1, config=config)  # at any tp but for check_tp, below
        except PlanError:
            continue  # refused at every tp from the checkpoint alone (LTX-2's defaults: another rope_type)
        vouched = {cp: vouched_for(plan, config, layouts, cp) for cp in (1, 2)}
        for tp in range(1, 17):
            try:
                check_tp(plan, layouts, tp, config)  # what resolve_plan(plan, shapes, tp) checks last
            except PlanError:
                continue  # refused from the checkpoint alone
            for cp in (1, 2):
                if not vouched[cp]:
                    continue
                try:  # check_plan_against_model(plan, config, tp, cp), its CP part only once per tp
                    (from_model.check_plan_against_model if cp == 1 else from_model.check_cp_plan)(
                        plan, config, *((tp, 1) if cp == 1 else (cp,))
                    )
                except PlanError as exc:
                    raise AssertionError(f"{plan.name} for {what}, tp={tp} cp={cp}: skipped, but {exc}") from None
                skipped += 1
                if not what.startswith(("tiny", class_name)) and cp == 1:
                    published.add(what)
            if not what.startswith(("tiny", class_name)):
                assert vouched[1], f"{what} at tp={tp}: the model check is not skipped"
    assert len(published) == 15 and skipped > 150, (sorted(published), skipped)


def test_a_variant_the_plan_does_not_cover_is_still_checked_against_the_model():
    """Negative control: Cosmos 2.5's image-context projections (q_img/k_img/v_img in the cross-attention whose
    heads the plan divides) pass every check made from the checkpoint at tp=2, and only the model check refuses
    them: the tensors show them, so `vouched_for` does not skip it. So are a norm rule on a module with a bias and
    a CP mesh for a plan without its own CP plan (the class's `_cp_plan` decides)."""
    import tiny_builtin
    from diffusers import CosmosTransformer3DModel

    from preshard.format.plan import resolve_plan
    from preshard.plans.from_model import build_on_meta, check_plan_against_model
    from preshard.plans.registry import load_plan, vouched_for

    base = dict(tiny_builtin.BUILDERS["cosmos"]()[0].config)
    for extra, vouched in (({}, True), ({"img_context_dim_in": 8, "img_context_dim_out": 48}, False)):
        model = build_on_meta(CosmosTransformer3DModel, {**base, **extra})
        config = {"_class_name": "CosmosTransformer3DModel", **{k: v for k, v in model.config.items() if k[0] != "_"}}
        shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        plan = load_plan("cosmos")
        layouts = resolve_plan(plan, shapes, 2, config=config)
        assert vouched_for(plan, config, layouts) is vouched
        if not vouched:
            with pytest.raises(PlanError, match="q_img is a Linear inside"):
                check_plan_against_model(plan, config, 2)
    wan = load_plan("wan")
    square, row = ((8, 8), torch.float32), ((8,), torch.float32)
    shapes = {
        "blocks.0.attn1.to_q.weight": square, "blocks.0.attn1.to_k.weight": square,
        "blocks.0.attn1.to_v.weight": square, "blocks.0.attn1.to_out.0.weight": square,
        "blocks.0.attn1.norm_q.weight": row, "blocks.0.attn1.norm_k.weight": row,
        "blocks.0.ffn.net.0.proj.weight": square, "blocks.0.ffn.net.2.weight": square,
        "blocks.0.attn2.to_q.weight": square,
    }  # fmt: skip
    config = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 2}
    layouts = resolve_plan(wan, shapes, 2, config=config)
    assert vouched_for(wan, config, layouts) and not vouched_for(wan, config, layouts, cp=2)
    with_bias = {**shapes, "blocks.0.attn1.norm_q.bias": row}
    assert not vouched_for(wan, config, resolve_plan(wan, with_bias, 2, config=config))
    whole = {**shapes, "blocks.0.attn1.extra.weight": square}  # a Linear the plan leaves whole
    assert not vouched_for(wan, config, resolve_plan(wan, whole, 2, config=config))
    norm = {**shapes, "blocks.0.attn1.norm_x.weight": row}  # a norm across the split heads
    assert not vouched_for(wan, config, resolve_plan(wan, norm, 2, config=config))


def test_a_plan_file_or_another_class_is_still_checked_against_the_model():
    from preshard.plans.registry import load_plan, vouched_for

    plan = load_plan("minimax-h3")
    assert vouched_for(plan, {"_class_name": "MiniMaxH3Transformer3DModel"}, {})
    assert not vouched_for(plan, {"_class_name": "FluxTransformer2DModel"}, {})  # a built-in plan, another class
    assert not vouched_for(plan, None, {})
    edited = Plan.from_dict({**plan.to_dict(), "config_divisible": []}, origin="plan file p.json")
    assert not vouched_for(edited, {"_class_name": "MiniMaxH3Transformer3DModel"}, {})  # not as shipped
