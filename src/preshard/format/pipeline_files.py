"""The files of a converted pipeline that no checkpoint manifest covers, and their checks.

A converted pipeline folder holds two kinds of files. Each sharded component's folder is a converted checkpoint:
its manifest covers its data files, `.metadata` and `config.json`, and the manifest's own digest is recorded in
`preshard_pipeline.json`. Everything else (the components kept whole: their weights, configs, tokenizer files,
scheduler configs; the index; top-level files such as README.md) is listed in the record with its size and
xxh3_128 (`PipelineFile`), and the record is sealed (a digest over its canonical JSON, as a manifest is), so a
byte changed anywhere after conversion is found: by `load_pipeline` (by default) and by `preshard verify OUT`.

Files the record does not list: inside the folder of a component kept whole, one is refused (diffusers or
transformers may read any file there: an extra weights file, a second config); anywhere else (a top-level
`.gitattributes` a Hub upload adds, a sharded component's folder, whose loader reads only what its manifest
lists) it is ignored, never read by the load.

Every file is opened through `CheckpointFolder` (regular files only, no link out of the folder or, for a Hub
snapshot, out of the HF cache).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from preshard.errors import CorruptCheckpointError
from preshard.format.folder import CheckpointFolder

HASH_BLOCK = 8 << 20
FILE_CHECKSUM = "xxh3_128"
# What to do about a file that is not what was converted.
FIX = "copy the converted pipeline again from a good copy, or convert it again (convert-checkpoint PIPELINE OUT)"


@dataclass(frozen=True)
class PipelineFile:
    """One file of a converted pipeline that no manifest covers: its path relative to OUT, size and xxh3_128."""

    name: str
    size: int
    xxh3_128: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "xxh3_128": self.xxh3_128}


def is_relative_name(name: object) -> bool:
    """A path inside the folder: `/`-separated plain names (no empty, `.`, `..`, NUL or backslash), not absolute."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") and "\0" not in part and "\\" not in part for part in name.split("/"))


def folder_files(folder: Path) -> list[str]:
    """Every regular file under `folder` (links not followed), as sorted names relative to it."""
    names = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        base = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            names.append((base / name).as_posix())
    return sorted(names)


def hash_file(folder: CheckpointFolder, name: str, cancel: threading.Event | None = None) -> tuple[int, str]:
    """(size, xxh3_128) of file `name` of `folder`, read once, front to back.

    Raises:
        FileNotFoundError: no such file. CorruptCheckpointError: a link out of the folder, not a regular file.
        OSError: it cannot be read.
    """
    fd = folder.open(name)
    try:
        digest = xxhash.xxh3_128()
        buffer = bytearray(HASH_BLOCK)
        view = memoryview(buffer)
        size = 0
        while True:
            if cancel is not None and cancel.is_set():
                break
            n = os.readv(fd, [buffer])
            if not n:
                break
            digest.update(view[:n])
            size += n
        return size, digest.hexdigest()
    finally:
        os.close(fd)


def record_files(folder: Path, names: Iterable[str]) -> tuple[PipelineFile, ...]:
    """The records of files `names` of `folder` (the conversion's partial folder, just before its commit)."""
    boundary = CheckpointFolder(folder, link_root=None)
    out = []
    for name in sorted(names):
        size, digest = hash_file(boundary, name)
        out.append(PipelineFile(name, size, digest))
    return tuple(out)


def _fingerprint(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class FileCheck:
    """The checks of a converted pipeline's listed files (`check_files`): problems, one line each, and what each
    file was when checked (`changed_since` finds a file replaced after its check, while the load read it)."""

    folder: CheckpointFolder
    problems: list[str]
    checked: dict[str, tuple[int, int, int, int]]
    hashed_bytes: int = 0

    def changed_since(self) -> str | None:
        """The first checked file that is no longer the file checked (another inode, size or modification time)."""
        for name, seen in self.checked.items():
            try:
                now = _fingerprint(os.stat(self.folder.resolve(name)))
            except (OSError, CorruptCheckpointError):
                now = None
            if now != seen:
                return name
        return None


def check_files(
    folder: CheckpointFolder,
    files: Iterable[PipelineFile],
    *,
    hash: bool = True,
    cancel: threading.Event | None = None,
    record_name: str = "preshard_pipeline.json",
) -> FileCheck:
    """Every listed file present, regular, inside the folder, of its recorded size and (with `hash`) xxh3_128.

    Args:
        folder: the converted pipeline's folder.
        files: the record's files.
        hash: read and hash each file (else its size only).
        cancel: set to stop early (the load failed elsewhere); what was found so far is returned.

    Returns:
        A FileCheck: one problem line per file that is not what was converted, naming it.
    """
    check = FileCheck(folder, [], {})
    for f in files:
        if cancel is not None and cancel.is_set():
            break
        where = folder.where(f.name)
        try:
            real = folder.resolve(f.name)
            st = os.stat(real, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{where} is not a regular file; {FIX}")
            if st.st_size != f.size:
                check.problems.append(
                    f"{where} is {st.st_size} bytes, {record_name} records {f.size}: it changed after conversion; {FIX}"
                )
                continue
            check.checked[f.name] = _fingerprint(st)
            if hash:
                size, digest = hash_file(folder, f.name, cancel)
                check.hashed_bytes += size
                if cancel is not None and cancel.is_set():
                    break
                if size != f.size or digest != f.xxh3_128:
                    check.problems.append(
                        f"{where} differs from the file converted (its xxh3_128 is not the one {record_name} records): "
                        f"it was edited or damaged after conversion; {FIX}"
                    )
        except FileNotFoundError:
            check.problems.append(f"{where} is missing ({f.size} bytes, listed in {record_name}); {FIX}")
        except CorruptCheckpointError as exc:
            check.problems.append(" ".join(str(exc).split()))
        except OSError as exc:
            check.problems.append(f"{where} cannot be read ({exc.strerror or exc}); {FIX}")
    return check


def unlisted_files(folder: Path, files: Iterable[PipelineFile], whole: Iterable[str]) -> list[str]:
    """Files inside the folders of the components kept whole that the record does not list (relative names)."""
    listed = {f.name for f in files}
    extra = []
    for component in sorted(whole):
        base = folder / component
        if not base.is_dir() or base.is_symlink():
            continue  # a missing folder: its listed files are reported missing; a link: refused by its files' checks
        extra += [f"{component}/{n}" for n in folder_files(base) if f"{component}/{n}" not in listed]
    return extra


def unlisted_problem(where: str, component: str, record_name: str = "preshard_pipeline.json") -> str:
    return (
        f"{where} is not a file of the converted pipeline ({record_name} does not list it), and the loader of "
        f"{component} may read it; remove it, or {FIX}"
    )


__all__ = [
    "FILE_CHECKSUM",
    "FileCheck",
    "PipelineFile",
    "check_files",
    "folder_files",
    "hash_file",
    "is_relative_name",
    "record_files",
    "unlisted_files",
    "unlisted_problem",
]
