"""The tp_layer_norm style on 2 gloo ranks: a LayerNorm across the heads of a column-split projection (LuminaNext's
`layer_norm_across_heads`), switched by `parallelize_norms` with the rank's weight and bias slices, gives each rank
its slice of torch.nn.LayerNorm's output on the whole row; with the TP group removed (no all-reduce) it does not."""

from __future__ import annotations

import torch
from multiproc import run_ranks
from torch import nn

WIDTH = 24


def _rank(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist
    from multiproc import init_gloo

    from preshard.format.plan import Plan
    from preshard.runtime.tp import parallelize_norms

    init_gloo()
    torch.manual_seed(0)
    norm = nn.LayerNorm(WIDTH, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(WIDTH))
        norm.bias.copy_(0.2 * torch.randn(WIDTH))
    x = 30 + 3 * torch.randn(2, 7, WIDTH)
    with torch.no_grad():
        want = norm(x)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_q = nn.LayerNorm(WIDTH // world, eps=1e-5)

    width = WIDTH // world
    part = slice(rank * width, (rank + 1) * width)
    block = Attention()
    with torch.no_grad():
        block.norm_q.weight.copy_(norm.weight[part])
        block.norm_q.bias.copy_(norm.bias[part])
    block.norm_q.normalized_shape = (WIDTH,)  # as the model builds it: the full width, before the switch
    plan = Plan.from_dict({"name": "t", "linear": [{"match": "norm_q", "style": "tp_layer_norm"}]})
    described = parallelize_norms(block, plan, dist.group.WORLD, rank, world)
    with torch.no_grad():
        got = block.norm_q(x[..., part])
        block.norm_q.tp_group = None  # negative control: each rank's own mean and variance
        alone = block.norm_q(x[..., part])
    return {
        "error": (got - want[..., part]).abs().max().item(),
        "alone": (alone - want[..., part]).abs().max().item(),
        "described": described["norm_q"],
    }


def test_tp_layer_norm_on_two_ranks_matches_torch_layer_norm_and_needs_its_all_reduces():
    for result in run_ranks(_rank, 2):
        assert result["error"] <= 1e-5, result
        assert result["alone"] > 0.05, result
        assert "tp_layer_norm: sum, then sum of squared deviations, all-reduced(sum)" in result["described"]
