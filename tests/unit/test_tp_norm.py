"""The tp_rms_norm style on simulated ranks: each rank's forward on its slice of the features and of the weight, its
sum of squares summed over the ranks as the TP all-reduce would, gives the unsharded norm's output slice (torch's and
diffusers' RMSNorm, with and without a weight, float32 and bfloat16); without the all-reduce it does not. And the plan
data that carries it: norm rules, optional rules, tp_split_outputs and config_requires, parsed, round-tripped and
checked."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from preshard.errors import PlanError
from preshard.format.plan import Plan, resolve_plan
from preshard.format.styles import TPRMSNorm, make_style, tp_norm_style
from preshard.runtime.tp import ParallelNorm, parallelize_norms

WIDTH = 24


def _diffusers_rms_norm() -> type[nn.Module]:
    """diffusers' RMSNorm, imported when a test needs it (not at collection: the unit tier imports no diffusers)."""
    from diffusers.models.normalization import RMSNorm

    return RMSNorm


def _norm(kind: str, affine: bool, dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    norm = nn.RMSNorm(WIDTH, eps=None, elementwise_affine=affine) if kind == "torch" else None
    if kind == "diffusers":
        norm = _diffusers_rms_norm()(WIDTH, eps=1e-6, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(WIDTH, generator=g))
    return norm.to(dtype)


def _sharded_forward(norm: nn.Module, x: torch.Tensor, tp: int, reduce: bool = True) -> torch.Tensor:
    """Run the style's forward on every simulated rank; the all-reduce sums the ranks' partial sums of squares."""
    forward = TPRMSNorm().parallel_forward()
    width = WIDTH // tp
    ranks = []
    for r in range(tp):
        local = copy.deepcopy(norm)
        if local.weight is not None:
            local.weight = nn.Parameter(norm.weight.detach()[r * width : (r + 1) * width].clone())
        local.preshard_full_width = WIDTH
        ranks.append(local)
    pieces = [x[..., r * width : (r + 1) * width] for r in range(tp)]
    partials: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        partials.append(t.clone())
        return t

    for r in range(tp):  # pass 1: each rank's own sum of squares, as it hands it to the all-reduce
        forward(ranks[r], pieces[r], r, tp, record)
    total = torch.stack(partials).sum(0)
    assert total.dtype == torch.float32 and total.shape == (*x.shape[:-1], 1)
    outs = [forward(ranks[r], pieces[r], r, tp, (lambda t: total) if reduce else (lambda t: t)) for r in range(tp)]
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("kind", ["torch", "diffusers"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_gets_its_slice_of_the_unsharded_norm(kind, affine, dtype, tp):
    norm = _norm(kind, affine, dtype)
    x = (3 * torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(tp))).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = _sharded_forward(norm, x, tp)
    assert got.dtype == want.dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of a value near 1
    assert (got.float() - want.float()).abs().max().item() <= tol
    if tp > 1:  # the all-reduce matters: each rank's own RMS is not the row's
        with torch.no_grad():
            alone = _sharded_forward(norm, x, tp, reduce=False)
        assert (alone.float() - want.float()).abs().max().item() > 0.05


def test_parallelize_norms_switches_the_class_keeps_isinstance_and_refuses_what_it_cannot_split():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.to_q = nn.Linear(8, WIDTH)
            self.norm_q = nn.RMSNorm(WIDTH)
            self.norm_k = _diffusers_rms_norm()(WIDTH, eps=1e-6, elementwise_affine=False)
            self.other = nn.LayerNorm(WIDTH)

    plan = Plan.from_dict(
        {
            "name": "t",
            "linear": [{"match": "norm_q", "style": "tp_rms_norm"}, {"match": "norm_k", "style": "tp_rms_norm"}],
        }
    )
    block = Block()
    reference = copy.deepcopy(block)
    described = parallelize_norms(block, plan, None, 0, 1)
    assert sorted(described) == ["norm_k", "norm_q"]
    assert isinstance(block.norm_q, nn.RMSNorm) and isinstance(block.norm_q, ParallelNorm)
    assert isinstance(block.norm_k, _diffusers_rms_norm()) and isinstance(block.norm_k, ParallelNorm)
    x = torch.randn(3, WIDTH)
    assert torch.allclose(block.norm_q(x), reference.norm_q(x), atol=1e-6)
    assert torch.allclose(block.norm_k(x), reference.norm_k(x), atol=1e-6)
    assert parallelize_norms(block, plan, None, 0, 1) == {}  # already switched: nothing happens twice

    with pytest.raises(PlanError, match=r"gives other the tp_rms_norm style, but it is a LayerNorm"):
        parallelize_norms(
            Block(), Plan.from_dict({"name": "t", "linear": [{"match": "other", "style": "tp_rms_norm"}]}), None, 0, 2
        )
    with pytest.raises(PlanError, match=r"--tp 5 does not divide the 24 features norm_q normalises"):
        parallelize_norms(Block(), plan, None, 0, 5)
    with pytest.raises(PlanError, match=r"norm_q has a weight of shape \[24\], not its slice \[12\] at tp=2"):
        parallelize_norms(Block(), plan, None, 0, 2)
    with pytest.raises(PlanError, match=r"norm rule 'nope' matches no module"):
        parallelize_norms(
            Block(), Plan.from_dict({"name": "t", "linear": [{"match": "nope", "style": "tp_rms_norm"}]}), None, 0, 1
        )


PLAN = {
    "name": "p",
    "linear": [
        {"match": "a.to_q", "style": "colwise"},
        {"match": "a.norm_q", "style": "tp_rms_norm"},
        {"match": "a.norm_x", "style": "tp_rms_norm"},  # a norm without a weight: no tensor to match
        {"match": "a.add_k_proj", "style": "colwise", "optional": True},  # absent from this checkpoint
    ],
    "tp_split_outputs": {"rope": {"0": {"dim": 1, "expected_dims": 4}}},
    "config_requires": {"rope_type": "split"},
}
SHAPES = {
    "a.to_q.weight": ((8, 4), torch.float32),
    "a.to_q.bias": ((8,), torch.float32),
    "a.norm_q.weight": ((8,), torch.float32),
}


def test_norm_rules_optional_rules_tp_split_outputs_and_config_requires_round_trip_and_resolve():
    plan = Plan.from_dict(PLAN)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["linear"][3] == {"match": "a.add_k_proj", "style": "colwise", "optional": True}
    assert "optional" not in plan.to_dict()["linear"][0]  # unchanged for plans that do not use it
    assert [r.match for r in plan.norm_rules()] == ["a.norm_q", "a.norm_x"]
    assert plan.tp_split_outputs["rope"][0].dim == 1
    resolved = resolve_plan(plan, SHAPES, 2, config={"rope_type": "split"})
    norm = resolved["a.norm_q.weight"]
    assert norm.style == make_style("tp_rms_norm") and norm.shard_dim == 0 and norm.local_shape(2) == (4,)
    with pytest.raises(PlanError, match=r"made for config rope_type = 'split', but the checkpoint's config.json has "
                       r"'interleaved'; write a plan file for this variant"):  # fmt: skip
        resolve_plan(plan, SHAPES, 2, config={"rope_type": "interleaved"})
    resolve_plan(plan, SHAPES, 2)  # no config (a manifest re-resolving its plan): nothing to compare
    no_optional = {**PLAN, "linear": [*PLAN["linear"][:3], {"match": "a.add_k_proj", "style": "colwise"}]}
    with pytest.raises(PlanError, match=r"rule 'a.add_k_proj' matches no tensor"):
        resolve_plan(Plan.from_dict(no_optional), SHAPES, 2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["linear"][3].update(optional="yes"), "'optional' must be true or false"),
        (lambda p: p.update(tp_split_outputs={"rope": {"x": {"dim": 1}}}), "must be an output index"),
        (lambda p: p.update(tp_split_outputs={"rope": {"0": {"dim": 7, "expected_dims": 4}}}), "tp_split_outputs"),
        (lambda p: p.update(tp_split_outputs=[]), "'tp_split_outputs' must map"),
        (lambda p: p.update(config_requires={"rope_type": ["split"]}), "'config_requires' must map config keys"),
        (lambda p: p["linear"][1].update(blocks=2), "'blocks' only applies to packed styles"),
    ],
)
def test_malformed_plan_fields_are_refused_in_one_line(edit, message):
    data = copy.deepcopy(PLAN)
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_tp_split_outputs_keep_this_ranks_slice_and_refuse_an_output_of_other_dims():
    from preshard.runtime.tp import split_outputs

    class Rope(nn.Module):
        def forward(self, x):
            return x, x + 1

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = Rope()

    plan = Plan.from_dict({**PLAN, "linear": []})
    table = torch.arange(2 * 8 * 3 * 2, dtype=torch.float32).reshape(2, 8, 3, 2)  # [B, heads, S, D/2]
    for rank in range(4):
        model = Model()
        assert split_outputs(model, plan, rank, 4) == {"rope": "tp: keep this rank's slice of output 0 dim 1"}
        cos, sin = model.rope(table)
        assert torch.equal(cos, table[:, 2 * rank : 2 * rank + 2])
        assert torch.equal(sin, table + 1)  # output 1 is not named: left whole
    model = Model()
    assert split_outputs(model, plan, 0, 1) == {}  # tp=1: nothing to slice
    split_outputs(model, plan, 0, 2)
    with pytest.raises(
        PlanError, match=r"output 0 of rope has 3 dims, the plan's tp_split_outputs expects a tensor with 4"
    ):
        model.rope(torch.zeros(2, 8, 3))
    with pytest.raises(PlanError, match=r"tp_split_outputs entry 'nope' matches no module"):
        split_outputs(Model(), Plan.from_dict({**PLAN, "tp_split_outputs": {"nope": {"0": {"dim": 1}}}}), 0, 2)


