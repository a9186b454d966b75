"""The memory table of docs/memory.md (its rows come from scripts/memory_table.py) at the published sizes, from
real safetensors headers over holes (no data, no disk): each row is what the planner (`plan_meshes`, and for a text
encoder the pipeline planner's per-degree estimate) computes for that model now, and what the doc says; for the
built-in plans, the weights per rank at every TP degree equal the replicated tensors plus 1/T of the sharded ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import memory_table  # noqa: E402

from preshard.examples.published import published, write_published  # noqa: E402
from preshard.tools.pipeline_plan import _text_encoder_per_rank  # noqa: E402
from preshard.tools.planner import plan_meshes  # noqa: E402

DOC = (ROOT / "docs" / "memory.md").read_text()

# name: (parameters in billions, TP degrees) of the published checkpoint
EXPECTED = {
    "HunyuanVideo": (12.82, [1, 2, 3, 4, 6, 8, 12, 24]),
    "HunyuanVideo 1.5": (8.33, [1, 2, 4, 8, 16]),
    "HunyuanImage 2.1": (17.43, [1, 2, 4, 7, 14, 28]),
    "Cosmos 1.0 14B": (14.27, [1, 2, 4, 5, 8, 10, 20, 40]),
    "SD 3.5 Large": (8.15, [1, 2, 19, 38]),
}


def _model(name: str) -> memory_table.Model:
    return next(m for m in memory_table.all_models() if m.name == name)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_full_size_figures_are_the_doc_table_row(name, tmp_path):
    row = memory_table.measure(memory_table.published_model(published(name)), tmp_path / "src")
    params, degrees = EXPECTED[name]
    assert round(row.params / 1e9, 2) == params and row.tp_degrees == degrees
    assert sum(p.stat().st_blocks for p in (tmp_path / "src").iterdir()) * 512 < 4 << 20  # holes: no data on disk
    sharded = row.stored_bytes - row.replicated
    for tp, weights in row.per_rank.items():
        assert weights == row.replicated + sharded // tp, tp
    assert row.replicated < 0.05 * row.stored_bytes  # what every rank holds whole is small
    if name == "Cosmos 1.0 14B":  # its AdaLN-LoRA projections are 256 wide: left whole
        assert "modulation" not in row.groups
    else:  # the AdaLN-Zero projections, a quarter to a third of the weights, are sharded
        assert row.groups["modulation"] > 0.25 * row.params
    assert memory_table.table([row]).splitlines()[-1] in DOC


def test_a_built_in_plans_row_is_the_planners_estimate(tmp_path):
    """Wan 2.1 T2V 14B, a built-in plan: the row's bytes per rank (tp2 among them) are plan_meshes' on the published
    checkpoint's headers written apart from the script."""
    row = memory_table.measure(_model("Wan 2.1 T2V 14B"), tmp_path / "row")
    report = plan_meshes(write_published(published("Wan 2.1 T2V 14B"), tmp_path / "apart"))
    assert row.per_rank == {m.tp: m.weight_bytes_per_rank for m in report.meshes}
    assert row.plan == report.plan == "wan" and row.tp_degrees == report.tp_degrees == [1, 2, 4, 8]
    assert round(row.per_rank[2] / memory_table.GIB, 2) == 13.58
    assert memory_table.table([row]).splitlines()[-1] in DOC


def test_an_inferred_plans_row_is_at_the_class_defaults_and_in_the_doc(tmp_path):
    """A class with no built-in plan nor `_tp_plan`, at its default config: the inferred plan's figures."""
    model = memory_table.default_model("AllegroTransformer3DModel")
    row = memory_table.measure(model, tmp_path / "row")
    assert row.plan == "inferred-AllegroTransformer3DModel" and memory_table.plan_label(row.plan) == "inferred"
    assert model.config_source == memory_table.DEFAULTS and row.params > memory_table.MIN_PARAMS
    assert row.per_rank[1] > row.per_rank[2] > row.per_rank[4] > row.per_rank[8]
    assert memory_table.table([row]).splitlines()[-1] in DOC


@pytest.mark.parametrize("name", ["T5-v1.1-XXL encoder", "Qwen2.5-VL 7B (text + vision)"])
def test_a_text_encoders_row_is_the_per_degree_estimate(name, tmp_path):
    """The row's bytes per rank, at every degree, are the pipeline planner's for a sharded text encoder, whose plan
    is inferred again at each TP degree. Qwen2.5-VL's 4 KV heads are computed whole at tp=28 (and its MLP, whose
    18944 features 28 does not divide, stays whole): a degree the tp=1 plan, splitting k/v, would not list."""
    row = memory_table.measure(_model(name), tmp_path / "row")
    assert row.per_rank == _text_encoder_per_rank(tmp_path / "row", row.tp_degrees, None, None)
    assert not row.cp
    if name.startswith("Qwen2.5"):
        assert row.tp_degrees == [1, 2, 4, 28] and row.per_rank[28] > row.per_rank[4]
    else:
        assert round(row.params / 1e9, 2) == 4.76 and row.tp_degrees == [1, 2, 4, 8, 16, 32, 64]
    assert memory_table.table([row]).splitlines()[-1] in DOC


def test_a_refused_class_gets_its_reason_in_the_doc(tmp_path):
    row = memory_table.measure(memory_table.default_model("SanaWMTransformer3DModel"), tmp_path / "row")
    assert row.plan is None and "q_linear" in row.refused and not row.per_rank
    assert memory_table.table([row]).splitlines()[-1] in DOC
