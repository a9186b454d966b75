"""Inference never guesses (issue 36): a model of the user's own, built from diffusers' blocks with custom code
where inference used to split by names and layouts (tests/support/custom_models.py: processors that reshape by a
module-level or their own head count or normalise q/k over the whole width, attention subclasses, blocks and models
that call `attn.to_q(x)` or read `attn.heads` outside the processor, feed-forwards with a softmax, an L2 norm, a
residual slice or a sum over the hidden width, custom activations, MLPs and single-stream blocks), converted at
tp=2 with no --plan and loaded on 2 gloo ranks, computes the unsharded model's function within 1e-5 (fp32), or
is refused in one line naming the module. Each keeps the custom unit whole, and still splits the diffusers
FeedForward beside it.

Negative control: the same model converted with the plan inference gives with its knowledge of code switched off
(every unit split by its names and layout, as before) differs, so the matches are the rule's.
"""

from __future__ import annotations

import warnings

import custom_models
import diffusers
import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.plans import infer
from preshard.plans.infer import infer_plan_keeping

TOL = 1e-5
# Custom code that is right at any TP degree: split as its twin, it still matches (no control).
RIGHT_WHEN_SPLIT = {"processor-custom-but-correct"}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _rank(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    from multiproc import init_gloo

    from preshard.runtime.load import load_sharded

    init_gloo()
    warnings.filterwarnings("ignore")
    out = {}
    for key, kind, folder in cases:
        model, inputs = custom_models.build(key)
        try:
            with torch.no_grad():
                want = model(**inputs)[0]
                got = load_sharded(type(model), folder)(**inputs)[0]
            out[(key, kind)] = {"rel": _rel(got, want), "error": None}
        except Exception as exc:  # noqa: BLE001 - reported to the parent test
            out[(key, kind)] = {"rel": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def _guessed_plan(cls: type):
    """The plan inference gave before it knew code: every unit split by its names and layout."""
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(infer, "unknown_attention", lambda module: None)
        patch.setattr(infer, "known_feed_forward", lambda module: True)
        patch.setattr(infer, "known_by_name", lambda cls, names: True)
        patch.setattr(infer, "reached_units", lambda model, units: {})
        return infer_plan_keeping(cls(), {}, 2)[0]


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("custom")
    warnings.filterwarnings("ignore")
    converted, refused, kept, cases = {}, {}, {}, []
    with pytest.MonkeyPatch.context() as patch:
        for key, cls in custom_models.CASES.items():
            patch.setattr(diffusers, cls.__name__, cls, raising=False)  # found by its config's _class_name
            model, _ = custom_models.build(key)
            source = save(model, root / f"src-{key}")
            try:
                convert_checkpoint(source, root / key, tp=2, progress=False)
            except PlanError as exc:
                refused[key] = str(exc)
                continue
            converted[key] = read_manifest(root / key).plan
            cases.append((key, "inferred", str(root / key)))
            with torch.device("meta"):
                kept[key] = infer_plan_keeping(cls(), {}, 2)[1]
            if key not in RIGHT_WHEN_SPLIT:
                guessed = _guessed_plan(cls)
                convert_checkpoint(source, root / f"{key}-guessed", tp=2, plan=guessed, progress=False)
                cases.append((key, "guessed", str(root / f"{key}-guessed")))
    results = run_ranks(_rank, 2, cases, timeout=600)[0]
    return {"converted": converted, "refused": refused, "kept": kept, "results": results}


@pytest.mark.parametrize("key", sorted(custom_models.CASES))
def test_custom_code_loads_sharded_with_the_unsharded_output_or_is_refused_naming_the_module(custom_run, key):
    if key in custom_run["refused"]:
        message = custom_run["refused"][key]
        assert "\n" not in message and "blocks." in message, message
        return
    result = custom_run["results"][(key, "inferred")]
    assert result["error"] is None and result["rel"] <= TOL, result
    plan = custom_run["converted"][key]
    assert any(rule.match.startswith("ff_out.") for rule in plan.linear), plan.linear  # something is split
    assert custom_run["kept"][key], key  # and the custom unit is named as kept whole
    assert "kept whole" in plan.description, plan.description


def test_the_plan_split_by_names_and_layouts_alone_computes_a_different_function(custom_run):
    guessed = {key: r for (key, kind), r in custom_run["results"].items() if kind == "guessed"}
    assert len(guessed) == len(custom_models.CASES) - len(RIGHT_WHEN_SPLIT), sorted(guessed)
    for key, result in guessed.items():
        assert result["error"] is not None or result["rel"] > 1e-3, (key, result)


@pytest.mark.quick
def test_what_is_kept_whole_is_named_with_why():
    def kept(key):
        with torch.device("meta"):
            return infer_plan_keeping(custom_models.CASES[key](), {}, 2)[1]

    assert "its processor GlobalHeadsProcessor is custom code" in kept("processor-global-heads")["blocks.0.attn"]
    assert "its processor AttnProcessor2_0 is custom code" in kept("processor-spoofed-module")["blocks.1.attn"]
    assert kept("block-calls-to_q")["blocks.0.attn"] == "CallsToQBlock.forward (blocks.0) uses attn.to_q"
    assert kept("model-calls-to_q")["blocks.1.attn"].endswith("uses blocks.[*].attn.to_q")
    assert "SoftmaxFeedForward is not a feed-forward" in kept("ff-subclass-forward")["blocks.0.ff"]
    assert "its block SingleStream is custom code" in kept("single-stream-custom")["blocks.0.attn"]
    # the twin, all diffusers code, keeps nothing whole
    with torch.device("meta"):
        assert infer_plan_keeping(custom_models.CustomModel(), {}, 2)[1] == {}


@pytest.mark.quick
def test_a_forward_hook_a_lambda_processor_or_a_diffusers_block_it_does_not_know_are_not_split():
    from torch import nn

    from preshard.plans.known_code import known_feed_forward, library_class, unknown_attention

    with torch.device("meta"):
        model = custom_models.CustomModel()
    assert unknown_attention(model.blocks[0].attn) is None and known_feed_forward(model.ff_out)
    model.ff_out.net[2].register_forward_pre_hook(lambda module, args: args)
    assert not known_feed_forward(model.ff_out)  # code of the user's runs inside it
    model.blocks[0].attn.processor = lambda attn, hidden_states, **kwargs: hidden_states
    assert "its processor function is custom code" in unknown_attention(model.blocks[0].attn)
    assert library_class(nn.Linear) and not library_class(custom_models.AttnProcessor2_0Spoof)
    # an outputless attention in a diffusers block that is no single-stream block preshard knows: refused, named
    with torch.device("meta"):
        model = custom_models.CASES["single-stream-custom"]()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(infer, "library_class", lambda cls: True)
        with pytest.raises(
            PlanError, match=r"attention blocks\.0\.attn has no output projection and its block blocks\.0"
        ):
            infer_plan_keeping(model, {}, 2)
