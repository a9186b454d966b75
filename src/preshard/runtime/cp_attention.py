"""Context-parallel attention over sequence-sharded q/k/v (Ulysses inside, ring outside).

The CP hook layer pads every sequence it splits to a multiple of the CP size, on its own, and gives each
rank one contiguous block of rows of each. A rank's local keys are those blocks joined in the order the
model joins them (`KeyLayout`: one sequence for most attention, text then image for Flux's joint
attention). Which key rows are padding therefore follows from the layout alone, on every rank, with no
data: this module drops them before any softmax (a slice where they are a suffix, a concatenation of the
real runs otherwise), so the fast unmasked kernels run, no row is left without a key (no NaN), and the
result is exactly the attention of the unpadded sequences. Query rows that are padding produce rows that
the hooks drop at the gather.

A mask over the keys (a text padding mask: HunyuanVideo's joint attention) comes as each CP rank's mask over
its local key rows (`key_masks`); it travels with the keys: after the Ulysses exchange this rank holds every
key of its ring rank's blocks and applies their masks joined, and each ring step applies the mask of the block
it computes. Padded rows are dropped from the mask as from the keys. A key block whose keys are all masked for
a batch row gives lse = -inf there, so it adds nothing when the blocks merge.

Ring steps compute each key block with a kernel that also returns the log-sum-exp and merge the blocks in
float32 from it: on CPU `aten._scaled_dot_product_flash_attention_for_cpu`; on CUDA the flash kernel
(fp16/bf16) or the memory-efficient one (untested on CUDA hardware); elsewhere a chunked float32 math path.
The next K/V block is already in flight while the current one is computed. Every collective goes through
`preshard.runtime.collectives` so the Neuron rule checker sees all of them and torch.compile traces them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from preshard.runtime import collectives

__all__ = [
    "CPGroups",
    "KeySequence",
    "attention_with_lse",
    "block_attention_with_lse",
    "cp_attention",
    "neuron_flash_advice",
]

# Upper bound on float32 score elements materialised at once by the math path (512 MiB).
_MAX_SCORE_ELEMENTS = 1 << 27
_NEURON_FLASH_MULTIPLE = 512
# The builtin behind F.scaled_dot_product_attention, taken at import: the default local kernel.
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


@dataclass(frozen=True)
class KeySequence:
    """One split sequence inside a rank's local key block: `length` real rows over the CP group, `rows` per rank.

    CP rank p holds rows `[p * rows, (p + 1) * rows)` of the sequence padded to `rows * cp_size`.
    """

    length: int
    rows: int

    def real_rows(self, cp_rank: int) -> int:
        """How many of CP rank `cp_rank`'s `rows` are real (the rest, at the end, are padding)."""
        return max(0, min(self.rows, self.length - cp_rank * self.rows))


KeyLayout = tuple[KeySequence, ...]


def _real_runs(layout: KeyLayout, cp_rank: int, offset: int) -> list[tuple[int, int]]:
    """[start, stop) runs of real key rows in CP rank `cp_rank`'s local block, shifted by `offset`."""
    runs: list[tuple[int, int]] = []
    for seq in layout:
        real = seq.real_rows(cp_rank)
        if real:
            if runs and runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], offset + real)
            else:
                runs.append((offset, offset + real))
        offset += seq.rows
    return runs


