"""Sharding styles: one object per way of splitting a module's weights across TP ranks.

A style owns every fact about itself, so that adding one touches this module only:
- which dimension of the weight and of the bias it splits (`shard_dim`);
- how a split dimension is cut into packed blocks (`block_sizes`), each split separately across ranks;
- which rectangular chunks (`Box`es) of the source tensor each TP rank keeps, and the local shape;
- how the runtime rewires the module's forward (`parallel_forward`, in `style_forwards`, which imports torch when
  the runtime asks for it); styles whose output is already this rank's slice of the features (colwise, packed
  colwise) need none.

For `W` of shape `[out, in]`, T ranks, rank r: colwise keeps rows `[r*out/T, (r+1)*out/T)`; rowwise keeps
columns and all-reduces `x_r W_r^T`, adding the bias once after the reduce; packed styles do the same
within each block of a fused dimension (SwiGLU's `[up; gate]`, Flux's single-stream `cat([attn, mlp])`
input); `replicated_input_rowwise` slices a replicated input locally before the row-parallel matmul.

One style applies to a norm rather than a Linear: `tp_rms_norm`, an RMSNorm over the output features of a
column-split projection (Wan's and LTX-2's `qk_norm="rms_norm_across_heads"`). Its weight is split like those
features; each rank sums the squares of its features in float32, all-reduces the sum over the TP group and
divides by the full width, so every rank normalises by the RMS of the whole row, exactly as the unsharded norm.

Two styles split a vocabulary by rows (a model's token embedding and its lm_head), each rank holding rows
`[r*V/T, (r+1)*V/T)`: `vocab_parallel` on an nn.Embedding looks up the ids in its rows (zeros for the others) and
all-reduces the sum, in which exactly one rank adds each row, so the sum is the row itself bit for bit;
`colwise_gather` on a Linear (an lm_head, tied to that embedding or not) computes its rows' outputs and
all-gathers them along the last dim, so every rank returns the full logits. Like every split here, T must divide
V (the plan is refused otherwise, naming the degrees that do; inference keeps such a vocabulary whole).
`tp_layer_norm` is the same for a LayerNorm (LuminaNext's `layer_norm_across_heads`): the row's sum is all-reduced
for its mean, then the sum of squared deviations from it for its variance (two small all-reduces rather than one
of sum and sum of squares, whose difference would cancel), and the weight and bias are split like the features.

`split_experts` applies to a module of mixture-of-experts parameters `[experts, ...]` (NucleusMoE's): whole
experts per rank, their rows of the output computed there and all-reduced (zeros elsewhere), exact like
`vocab_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from preshard.errors import PlanError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor, as torch DCP describes chunks


@dataclass(frozen=True)
class Style:
    """Replicated: every rank keeps the whole tensor and the module runs unchanged."""

    name: ClassVar[str] = "replicate"
    weight_dim: ClassVar[int | None] = None
    bias_dim: ClassVar[int | None] = None
    packed: ClassVar[bool] = False
    reduces_output: ClassVar[bool] = False
    # What the style applies to: "linear" (weight [out, in], bias [out]), "norm" (weight and bias [features]),
    # "embedding" (an nn.Embedding's weight [vocab, dim]) or "experts" (a module of parameters [experts, ...]).
    module_kind: ClassVar[str] = "linear"
    # The TP group's collective the rewired forward combines the ranks' results with: "all_reduce" (sum) or
    # "all_gather" (concatenated along the last dim).
    collective: ClassVar[str] = "all_reduce"

    # A packed style's blocks: a count of equal blocks or the block sizes, as the plan gives them.
    blocks: int | tuple[int, ...] | None = None

    def shard_dim(self, param: str) -> int | None:
        """The dimension this style splits for the Linear's `param` ("weight", "bias"); None keeps it whole."""
        return {"weight": self.weight_dim, "bias": self.bias_dim}.get(param)

    def block_sizes(self, size: int, where: str) -> tuple[int, ...]:
        """Absolute sizes of the blocks that cut a split dimension of `size`; one block for unpacked styles."""
        if not self.packed:
            return (size,)
        if isinstance(self.blocks, int):
            if size % self.blocks:
                raise PlanError(f"{where}: {size} does not split into {self.blocks} equal packed blocks")
            return (size // self.blocks,) * self.blocks
        sizes = tuple(self.blocks or ())
        if sum(sizes) != size:
            raise PlanError(f"{where}: packed blocks {list(sizes)} add up to {sum(sizes)}, not {size}")
        return sizes

    def weight_ndim(self) -> int:
        """How many dims the module's weight has: 2 for a Linear `[out, in]` or an Embedding `[vocab, dim]`, 1 for a
        norm `[features]`."""
        return 1 if self.module_kind == "norm" else 2

    def param_ndim(self, param: str) -> int | None:
        """How many dims the module's parameter `param` has under this style (None: a parameter it does not cut)."""
        return {"weight": self.weight_ndim(), "bias": 1}.get(param)

    def parallel_forward(self) -> Callable[..., Any] | None:
        """`forward(module, x, tp_rank, tp, combine)` for a rewired module, `combine` the TP group's `collective`;
        None leaves it unchanged."""
        return None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"style": self.name}
        if self.packed:
            data["blocks"] = self.blocks if isinstance(self.blocks, int) else list(self.blocks or ())
        return data


