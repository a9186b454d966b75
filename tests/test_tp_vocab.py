"""The two styles of a split vocabulary, each alone on 2 gloo ranks.

`colwise_gather` (an lm_head over a vocabulary split by rows): each rank holds its rows of the Linear's weight and
bias, and the all-gather of its logits gives every rank the whole Linear's logits; with the TP group removed (no
gather) a rank returns only its V/T logits, the wrong shape. `vocab_parallel` (an nn.Embedding split by rows): each
rank looks up the ids in its rows and the all-reduce gives the whole lookup; without the all-reduce the ids in the
rank's rows are still right but every id outside them comes back as zeros, not its row.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks
from torch import nn

VOCAB, WIDTH = 12, 8


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from multiproc import init_gloo

    from preshard.format.styles import ColwiseGather, VocabParallel
    from preshard.runtime.tp import parallelize_embedding, parallelize_linear

    init_gloo()
    torch.manual_seed(0)
    head, embed = nn.Linear(WIDTH, VOCAB), nn.Embedding(VOCAB, WIDTH)
    x, ids = torch.randn(2, 3, WIDTH), torch.arange(VOCAB).reshape(2, 6)
    rows = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
    local_head, local_embed = nn.Linear(WIDTH, VOCAB // world), nn.Embedding(VOCAB // world, WIDTH)
    with torch.no_grad():
        want_logits, want_rows = head(x), embed(ids)
        local_head.weight.copy_(head.weight[rows])
        local_head.bias.copy_(head.bias[rows])
        local_embed.weight.copy_(embed.weight[rows])
        described = [
            parallelize_linear(local_head, ColwiseGather(), dist.group.WORLD, rank, world),
            parallelize_embedding(local_embed, VocabParallel(), dist.group.WORLD, rank, world),
        ]
        logits, looked_up = local_head(x), local_embed(ids)
        local_head.tp_group = local_embed.tp_group = None  # negative controls: no all-gather, no all-reduce
        alone_logits, alone_rows = local_head(x), local_embed(ids)
    own = (ids >= rows.start) & (ids < rows.stop)
    return {
        "logits": (logits - want_logits).abs().max().item(),
        "logits_shape": list(logits.shape),
        "alone_shape": list(alone_logits.shape),
        "alone_own_logits": (alone_logits - want_logits[..., rows]).abs().max().item(),
        "rows": (looked_up - want_rows).abs().max().item(),
        "alone_own": (alone_rows[own] - want_rows[own]).abs().max().item(),
        "alone_other": (alone_rows[~own] - want_rows[~own]).abs().max().item(),
        "alone_other_zero": bool((alone_rows[~own] == 0).all()),
        "others": int((~own).sum()),
        "described": described,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank, 2, timeout=120)


def test_colwise_gather_gives_every_rank_the_whole_linears_logits_and_needs_its_gather(ranks):
    for result in ranks:
        assert result["logits"] <= 1e-6 and result["logits_shape"] == [2, 3, VOCAB], result
        assert result["alone_shape"] == [2, 3, VOCAB // 2], result  # without the gather: this rank's logits only
        assert result["alone_own_logits"] <= 1e-6, result
        assert "all-gather(last dim)" in result["described"][0], result


def test_vocab_parallel_lookup_is_the_whole_embeddings_and_wrong_without_its_all_reduce(ranks):
    for result in ranks:
        assert result["rows"] <= 1e-6, result
        assert result["others"] == VOCAB // 2, result  # half the ids lie in the other rank's rows
        assert result["alone_own"] <= 1e-6, result
        assert result["alone_other_zero"] and result["alone_other"] > 0.1, result
        assert "lookups all-reduce(sum)" in result["described"][1], result
