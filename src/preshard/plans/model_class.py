"""The diffusers model class a checkpoint's config.json names, imported only when a check needs it.

Torch-free to import (torch and diffusers come with the class): the conversion path asks for a class only for plan
files, and for CP meshes whose plan has no CP plan of its own (`check_cp_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from preshard.errors import PlanError

if TYPE_CHECKING:
    from preshard.format.plan import Plan


def is_transformers_config(config: dict[str, Any] | None) -> bool:
    """config.json of a transformers model: `architectures` (a list of class names) and `model_type`, and no
    diffusers `_class_name`."""
    config = config or {}
    architectures = config.get("architectures")
    return (
        "_class_name" not in config
        and isinstance(config.get("model_type"), str)
        and isinstance(architectures, list)
        and bool(architectures)
        and all(isinstance(a, str) for a in architectures)
    )


def import_model_class(class_name: str) -> type:
    """`diffusers.<class_name>`.

    Raises:
        PlanError: diffusers is not installed, or has no such class.
    """
    from torch import nn

    try:
        import diffusers
    except ImportError:
        raise PlanError(
            f"the checkpoint's model class {class_name} has no built-in plan; reading the plan it declares needs "
            "diffusers: pip install 'preshard[diffusers]', or pass --plan NAME|FILE"
        ) from None
    cls = getattr(diffusers, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise PlanError(
            f"no built-in plan for model class {class_name}, and diffusers {diffusers.__version__} has no such "
            "model class; pass --plan NAME|FILE"
        )
    return cls


def declared_class(config: dict[str, Any] | None) -> type | None:
    """The diffusers class config.json's `_class_name` names, or None where there is none to import."""
    class_name = (config or {}).get("_class_name")
    if not isinstance(class_name, str):
        return None
    try:
        return import_model_class(class_name)
    except PlanError:
        return None


def check_cp_plan(plan: Plan, config: dict[str, Any] | None, cp: int) -> None:
    """A CP mesh (`cp` = ring x ulysses > 1) needs a CP plan: the plan's own, or the model class's `_cp_plan`
    (what the runtime uses): refused when converting rather than by every rank at load. Imports diffusers (~2 s)
    unless the plan has its own; an unknown class is not checked.

    Raises:
        PlanError: neither the plan nor the model class has one; a config value the CP plan does not work for.
    """
    if cp <= 1:
        return
    plan.check_cp_config(config)
    if plan.cp_plan:
        return
    cls = declared_class(config)  # torch and diffusers: only for a plan without a CP plan of its own
    if cls is not None and not getattr(cls, "_cp_plan", None):
        raise PlanError(
            f"plan {plan.name} has no cp_plan and {cls.__name__} declares no _cp_plan, so no rank could load a "
            f"context-parallel mesh (ring x ulysses = {cp}): use ring=1 and ulysses=1 (--cp 1), or add a cp_plan "
            "to a plan file"
        )
