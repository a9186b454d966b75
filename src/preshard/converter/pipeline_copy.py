"""What a pipeline conversion copies from the source folder: regular files, never through a link that leaves it.

Why: a component folder, a weights file, a file inside a copied component or a top-level README.md that was a
symbolic link out of the pipeline folder was copied into OUT, so a secret file's content ended up in the output,
ready to upload. The checkpoint readers refuse such links (`format/folder.CheckpointFolder`); so does this:

- every entry preshard reads from the source is resolved, and its target must lie inside the source folder (or,
  for a pipeline snapshot in the Hugging Face cache, whose files are links to the cache's blobs, inside the cache
  root), else one line names the link and where it leads;
- a link that stays inside is copied as its target's bytes (a folder link as the folder's files), never as a link;
  a link cycle is refused;
- only regular files are copied: a FIFO, socket or device is refused in one line, never opened;
- `source_files` is the one walk of a component: the conversion checks every component with it before anything is
  written, its stamp for resuming comes from it, and the copy itself re-checks each entry as it copies.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from preshard.converter.contained import inside, writable_inside
from preshard.errors import SourceError
from preshard.format.folder import file_kind, hf_cache_root, open_regular


class SourceBoundary:
    """The source pipeline folder and where its links may lead (the folder, and the HF cache when it lies there).

    Example:
        >>> boundary = SourceBoundary(Path("Wan2.2-T2V"))
        >>> files = boundary.source_files(Path("Wan2.2-T2V/vae"))  # {relative name: real path}
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.real = Path(os.path.realpath(folder))
        self.cache = hf_cache_root(self.real)

    def resolve(self, path: Path) -> Path:
        """`path`'s real path, proven inside the boundary.

        Raises:
            SourceError: a link leading out of the pipeline folder (naming the link and its target).
        """
        target = Path(os.path.realpath(path))
        if target.is_relative_to(self.real) or (self.cache is not None and target.is_relative_to(self.cache)):
            return target
        inside_what = "the pipeline folder" + (f" or the Hugging Face cache {self.cache}" if self.cache else "")
        link = next((p for p in [path, *path.parents] if p.is_symlink()), path)
        raise SourceError(
            f"{link} is a symbolic link to {os.path.realpath(link)}, outside {inside_what}; preshard copies nothing "
            "from outside the pipeline: copy the file itself into the folder"
        )

    def source_files(self, folder: Path) -> dict[str, Path]:
        """Every regular file under `folder` (links inside the boundary followed), as {relative name: real path}.

        Raises:
            SourceError: a link out of the boundary, a link cycle, or a FIFO, socket or device.
        """
        files: dict[str, Path] = {}
        self._walk(folder, self.resolve(folder), "", files, set())
        return files

    def _walk(self, shown: Path, real: Path, prefix: str, files: dict[str, Path], above: set[Path]) -> None:
        if real in above:
            raise SourceError(f"{shown} is a symbolic link to a folder above it (a cycle); remove the link")
        try:
            entries = sorted(os.scandir(real), key=lambda e: e.name)
        except NotADirectoryError:
            raise SourceError(f"{shown} is not a folder; a pipeline component is a folder of files") from None
        for entry in entries:
            path = shown / entry.name
            target = self.resolve(path) if entry.is_symlink() else real / entry.name
            try:
                mode = os.stat(target).st_mode
            except FileNotFoundError:
                raise SourceError(f"{path} is a link to {target}, which does not exist; fix or remove it") from None
            if stat.S_ISDIR(mode):
                self._walk(path, target, f"{prefix}{entry.name}/", files, above | {real})
            elif stat.S_ISREG(mode):
                files[prefix + entry.name] = target
            else:
                raise SourceError(f"{path} is {file_kind(mode)}, not a regular file; remove it from the pipeline")

    def top_level_files(self, skip: set[str]) -> dict[str, Path]:
        """The pipeline folder's own files (the index, README, LICENSE), links checked; folders are left alone.

        Raises:
            SourceError: as `source_files`.
        """
        files: dict[str, Path] = {}
        for entry in sorted(os.scandir(self.real), key=lambda e: e.name):
            if entry.name in skip:
                continue
            path = self.folder / entry.name
            target = self.resolve(path) if entry.is_symlink() else self.real / entry.name
            try:
                mode = os.stat(target).st_mode
            except FileNotFoundError:
                continue  # a dangling link at the top: nothing to copy
            if stat.S_ISREG(mode):
                files[entry.name] = target
            elif not stat.S_ISDIR(mode):
                raise SourceError(f"{path} is {file_kind(mode)}, not a regular file; remove it from the pipeline")
        return files


def copy_file(source: Path, shown: Path, work: Path, dst: Path) -> None:
    """Copy regular file `source` (its real path; `shown` for messages) to `dst`, proven inside `work`, keeping
    its modification time (a resume compares it)."""
    fix = "a pipeline folder holds regular files only; remove it"
    fd = open_regular(source, str(shown), SourceError, fix, follow_symlinks=False)
    target = writable_inside(work, dst)
    try:
        with os.fdopen(fd, "rb") as f, open(target, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
            st = os.fstat(f.fileno())
        os.chmod(target, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    except BaseException:
        if not os.path.lexists(target):
            raise
        target.unlink()
        raise


def copy_component(boundary: SourceBoundary, folder: Path, dst: Path, work: Path) -> None:
    """Copy component folder `folder` to `dst` (replacing what is there), proven inside `work`, links checked.

    Raises:
        SourceError: as `SourceBoundary.source_files`. OutputError: `dst` not inside `work`.
    """
    files = boundary.source_files(folder)
    target = writable_inside(work, dst)
    target.mkdir()
    for name, real in files.items():
        copy = inside(work, target / name)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy_file(real, folder / name, work, copy)


__all__ = ["SourceBoundary", "copy_component", "copy_file"]
