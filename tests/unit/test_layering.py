"""The package's layers import downward only (docs/design.md, "Layers"), checked on the source text, so a lazy import
inside a function counts too (an import under `if TYPE_CHECKING:` does not: it never runs).

Every module of the package has a layer (a new file without one fails `test_every_module_has_a_layer`); a layer
imports only the layers its rule names; no module imports a private name (`_x`) of another module or reaches one
through a module attribute; and the module graph has no cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "preshard"
# Imported by every layer: the package itself (for __version__; its own runtime imports are errors only).
BASE = {"preshard", "preshard/errors.py", "preshard/units.py", "preshard/progress.py", "preshard/process.py"}
# Path inside the package (a file, or a folder for everything in it; the longest match wins) -> what it may import.
RULES: dict[str, set[str]] = {
    "errors.py": set(),
    "units.py": set(),
    "progress.py": {"units.py"},
    "process.py": set(),
    "format": {"format"},
    "plans": {"format", "plans"},
    "sources": {"format", "sources"},
    "converter": {"format", "plans", "sources", "converter"},
    "runtime": {"format", "plans", "runtime"},
    # A pre-sharded checkpoint on the Hub is fetched with the Hub helpers sources use (one file, public names);
    # the runtime never opens a source checkpoint.
    "runtime/hub.py": {"format", "runtime", "sources/hub.py", "sources/hub_retry.py"},
    # Object storage: the client (fsspec) is reached through format/object_store.py alone, the bottom of the stack;
    # a rank's fetch, a source's fetch and an output's upload each sit in their own layer and import only it below.
    "format/object_store.py": set(),
    "runtime/object_rank.py": {"format"},
    "sources/object_source.py": {"format/object_store.py"},
    "converter/object_output.py": {"format"},
    "tools/__init__.py": set(),
    # inspect and verify read through format/ (a Hub checkpoint's manifest, verify's --source through sources/);
    # neither imports the converter.
    "tools/inspect.py": {"format", "sources"},
    "tools/verify.py": {"format", "sources"},
    # the planner sizes a conversion with the converter's own planning; reshard/unshard write through the converter.
    "tools/planner.py": {"format", "plans", "sources", "converter"},
    "tools/estimate.py": {"format", "sources"},
    # a pipeline's plan: each component as the pipeline conversion treats it, sized by the planner
    "tools/pipeline_plan.py": {"format", "plans", "sources", "converter", "tools/planner.py"},
    # --show-plan: the plan a conversion would choose, written as a plan file.
    "tools/show_plan.py": {"format", "plans", "sources"},
    # the dry runs: convert's and what they share here, reshard's and unshard's beside their tools
    "tools/dry_run.py": {"format", "plans", "sources", "converter", "tools/estimate.py", "tools/planner.py"},
    "tools/reshard.py": {"format", "plans", "sources", "converter", "tools/estimate.py", "tools/dry_run.py"},
    "tools/unshard.py": {"format", "sources", "converter", "tools/estimate.py", "tools/dry_run.py"},
    # check: the sharded model (runtime) against the unsharded one its class loads; the class found as plans find it
    "tools/check.py": {"format", "plans", "runtime"},
    "tools/plan_check.py": {"format", "plans", "sources", "converter", "tools/check.py"},
    "examples": {"examples"},
    "demo.py": {"format", "converter", "runtime", "examples"},
    "cli.py": {"format", "converter", "tools", "demo.py"},
    "torchrun_convert.py": {"cli.py", "converter"},
    "__main__.py": {"cli.py"},
    # The public API: re-exports from every layer, imported lazily (runtime imports: errors only).
    "__init__.py": {"format", "converter", "runtime", "tools"},
}


def _module_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _key(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _rule(key: str) -> str | None:
    matches = [r for r in RULES if key == r or key.startswith(r + "/")]
    return max(matches, key=len) if matches else None


def _file_of(module: str) -> str | None:
    """'preshard.sources.hub' -> 'sources/hub.py' (a package -> its __init__.py); None if not in the package."""
    parts = module.split(".")
    if parts[0] != "preshard":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    if base.with_suffix(".py").is_file() and parts[1:]:
        return _key(base.with_suffix(".py"))
    if (base / "__init__.py").is_file():
        return _key(base / "__init__.py")
    return None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


@cache
def _imports(key: str) -> tuple[tuple[str, str, int], ...]:
    """(imported module file, name imported or "", line) for every runtime import of preshard in `key`."""
    tree = ast.parse((PACKAGE / key).read_text())
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _file_of(alias.name)) is not None:
                    found.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if (target := _file_of(node.module)) is None:
                continue
            for alias in node.names:
                submodule = _file_of(f"{node.module}.{alias.name}")
                if submodule is not None and submodule != target:
                    found.append((submodule, "", node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return tuple(found)


def _where(target: str) -> str:
    return "preshard" if target == "__init__.py" else target.removesuffix("/__init__.py")


def _allowed(target: str, rule: str) -> bool:
    if "preshard/" + target in BASE or target == "__init__.py":
        return True
    own = RULES[rule] | {rule}
    return any(target == a or target.startswith(a + "/") for a in own)


def test_every_module_has_a_layer():
    missing = [_key(p) for p in _module_files() if _rule(_key(p)) is None]
    assert not missing, f"modules with no layer in RULES: {missing}"
    stale = [r for r in RULES if not (PACKAGE / r).exists()]
    assert not stale, f"RULES names paths that do not exist: {stale}"


@pytest.mark.parametrize("key", [_key(p) for p in _module_files()])
def test_imports_point_down(key):
    rule = _rule(key)
    for target, _, line in _imports(key):
        if target == key:
            continue
        assert _allowed(target, rule), f"{key}:{line} imports {_where(target)} (up or across; rule {rule!r})"


def test_no_private_names_across_modules():
    problems = []
    for path in _module_files():
        key = _key(path)
        for target, name, line in _imports(key):
            if name.startswith("_") and not name.startswith("__") and target != key:
                problems.append(f"{key}:{line} imports {name} from {_where(target)}")
        # `from preshard.sources import hub` then `hub._join(...)`: a private name reached through the module
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("preshard"):
                modules.update(a.asname or a.name for a in node.names if _file_of(f"{node.module}.{a.name}"))
            elif isinstance(node, ast.Import):
                modules.update(a.asname for a in node.names if a.asname and a.name.startswith("preshard"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                problems.append(f"{key}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not problems, problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_check_finds_a_cycle():
    """The negative control: the check sees a two-module cycle and a longer one."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = {
        _key(p): {t for t, _, _ in _imports(_key(p)) if t != _key(p) and t != "__init__.py"} for p in _module_files()
    }
    assert not _cycles(graph), _cycles(graph)


def test_the_design_documents_every_layer():
    """docs/design.md is the design the code is held to: its layer table names every rule here."""
    design = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    section = design[design.index("## Layers") : design.index("## Errors")]
    for rule in RULES:
        name = rule.removesuffix("/__init__.py")
        if rule in ("errors.py", "units.py", "progress.py", "__init__.py", "tools/__init__.py"):
            continue  # the base and the package's own __init__ files
        assert f"`{name}" in section or f"`{name}/" in section, f"docs/design.md's layer table lacks {name}"
