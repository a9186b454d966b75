"""Context-parallel attention (Ulysses, ring, both) against full SDPA, on real gloo groups (8 CPU ranks).

All configurations run in one spawn of 8 ranks: a config with CP size c runs as 8/c independent CP
replicas (a TP-like outer axis), each on its own data, so groups that do not start at rank 0 are
exercised too. Global rank = replica * c + cp_rank, cp_rank = ring_rank * U + ulysses_rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import init_gloo, run_ranks

from preshard.runtime import collectives as C
from preshard.runtime import cp_attention as CPA

pytestmark = pytest.mark.xla_api  # a dependency API at its lower bound: the XLA tier runs it

WORLD = 8


def _gloo_entry(rank: int, world: int, fn: Callable[[int, int], Any]) -> Any:
    init_gloo()
    return fn(rank, world)


def launch(fn: Callable[[int, int], Any], world: int, timeout: float = 120.0) -> list[Any]:
    """Run `fn(rank, world)` on `world` gloo ranks (the shared launcher: free port, timeout, teardown)."""
    return run_ranks(_gloo_entry, world, fn, timeout=timeout)


# --- cases -----------------------------------------------------------------------------------------

# (ring, ulysses); ring 4 because with ring 2 "next" and "previous" are the same rank
CONFIGS = [(1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (4, 1), (4, 2)]


@dataclass(frozen=True)
class Case:
    ring: int
    ulysses: int
    seq_len: int
    heads: int
    s_local: int
    scale: float | None = None

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def name(self) -> str:
        extra = f"-scale{self.scale}" if self.scale is not None else ""
        return f"r{self.ring}u{self.ulysses}-s{self.seq_len}-h{self.heads}-l{self.s_local}{extra}"


def _cases() -> list[Case]:
    cases = []
    for ring, uly in CONFIGS:
        cp = ring * uly
        odd_heads = {1: 3, 2: 3, 4: 7}[uly]
        cases.append(Case(ring, uly, seq_len=3 * cp, heads=4, s_local=3))  # no padding, heads divide U
        for seq in (13, 37):  # primes: padding on the last rank(s), heads not divisible by U
            cases.append(Case(ring, uly, seq_len=seq, heads=odd_heads, s_local=math.ceil(seq / cp)))
    # more padding than a whole ring block (block 1 of rows 8..15 is all padding), and a custom scale
    cases.append(Case(2, 4, seq_len=5, heads=7, s_local=2))
    cases.append(Case(2, 2, seq_len=13, heads=3, s_local=4, scale=0.3))
    return cases


CASES = _cases()


def _build_groups(rank: int) -> dict[tuple[int, int], CPA.CPGroups]:
    """Every rank creates every group in the same order; keep the ones this rank belongs to."""
    mine = {}
    for ring, uly in CONFIGS:
        cp = ring * uly
        replica, cp_rank = divmod(rank, cp)
        ring_rank, uly_rank = divmod(cp_rank, uly)
        ring_group = uly_group = None
        for t in range(WORLD // cp):
            for r in range(ring if uly > 1 else 0):
                g = dist.new_group([t * cp + r * uly + u for u in range(uly)])
                if (t, r) == (replica, ring_rank):
                    uly_group = g
            for u in range(uly if ring > 1 else 0):
                g = dist.new_group([t * cp + r * uly + u for r in range(ring)])
                if (t, u) == (replica, uly_rank):
                    ring_group = g
        mine[(ring, uly)] = CPA.CPGroups(ring_group, ring, ring_rank, uly_group, uly, uly_rank)
    return mine


def _data(case: Case, replica: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * CASES.index(case) + replica)
    return tuple(torch.randn(2, case.heads, case.seq_len, 8, generator=gen) for _ in range(3))


def _math_path_forbidden(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the float32 math path ran where a fused kernel should have")


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    groups = _build_groups(rank)
    # Ring steps must run on the fused LSE kernel: count its calls (key rows of each block), forbid the math path.
    kernel_blocks: list[int] = []
    fused = CPA.block_attention_with_lse

    def counting_kernel(q, k, v, scale, *mask):
        kernel_blocks.append(k.shape[2])
        return fused(q, k, v, scale, *mask)

    CPA.block_attention_with_lse = counting_kernel
    CPA._attention_f32 = _math_path_forbidden
    out = {}
    for case in CASES:
        kernel_blocks.clear()
        g = groups[(case.ring, case.ulysses)]
        replica = rank // case.cp
        q, k, v = _data(case, replica)
        ref = F.scaled_dot_product_attention(q, k, v, scale=case.scale)
        s_pad = case.s_local * case.cp
        lo = g.cp_rank * case.s_local
        real = max(0, min(case.s_local, case.seq_len - lo))

        def local(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (0, 0, 0, s_pad - case.seq_len))[:, :, lo : lo + case.s_local]  # noqa: B023

        ql, kl, vl = local(q), local(k), local(v)
        sdpa_calls = []

        def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
            sdpa_calls.append(args[1].shape[2])  # noqa: B023
            return F.scaled_dot_product_attention(*args, **kwargs)

        with C.NeuronRuleChecker() as checker:
            got = CPA.cp_attention(
                ql, kl, vl, groups=g, seq_len=case.seq_len, scale=case.scale, local_attention=counting_sdpa
            )
        blocks_seen = list(kernel_blocks)
        unmasked = CPA._cp_attention(
            ql,
            kl,
            vl,
            groups=g,
            layout=(CPA.KeySequence(case.seq_len, case.s_local),),
            scale=case.scale,
            local_attention=None,
            drop_padding=False,
        )
        # Key masks (a text padding mask): each CP rank's mask over its local key rows; batch row 1 keeps only its
        # first two keys, so whole key blocks are masked for it (their lse must not count). Bool and float.
        gen = torch.Generator().manual_seed(7 + CASES.index(case))
        valid = torch.rand(2, case.seq_len, generator=gen) > 0.4
        valid[0, 0] = True
        valid[1] = torch.arange(case.seq_len) < 2
        bias = torch.where(valid, 0.5 * torch.randn(2, case.seq_len, generator=gen), float("-inf"))
        masked = {}
        for kind, mask in (("bool", valid), ("float", bias)):
            ref_masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=case.scale)
            per_rank = F.pad(mask, (0, s_pad - case.seq_len)).view(2, case.cp, case.s_local).transpose(0, 1)
            got_masked = CPA.cp_attention(
                ql, kl, vl, groups=g, seq_len=case.seq_len, scale=case.scale, key_masks=per_rank
            )
            masked[kind] = (
                (got_masked[:, :, :real] - ref_masked[:, :, lo : lo + real]).abs().max().item() if real else 0.0
            )
            masked[f"{kind}-ignored"] = (
                (got[:, :, :real] - ref_masked[:, :, lo : lo + real]).abs().max().item() if real else 0.0
            )
        # the rows the test gathers: all real rows of this replica, assembled in cp-rank order
        cp_ranks = [replica * case.cp + i for i in range(case.cp)]
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got.contiguous())
        assembled = torch.cat([gathered[i] for i in cp_ranks], dim=2)[:, :, : case.seq_len]
        out[case.name] = {
            "shape": tuple(got.shape),
            "finite": bool(torch.isfinite(got).all()),
            "err": (got[:, :, :real] - ref[:, :, lo : lo + real]).abs().max().item() if real else 0.0,
            "assembled_err": (assembled - ref).abs().max().item(),
            "unmasked_err": (unmasked[:, :, :real] - ref[:, :, lo : lo + real]).abs().max().item() if real else 0.0,
            "ops": checker.ops(),
            "violations": list(checker.violations),
            "sdpa_key_lens": sdpa_calls,
            "kernel_blocks": blocks_seen,
            "masked": masked,
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return launch(_worker, WORLD)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_full_sdpa(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    for rank, res in enumerate(results):
        r = res[case.name]
        assert r["shape"] == (2, case.heads, case.s_local, 8)
        assert r["finite"], f"rank {rank}: non-finite output (padded rows must stay finite)"
        assert r["err"] <= 1e-5, f"rank {rank}: max abs err {r['err']}"
        assert r["assembled_err"] <= 1e-5


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_collectives_pass_neuron_rules(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    want = ["all_to_all_equal"] * (case.ulysses > 1) + ["ring_pass"] * (case.ring - 1)
    want += ["all_to_all_equal"] * (case.ulysses > 1)
    for res in results:
        r = res[case.name]
        assert r["violations"] == []
        assert r["ops"] == want


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_local_attention_used_without_ring(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    """With ring size 1 the caller's kernel runs, over the real keys only; with a ring it cannot (LSE)."""
    for res in results:
        lens = res[case.name]["sdpa_key_lens"]
        assert lens == ([case.seq_len] if case.ring == 1 else [])


