"""What a checkpoint's tensors show of its model's structure: enough to vouch for a built-in plan without the model.

Apart from `model_check` because it reads layouts only: a conversion with a built-in plan runs it and never imports
torch or diffusers.
"""

from __future__ import annotations

from collections.abc import Mapping

from preshard.format.layout import TensorLayout
from preshard.format.plan import Plan, matches, module_names
from preshard.format.styles import REPLICATE


def structure_shown_by_tensors(plan: Plan, layouts: Mapping[str, TensorLayout]) -> bool:
    """Whether a checkpoint's tensors (resolved under `plan`) show none of what `check_model_structure` refuses,
    as far as tensors can: inside every attention module whose heads the plan divides, no Linear weight (2-D) is
    left whole and no norm weight directly in it has the width of a column-split Linear beside it; and every
    `tp_rms_norm` module has a weight only, the width of a column-split Linear beside it.

    Why: a built-in plan is proven against its model classes' module trees by the test suite
    (`registry.vouched_for`); a variant of a class whose config adds modules the plan does not cover (Cosmos
    2.5's image-context projections) shows them as tensors, and then the model check must run (it names them).
    What no tensor shows (a norm without a weight, a module's type) the class's own code fixes, as the proof
    covers. Linear in the tensor count.
    """
    divided_rules = [rule.match for rule in plan.attention if rule.divide]
    divided = {m for m in module_names(layouts) if m and any(matches(r, m) for r in divided_rules)}
    split: dict[str, set[int]] = {}  # module -> out widths of the column-split Linear weights directly in it
    for name, layout in layouts.items():
        if name.endswith(".weight") and len(layout.shape) == 2 and layout.shard_dim == 0:
            module = name.rpartition(".")[0]
            split.setdefault(module.rpartition(".")[0], set()).add(layout.shape[0])
    for name, layout in layouts.items():
        module, _, param = name.rpartition(".")
        parent = module.rpartition(".")[0]
        if layout.style.module_kind == "norm":
            if param != "weight" or layout.shape[0] not in split.get(parent, ()):
                return False
            continue
        if not divided or layout.style.name != REPLICATE.name or param != "weight":
            continue
        if len(layout.shape) == 1 and parent in divided and layout.shape[0] in split.get(parent, ()):
            return False  # a norm across the heads of a split projection, left whole
        if len(layout.shape) == 2 and _inside(module, divided):
            return False  # a Linear inside divided attention, left whole
    return True


def _inside(module: str, modules: set[str]) -> bool:
    """Whether `module` lies below one of `modules`."""
    while module:
        module = module.rpartition(".")[0]
        if module in modules:
            return True
    return False
