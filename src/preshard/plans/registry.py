"""Finding a plan: a built-in one by name or by the checkpoint's model class, a plan file, or the plan the
model class declares itself (diffusers' `_tp_plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preshard.errors import PlanError
from preshard.format.jsonio import parse_json_text, read_json
from preshard.format.plan import Plan
from preshard.plans.model_class import is_transformers_config
from preshard.plans.tensor_check import structure_shown_by_tensors
from preshard.progress import note

if TYPE_CHECKING:
    from preshard.format.layout import TensorLayout


AUTO = "auto"  # --plan auto: infer the plan from the model's modules, whatever other plan exists


def builtin_plan_names() -> list[str]:
    folder = resources.files("preshard.plans") / "builtin"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_plan(name_or_path: str | Path) -> Plan:
    """A built-in plan by name, or a JSON plan file by path.

    Raises:
        PlanError: an unknown name, a missing or malformed file.
    """
    text = str(name_or_path)
    if text in builtin_plan_names():
        source = resources.files("preshard.plans") / "builtin" / f"{text}.json"
        data = parse_json_text(source.read_text(), f"built-in plan {text}", PlanError, "reinstall preshard")
        return Plan.from_dict(data, origin=f"built-in plan {text}")
    path = Path(text)
    if path.suffix != ".json" and not path.exists():
        raise PlanError(
            f"unknown plan {text!r}: built-in plans are {', '.join(builtin_plan_names())}; "
            "or pass the path of a JSON plan file"
        )
    data = read_json(path, f"plan file {text}", PlanError, "pass a JSON plan file or a built-in plan name")
    return Plan.from_dict(data, origin=f"plan file {text}")


def builtin_plan_for_class(class_name: str | None) -> Plan | None:
    """The built-in plan that declares `class_name`, if any."""
    if not class_name:
        return None
    for name in builtin_plan_names():
        plan = load_plan(name)
        if class_name in plan.model_classes:
            return plan
    return None


def vouched_for(plan: Plan, config: dict[str, Any] | None, layouts: Mapping[str, TensorLayout], cp: int = 1) -> bool:
    """Whether conversion may skip checking `plan` against the model class (`check_plan_against_model`): `plan`
    is a built-in plan, as shipped, made for the checkpoint's model class (config.json's `_class_name` among its
    `model_classes`); the checkpoint's tensors (`layouts`, resolved under it) show no module it leaves whole
    where the model check would refuse one (`tensor_check.structure_shown_by_tensors`); and a CP mesh (`cp` =
    ring x ulysses > 1) has the plan's own CP plan (else the class's `_cp_plan` decides, which needs the class).

    Why: the model check imports diffusers and builds the model on the meta device (about 2 CPU s, more than
    converting a small checkpoint). For the built-in plans the test suite does it once and for all
    (tests/test_diffusers_plans.py): for every plan, class and published config (and the variants the tests
    build), at every TP degree the checks made from the checkpoint alone accept, the model check accepts too.
    """
    class_name = (config or {}).get("_class_name")
    if not isinstance(class_name, str) or class_name not in plan.model_classes:
        return False
    if plan.name not in builtin_plan_names() or (cp > 1 and not plan.cp_plan):
        return False
    if load_plan(plan.name).to_dict() != plan.to_dict():
        return False
    return structure_shown_by_tensors(plan, layouts)


def choose_plan(plan: str | Path | Plan | None, config: dict[str, Any] | None, tp: int = 1) -> Plan:
    """The plan a conversion uses: the one given; else a built-in plan for config.json's `_class_name` (if the
    config has the values it is made for, `config_requires`: LTX-2's rope_type); else the plan the diffusers
    class declares (`_tp_plan`), read from the class built on the meta device; else the plan inferred from its
    modules (`plans/infer.py`), which `plan="auto"` asks for whatever else exists. A built-in plan passed over
    for its config is named, with why, in the description and origin of the plan chosen instead. For a
    transformers model (config.json's `architectures`), the plan inferred from its blocks at TP degree `tp`
    (`hf_transformers`: grouped KV heads are split or kept whole depending on it).

    Raises:
        PlanError: no plan can be found (the message says how to give one), or the model class cannot be
            sharded as it declares.
    """
    if isinstance(plan, Plan):
        return plan
    auto = plan == AUTO
    if plan is not None and not auto:
        return load_plan(plan)
    class_name = (config or {}).get("_class_name")
    found = None if auto else builtin_plan_for_class(class_name)
    passed_over = None if found is None else found.config_mismatch(config)
    if found is not None and passed_over is None:
        return found
    if is_transformers_config(config):
        from preshard.plans.hf_transformers import plan_for_transformers  # torch and transformers

        return plan_for_transformers(config or {}, tp)
    if not class_name:
        raise PlanError("no plan: the checkpoint has no config.json naming its model class; pass --plan NAME|FILE")
    from preshard.plans.from_model import plan_from_model_class

    note(f"planning: reading the plan of {class_name} from its modules (built on the meta device)")
    if passed_over is None:
        return plan_from_model_class(class_name, config or {}, infer=auto, tp=tp)
    try:  # the built-in plan is made for another variant of the class: the next source decides, saying why
        plan = plan_from_model_class(class_name, config or {}, passed_over=passed_over, tp=tp)
    except PlanError as exc:
        raise PlanError(f"{passed_over}, and no other plan fits: {exc}") from None
    if plan.cp_plan and found is not None and found.config_requires and not plan.cp_config_requires:
        # The class's _cp_plan is known to run only at the variant the built-in plan is made for (LTX-2's
        # interleaved rope fails in the CP forward: its cross-modal table is not split), so CP is kept for that
        # variant: a CP mesh is refused in one line, TP alone converts.
        plan = replace(plan, cp_config_requires=dict(found.config_requires))
    return plan
