"""`--model-class module:Class` (and `model_class=`): a model class of the user's own, outside diffusers and
transformers, named explicitly on the command line, converts through the CLI and its tp2 load matches the unsharded
model; without it the same checkpoint is refused (diffusers has no such class). Bad names are one-line errors (syntax,
a missing module, a missing attribute, a non-class, a non-module class, another class than config.json's), the class
is recorded in the manifest (a record: a bad one there is refused, nothing imports it), and a config.json naming a
module is never imported."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import assembled_model
import pytest
import torch
from clitools import assert_one_line, cli_runner
from manifests import edit_manifest
from multiproc import run_ranks
from tiny_diffusers import save

from preshard.cli import main
from preshard.errors import CorruptCheckpointError, UsageError
from preshard.format.manifest import read_manifest

SPEC = "assembled_model:AssembledTransformer2DModel"
TOL = 1e-5


def _convert(*args: str):
    return cli_runner().invoke(main, ["convert", *args, "--quiet"])


def _rank_load(rank: int, world: int, folder: str) -> dict:
    from multiproc import init_gloo

    from preshard.runtime.load import load_sharded
    from preshard.runtime.tp import ParallelLinear

    init_gloo()
    warnings.filterwarnings("ignore")
    model, inputs = assembled_model.build()
    with torch.no_grad():
        want = model(**inputs)[0]
        net = load_sharded(assembled_model.AssembledTransformer2DModel, folder)
        got = net(**inputs)[0]
        diff = (got - want).abs().max().item()
        split = [m for m in net.modules() if isinstance(m, ParallelLinear)]
        for m in split:  # negative control: the row-split layers without their all-reduce
            m.tp_group = None
        control = (net(**inputs)[0] - want).abs().max().item()
    return {"diff": diff, "control": control, "rowwise": len(split)}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save(assembled_model.build()[0], tmp_path_factory.mktemp("assembled") / "src")


def test_a_users_own_class_converts_through_the_cli_and_its_tp2_load_matches(source, tmp_path):
    refused = _convert(str(source), str(tmp_path / "without"), "--tp", "2")
    assert_one_line(refused.exit_code, refused.stderr, 2, "has no such model class", "--model-class module:Class")
    out = tmp_path / "ckpt"
    result = _convert(str(source), str(out), "--tp", "2", "--model-class", SPEC)
    assert result.exit_code == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest.model_class == SPEC
    assert manifest.plan.name == "inferred-AssembledTransformer2DModel"
    assert json.loads((out / "manifest.json").read_text())["model_class"] == SPEC
    ranks = run_ranks(_rank_load, 2, str(out), timeout=300)
    for r in ranks:
        assert r["diff"] <= TOL, ranks
        assert r["rowwise"] >= 4 and r["control"] > 1e-2, ranks  # the match is the TP's
    again = _convert(str(source), str(out), "--tp", "2", "--model-class", SPEC, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["status"] == "already converted", again.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    "spec", ["assembled_model", "assembled_model:", ":Cls", "a b:C", "1mod:C", "mod:class", "mod.:C", "m:C:D", "m:C.D"]
)
def test_a_bad_spec_is_one_line(source, tmp_path, spec):
    result = _convert(str(source), str(tmp_path / "o"), "--tp", "2", "--model-class", spec)
    assert_one_line(result.exit_code, result.stderr, 2, "is not module:Class", "e.g. --model-class")
    assert not (tmp_path / "o").exists()


@pytest.mark.quick
@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_such_module_xyz.sub:Cls", "no module named 'no_such_module_xyz' on the Python path"),
        ("assembled_model:NoSuchClass", "module assembled_model has no attribute 'NoSuchClass'"),
        ("assembled_model:build", "assembled_model.build is a function, not a class"),
        ("collections:OrderedDict", "OrderedDict is not a torch.nn.Module class"),
        ("diffusers:FluxTransformer2DModel", "names AssembledTransformer2DModel, not FluxTransformer2DModel"),
    ],
)
def test_a_class_that_is_not_there_or_not_the_checkpoints_is_one_line(source, tmp_path, spec, fragment):
    result = _convert(str(source), str(tmp_path / "o"), "--tp", "2", "--model-class", spec)
    assert_one_line(result.exit_code, result.stderr, 2, fragment)
    assert not (tmp_path / "o").exists()


@pytest.mark.quick
def test_a_module_that_fails_to_import_is_one_line_naming_it(source, tmp_path, monkeypatch):
    (tmp_path / "broken_user_models.py").write_text("raise RuntimeError('no GPU here\\nsecond line')\n")
    (tmp_path / "importing_missing.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _convert(str(source), str(tmp_path / "o"), "--tp", "2", "--model-class", "broken_user_models:M")
    assert_one_line(result.exit_code, result.stderr, 2, "importing broken_user_models failed: RuntimeError: no GPU")
    result = _convert(str(source), str(tmp_path / "o"), "--tp", "2", "--model-class", "importing_missing:M")
    assert_one_line(result.exit_code, result.stderr, 2, "importing importing_missing failed", "not_installed")


@pytest.mark.quick
@pytest.mark.parametrize("named", ["evil_user_module:Evil", "evil_user_module.Evil", "evil_user_module"])
def test_a_config_naming_a_module_imports_nothing(source, tmp_path, monkeypatch, named):
    marker = tmp_path / "imported"
    (tmp_path / "evil_user_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\nclass Evil(torch.nn.Module):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evil_user_module", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    weights = "diffusion_pytorch_model.safetensors"
    (src / weights).write_bytes((source / weights).read_bytes())
    config = json.loads((source / "config.json").read_text()) | {"_class_name": named}
    (src / "config.json").write_text(json.dumps(config))
    result = _convert(str(src), str(tmp_path / "o"), "--tp", "2")
    assert result.exit_code == 2, result.stderr
    assert not marker.exists() and "evil_user_module" not in sys.modules


@pytest.mark.quick
def test_the_python_api_takes_the_class_itself_and_the_manifest_refuses_a_bad_record(source, tmp_path):
    from preshard.converter.convert import convert_checkpoint

    manifest = convert_checkpoint(
        source, tmp_path / "ckpt", tp=2, progress=False, model_class=assembled_model.AssembledTransformer2DModel
    )
    assert manifest.model_class == SPEC
    with pytest.raises(UsageError, match="is not module:Class"):
        convert_checkpoint(source, tmp_path / "other", tp=2, progress=False, model_class="not a spec")
    edit_manifest(tmp_path / "ckpt", lambda d: d.update(model_class="os.system('x')"))
    with pytest.raises(CorruptCheckpointError, match="model_class"):
        read_manifest(tmp_path / "ckpt")