@dataclass(frozen=True)
class Colwise(Style):
    """Output features split: rows of the weight and the bias. No communication."""

    name: ClassVar[str] = "colwise"
    weight_dim: ClassVar[int | None] = 0
    bias_dim: ClassVar[int | None] = 0


@dataclass(frozen=True)
class PackedColwise(Colwise):
    """Colwise within each block of a fused output (`[up; gate]`, fused QKV): local output `[b0_r; b1_r; ...]`."""

    name: ClassVar[str] = "packed_colwise"
    packed: ClassVar[bool] = True


@dataclass(frozen=True)
class Rowwise(Style):
    """Input features split; the input is already this rank's slice. All-reduce, then the bias once."""

    name: ClassVar[str] = "rowwise"
    weight_dim: ClassVar[int | None] = 1
    reduces_output: ClassVar[bool] = True

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import rowwise_forward

        return rowwise_forward


@dataclass(frozen=True)
class PackedRowwise(Rowwise):
    """Rowwise within each block of a fused input (`cat([attn, mlp])`): the input is `[attn_r; mlp_r]`."""

    name: ClassVar[str] = "packed_rowwise"
    packed: ClassVar[bool] = True


@dataclass(frozen=True)
class ReplicatedInputRowwise(Rowwise):
    """Rowwise on a replicated input: each rank slices its `in/T` features first (MiniMax-H3's adaln_proj)."""

    name: ClassVar[str] = "replicated_input_rowwise"

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import replicated_input_rowwise_forward

        return replicated_input_rowwise_forward


@dataclass(frozen=True)
class TPNorm(Style):
    """A norm over the features of a column-split projection: weight (and bias) split like those features, the
    row's statistics all-reduced over the TP group (the subclasses say which). Exact at any TP degree that divides
    the heads; a norm without a weight (`elementwise_affine=False`) has nothing to split but still needs them.
    """

    weight_dim: ClassVar[int | None] = 0
    bias_dim: ClassVar[int | None] = 0
    module_kind: ClassVar[str] = "norm"
    # (module, class name) of the norm classes the style's forward computes exactly as: a subclass may compute
    # something else in its forward, so exactly these.
    classes: ClassVar[tuple[tuple[str, str], ...]] = ()
    knows: ClassVar[str] = ""

    @staticmethod
    def width(module: Any) -> int | None:
        """The features a norm normalises over (one trailing dim: `normalized_shape` or `dim`), else None."""
        shape = getattr(module, "normalized_shape", None)
        if shape is None:
            shape = getattr(module, "dim", None)
        if isinstance(shape, int) and not isinstance(shape, bool):
            return shape
        if isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
            return int(shape[0])  # (torch.Size is a tuple)
        return None

    @classmethod
    def unsupported(cls, module: Any) -> str | None:
        """Why `module` cannot take this style (None: it can)."""
        kind = type(module)
        if (kind.__module__, kind.__name__) not in cls.classes:
            return f"is a {kind.__name__}, and {cls.name} knows {cls.knows} only"
        if cls.width(module) is None:
            return f"normalises over more than one trailing dim, and {cls.name} splits one"
        return None


