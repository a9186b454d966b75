"""The claims of the user documentation that can be checked: the README is short, its test command is the one CI
runs, every relative link in the README, docs/ and benchmarks/README.md leads to a file and heading that exist, the
manifest table in docs/format.md names every key the manifest writes, and format/ (the contract) imports no torch
at import, style_forwards.py aside, as docs/design.md says."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readmes_test_command_is_what_ci_runs():
    """The README's second command ends in the test command; .ci/run runs exactly that line."""
    text = README.read_text()
    block = text[text.index("# 2. The tests") :]
    install_and_test = block.splitlines()[1]
    test_command = install_and_test.split("&&")[-1].strip()
    assert test_command.startswith("python -m pytest"), install_and_test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci], (test_command, ".ci/run")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    in_code, anchors = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _manifest_keys() -> set[str]:
    """Every key `Manifest.body` writes (nested: the source's too), read from its source text."""
    tree = ast.parse((ROOT / "src" / "preshard" / "format" / "manifest.py").read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "body")
    keys = set()
    for node in ast.walk(body):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return keys


def test_the_manifest_table_names_every_key_the_manifest_writes():
    text = (ROOT / "docs" / "format.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    keys = _manifest_keys()
    assert {"format", "source", "loras", "metadata", "ranks"} <= keys  # the walk found the body
    missing = sorted(k for k in keys if not re.search(rf"[`.]{re.escape(k)}[`.\[ ,]", table))
    assert not missing, missing
    design = (ROOT / "docs" / "design.md").read_text()
    assert "| key | type | meaning |" not in design  # the one table is format.md's; design.md links to it


def test_format_imports_no_torch_at_import_but_style_forwards():
    modules = sorted(
        f"preshard.format.{p.stem}"
        for p in (ROOT / "src" / "preshard" / "format").glob("*.py")
        if p.stem not in ("__init__", "style_forwards")
    )
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    env_path = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": env_path}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "a format/ module imports torch at import"
