"""Every path a pipeline conversion removes or writes is proven inside its own folder first, by one helper.

Why: the copy step removes its destination before copying, and the destination was the partial folder joined with
a name from the source's index. A name such as `..`, `../victim` or an absolute path turned that removal into one of
the folder holding OUT, a sibling, or any folder at all. Names are now checked where they are read
(`format/component_name.py`); this is the second wall: `inside(root, path)` resolves `path` (every folder above
its last name, links included; the last name itself is not followed, so a link there is removed as a link, never
its target) and refuses it unless it lies strictly inside `root` (the partial folder, or OUT). `remove_inside`
and `writable_inside` are the only ways the pipeline conversion removes or creates a path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from preshard.errors import OutputError


def inside(root: Path, path: Path, action: str = "write") -> Path:
    """`path` resolved and proven strictly inside `root` (never `root` itself).

    Args:
        root: the folder the path must lie in (the conversion's partial folder, or OUT).
        action: what is about to be done ("remove", "write"), for the message.

    Returns:
        The resolved path (its last name not followed).

    Raises:
        OutputError: `path` is `root`, lies outside it, or ends in `.`/`..`.

    Example:
        >>> inside(Path("/tmp/.out.partial"), Path("/tmp/.out.partial/vae"))
        PosixPath('/tmp/.out.partial/vae')
    """
    real_root = Path(os.path.realpath(root))
    name = os.path.basename(os.path.normpath(path)) if str(path) else ""
    given = Path(os.path.abspath(path))
    target = Path(os.path.realpath(given.parent)) / given.name
    if name in ("", ".", "..") or given.name in ("", ".", "..") or not target.is_relative_to(real_root):
        raise OutputError(f"refusing to {action} {path}: it is not inside {root}; preshard writes only there")
    if target == real_root:
        raise OutputError(f"refusing to {action} {path}: it is {root} itself; preshard writes only inside it")
    return target


def remove_inside(root: Path, path: Path) -> None:
    """Remove `path` (a file, a link as a link, or a folder tree) once `inside` proves it inside `root`; nothing
    when it does not exist.

    Raises:
        OutputError: as `inside`.
    """
    target = inside(root, path, "remove")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def writable_inside(root: Path, path: Path) -> Path:
    """`path`, proven inside `root` and cleared (whatever stood there removed, `remove_inside`), ready to create.

    Raises:
        OutputError: as `inside`.
    """
    remove_inside(root, path)
    return inside(root, path, "write")


__all__ = ["inside", "remove_inside", "writable_inside"]
