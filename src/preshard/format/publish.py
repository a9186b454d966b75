"""Publishing: what preshard writes appears in one step, so a reader, or a crash, finds the old set or the new one,
never a mix.

The one primitive for every place that publishes: a converted, resharded or unsharded checkpoint
(`converter/workdir.commit`), a JSON or text file (the manifest of a reshard, `format/jsonio`), a Hub rank folder
in the assets cache (`runtime/hub.py`), the folder `save_pretrained` writes (`runtime/saving.py`). Everything is
written into a staged sibling (same file system, so a rename is atomic), made durable, and then renamed over the
target; an existing folder is swapped out with Linux's `renameat2(RENAME_EXCHANGE)`. Kept by hand because neither
the standard library (no `renameat2`) nor huggingface_hub (it publishes single files) has this.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staged_sibling(target: Path, purpose: str) -> Path:
    """A new, empty hidden folder beside `target` (unique to this process), created with the mode `target` has,
    else the umask's."""
    target = Path(target)
    path = target.parent / f".{target.name}.{purpose}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)
    with contextlib.suppress(OSError):
        os.chmod(path, os.stat(target).st_mode & 0o7777)
    return path


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2` with `RENAME_EXCHANGE`); False where the system
    or file system does not support it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_folder(staged: Path, target: Path, *, replace: bool = True) -> bool:
    """Put the finished folder `staged` at `target` in one step; the previous `target` is removed afterwards.

    Where the exchange is unsupported, an existing target is first moved aside (a crash then leaves the old folder
    under its hidden name or the new one in place, still never a mix).

    Args:
        staged: a complete folder beside `target` (same file system).
        target: where it goes.
        replace: replace an existing `target`; if False and `target` exists, nothing moves and `staged` stays.

    Returns:
        True if `staged` is now `target`; False if `replace` is False and another `target` was there.

    Raises:
        OSError: the rename failed (`staged` is left as it was).
    """
    staged, target = Path(staged), Path(target)
    fsync_dir(staged)
    if not replace:
        try:
            os.rename(staged, target)  # refused for a non-empty folder already there
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) or target.exists():
                return False
            raise
    elif os.path.lexists(target) and exchange(staged, target):
        shutil.rmtree(staged)  # now the previous target
    elif os.path.lexists(target):
        retired = target.parent / f".{target.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(target, retired)
        os.rename(staged, target)
        shutil.rmtree(retired)
    else:
        os.rename(staged, target)
    fsync_dir(target.parent)
    return True


def publish_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to a sibling, make it durable and rename it over `path`: readers see the old file or
    the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


class FolderUpdate:
    """A new set of files for a folder that may already hold others: written into a staged sibling (`path`), then
    `commit` carries over what the folder holds that this set neither writes nor drops (hard links, so nothing is
    copied) and publishes the result in one step. A failure before the commit leaves the folder as it was.

    Why a whole-folder swap: files renamed into place one by one are each atomic, but not as a set (a crash between
    two renames leaves new weights beside an old index).
    """

    def __init__(self, target: Path, purpose: str) -> None:
        # A link to a folder stays a link: the folder it names is the one updated.
        self.target = Path(os.path.realpath(target)) if os.path.islink(target) else Path(target)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = staged_sibling(self.target, purpose)

    def commit(self, drop: Callable[[str], bool] = lambda name: False) -> None:
        """Carry over every entry of the current folder not written and not `drop(name)`, then publish.

        Raises:
            OSError: carrying over or publishing failed; the folder is as it was.
        """
        try:
            if self.target.is_dir():
                written = set(os.listdir(self.path))
                for entry in os.scandir(self.target):
                    if entry.name in written or drop(entry.name):
                        continue
                    src, dst = Path(entry.path), self.path / entry.name
                    if entry.is_dir(follow_symlinks=False):
                        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
                    else:
                        _link_or_copy(src, dst)
            publish_folder(self.path, self.target)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Remove the staged folder (after a failure; nothing once committed)."""
        shutil.rmtree(self.path, ignore_errors=True)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


__all__ = ["FolderUpdate", "exchange", "fsync_dir", "publish_folder", "publish_text", "staged_sibling"]