def _threaded_ranks(forward, norms: list[nn.Module], pieces: list[torch.Tensor], reduce: bool) -> list[torch.Tensor]:
    """Each simulated rank's forward in a thread of its own; `all_reduce` sums what every rank hands it (as many
    times as the forward asks), or hands back the rank's own value (`reduce=False`: the negative control)."""
    import threading

    tp = len(norms)
    barrier = threading.Barrier(tp)
    slots: list[torch.Tensor | None] = [None] * tp
    calls = [0] * tp
    outs: list[torch.Tensor | None] = [None] * tp

    def run(r: int) -> None:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            calls[r] += 1
            if not reduce:
                return t
            slots[r] = t.clone()
            barrier.wait()
            total = torch.stack([s for s in slots if s is not None]).sum(0)
            barrier.wait()
            return total

        outs[r] = forward(norms[r], pieces[r], r, tp, all_reduce)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert calls == [2] * tp  # the row's sum, then its sum of squared deviations
    return [o for o in outs if o is not None]


def _layer_norm(kind: str, dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(5)
    if kind == "fp32":
        from diffusers.models.normalization import FP32LayerNorm

        norm: nn.Module = FP32LayerNorm(WIDTH, eps=1e-6, elementwise_affine=False, bias=False)
    else:
        norm = nn.LayerNorm(WIDTH, eps=1e-5, elementwise_affine=kind != "plain", bias=kind == "affine")
    with torch.no_grad():
        if norm.weight is not None:
            norm.weight.copy_(1 + 0.3 * torch.randn(WIDTH, generator=g))
        if norm.bias is not None:
            norm.bias.copy_(0.2 * torch.randn(WIDTH, generator=g))
    return norm.to(dtype)


@pytest.mark.parametrize("kind", ["affine", "weight-only", "plain", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_layer_norm_gives_each_rank_its_slice_of_the_unsharded_layer_norm(kind, dtype, tp):
    norm = _layer_norm(kind, dtype)
    # rows far from zero mean: one pass of sum and sum of squares would lose the variance to cancellation
    x = (40 + 3 * torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(tp))).to(dtype)
    width = WIDTH // tp
    locals_ = []
    for r in range(tp):
        local = copy.deepcopy(norm)
        for param in ("weight", "bias"):
            if getattr(local, param) is not None:
                setattr(local, param, nn.Parameter(getattr(norm, param).detach()[r * width : (r + 1) * width].clone()))
        local.preshard_full_width = WIDTH
        locals_.append(local)
    pieces = [x[..., r * width : (r + 1) * width] for r in range(tp)]
    forward = make_style("tp_layer_norm").parallel_forward()
    with torch.no_grad():
        want = norm(x)
        got = torch.cat(_threaded_ranks(forward, locals_, pieces, reduce=True), dim=-1)
    assert got.dtype == want.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of a value of a few units
    assert (got.float() - want.float()).abs().max().item() <= tol
    if tp > 1:  # without the all-reduces each rank normalises by its own mean and variance: wrong
        with torch.no_grad():
            alone = torch.cat(_threaded_ranks(forward, locals_, pieces, reduce=False), dim=-1)
        assert (alone.float() - want.float()).abs().max().item() > 0.05


def test_tp_norm_style_picks_the_style_for_the_norm_class_and_says_why_none_fits():
    from diffusers.models.normalization import FP32LayerNorm

    assert tp_norm_style(nn.RMSNorm(WIDTH)) == make_style("tp_rms_norm")
    assert tp_norm_style(_diffusers_rms_norm()(WIDTH, eps=1e-6)) == make_style("tp_rms_norm")
    assert tp_norm_style(nn.LayerNorm(WIDTH)) == make_style("tp_layer_norm")
    assert tp_norm_style(FP32LayerNorm(WIDTH)) == make_style("tp_layer_norm")

    class MyLayerNorm(nn.LayerNorm):  # a subclass may compute something else: refused
        pass

    assert "is a MyLayerNorm, and the TP norm styles know" in str(tp_norm_style(MyLayerNorm(WIDTH)))
    assert "more than one trailing dim" in str(tp_norm_style(nn.LayerNorm((4, WIDTH))))
    assert "is a GroupNorm" in str(tp_norm_style(nn.GroupNorm(2, WIDTH)))
    assert make_style("tp_layer_norm").unsupported(nn.RMSNorm(WIDTH)) == (
        "is a RMSNorm, and tp_layer_norm knows torch.nn.LayerNorm and diffusers' FP32LayerNorm only"
    )
