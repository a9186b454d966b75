"""The built-in plans at the published sizes, from real safetensors headers over holes (no data, no disk): each
family's TP degrees, and its weights per rank at every one of them equal to the replicated tensors plus 1/T of the
sharded ones, are what the model table of docs/models-and-plans.md says (its rows come from scripts/memory_table.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import memory_table  # noqa: E402

from preshard.examples.published import published  # noqa: E402

# name: (parameters in billions, TP degrees) of the published checkpoint
EXPECTED = {
    "HunyuanVideo": (12.82, [1, 2, 3, 4, 6, 8, 12, 24]),
    "HunyuanVideo 1.5": (8.33, [1, 2, 4, 8, 16]),
    "HunyuanImage 2.1": (17.43, [1, 2, 4, 7, 14, 28]),
    "Cosmos 1.0 14B": (14.27, [1, 2, 4, 5, 8, 10, 20, 40]),
    "SD 3.5 Large": (8.15, [1, 2, 19, 38]),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_full_size_figures_are_the_readme_table_row(name, tmp_path):
    row = memory_table.measure(published(name), tmp_path / "src")
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
    assert memory_table.table([row]).splitlines()[-1] in (ROOT / "docs" / "models-and-plans.md").read_text()