@dataclass(frozen=True)
class TPRMSNorm(TPNorm):
    """An RMSNorm over the features of a column-split projection: the rank's sum of squares is all-reduced in
    float32 over the TP group and divided by the full width, then the rank's weight slice applies."""

    name: ClassVar[str] = "tp_rms_norm"
    classes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("torch.nn.modules.normalization", "RMSNorm"),
        ("diffusers.models.normalization", "RMSNorm"),
    )
    knows: ClassVar[str] = "torch.nn.RMSNorm and diffusers' RMSNorm"

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import tp_rms_norm_forward

        return tp_rms_norm_forward


@dataclass(frozen=True)
class TPLayerNorm(TPNorm):
    """A LayerNorm over the features of a column-split projection (LuminaNext's `layer_norm_across_heads`): two
    all-reduces, the row's sum (for its mean), then its sum of squared deviations from that mean (its variance,
    without the cancellation of E[x^2] - E[x]^2), then the rank's weight and bias slices apply."""

    name: ClassVar[str] = "tp_layer_norm"
    classes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("torch.nn.modules.normalization", "LayerNorm"),
        ("diffusers.models.normalization", "FP32LayerNorm"),
    )
    knows: ClassVar[str] = "torch.nn.LayerNorm and diffusers' FP32LayerNorm"

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import tp_layer_norm_forward

        return tp_layer_norm_forward


TP_NORMS: tuple[type[TPNorm], ...] = (TPRMSNorm, TPLayerNorm)


def tp_norm_style(module: Any) -> TPNorm | str:
    """The TP norm style that computes `module` exactly when its features are split, else why none does."""
    for cls in TP_NORMS:
        if cls.unsupported(module) is None:
            return cls()
    for cls in TP_NORMS:  # a known class over several dims: say so
        kind = type(module)
        if (kind.__module__, kind.__name__) in cls.classes:
            return str(cls.unsupported(module))
    known = ", ".join(cls.knows for cls in TP_NORMS)
    return f"is a {type(module).__name__}, and the TP norm styles know {known} only"


@dataclass(frozen=True)
class KVHeadSelect(Style):
    """A grouped key/value projection when TP exceeds its heads (`blocks` = its KV heads, which must divide T):
    stored whole, read by every rank, and rank r computes only KV head `r * blocks // T`, the one its query heads
    share. Splitting would give a rank part of a head; the weights are small (KV heads / query heads of q's).
    """

    name: ClassVar[str] = "kv_head_select"
    packed: ClassVar[bool] = True  # `blocks` is the head count; nothing is split

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import kv_head_select_forward

        return kv_head_select_forward


@dataclass(frozen=True)
class ColwiseGather(Colwise):
    """Output features split as colwise, then all-gathered along the last dim: every rank returns the whole output.
    For an lm_head over a vocabulary split by rows: each rank computes its V/T logits, the gather gives all V."""

    name: ClassVar[str] = "colwise_gather"
    collective: ClassVar[str] = "all_gather"

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import colwise_gather_forward

        return colwise_gather_forward


@dataclass(frozen=True)
class VocabParallel(Style):
    """An nn.Embedding split by vocabulary rows: rank r holds rows `[r*V/T, (r+1)*V/T)`, looks up the ids in them
    (a zero vector for the others) and all-reduces the sum over the TP group, which is the unsharded lookup exactly
    (each row comes from one rank, every other adds zeros). An id outside the vocabulary gives a zero vector where
    the unsharded embedding raises an index error."""

    name: ClassVar[str] = "vocab_parallel"
    weight_dim: ClassVar[int | None] = 0
    module_kind: ClassVar[str] = "embedding"

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import vocab_parallel_forward

        return vocab_parallel_forward

    @staticmethod
    def unsupported(module: Any) -> str | None:
        """Why `module` cannot take this style (None: it can): an nn.Embedding without `max_norm` (which renormalises
        the rows it looks up, in place), of torch's class or of a subclass whose own forward, if it has one, calls
        `super()` and so computes on nn.Embedding's lookup (Gemma-3's scaled embedding multiplies it by a constant)."""
        import torch

        if not isinstance(module, torch.nn.Embedding):
            return f"is a {type(module).__name__}, not an nn.Embedding"
        if module.max_norm is not None:
            return "renormalises the rows it looks up (max_norm), which a split vocabulary cannot do alike"
        forward = type(module).forward
        code = getattr(forward, "__code__", None)
        if forward is not torch.nn.Embedding.forward and (code is None or "super" not in code.co_names):
            return (
                f"is a {type(module).__name__} whose forward does not call nn.Embedding's, and vocab_parallel splits "
                "that lookup only"
            )
        return None


