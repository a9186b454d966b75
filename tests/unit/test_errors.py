"""The error hierarchy: every kind is a PreshardError and also the builtin category a Python caller would catch
(`FileNotFoundError` for a missing source or checkpoint, `FileExistsError` for an existing output, ...), raised
where that happens; every error class of the package lives in errors.py."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

from preshard import errors
from preshard.converter.workdir import OutputLock, check_output
from preshard.format.manifest import read_manifest
from preshard.sources import open_source

PACKAGE = Path(errors.__file__).parent
CATEGORIES = {
    "UsageError": ValueError,
    "PlanError": ValueError,
    "SourceError": ValueError,
    "SourceNotFoundError": FileNotFoundError,
    "SourceAccessError": PermissionError,
    "SourceUnreachableError": ConnectionError,
    "PipelineRepoError": ValueError,
    "OutputError": ValueError,
    "OutputExistsError": FileExistsError,
    "OutputPermissionError": PermissionError,
    "OutputLockedError": BlockingIOError,
    "CheckpointNotFoundError": FileNotFoundError,
    "CorruptCheckpointError": ValueError,
    "ChecksumMismatch": ValueError,
    "CheckpointFileMissingError": FileNotFoundError,
    "ManifestVersionError": ValueError,
    "MismatchError": ValueError,
    "InconsistentInputsError": ValueError,
    "DeviceError": RuntimeError,
    "JobTimeoutError": TimeoutError,
    "WorkerError": RuntimeError,
    "ResourceError": MemoryError,
    "ObjectStoreError": ValueError,
    "ObjectNotFoundError": FileNotFoundError,
    "ObjectAccessError": PermissionError,
    "ObjectUnreachableError": ConnectionError,
}


def test_every_kind_is_a_preshard_error_and_its_builtin_category():
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, BaseException)}
    internal = {"DamagedRecord"}  # never leaves a resume (converter/workdir.py catches it)
    internal.add("CollectiveRuleViolation")  # a bug caught by the collectives checker: a RuntimeError only
    assert not issubclass(errors.CollectiveRuleViolation, errors.PreshardError)
    assert set(classes) == set(CATEGORIES) | {"PreshardError", "Interrupted"} | internal, "update CATEGORIES and docs"
    for name, category in CATEGORIES.items():
        cls = classes[name]
        error = cls("a  problem;\n the fix")
        assert isinstance(error, errors.PreshardError) and isinstance(error, category), name
        assert str(error) == "a problem; the fix", (name, str(error))  # one line, as OSError's __str__ would not be
    assert not issubclass(errors.PreshardError, ValueError)  # a kind says its category; the base is any problem
    assert set(errors.__all__) == set(classes)


def test_the_cli_manual_documents_every_error():
    manual = (PACKAGE.parents[1] / "docs" / "cli-and-hub.md").read_text()
    for name in CATEGORIES:
        assert f"`{name}`" in manual, name


def test_no_error_class_outside_errors_py():
    """User-facing errors live in errors.py; a private exception that only carries another one between threads of
    one module (converter/pipeline.py's `_Failed`) is no error a user sees."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any(b.endswith(("Error", "Exception", "Mismatch")) for b in bases), (path, node.name)


def test_a_missing_source_or_checkpoint_is_a_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_manifest(tmp_path / "no-checkpoint")
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing") as caught:
        read_manifest(tmp_path / "half")
    assert isinstance(caught.value, errors.CorruptCheckpointError)


def test_an_existing_output_is_a_file_exists_error(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        check_output(out, [], overwrite=False)
    with pytest.raises(FileExistsError, match="not a preshard checkpoint"):
        check_output(out, [], overwrite=True)


def test_an_unwritable_output_folder_is_a_permission_error(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real(path, mode))
    with pytest.raises(PermissionError, match="cannot write in"):
        check_output(tmp_path / "out", [], overwrite=False)


def test_a_held_lock_is_a_blocking_io_error(tmp_path):
    out = tmp_path / "out"
    with OutputLock(out), pytest.raises(BlockingIOError, match="another conversion"):
        with OutputLock(out):
            pass
