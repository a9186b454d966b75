"""transformers models at load: built from a transformers config.json, and their grouped-query attention told how
many query heads share each local KV head.

transformers' attention reshapes by `head_dim` with `-1` heads, so splitting q/k/v by whole heads needs no head
count changed, but `num_key_value_groups` (query heads per KV head, what `repeat_kv` repeats by) must match the
local heads: unchanged when the KV heads are split with the query heads, and the local query heads when each rank
computes one KV head (`kv_head_select`). The plan's attention rules divide the head counts modules keep
(T5's `n_heads`, `inner_dim`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from preshard.errors import MismatchError, PlanError
from preshard.format.manifest import Manifest
from preshard.format.plan import matches
from preshard.format.styles import KVHeadSelect, Style


def build_transformers_model(model: type, checkpoint: Path, config: dict[str, Any], on_meta: Any) -> nn.Module:
    """`model` (a transformers class config.json's `architectures` names, or one of the same `model_type`) built
    from the checkpoint's config inside `on_meta()` (parameters on meta, buffers real), in eval mode as
    `from_pretrained` leaves it (T5's dropout would otherwise be on).

    Raises:
        MismatchError: another model's checkpoint, or a config the class rejects.
    """
    from preshard.plans.hf_transformers import build_transformers

    declared = [str(a) for a in config.get("architectures") or []]
    model_type = getattr(getattr(model, "config_class", None), "model_type", None)
    if model.__name__ not in declared and model_type != config.get("model_type"):
        raise MismatchError(
            f"{checkpoint} holds a {', '.join(declared)} checkpoint ({config.get('model_type')}), not "
            f"{model.__name__}; pass the matching class"
        )
    try:
        with on_meta():
            return build_transformers(model, config).eval()
    except PlanError as exc:
        raise MismatchError(str(exc)) from None


def localise_kv_groups(model: nn.Module, manifest: Manifest) -> dict[str, int]:
    """Set `num_key_value_groups` on every attention module whose k projection computes one KV head per rank
    (`kv_head_select`) to the query heads this rank holds.

    Returns:
        The value set, by module name.
    """
    changed: dict[str, int] = {}
    for name, record in manifest.tensors.items():
        if not name.endswith(".k_proj.weight") or not isinstance(record.layout.style, KVHeadSelect):
            continue
        attention = model.get_submodule(name.removesuffix(".k_proj.weight"))
        head_dim, q_proj = getattr(attention, "head_dim", None), getattr(attention, "q_proj", None)
        if not isinstance(head_dim, int) or not isinstance(q_proj, nn.Linear):
            continue
        groups = q_proj.out_features // head_dim  # already local
        if isinstance(getattr(attention, "num_key_value_groups", None), int):
            setattr(attention, "num_key_value_groups", groups)  # noqa: B010 - an int attribute, not a submodule
        if isinstance(getattr(attention, "num_key_value_heads", None), int):
            setattr(attention, "num_key_value_heads", 1)  # noqa: B010
        changed[name.removesuffix(".k_proj.weight")] = groups
    return changed


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Parameters held under a second name (tied input embeddings: T5's `shared` and `encoder.embed_tokens`):
    alias -> the name the checkpoint stores it under (the first, as `named_parameters` lists it)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """After loading, each alias holds the loaded parameter again (loading replaced the one it shared)."""
    for alias, name in aliases.items():
        module_name, _, leaf = alias.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = model.get_parameter(name)


def tied_splits(manifest: Manifest, aliases: dict[str, str]) -> dict[str, Style]:
    """Modules that hold a split tensor under a second name (a tied lm_head over an embedding split by vocabulary,
    T5's `encoder.embed_tokens` beside `shared`): after `retie` their weight is this rank's rows, so each needs the
    style the plan gives it, splitting the same dimension.

    Returns:
        The style of each such module, by module name.

    Raises:
        PlanError: an alias of a split tensor that the plan gives no style splitting it alike, naming both.
    """
    styles: dict[str, Style] = {}
    for alias, stored in aliases.items():
        record = manifest.tensors.get(stored)
        if record is None or not record.layout.sharded:
            continue
        module = alias.rpartition(".")[0]
        rules = [rule for rule in manifest.plan.linear if matches(rule.match, module)]
        style = rules[0].style if rules else None
        if style is None or style.shard_dim(alias.rpartition(".")[2]) != record.layout.shard_dim:
            raise PlanError(
                f"{alias} is the same parameter as {stored}, which the plan splits ({record.layout.style.name}), but "
                f"the plan gives {module} no style splitting it alike; add a rule for {module} (colwise_gather for "
                "an lm_head, vocab_parallel for an embedding) or keep both whole"
            )
        styles[module] = style
    return styles
