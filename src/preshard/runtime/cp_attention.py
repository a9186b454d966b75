"""Context-parallel attention over a sequence-sharded q/k/v (Ulysses inside, ring outside).

The CP hook layer pads the sequence to a multiple of the CP size and gives each rank one contiguous
block of rows; this module computes, for that rank's query rows, exactly the non-causal softmax
attention of the unpadded sequence. Padding rows form a suffix of the global sequence, so in every key
block the real keys are a prefix: cutting the block there (rather than masking) keeps padded keys out
of every softmax, lets the fast unmasked kernels run, and leaves no row without a key (so no NaN).
Every collective goes through `preshard.runtime.collectives` so the Neuron rule checker sees all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from preshard.runtime import collectives

__all__ = ["CPGroups", "attention_with_lse", "cp_attention", "neuron_flash_advice"]

# Upper bound on float32 score elements materialised at once by the math path (512 MiB).
_MAX_SCORE_ELEMENTS = 1 << 27
_NEURON_FLASH_MULTIPLE = 512
# The builtin behind F.scaled_dot_product_attention, taken at import so that a runtime patch of the public
# name (the CP hooks intercept it) can never make the default recurse into itself.
_ORIGINAL_SDPA: Callable[..., torch.Tensor] = getattr(
    torch._C._nn, "scaled_dot_product_attention", F.scaled_dot_product_attention
)


@dataclass(frozen=True)
class CPGroups:
    """This rank's place on the context-parallel axes; a group is None when its axis has size 1."""

    ring_group: ProcessGroup | None
    ring_size: int
    ring_rank: int
    ulysses_group: ProcessGroup | None
    ulysses_size: int
    ulysses_rank: int

    def __post_init__(self) -> None:
        for axis in ("ring", "ulysses"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            group = getattr(self, f"{axis}_group")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"CPGroups: {axis} rank {rank} is not in [0, {size})")
            if size > 1 and group is None:
                raise ValueError(f"CPGroups: {axis} size is {size} but no {axis} group was given")

    @property
    def cp_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def cp_rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    seq_len: int,
    scale: float | None = None,
    local_attention: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of this rank's query rows against the whole (real) sequence, `[B, H, S_local, D]`.

    q/k/v hold global rows `[cp_rank * S_local, (cp_rank + 1) * S_local)` of a sequence padded to
    `S_local * cp_size`; rows at positions `>= seq_len` are padding. `local_attention` is called as
    `local_attention(q, k, v, scale=scale)` where no log-sum-exp is needed (ring size 1); pass the
    original, unpatched `scaled_dot_product_attention` so the device's kernels run (the default is
    torch's builtin, captured at import, so it is safe even while the public name is patched).
    """
    return _cp_attention(
        query,
        key,
        value,
        groups=groups,
        seq_len=seq_len,
        scale=scale,
        local_attention=local_attention,
        mask_padding=True,
    )


def _cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    seq_len: int,
    scale: float | None,
    local_attention: Callable[..., torch.Tensor] | None,
    mask_padding: bool,
) -> torch.Tensor:
    """`cp_attention`, with a switch that lets tests show that cutting out padded keys matters."""
    _check_inputs(query, key, value, groups, seq_len)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if local_attention is None:
        local_attention = _ORIGINAL_SDPA
    heads = query.shape[1]
    u = groups.ulysses_size

    if u > 1:
        query, key, value = _seq_to_heads([query, key, value], groups.ulysses_group, u)
    # Now this rank holds rows [ring_rank * block, (ring_rank + 1) * block) for its heads.
    block = key.shape[2]

    if groups.ring_size == 1:
        if mask_padding and seq_len < block:
            key, value = key[:, :, :seq_len], value[:, :, :seq_len]
        out = local_attention(query, key, value, scale=scale)
    else:
        out, _ = _ring_attention(query, key, value, groups, seq_len=seq_len if mask_padding else None, scale=scale)
        out = out.to(query.dtype)

    if u > 1:
        out = _heads_to_seq(out, groups.ulysses_group, u, heads)
    return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: CPGroups, seq_len: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("cp_attention: q, k, v must be [B, H, S_local, D]")
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share B, H, "
            "S_local (no GQA), and q/k the head dim"
        )
    s_pad = q.shape[2] * groups.cp_size
    if not 1 <= seq_len <= s_pad:
        raise ValueError(f"cp_attention: seq_len {seq_len} not in [1, {s_pad}] (S_local * cp_size)")


def _seq_to_heads(xs: list[torch.Tensor], group: ProcessGroup | None, u: int) -> list[torch.Tensor]:
    """Ulysses forward all-to-all: `[B, H, S, D]` sequence shards -> `[B, ceil(H/u), u*S, D]` head shards.

    Heads are zero-padded to a multiple of `u` so the exchange is equal-sized; q/k/v travel in one
    all-to-all when they share a shape.
    """
    if all(x.shape == xs[0].shape for x in xs):
        return list(_seq_to_heads_stacked(torch.stack(xs), group, u).unbind(0))
    return [_seq_to_heads_stacked(x.unsqueeze(0), group, u)[0] for x in xs]


def _seq_to_heads_stacked(x: torch.Tensor, group: ProcessGroup | None, u: int) -> torch.Tensor:
    n, b, h, s, d = x.shape
    h_pad = -(-h // u) * u
    if h_pad != h:
        x = F.pad(x, (0, 0, 0, 0, 0, h_pad - h))
    hu = h_pad // u
    # [u (head chunk -> destination), n, b, hu, s, d]
    send = x.reshape(n, b, u, hu, s, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    recv = collectives.all_to_all_equal(send, group)
    # recv[i] is sequence block i of the Ulysses group, for this rank's head chunk.
    return recv.permute(1, 2, 3, 0, 4, 5).reshape(n, b, hu, u * s, d)


def _heads_to_seq(out: torch.Tensor, group: ProcessGroup | None, u: int, heads: int) -> torch.Tensor:
    """Ulysses return all-to-all: `[B, H_pad/u, u*S, D]` -> `[B, heads, S, D]`, padded heads dropped."""
    b, hu, us, d = out.shape
    s = us // u
    # [u (sequence block -> destination), b, hu, s, d]
    send = out.reshape(b, hu, u, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = collectives.all_to_all_equal(send, group)
    # recv[j] is head chunk j, for this rank's sequence block.
    full = recv.permute(1, 0, 2, 3, 4).reshape(b, u * hu, s, d)
    return full[:, :heads] if u * hu != heads else full


def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: CPGroups,
    *,
    seq_len: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention: K/V blocks travel round the ring group; partials merge by log-sum-exp (float32).

    Block from ring rank r covers rows `[r * L, (r + 1) * L)`; its keys at `>= seq_len` are cut off
    (None: keep all, for the negative-control test). Returns float32 `(out, lse)`.
    """
    n, me, block = groups.ring_size, groups.ring_rank, k.shape[2]
    k_numel = k.numel()
    k_shape, v_shape = k.shape, v.shape
    buf = torch.cat([k.reshape(-1), v.reshape(-1)])
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(n):
        pending = collectives.ring_pass_async(buf, groups.ring_group) if step < n - 1 else None
        src = (me - step) % n
        valid = block if seq_len is None else max(0, min(block, seq_len - src * block))
        if valid > 0:
            k_blk = buf[:k_numel].view(k_shape)[:, :, :valid]
            v_blk = buf[k_numel:].view(v_shape)[:, :, :valid]
            o_blk, lse_blk = _attention_f32(q, k_blk, v_blk, None, scale)
            out, lse = (o_blk, lse_blk) if out is None else _merge(out, lse, o_blk, lse_blk)
        if pending is not None:
            buf = pending.wait()
    if out is None:  # unreachable while seq_len >= 1: ring rank 0's block always has a real key
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax partials; rows with lse = -inf on both sides stay 0 instead of NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = out_a * torch.exp(lse_a - ref).unsqueeze(-1) + out_b * torch.exp(lse_b - ref).unsqueeze(-1)
    return out, lse