@pytest.mark.parametrize("case", [c for c in CASES if c.ring > 1], ids=lambda c: c.name)
def test_ring_blocks_run_on_the_fused_kernel(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    """Each ring step with a real key calls the LSE kernel once, over that block's real keys only (the math path
    is forbidden in the ranks); a block that is all padding is skipped."""
    for rank, res in enumerate(results):
        ring_rank = (rank % case.cp) // case.ulysses
        want = []
        for step in range(case.ring):
            src = (ring_rank - step) % case.ring
            lo = src * case.ulysses * case.s_local  # the block holds the rows of cp ranks src*U .. src*U+U-1
            real = max(0, min(case.ulysses * case.s_local, case.seq_len - lo))
            want += [real] if real else []
        assert res[case.name]["kernel_blocks"] == want, (rank, res[case.name]["kernel_blocks"], want)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_key_masks_travel_with_the_keys(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    """A mask over the keys (bool, and a float bias with -inf), given as each CP rank's mask over its own key rows,
    equals SDPA with the whole mask, also where every key of a block is masked for a batch row; ignoring the mask
    (the unmasked result) is wrong, so the test sees it."""
    for rank, res in enumerate(results):
        masked = res[case.name]["masked"]
        assert masked["bool"] <= 1e-5 and masked["float"] <= 1e-5, (rank, masked)
    assert max(res[case.name]["masked"]["bool-ignored"] for res in results) > 1e-3
    assert max(res[case.name]["masked"]["float-ignored"] for res in results) > 1e-3


@pytest.mark.parametrize("case", [c for c in CASES if c.s_local * c.cp > c.seq_len], ids=lambda c: c.name)
def test_unmasked_padding_is_wrong(results: list[dict[str, dict[str, Any]]], case: Case) -> None:
    """Negative control: letting the zero pad keys into the softmax changes real rows, so the mask matters."""
    assert max(res[case.name]["unmasked_err"] for res in results) > 1e-3


# --- pure unit tests --------------------------------------------------------------------------------


def test_attention_with_lse_matches_sdpa_and_merges() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3))
    out, lse = CPA.attention_with_lse(q, k, v, None)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 2.0, dim=-1))
    # two key blocks merged by LSE give the whole
    valid = torch.arange(5) < 3
    a = CPA.attention_with_lse(q, k, v, valid)
    b = CPA.attention_with_lse(q, k, v, ~valid)
    merged, merged_lse = CPA._merge(a[0], a[1], b[0], b[1])
    torch.testing.assert_close(merged, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged_lse, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_kernel_matches_the_math_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 7, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 3, 11, 16, generator=gen).to(dtype) for _ in range(2))
    out, lse = CPA.block_attention_with_lse(q, k, v, 0.3)
    want, want_lse = CPA.attention_with_lse(q.float(), k.float(), v.float(), None, 0.3)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 7)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def test_all_padding_block_gives_no_nan() -> None:
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    out, lse = CPA.attention_with_lse(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.zeros(3, dtype=torch.bool))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    merged, merged_lse = CPA._merge(out.float(), lse, out.float(), lse)
    assert torch.all(merged == 0) and torch.all(merged_lse == float("-inf"))
    real, real_lse = CPA.attention_with_lse(q, k, v, None)
    merged, merged_lse = CPA._merge(out.float(), lse, real, real_lse)
    torch.testing.assert_close(merged, real)


