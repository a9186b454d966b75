"""The package declares what it imports: every third-party module the source imports (at the top of a module or
inside a function) is a declared dependency, or an optional one the code imports behind a guard that names the
package to install; every declared dependency is used. Plus the metadata a wheel carries (an SPDX license with
its LICENSE file) and `python -m preshard`.

The wheel itself is installed without extras in a fresh venv and driven from outside the source tree by CI
(`.ci/wheel`)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from preshard import __version__

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "preshard"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub"}
# Used without an import statement: `Tensor.numpy()` (format/fileio.py's byte views) needs numpy installed.
USED_WITHOUT_IMPORT = {"numpy"}
# Imported only behind a guard, with why it need not be a core dependency.
OPTIONAL = {
    "diffusers": "the model classes: the `diffusers` extra; plans/from_model.py names it when missing",
    "safetensors": "examples/ writing diffusers checkpoints, with diffusers: the `diffusers` extra",
    "peft": "LoRAs (--lora, load_lora_adapter): the `lora` extra; converter/lora.py names it when missing",
    "torch_xla": "device=xla: runtime/devices.py names the pip package when missing",
    "torch_neuronx": "device=neuron: runtime/devices.py names the pip package when missing",
    "transformers": "the tiny pipelines' text encoders (examples/minimax_h3_pipeline.py, for tests and the example's "
    "--tiny): the `test` extra; a real diffusers pipeline needs it anyway",
    "httpx2": "huggingface_hub's own HTTP client, imported for its error type with a fallback",
    "fsspec": "object storage (s3:// and other URLs): the `s3` extra; format/object_store.py names it when missing",
}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _third_party_imports() -> dict[str, set[str]]:
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top not in ("preshard", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(PACKAGE)))
    return found


def test_every_import_is_declared_and_every_dependency_used():
    declared = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["diffusers"]}
    imported = _third_party_imports()
    for module, where in imported.items():
        distribution = DISTRIBUTIONS.get(module, module).replace("_", "-")
        assert distribution in declared or module in OPTIONAL, f"{module} (imported in {sorted(where)}) is undeclared"
    for module in ("diffusers", "safetensors"):
        assert module in extras, f"{module} belongs in the diffusers extra"
    assert USED_WITHOUT_IMPORT <= declared, "numpy: Tensor.numpy() fails without it"
    used = {DISTRIBUTIONS.get(m, m).replace("_", "-") for m in set(imported) | USED_WITHOUT_IMPORT}
    assert declared <= used, f"declared but never imported: {sorted(declared - used)}"
    assert not set(OPTIONAL) - set(imported), "an OPTIONAL entry the source no longer imports"


def test_every_requirement_has_a_lower_bound_and_the_extras_a_range():
    for requirement in PYPROJECT["project"]["dependencies"]:
        assert ">=" in requirement, requirement
    for requirement in PYPROJECT["project"]["optional-dependencies"]["diffusers"]:
        assert ">=" in requirement and "==" not in requirement, requirement
    diffusers = next(r for r in PYPROJECT["project"]["optional-dependencies"]["diffusers"] if "diffusers" in r)
    assert "<" in diffusers, "diffusers moves model code between minor releases: an upper bound"


def test_license_metadata():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in project["classifiers"])


def test_python_dash_m_preshard():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "preshard", "--version"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"preshard, version {__version__}", proc