def _attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Math-path attention in float32, query rows chunked to bound the score matrix."""
    kf = k.float().transpose(-1, -2)
    vf = v.float()
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    rows = max(1, _MAX_SCORE_ELEMENTS // max(1, b * h * lk))
    outs, lses = [], []
    for start in range(0, lq, rows):
        scores = torch.matmul(q[:, :, start : start + rows].float(), kf) * scale
        if key_valid is not None:
            scores = scores.masked_fill(~key_valid, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        outs.append(torch.matmul(torch.exp(scores - ref.unsqueeze(-1)), vf))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention plus its log-sum-exp, so partial results over key blocks can be merged.

    `key_valid`: bool, broadcastable to `[B, H, 1, Lk]` (e.g. `[Lk]`); False keys are ignored. Rows with
    no valid key give out = 0 and lse = -inf (never NaN). Computed in float32; `out` is returned in the
    input dtype, `lse` in float32 `[B, H, Lq]`.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, lse = _attention_f32(q, k, v, key_valid, scale)
    return out.to(q.dtype), lse


def neuron_flash_advice(seq_len: int) -> str | None:
    """Advice when Neuron's NKI flash-attention kernel would be skipped for this sequence length.

    Neuron's SDPA uses the NKI flash kernel only when the attention sequence length is a multiple of 512;
    otherwise it silently builds the full score matrix. Written from Neuron's documented behaviour,
    untested on Neuron hardware. Returns None when the kernel applies, else a one-line message.
    """
    if seq_len < 1:
        raise ValueError(f"neuron_flash_advice: seq_len must be positive, got {seq_len}")
    m = _NEURON_FLASH_MULTIPLE
    if seq_len % m == 0:
        return None
    up = -(-seq_len // m) * m
    down = seq_len // m * m
    fix = f"add {up - seq_len} rows (to {up})"
    if down > 0:
        fix += f" or trim {seq_len - down} rows (to {down})"
    return (
        f"Neuron: attention sequence length {seq_len} is not a multiple of {m}, so the NKI flash-attention "
        f"kernel will be skipped and the full score matrix materialised; {fix}."
    )