def test_cpgroups_coordinates_and_validation() -> None:
    g = CPA.CPGroups(object(), 2, 1, object(), 4, 3)  # type: ignore[arg-type]
    assert (g.cp_size, g.cp_rank) == (8, 7)
    with pytest.raises(ValueError, match="no ring group"):
        CPA.CPGroups(None, 2, 0, None, 1, 0)
    with pytest.raises(ValueError, match="ulysses rank 2"):
        CPA.CPGroups(None, 1, 0, None, 1, 2)
    single = CPA.CPGroups(None, 1, 0, None, 1, 0)
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="seq_len 5"):
        CPA.cp_attention(q, q, q, groups=single, seq_len=5)


def test_single_rank_with_padding_and_patched_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default kernel is the builtin, so a runtime that patches the public name cannot recurse."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    padded = [F.pad(x, (0, 0, 0, 2)) for x in (q, k, v)]

    def intercepted(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the patched public sdpa must not be called")

    monkeypatch.setattr(F, "scaled_dot_product_attention", intercepted)
    got = CPA.cp_attention(*padded, groups=CPA.CPGroups(None, 1, 0, None, 1, 0), seq_len=6)
    torch.testing.assert_close(got[:, :, :6], want, atol=1e-6, rtol=0)
    assert torch.isfinite(got).all()


def test_math_path_chunks_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    whole = CPA.attention_with_lse(q, k, v, None)
    monkeypatch.setattr(CPA, "_MAX_SCORE_ELEMENTS", 40)  # 2 query rows per chunk
    chunked = CPA.attention_with_lse(q, k, v, None)
    torch.testing.assert_close(chunked, whole)


def test_neuron_flash_advice() -> None:
    assert CPA.neuron_flash_advice(512) is None
    assert CPA.neuron_flash_advice(4096) is None
    msg = CPA.neuron_flash_advice(1000)
    assert msg is not None and "\n" not in msg
    assert "add 24 rows (to 1024)" in msg and "trim 488 rows (to 512)" in msg
    small = CPA.neuron_flash_advice(300)
    assert small is not None and "add 212 rows (to 512)" in small and "trim" not in small
    with pytest.raises(ValueError):
        CPA.neuron_flash_advice(0)
