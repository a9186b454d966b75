"""`preshard plan SOURCE --show-plan FILE`: the plan a conversion of SOURCE would use, written as a plan file.

Whatever its source (a built-in plan, the class's `_tp_plan`, or the plan inferred from its modules), the plan is
written in the plan-file format `--plan FILE` reads, so a user can read what will be split and edit it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from preshard.errors import OutputPermissionError
from preshard.format.plan import Plan
from preshard.format.publish import publish_text
from preshard.plans.registry import choose_plan
from preshard.sources import open_source_headers


def resolved_plan(
    source: str | Path,
    *,
    plan: str | Path | Plan | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Plan:
    """The plan `convert_checkpoint(source, ..., plan=plan)` would use, from the checkpoint's headers and config.

    Raises:
        SourceError, PlanError: as for a conversion.
    """
    src = open_source_headers(source, subfolder=subfolder, revision=revision, token=token)
    return choose_plan(plan, src.config)


def write_plan_file(chosen: Plan, path: str | Path) -> Path:
    """Write `chosen` as a plan file (JSON, one rule a line), replacing `path` in one rename.

    Returns:
        The path written.

    Raises:
        OutputPermissionError: the folder cannot be written.
    """
    out = Path(path)
    data: dict[str, Any] = chosen.to_dict()
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "linear"]
    rules = ",\n".join(f"    {json.dumps(rule)}" for rule in data["linear"])
    text = "{\n" + ",\n".join([*lines[:4], f'  "linear": [\n{rules}\n  ]', *lines[4:]]) + "\n}\n"
    try:
        publish_text(out, text)
    except PermissionError:
        raise OutputPermissionError(f"cannot write the plan file {out}: permission denied; pick another path") from None
    return out
