"""Plans as data: strict parsing (every malformed field one line naming it), resolution against tensor names
and shapes, the TP degrees that work, and the round trip through JSON."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preshard.errors import PlanError
from preshard.format.plan import Plan, matches, module_names, resolve_plan, valid_tp_degrees
from preshard.plans.registry import builtin_plan_names, choose_plan, load_plan

GOOD = {
    "name": "p",
    "linear": [
        {"match": "blocks.*.q", "style": "colwise"},
        {"match": "blocks.*.o", "style": "rowwise"},
        {"match": "blocks.*.ff", "style": "packed_colwise", "blocks": 2},
        {"match": "blocks.*.out", "style": "packed_rowwise", "blocks": [4, 12]},
    ],
    "attention": [{"match": "blocks.*", "divide": ["heads"], "context_parallel": True, "per_head_masks": True}],
    "config_divisible": ["num_heads"],
    "tp_split_inputs": {"rotary_emb": {"0": {"dim": -1, "whole": 32, "expected_dims": 3}}},
    "cp_plan": {
        "": {"split_inputs": {"x": {"dim": 1, "expected_dims": 3}}},
        "rope": {"split_outputs": {"0": {"dim": 0, "expected_dims": 2}}},
        "head": {"gather_output": {"dim": 1, "expected_dims": 3}},
    },
}
TENSORS = {
    "blocks.0.q.weight": ((8, 16), torch.bfloat16),
    "blocks.0.q.bias": ((8,), torch.bfloat16),
    "blocks.0.o.weight": ((16, 8), torch.bfloat16),
    "blocks.0.o.bias": ((16,), torch.bfloat16),
    "blocks.0.ff.weight": ((32, 16), torch.float32),
    "blocks.0.out.weight": ((16, 16), torch.float32),
    "blocks.0.norm.weight": ((16,), torch.float32),
}


def test_round_trip_through_json():
    plan = Plan.from_dict(json.loads(json.dumps(GOOD)))
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()
    assert again.cp_plan[""].split_inputs["x"].dim == 1
    assert again.cp_plan["rope"].split_outputs[0].expected_dims == 2
    assert again.cp_plan["head"].gather_output.dim == 1
    assert again.attention[0].per_head_masks
    assert again.tp_split_inputs["rotary_emb"][0].whole == 32


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda p: p.update(attention=5), "'attention' must be a list"),
        (lambda p: p.update(linear={}), "'linear' must be a list"),
        (lambda p: p.update(name=""), "'name' must be a non-empty string"),
        (lambda p: p.update(extra=1), "unknown keys ['extra']"),
        (lambda p: p.update(format=9), "format 9 is not supported"),
        (lambda p: p["linear"][0].update(style="diagonal"), "unknown style 'diagonal'"),
        (lambda p: p["linear"][0].update(blocks=2), "'blocks' only applies to packed styles"),
        (lambda p: p["linear"][2].pop("blocks"), "packed_colwise needs 'blocks'"),
        (lambda p: p["linear"][2].update(blocks=[2, 0]), "packed_colwise needs 'blocks'"),
        (lambda p: p["linear"][2].update(blocks=True), "packed_colwise needs 'blocks'"),
        (lambda p: p["linear"][0].update(match=3), "linear rule 0 needs a non-empty string 'match'"),
        (lambda p: p["attention"][0].update(context_parallel="yes"), "'context_parallel' must be true or false"),
        (lambda p: p["attention"][0].update(divide="heads"), "'divide' must be a list of attribute names"),
        (lambda p: p["attention"][0].update(divide=["a-b"]), "'divide' must be a list of attribute names"),
        (lambda p: p.update(config_divisible="heads"), "'config_divisible' must be a list"),
        (lambda p: p["attention"][0].update(per_head_masks=1), "'per_head_masks' must be true or false"),
        (lambda p: p.update(tp_split_inputs=[]), "'tp_split_inputs' must map forward input names"),
        (lambda p: p.update(tp_split_inputs={"a-b": {"0": {}}}), "entry 'a-b' must map a forward input's name"),
        (lambda p: p["tp_split_inputs"]["rotary_emb"].update(x={}), "item x: the key must be an item index"),
        (lambda p: p["tp_split_inputs"]["rotary_emb"]["0"].update(whole=0), "'whole' must be the width"),
        (lambda p: p["tp_split_inputs"]["rotary_emb"]["0"].update(dim=3), "not a dimension of a 3-dim tensor"),
        (lambda p: p.update(cp_plan=[]), "'cp_plan' must be an object"),
        (lambda p: p["cp_plan"][""].update(split_inputs={"x": {"dim": "1"}}), "cp_plan .x must be"),
        (lambda p: p["cp_plan"][""].update(split_inputs={"x": {"dim": 5, "expected_dims": 3}}), "not a dimension"),
        (lambda p: p["cp_plan"]["rope"].update(split_outputs={"a": {"dim": 0}}), "must be an output index"),
        (lambda p: p["cp_plan"].update(head={"gather": {}}), "cp_plan entry 'head' must have"),
    ],
)
def test_every_malformed_field_is_one_line_naming_it(edit, needle):
    data = json.loads(json.dumps(GOOD))
    edit(data)
    with pytest.raises(PlanError) as info:
        Plan.from_dict(data, origin="plan file x.json")
    message = str(info.value)
    assert message.startswith("plan file x.json: ") and needle in message and "\n" not in message


def test_resolution_gives_styles_dims_and_blocks():
    layouts = resolve_plan(Plan.from_dict(GOOD), TENSORS, 2, config={"num_heads": 4})
    assert {n: (lay.style.name, lay.shard_dim, lay.blocks) for n, lay in layouts.items()} == {
        "blocks.0.q.weight": ("colwise", 0, (8,)),
        "blocks.0.q.bias": ("colwise", 0, (8,)),
        "blocks.0.o.weight": ("rowwise", 1, (8,)),
        "blocks.0.o.bias": ("rowwise", None, None),
        "blocks.0.ff.weight": ("packed_colwise", 0, (16, 16)),
        "blocks.0.out.weight": ("packed_rowwise", 1, (4, 12)),
        "blocks.0.norm.weight": ("replicate", None, None),
    }
    layouts = resolve_plan(Plan.from_dict(GOOD), TENSORS, 2, cast=torch.bfloat16)
    assert {lay.dtype.torch for lay in layouts.values()} == {torch.bfloat16}
    assert layouts["blocks.0.ff.weight"].source_dtype.torch == torch.float32


def test_tp_that_does_not_divide_lists_the_degrees_that_work():
    plan = Plan.from_dict(GOOD)
    layouts = resolve_plan(plan, TENSORS, 1, config={"num_heads": 4})
    assert valid_tp_degrees(plan, layouts, {"num_heads": 4}) == [1, 2, 4]
    assert valid_tp_degrees(plan, layouts, {"num_heads": 6}) == [1, 2]
    with pytest.raises(PlanError, match=r"--tp 3 does not divide .* TP degrees that work for this checkpoint: 1, 2, 4"):
        resolve_plan(plan, TENSORS, 3, config={"num_heads": 4})


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda p: p["linear"].append({"match": "blocks.*.zz", "style": "colwise"}), "'blocks.*.zz' matches no tensor"),
        (lambda p: p["linear"].append({"match": "blocks.0.q", "style": "rowwise"}), "matches both"),
        (lambda p: p["linear"].append({"match": "blocks.*.norm", "style": "colwise"}), "not a Linear weight"),
        (lambda p: p["attention"].append({"match": "towers.*.attn"}), "attention rule 'towers.*.attn' matches no"),
    ],
)
def test_rules_that_do_not_fit_the_checkpoint_are_errors(edit, needle):
    data = json.loads(json.dumps(GOOD))
    edit(data)
    with pytest.raises(PlanError, match=needle.replace("*", r"\*").replace("(", r"\(")):
        resolve_plan(Plan.from_dict(data), TENSORS, 2)


def test_patterns_match_one_component_and_the_root():
    assert matches("blocks.*.q", "blocks.12.q") and not matches("blocks.*.q", "blocks.1.2.q")
    assert matches("", "") and not matches("", "blocks") and not matches("blocks", "")
    assert module_names(["a.b.weight", "c"]) == {"", "a", "a.b"}


_PART = st.text(alphabet="ab.*?[]!0\n", max_size=8)


@settings(max_examples=400, deadline=None)
@given(pattern=_PART, module=st.text(alphabet="ab.0\n*?[]", max_size=8))
def test_the_compiled_matcher_is_fnmatch_per_component(pattern, module):
    """`matches` compiles a pattern into one regular expression (planning 100 000 tensors costs one match per
    rule each): it must say exactly what matching component by component with fnmatch says."""
    if pattern == "" or module == "":
        expected = pattern == module
    else:
        want, have = pattern.split("."), module.split(".")
        expected = len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))
    assert matches(pattern, module) == expected


def test_builtin_plans_load_and_are_chosen_by_class_name():
    assert "minimax-h3" in builtin_plan_names()
    assert load_plan("minimax-h3").name == "minimax-h3"
    assert choose_plan(None, {"_class_name": "MiniMaxH3Transformer3DModel"}).name == "minimax-h3"
    with pytest.raises(PlanError, match="no config.json naming its model class"):
        choose_plan(None, None)
    with pytest.raises(PlanError, match="unknown plan 'nope'"):
        load_plan("nope")
