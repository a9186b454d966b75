"""The checkpoint folder is the boundary of every file preshard opens in it, and only regular files are opened.

A converted checkpoint is a folder of files preshard wrote. Whatever reads one (verify, inspect, reshard,
unshard, load_sharded) opens its manifest, `.metadata`, config.json and data files through `CheckpointFolder`:

- a name that is a symbolic link is resolved, and the target must lie inside the folder. The one exception is
  the Hugging Face cache, whose folders are made of links: a snapshot folder's files link to the cache's blobs,
  and preshard's own rank folders (in the cache's assets folder) link to snapshot files. When the folder itself
  lies in the cache (or the caller says it came from there), links are allowed into the cache root, and nowhere
  else. The resolved file is then opened with O_NOFOLLOW, so a link swapped in meanwhile is refused too;
- only a regular file is opened: every open is non-blocking, so a FIFO (whose open would wait for a writer
  forever), a device or a socket is refused, by fstat, in one line and without waiting.

`open_regular` and `read_regular` apply the second rule to any other file preshard reads (a plan, a source's
config.json or index).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from preshard.errors import CorruptCheckpointError, PreshardError

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a symbolic link",
}
AUTO = "auto"  # CheckpointFolder's link_root: the HF cache root when the folder lies in the cache, else none


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(
    path: str | Path, where: str, error: type[PreshardError], fix: str, *, follow_symlinks: bool = True
) -> int:
    """Open `path` read-only without blocking, and keep the descriptor only if it is a regular file.

    Raises:
        FileNotFoundError: `path` does not exist (callers say what is missing in their own words).
        error: it is a FIFO, device, socket or folder (`"{where} is a FIFO ...; {fix}"`), a symbolic link when
            `follow_symlinks` is false, or it cannot be opened.
    """
    flags = _OPEN_FLAGS | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode  # a FIFO or socket is never opened at all
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{where} cannot be read ({exc.strerror or exc}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{where} is {file_kind(mode)}, not a regular file; {fix}")
    try:
        fd = os.open(path, flags)  # non-blocking all the same: it may have been swapped for a FIFO meanwhile
    except FileNotFoundError:
        raise
    except OSError as exc:
        if not follow_symlinks and os.path.islink(path):
            raise error(f"{where} was replaced by a symbolic link while it was being opened; {fix}") from None
        raise error(f"{where} cannot be opened ({exc.strerror or exc}); {fix}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{where} is {file_kind(mode)}, not a regular file; {fix}")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, limit: int | None = None) -> bytes:
    """Every byte of an open file from its start (at most `limit`, when given), whatever its recorded size."""
    parts, position = [], 0
    while limit is None or position < limit:
        block = os.pread(fd, 1 << 20 if limit is None else min(1 << 20, limit - position), position)
        if not block:
            break
        parts.append(block)
        position += len(block)
    return b"".join(parts)


def read_regular(path: str | Path, where: str, error: type[PreshardError], fix: str) -> bytes:
    """The bytes of a regular file (see `open_regular`; FileNotFoundError when it does not exist)."""
    fd = open_regular(path, where, error, fix)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


def hf_cache_root(folder: Path) -> Path | None:
    """The Hugging Face hub cache root when `folder` (resolved) lies in the cache or its assets folder, else None."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None
    hub = Path(constants.HF_HUB_CACHE).resolve()
    assets = Path(constants.HF_ASSETS_CACHE).resolve()
    return hub if folder.is_relative_to(hub) or folder.is_relative_to(assets) else None


class CheckpointFolder:
    """Opens files of a checkpoint folder, never outside it (see the module docstring).

    Args:
        path: the folder.
        link_root: where symbolic links may lead besides the folder itself: a folder (the HF cache root, for a
            folder preshard's Hub code made), None (nowhere), or AUTO (the HF cache root when `path` lies in the
            cache, else nowhere).
    """

    def __init__(self, path: str | Path, *, link_root: str | Path | None = AUTO) -> None:
        self.path = Path(path)
        self.real = self.path.resolve()
        self._link_root = link_root

    @property
    def link_root(self) -> Path | None:
        if self._link_root == AUTO:
            self._link_root = hf_cache_root(self.real)
        return Path(self._link_root).resolve() if self._link_root is not None else None

    def where(self, name: str) -> str:
        return str(self.path / name)

    def resolve(self, name: str) -> Path:
        """The real path of `name`: itself, or the target of a link that stays within the boundary.

        Raises:
            FileNotFoundError: no such file (a dangling link inside the boundary counts as missing).
            CorruptCheckpointError: a link leading out of the folder (and the cache, where allowed).
        """
        path = self.path / name
        if not os.path.islink(path):
            if not os.path.lexists(path):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
            return self.real / name
        target = Path(os.path.realpath(path))
        if target.is_relative_to(self.real):
            return target
        root = self.link_root
        if root is not None and target.is_relative_to(root):
            return target
        inside = "the checkpoint folder" + (f" or the Hugging Face cache {root}" if root is not None else "")
        raise CorruptCheckpointError(
            f"{path} is a symbolic link to {target}, outside {inside}; preshard reads nothing outside the checkpoint: "
            "copy the file itself into the folder"
        )

    def open(self, name: str) -> int:
        """A read-only descriptor of regular file `name`, within the boundary (the caller closes it).

        Raises:
            FileNotFoundError: no such file.
            CorruptCheckpointError: a link out of the boundary, or not a regular file (a FIFO is never waited on).
        """
        fix = "a checkpoint holds regular files only: restore the file, or convert again"
        return open_regular(self.resolve(name), self.where(name), CorruptCheckpointError, fix, follow_symlinks=False)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of `name` (at most `limit`), read as `open` opens it."""
        fd = self.open(name)
        try:
            return read_fd(fd, limit)
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        """The size of regular file `name` (raises as `open`)."""
        fd = self.open(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


__all__ = ["AUTO", "CheckpointFolder", "file_kind", "hf_cache_root", "open_regular", "read_fd", "read_regular"]
