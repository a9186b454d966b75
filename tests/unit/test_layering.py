"""The package's layers import downward only (DESIGN.md): format/ is the contract and imports nothing else of
preshard; plans/ and sources/ build on it; the converter and the runtime never import each other, the tools or
the CLI (the runtime's Hub download shares sources/hub.py's helpers); verify and inspect read through format/ and
never import the converter. Checked on the source text, so
a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "preshard"
BASE = {"preshard", "preshard.errors", "preshard.units", "preshard.progress"}
# The runtime fetches a pre-sharded checkpoint from the Hub with the same Hub helpers sources use; it never reads a
# source checkpoint.
EXCEPTIONS = {("runtime", "preshard.sources.hub")}
ALLOWED = {
    "format": {"format"},
    "plans": {"format", "plans"},
    "sources": {"format", "sources"},
    "converter": {"format", "plans", "sources", "converter"},
    "runtime": {"format", "plans", "runtime"},
    "tools/verify.py": {"format", "sources", "tools"},
    "tools/inspect.py": {"format", "tools"},
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "preshard" or n.startswith("preshard.")}


def _layer(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("where", sorted(ALLOWED))
def test_imports_point_down(where):
    target = PACKAGE / where
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files
    for path in files:
        for module in _imports(path) - BASE:
            if (where, module) in EXCEPTIONS:
                continue
            assert _layer(module) in ALLOWED[where], f"{path.relative_to(PACKAGE)} imports {module} (up or across)"