def _select_rows(x: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of `x` (dim 2) in `runs`: the tensor itself, a slice, or a concatenation of slices."""
    if len(runs) == 1 and runs[0] == (0, x.shape[2]):
        return x
    if len(runs) == 1:
        return x[:, :, runs[0][0] : runs[0][1]]
    return torch.cat([x[:, :, a:b] for a, b in runs], dim=2)


def _select_last(x: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """`_select_rows` along the last dim (a key mask's keys)."""
    if len(runs) == 1 and runs[0] == (0, x.shape[-1]):
        return x
    return torch.cat([x[..., a:b] for a, b in runs], dim=-1)


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    seq_len: int | None = None,
    key_layout: Sequence[KeySequence] | None = None,
    scale: float | None = None,
    local_attention: Callable[..., torch.Tensor] | None = None,
    key_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's query rows against every real key of the CP group, `[B, H, S_q_local, D]`.

    Args:
        query: `[B, H, S_q_local, D]`, this rank's query rows (padding rows give rows the caller drops).
        key, value: `[B, H, S_k_local, D]`, this rank's key rows, laid out as `key_layout` says.
        groups: this rank's CP axes.
        seq_len: shorthand for a single split sequence of that many real rows (`key_layout` of one entry).
        key_layout: the split sequences joined, in order, in every rank's local key block.
        scale: softmax scale (default `D ** -0.5`).
        local_attention: called as `local_attention(q, k, v, scale=scale)` (with `attn_mask=` when masked)
            where no log-sum-exp is needed (ring size 1); default torch's builtin SDPA.
        key_masks: optional `[cp_size, B or 1, S_k_local]`: for each CP rank, in CP rank order, the mask over
            its local key rows, bool (True: attend) or float (added to the scores), as SDPA's `attn_mask`.

    Returns:
        The attention output for this rank's query rows, in the query dtype.

    Raises:
        ValueError: shapes that do not fit, or a layout that does not describe the local key block.
    """
    layout = _layout(key, groups, seq_len, key_layout)
    if key_masks is not None and (
        key_masks.dim() != 3
        or key_masks.shape[0] != groups.cp_size
        or key_masks.shape[1] not in (1, key.shape[0])
        or key_masks.shape[2] != key.shape[2]
    ):
        raise ValueError(
            f"cp_attention: key_masks {tuple(key_masks.shape)} must be [cp_size={groups.cp_size}, B or 1, "
            f"{key.shape[2]} local key rows]"
        )
    return _cp_attention(
        query,
        key,
        value,
        groups=groups,
        layout=layout,
        scale=scale,
        local_attention=local_attention,
        drop_padding=True,
        key_masks=key_masks,
    )


def _layout(
    key: torch.Tensor, groups: CPGroups, seq_len: int | None, key_layout: Sequence[KeySequence] | None
) -> KeyLayout:
    if (seq_len is None) == (key_layout is None):
        raise ValueError("cp_attention: pass exactly one of seq_len and key_layout")
    if key_layout is None:
        key_layout = (KeySequence(seq_len, key.shape[2]),)
    layout = tuple(key_layout)
    if key.dim() == 4 and sum(s.rows for s in layout) != key.shape[2]:
        raise ValueError(f"cp_attention: key layout {layout} does not add up to the {key.shape[2]} local key rows")
    for s in layout:
        if not 1 <= s.length <= s.rows * groups.cp_size:
            raise ValueError(f"cp_attention: seq_len {s.length} not in [1, {s.rows * groups.cp_size}] (rows * cp_size)")
    return layout


def _cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    groups: CPGroups,
    layout: KeyLayout,
    scale: float | None,
    local_attention: Callable[..., torch.Tensor] | None,
    drop_padding: bool,
    key_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cp_attention`, with a switch that lets tests show that dropping padded keys matters."""
    _check_inputs(query, key, value)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if local_attention is None:
        local_attention = _ORIGINAL_SDPA
    heads = query.shape[1]
    u = groups.ulysses_size

    if u > 1:
        query, key, value = _seq_to_heads([query, key, value], groups.ulysses_group, u)
    # This rank now holds, for its heads, the key blocks of CP ranks ring_rank * u + j for j < u, joined.

    def runs(ring_rank: int) -> list[tuple[int, int]]:
        rows = key.shape[2] // u
        if not drop_padding:
            return [(0, key.shape[2])]
        found: list[tuple[int, int]] = []
        for j in range(u):
            for a, b in _real_runs(layout, ring_rank * u + j, j * rows):
                if found and found[-1][1] == a:
                    found[-1] = (found[-1][0], b)
                else:
                    found.append((a, b))
        return found

    def mask(ring_rank: int, real: list[tuple[int, int]]) -> torch.Tensor | None:
        """The mask of the key block that started on `ring_rank` (its u CP ranks' blocks joined), real rows only,
        as `[B, 1, 1, keys]`."""
        if key_masks is None:
            return None
        blocks = key_masks[ring_rank * u : (ring_rank + 1) * u]  # [u, B, S]
        joined = blocks.permute(1, 0, 2).reshape(blocks.shape[1], -1)
        return _select_last(joined, real)[:, None, None, :]

    if groups.ring_size == 1:
        mine = runs(0)
        masked = mask(0, mine)
        extra = {} if masked is None else {"attn_mask": _as_sdpa_mask(masked, query.dtype)}
        out = local_attention(query, _select_rows(key, mine), _select_rows(value, mine), scale=scale, **extra)
    else:
        out = _ring_attention(query, key, value, groups, runs, scale=scale, mask=mask).to(query.dtype)

    if u > 1:
        out = _heads_to_seq(out, groups.ulysses_group, u, heads)
    return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("cp_attention: q, k, v must be [B, H, S_local, D]")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share B and H (no GQA), "
            "k and v their rows, and q and k the head dim"
        )


def _seq_to_heads(xs: list[torch.Tensor], group: ProcessGroup | None, u: int) -> list[torch.Tensor]:
    """Ulysses forward all-to-all: `[B, H, S, D]` sequence shards -> `[B, ceil(H/u), u*S, D]` head shards.

    Heads are zero-padded to a multiple of `u` so the exchange is equal-sized; tensors of one shape travel in
    one all-to-all (q, k and v together for self-attention).
    """
    out: list[torch.Tensor | None] = [None] * len(xs)
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        by_shape.setdefault((tuple(x.shape), x.dtype), []).append(i)
    for members in by_shape.values():
        moved = _seq_to_heads_stacked(torch.stack([xs[i] for i in members]), group, u).unbind(0)
        for i, x in zip(members, moved):
            out[i] = x
    return out  # type: ignore[return-value]


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
    runs: Callable[[int], list[tuple[int, int]]],
    *,
    scale: float,
    mask: Callable[[int, list[tuple[int, int]]], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Ring attention: K/V blocks travel round the ring group; partials merge by log-sum-exp in float32.

    `runs(r)` gives the real rows of the block that started on ring rank r (static: known from the layout);
    `mask(r, runs(r))` its key mask, if any. The next block is sent before the current one is computed, so the
    pass overlaps the kernel.
    """
    n, me = groups.ring_size, groups.ring_rank
    k_numel, k_shape, v_shape = k.numel(), k.shape, v.shape
    buf = torch.cat([k.reshape(-1), v.reshape(-1)])
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(n):
        pending = collectives.ring_pass_async(buf, groups.ring_group) if step < n - 1 else None
        src = (me - step) % n
        real = runs(src)
        if real:
            k_blk = _select_rows(buf[:k_numel].view(k_shape), real)
            v_blk = _select_rows(buf[k_numel:].view(v_shape), real)
            m_blk = mask(src, real) if mask is not None else None
            if m_blk is None:
                o_blk, lse_blk = block_attention_with_lse(q, k_blk, v_blk, scale)
            else:
                o_blk, lse_blk = block_attention_with_lse(q, k_blk, v_blk, scale, m_blk)
            out, lse = (o_blk.float(), lse_blk) if out is None else _merge(out, lse, o_blk, lse_blk)
        if pending is not None:
            buf = pending.wait()
    if out is None:  # unreachable while a sequence has a real row: ring rank 0's block always has one
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
    return out


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax partials in float32; rows with lse = -inf on both sides stay 0 instead of NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = out_a * torch.exp(lse_a - ref).unsqueeze(-1) + out_b.float() * torch.exp(lse_b - ref).unsqueeze(-1)
    return out, lse


def block_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block and its log-sum-exp (float32 `[B, H, Lq]`), on a fused kernel.

    CPU: the flash kernel SDPA itself uses (a mask as a float bias). CUDA (untested on CUDA hardware): the flash
    kernel for fp16/bf16, else the memory-efficient one; with a mask, the chunked float32 math path. Anything
    else: the math path. `out` may be in q's dtype. `attn_mask`: a key mask `[B or 1, 1, 1, Lk]`, bool (True:
    attend) or float (added to the scores); where it masks every key of a batch row, lse is -inf there (the
    kernels report 0), so the row adds nothing when blocks merge.
    """
    if attn_mask is not None:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=_as_bias(attn_mask, q.dtype), scale=scale
            )
        else:
            out, lse = _attention_f32(q, k, v, attn_mask, scale)
        attends = (attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")).any(dim=-1)
        return out, lse.masked_fill(~attends, float("-inf"))  # attends: [B or 1, 1, 1], broadcast over H and Lq
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse
    if q.device.type == "cuda":  # untested on CUDA hardware
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return result[0], result[1]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
        return out, lse[..., : q.shape[2]]
    return _attention_f32(q, k, v, None, scale)


def _as_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask as an additive float bias of `dtype` (bool: 0 where True, -inf where False)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _as_sdpa_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask SDPA takes: bool as it is, float in the query dtype."""
    return mask if mask.dtype == torch.bool else mask.to(dtype)


def _attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Math-path attention in float32, query rows chunked to bound the score matrix.

    `key_valid`: None, a bool mask (False keys ignored) or a float bias added to the scores.
    """
    kf = k.float().transpose(-1, -2)
    vf = v.float()
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    rows = max(1, _MAX_SCORE_ELEMENTS // max(1, b * h * lk))
    outs, lses = [], []
    for start in range(0, lq, rows):
        scores = torch.matmul(q[:, :, start : start + rows].float(), kf) * scale
        if key_valid is not None and key_valid.dtype == torch.bool:
            scores = scores.masked_fill(~key_valid, float("-inf"))
        elif key_valid is not None:
            scores = scores + key_valid.float()
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
    """Softmax attention plus its log-sum-exp, so partial results over key blocks can be merged (math path).

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
        f"kernel will be skipped and the full score matrix materialised; {fix} (in a pipeline: choose "
        "height, width, num_frames or max_sequence_length to match)."
    )
