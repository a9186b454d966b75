"""docs/models.md: every diffusers transformer class of tests/support/tiny_zoo.json, from the results of
tests/test_inferred_plans.py and the class built at its default (published) config on the meta device.

    PRESHARD_ZOO_RESULTS=results.json python -m pytest tests/test_inferred_plans.py
    python scripts/models_table.py results.json docs/models.md

Columns: the class; its parameters at the default config of its constructor (counted on the meta device: no
memory, no weights; diffusers' defaults are mostly the published model's, not always); where its plan comes from
(a built-in plan, the class's `_tp_plan`, or inferred from its modules); the TP degrees the plan allows at that
config (every sharded dimension and every divided head count); whether it has a CP plan ("inferred": by a probe of
its forward, `plans/infer_cp.py`); the meshes the test ran on the tiny config, with an inferred CP plan also at
sequence lengths the CP size does not divide ("uneven"), and what they gave; for a refused or failing class, why.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import diffusers

from preshard.errors import PlanError
from preshard.format.plan import matches, resolve_plan, valid_tp_degrees
from preshard.plans.from_model import build_on_meta
from preshard.plans.registry import builtin_plan_names, choose_plan

TOL = 1e-5
MESHES = {
    "u1r1": "tp2", "u2r1": "tp2 x ulysses2", "u1r2": "tp2 x ring2",
    "u2r1odd": "tp2 x ulysses2 (uneven)", "u1r2odd": "tp2 x ring2 (uneven)",
}  # fmt: skip


def source_of(name: str) -> str:
    if name in builtin_plan_names():
        return f"built-in `{name}`"
    if name.endswith("._tp_plan"):
        return "`_tp_plan`"
    return "inferred" if name.startswith("inferred-") else name


def at_published(class_name: str) -> tuple[str, str, str]:
    """Parameters, TP degrees and CP at the class's default config (or why none)."""
    cls = getattr(diffusers, class_name)
    try:
        model = build_on_meta(cls, {})
    except PlanError:
        return "?", "(no default config)", "?"
    params = sum(p.numel() for p in model.parameters())
    config = {"_class_name": class_name, **dict(getattr(model, "config", {}))}
    try:
        plan = choose_plan(None, config)
    except PlanError as exc:
        return f"{params / 1e9:.2f} B", f"refused: {str(exc)[:90]}", "-"
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    try:
        whole = resolve_plan(plan, shapes, 1, config=config, check_divisible=False)
    except PlanError as exc:
        return f"{params / 1e9:.2f} B", f"refused: {str(exc)[:90]}", "-"
    g = math.prod(valid_tp_degrees(plan, whole, config)[-1:])
    for rule in plan.attention:
        for name, module in model.named_modules():
            if name and matches(rule.match, name):
                for attr in rule.divide:
                    g = math.gcd(g, getattr(module, attr))
    degrees = [d for d in range(1, g + 1) if g % d == 0]
    inferred = plan.name.startswith("inferred-") and not getattr(cls, "_cp_plan", None)
    cp = ("inferred" if inferred else "yes") if plan.cp_plan or getattr(cls, "_cp_plan", None) else "no"
    return f"{params / 1e9:.2f} B", ", ".join(map(str, degrees)), cp


def transformer_classes() -> list[str]:
    """Every model class diffusers exports from `diffusers.models.transformers`."""
    import inspect

    from diffusers.models import transformers

    names = [n for n in dir(transformers) if not n.startswith("_") and inspect.isclass(getattr(transformers, n))]
    return [n for n in names if hasattr(diffusers, n)]  # config.json names a class diffusers exports


def plan_source(class_name: str) -> str:
    cls = getattr(diffusers, class_name, None)
    try:
        model = build_on_meta(cls, {}) if cls is not None else None
        return source_of(choose_plan(None, {"_class_name": class_name, **dict(model.config)}).name) if model else "?"
    except PlanError:
        return "refused"


ZOO = Path(__file__).resolve().parent.parent / "tests" / "support"


def zoo_configs() -> dict[str, dict[str, Any]]:
    """Each zoo key's config.json (tiny_zoo*.json: data, read as JSON)."""
    entries: dict[str, Any] = {}
    for path in sorted(ZOO.glob("tiny_zoo*.json")):
        entries |= json.loads(path.read_text())
    return {key: {"_class_name": e["class"], **e["init"]} for key, e in entries.items()}


