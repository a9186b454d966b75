"""What a TP rank cuts from what the model is given rather than from what it computes: forward inputs that span
every head (`tp_split_inputs`, the SANA-WM LTX-2 refiner's `video_rotary_emb`) and attention masks with a row per
(batch, head) of the full head count (`per_head_masks`, PriorTransformer's repeated text mask).

The refiner on 2 gloo ranks matches the unsharded model with whole tables given and with the tables its own
`build_rotary_emb_for_absolute_positions` makes on each rank (already the rank's part: they pass as they are);
without the input's pre-hook the whole tables do not fit; tables of another width are one line. The masks: a
diffusers `Attention` of 4 heads whose mask differs for every (batch, head), split over 2 emulated ranks (the
rowwise sum done here), matches the whole module; without the hook it fails, with the other rank's rows it differs.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from tiny_diffusers import save
from tiny_zoo import build
from torch import nn

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError
from preshard.format.manifest import read_manifest
from preshard.format.plan import Plan
from preshard.runtime.tp import slice_head_masks

REFINER = "SanaWMLTX2RefinerTransformer3DModel"


def _sample(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _refiner_rank(rank: int, world: int, folder: str) -> dict:
    from multiproc import error_of, init_gloo

    from preshard.runtime.load import load_sharded

    init_gloo()
    warnings.filterwarnings("ignore")
    model, inputs = build(REFINER)
    net = load_sharded(type(model), folder)
    where = dict(frame_positions=[0, 1], height=2, width=2, device=torch.device("cpu"), fps=24.0)
    with torch.no_grad():
        want = _sample(model(**inputs))
        got = _sample(net(**inputs))
        whole_tables = model.build_rotary_emb_for_absolute_positions(1, **where)
        own_tables = net.build_rotary_emb_for_absolute_positions(1, **where)  # the rank's part, from `rope`
        want_own = _sample(model(**(inputs | {"video_rotary_emb": whole_tables})))
        got_own = _sample(net(**(inputs | {"video_rotary_emb": own_tables})))
        got_whole = _sample(net(**(inputs | {"video_rotary_emb": whole_tables})))
        narrow = tuple(t[..., :24] for t in whole_tables)
        wrong_width = error_of(lambda: net(**(inputs | {"video_rotary_emb": narrow})))
        changes = net.preshard_changes.changes
        hook = next(c for c in changes if c.kind == "hook" and c.module == "" and "of input video_rotary_emb" in c.what)
        hook.undo()  # negative control: the whole tables reach attention that holds half the heads
        unsliced = error_of(lambda: net(**inputs))
    return {
        "rel": _rel(got, want),
        "own_width": own_tables[0].shape[-1],
        "rel_own": _rel(got_own, want_own),
        "rel_whole": _rel(got_whole, want_own),
        "wrong_width": wrong_width,
        "unsliced": unsliced,
        "hooks": net.preshard_report.hooks.get("", []),
    }


def test_rotary_tables_given_whole_or_made_by_the_sharded_model_match_and_need_the_input_slice(tmp_path: Path):
    warnings.filterwarnings("ignore")
    model, _ = build(REFINER)
    convert_checkpoint(save(model, tmp_path / "src"), tmp_path / "tp2", tp=2, progress=False)
    plan = read_manifest(tmp_path / "tp2").plan
    assert set(plan.tp_split_inputs) == {"video_rotary_emb"}
    assert {i: (s.dim, s.whole) for i, s in plan.tp_split_inputs["video_rotary_emb"].items()} == {
        0: (-1, 32),
        1: (-1, 32),
    }
    for result in run_ranks(_refiner_rank, 2, str(tmp_path / "tp2"), timeout=300):
        assert result["rel"] <= 1e-5, result
        assert result["own_width"] == 16 and result["rel_own"] <= 1e-5, result
        assert result["rel_whole"] <= 1e-5, result
        assert (
            result["wrong_width"] is not None
            and "neither the 32 of every head nor this rank's 16" in (result["wrong_width"])
        ), result
        assert "\n" not in result["wrong_width"] and result["wrong_width"].startswith("PlanError"), result
        assert result["unsliced"] is not None, result  # the whole tables do not fit half the heads
        assert any("video_rotary_emb item 0 dim -1 (32 -> 16)" in h for h in result["hooks"]), result


class _Holder(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn


HEADS, HEAD_DIM, WORLD = 4, 4, 2
MASK_PLAN = Plan.from_dict(
    {"name": "t", "linear": [], "attention": [{"match": "attn", "divide": ["heads"], "per_head_masks": True}]}
)


def _rank_module(full: nn.Module, rank: int) -> _Holder:
    """Rank `rank`'s part of `full` as load_sharded leaves it: q/k/v rows and to_out columns of its heads, heads
    divided, the output bias on rank 0 only (the rowwise sum below adds it once)."""
    part = copy.deepcopy(full)
    width = HEADS * HEAD_DIM // WORLD
    rows = slice(rank * width, (rank + 1) * width)
    with torch.no_grad():
        for name in ("to_q", "to_k", "to_v"):
            linear = getattr(part, name)
            linear.weight = nn.Parameter(linear.weight[rows].clone())
            linear.bias = nn.Parameter(linear.bias[rows].clone())
        out = part.to_out[0]
        out.weight = nn.Parameter(out.weight[:, rows].clone())
        if rank:
            out.bias = nn.Parameter(torch.zeros_like(out.bias))
    part.heads = HEADS // WORLD
    return _Holder(part)


def test_a_mask_with_a_row_per_batch_item_and_head_is_cut_to_the_ranks_heads():
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    full = Attention(query_dim=16, heads=HEADS, dim_head=HEAD_DIM, bias=True, out_bias=True).eval()
    x = torch.randn(2, 5, 16)
    mask = 3 * torch.randn(2 * HEADS, 5, 5)  # additive, different for every (batch, head)
    batch_mask = 3 * torch.randn(2, 5, 5)  # one row per batch item: repeated by the local heads in the processor
    with torch.no_grad():
        want, want_batch = full(x, attention_mask=mask), full(x, attention_mask=batch_mask)
        parts = [_rank_module(full, r) for r in range(WORLD)]
        with pytest.raises(RuntimeError):  # negative control: the whole mask's rows do not fit half the heads
            parts[0].attn(x, attention_mask=mask)
        described = [slice_head_masks(p, MASK_PLAN, r, WORLD) for r, p in enumerate(parts)]
        got = sum(p.attn(x, attention_mask=mask) for p in parts)
        got_batch = sum(p.attn(x, attention_mask=batch_mask) for p in parts)
        got_positional = sum(p.attn(x, None, mask) for p in parts)  # the mask given by position
        swapped = [_rank_module(full, r) for r in range(WORLD)]  # negative control: the other rank's rows
        for r, p in enumerate(swapped):
            slice_head_masks(p, MASK_PLAN, WORLD - 1 - r, WORLD)
        wrong = sum(p.attn(x, attention_mask=mask) for p in swapped)
    assert (got - want).abs().max() <= 1e-5
    assert (got_batch - want_batch).abs().max() <= 1e-5
    assert (got_positional - want).abs().max() <= 1e-5
    assert (wrong - want).abs().max() > 0.05
    assert "attention mask of 4 heads' rows per batch item: keep this rank's 2" in described[0]["attn"]


def test_a_per_head_mask_rule_on_a_module_without_a_mask_is_one_line():
    holder = _Holder(nn.Linear(4, 4))
    with pytest.raises(PlanError) as info:
        slice_head_masks(holder, MASK_PLAN, 0, 2)
    assert "cuts per-head attention masks at attn" in str(info.value) and "\n" not in str(info.value)