@dataclass(frozen=True)
class SplitExperts(Style):
    """A module of mixture-of-experts weights stored as parameters `[experts, ...]` (NucleusMoE's `SwiGLUExperts`:
    `gate_up_proj [E, in, 2I]`, `down_proj [E, I, out]`), split by whole experts: rank r keeps experts
    `[r*E/T, (r+1)*E/T)` of every parameter (dim 0). Its forward runs the module's own forward on the rows of its
    experts only (the module takes its tokens sorted by expert, with the count of each), zeros in every other row,
    and all-reduces: each row comes from the one rank holding its expert, so the sum is the unsharded output bit
    for bit (as `vocab_parallel`). Every TP rank holds every token (the router runs replicated), so no token moves.
    """

    name: ClassVar[str] = "split_experts"
    module_kind: ClassVar[str] = "experts"
    reduces_output: ClassVar[bool] = True
    # (module, class name) of the experts classes whose forward takes (tokens sorted by expert, tokens per expert)
    # and computes each expert's rows from its own slice of every parameter: exactly these.
    classes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("diffusers.models.transformers.transformer_nucleusmoe_image", "SwiGLUExperts"),
    )

    def shard_dim(self, param: str) -> int | None:
        return 0

    def param_ndim(self, param: str) -> int | None:
        return 3

    def parallel_forward(self) -> Callable[..., Any]:
        from preshard.format.style_forwards import split_experts_forward

        return split_experts_forward

    @classmethod
    def unsupported(cls, module: Any) -> str | None:
        """Why `module` cannot take this style (None: it can): a class whose forward it knows, whose parameters are
        all 3-D with the same number of experts first."""
        kind = type(module)
        if (kind.__module__, kind.__name__) not in cls.classes:
            return f"is a {kind.__name__}, and {cls.name} knows diffusers' SwiGLUExperts (NucleusMoE) only"
        shapes = [tuple(p.shape) for p in module.parameters(recurse=False)]
        if not shapes or len({len(s) for s in shapes} | {3}) != 1 or len({s[0] for s in shapes}) != 1:
            return f"has parameters of shapes {[list(s) for s in shapes]}, not all [experts, ...] of one expert count"
        return None


_ALL_STYLES: tuple[type[Style], ...] = (
    Style,
    Colwise,
    Rowwise,
    PackedColwise,
    PackedRowwise,
    ReplicatedInputRowwise,
    *TP_NORMS,
    KVHeadSelect,
    ColwiseGather,
    VocabParallel,
    SplitExperts,
)
STYLES: dict[str, type[Style]] = {cls.name: cls for cls in _ALL_STYLES}
REPLICATE = Style()


def style_names() -> str:
    return ", ".join(STYLES)


def make_style(name: object, blocks: object = None, where: str = "plan") -> Style:
    """A style from plan data (`{"style": ..., "blocks": ...}`), validated.

    Raises:
        PlanError: an unknown style name, or blocks that are missing, malformed, or given to an unpacked style.
    """
    cls = STYLES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise PlanError(f"{where}: unknown style {name!r}; use one of {style_names()}")
    if not cls.packed:
        if blocks is not None:
            raise PlanError(f"{where}: 'blocks' only applies to packed styles, not to {name}")
        return cls()
    if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 1:
        return cls(blocks=blocks)
    if (
        isinstance(blocks, (list, tuple))
        and blocks
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks)
    ):
        return cls(blocks=tuple(blocks))
    raise PlanError(f"{where}: {name} needs 'blocks': a count of equal blocks (2 for [up; gate]) or a list of sizes")