def why_no_cp(config: dict[str, Any] | None) -> str:
    """Why the plan chosen for a tiny config has no CP: the probe's reason (naming the module or input), or the
    config value a class's CP plan is not made for."""
    if config is None:
        return "no CP plan"
    try:
        plan = choose_plan(None, config)
    except PlanError:  # a config the class builds only with its defaults filled in (the test builds it so)
        return "no CP plan"
    try:
        plan.check_cp_config(config)
    except PlanError as exc:
        return str(exc)
    _, found, reason = plan.description.partition("no CP plan: ")
    return f"no CP: {reason}" if found else "no CP plan"


def row(key: str, run: dict[str, Any], cache: dict[str, tuple[str, str, str]], configs: dict[str, Any]) -> str:
    class_name = key.split("#")[0]
    if class_name not in cache:
        cache[class_name] = at_published(class_name)
    params, degrees, cp = cache[class_name]
    if key in run["refused"]:
        why = run["refused"][key].replace("|", "/")
        return f"| {key} | {params} | refused | {degrees} | {cp} | none | {why} |"
    plan = run["plans"][key]
    tested, problems = [], []
    for mesh, label in MESHES.items():
        result = run["results"].get(f"{key}|{mesh}")
        if result is None:
            continue
        ok = result["error"] is None and result["rel"] <= TOL
        tested.append(f"{label} {'ok' if ok else 'FAILS'}")
        if not ok:
            problems.append(f"{label}: {result['error'] or 'rel ' + format(result['rel'], '.1e')}")
    if not plan["cp"]:
        problems.append(why_no_cp(configs.get(key)))
    why = "; ".join(problems).replace("|", "/")[:400]
    return f"| {key} | {params} | {source_of(plan['name'])} | {degrees} | {cp} | {', '.join(tested)} | {why} |"


def main(results: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    run = json.loads(Path(results).read_text())
    cache: dict[str, tuple[str, str, str]] = {}
    keys = sorted(set(run["refused"]) | set(run["plans"]))
    keys = [k for k in keys if hasattr(diffusers, k.split("#")[0])]
    configs = zoo_configs()
    rows = [row(k, run, cache, configs) for k in keys]
    untested = sorted(set(transformer_classes()) - {k.split("#")[0] for k in keys})
    for class_name in untested:  # no tiny config that runs: the plan at the default config only
        params, degrees, cp = at_published(class_name)
        source = "refused" if degrees.startswith("refused") else plan_source(class_name)
        rows.append(f"| {class_name} | {params} | {source} | {degrees} | {cp} | none (no tiny config) | |")
    matched = [k for k in keys if k in run["plans"] and run["results"].get(f"{k}|u1r1", {}).get("error") is None]
    tp_classes = {k.split("#")[0] for k in matched}
    cp_classes = {k.split("#")[0] for k in matched if run["plans"][k]["cp"]}
    lines = [
        "# Models: which diffusers transformer classes preshard shards",
        "",
        "Generated by `scripts/models_table.py` from a run of `tests/test_inferred_plans.py` (tiny random instances",
        "with the configs of diffusers' own model tests; tp2 and, where the plan has CP, tp2 x ulysses2 and tp2 x",
        "ring2, an inferred CP plan or the class's own `_cp_plan` also at lengths the CP size does not divide",
        f"(uneven), each compared with the unsharded forward within {TOL:g} in float32) and each class built at its",
        "default config on the meta device (parameters, TP degrees, CP). Nothing here ran on a GPU. Plan sources: a",
        "built-in JSON plan, the class's own diffusers `_tp_plan`, or the plan inferred from its modules",
        "([design](design.md#plans-inferred-from-the-model)). A case key with `#2` is a second test config.",
        "Weights per rank of each class at full size, at TP 1 to 8: [memory.md](memory.md).",
        "",
        f"{len(keys)} test cases; {len(matched)} converted and ran at tp2; {len(run['refused'])} refused. The last"
        f" {len(untested)} rows are classes with no tiny config that runs here (none in diffusers' tests, or its"
        " inputs fail on CPU): their plan is resolved at the default config only, never run.",
        "",
        f"CP: {len(cp_classes)} of the {len(tp_classes)} classes that convert at TP have CP at some tested config and"
        " match at every CP mesh tested; each test case without CP says why in its last column (the module or"
        " input the CP probe refused, or the config value a class's CP plan is not made for). CP column: the"
        " default config's (`inferred`: by a probe of the forward, `plans/infer_cp.py`).",
        "",
        "| class | parameters (default config) | plan | TP degrees (default config) | CP | meshes tested | why not |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    Path(out).write_text("\n".join(lines))
    print(f"wrote {out}: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
