"""format/publish.py, the one publish primitive: a process killed at any step of publishing a new set of files
into a folder (before and after every file-system call it makes) leaves the old set or the new one there, never
a mix; an error raised mid-publish leaves the old set and no staged folder. A negative control shows the same
harness catches a mix: files renamed into place one by one (what save_pretrained did) are atomic each, not as a
set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from preshard.format import publish

pytestmark = pytest.mark.quick

OLD = {"a": "old", "b": "old", "index": "old", "notes.txt": "user", "sub/x": "user"}
NEW = {"a": "new", "c": "new", "index": "new", "notes.txt": "user", "sub/x": "user"}  # b dropped, c added

# Runs one publish of NEW over OLD, SIGKILLed just before its K-th counted file-system call.
CHILD = r"""
import os, signal, sys
from pathlib import Path
from preshard.format import publish

target, k, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
calls = [0]

def counted(fn):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call

for name in ("mkdir", "chmod", "rename", "replace", "link", "symlink", "fsync", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
publish.exchange = counted(publish.exchange if how != "fallback" else (lambda a, b: False))

new = {"a": "new", "c": "new", "index": "new"}
if how == "naive":  # the negative control: each file renamed into place on its own
    for name, text in new.items():
        (target.parent / f"tmp-{name}").write_text(text)
        os.replace(target.parent / f"tmp-{name}", target / name)
    os.unlink(target / "b")
else:
    update = publish.FolderUpdate(target, "test")
    for name, text in new.items():
        (update.path / name).write_text(text)
    update.commit(drop=lambda name: name == "b")
print(calls[0])
"""


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def _read(folder: Path) -> dict[str, str] | None:
    if not folder.is_dir():
        return None
    return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}


def _kill_at_every_step(tmp_path: Path, how: str) -> list[tuple[int, dict[str, str] | None, Path]]:
    """(k, what the target holds after a kill before call k, the run's folder), for every k until a run completes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    seen = []
    for k in range(1, 200):
        root = tmp_path / f"{how}-{k}"
        root.mkdir()
        _write(root / "model", OLD)
        run = subprocess.run(
            [sys.executable, "-c", CHILD, str(root / "model"), str(k), how], env=env, capture_output=True, text=True
        )
        seen.append((k, _read(root / "model"), root))
        if run.returncode == 0:
            assert int(run.stdout) < k, run.stdout  # ran to the end without reaching call k
            return seen
        assert run.returncode == -9, run.stderr
    raise AssertionError("the publish never finished")


@pytest.mark.parametrize("how", ["exchange", "fallback"])
def test_a_kill_at_any_step_leaves_the_old_set_or_the_new_never_a_mix(tmp_path, how):
    seen = _kill_at_every_step(tmp_path, how)
    for k, files, root in seen:
        if files is None and how == "fallback":  # killed between moving the old folder aside and the new in
            (retired,) = root.glob(".model.replaced-*")
            assert _read(retired) == OLD, k
            continue
        assert files in (OLD, NEW), (k, files)
    outcomes = [files for _, files, _ in seen]
    assert outcomes[0] == OLD and outcomes[-1] == NEW  # the kills spanned the publish
    assert len(seen) > 5  # every call of the primitive was a kill point


def test_the_harness_sees_a_mix_when_files_are_published_one_by_one(tmp_path):
    """Negative control: the same kills against per-file renames leave a mix of the two sets."""
    seen = _kill_at_every_step(tmp_path, "naive")
    mixes = [files for _, files, _ in seen if files not in (OLD, NEW)]
    assert mixes, seen


def test_an_error_mid_publish_leaves_the_old_set_and_no_staged_folder(tmp_path, monkeypatch):
    target = tmp_path / "model"
    _write(target, OLD)

    def broken(a, b):
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(publish, "exchange", broken)
    update = publish.FolderUpdate(target, "test")
    _write(update.path, {"a": "new", "c": "new", "index": "new"})
    with pytest.raises(OSError, match="simulated"):
        update.commit(drop=lambda name: name == "b")
    assert _read(target) == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_new_folder_appears_whole_and_keeps_the_umask_mode(tmp_path):
    target = tmp_path / "parent" / "model"  # missing parents are made
    update = publish.FolderUpdate(target, "test")
    _write(update.path, {"a": "new"})
    update.commit()
    assert _read(target) == {"a": "new"}
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_publish_folder_without_replace_leaves_an_existing_folder(tmp_path):
    target = tmp_path / "model"
    _write(target, OLD)
    staged = publish.staged_sibling(target, "test")
    _write(staged, {"a": "new"})
    assert publish.publish_folder(staged, target, replace=False) is False
    assert _read(target) == OLD and _read(staged) == {"a": "new"}


def test_publish_text_replaces_a_file_whole(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    publish.publish_text(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_an_update_through_a_link_updates_the_folder_it_names(tmp_path):
    real = tmp_path / "real"
    _write(real, OLD)
    (tmp_path / "link").symlink_to(real)
    update = publish.FolderUpdate(tmp_path / "link", "test")
    _write(update.path, {"a": "new", "c": "new", "index": "new"})
    update.commit(drop=lambda name: name == "b")
    assert (tmp_path / "link").is_symlink() and _read(real) == NEW
