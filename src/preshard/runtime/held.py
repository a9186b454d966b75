"""The files of one load, opened once and held: what the ranks agree on is what each of them reads.

A rank that opened `manifest.json` by path and, later, the data files by path could read the manifest of one
checkpoint and the data of another, if the folder is replaced in between (`convert-checkpoint --overwrite`
swaps folders). So a rank opens everything it will read before the ranks compare their manifest digests
(`preshard.runtime.agreement`): the manifest (parsed from the bytes of the descriptor it holds), config.json
and its data files, each inside the checkpoint folder and only if it is a regular file
(`preshard.format.folder`). Every later read goes through these descriptors, which keep the files they
opened whatever happens to the folder.

At the end of the load, `replaced` says whether the checkpoint changed meanwhile: a held file is no longer
the file at its path (the folder was swapped, a file renamed over), or was modified in place (its size or
mtime moved). That is asked of the file system alone: nothing is read a second time. The load then refuses
on every rank rather than hand back a model of a checkpoint that is not there any more.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from preshard.errors import CorruptCheckpointError
from preshard.format.folder import AUTO, CheckpointFolder, read_fd
from preshard.format.jsonio import canonical_json
from preshard.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    manifest_folder,
    manifest_from_bytes,
    missing_manifest,
)
from preshard.runtime.construct import read_checkpoint_config
from preshard.runtime.reader import open_data_files


def _fingerprint(fd: int) -> tuple[int, int]:
    """What a write in place changes (not the ctime: hard-linking the file, as a CP-only reshard does, moves it)."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


@dataclass
class HeldCheckpoint:
    """A checkpoint as one rank opened it for one load (see the module docstring). Close it when done."""

    folder: CheckpointFolder
    manifest: Manifest
    raw_manifest: bytes
    config: dict[str, Any] | None
    fds: dict[str, int] = field(default_factory=dict)  # MANIFEST_NAME and the data files
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def open(
        cls, path: str | Path, *, link_root: str | Path | None = AUTO, manifest: Manifest | None = None
    ) -> HeldCheckpoint:
        """Open the manifest (and config.json) of the checkpoint folder `path`.

        Args:
            link_root: where symbolic links may lead besides the folder (`CheckpointFolder`).
            manifest: the manifest, parsed already from these very bytes (a Hub load reads it first to know which
                files to fetch): the held bytes are then only checked to carry the same digest, not parsed again.

        Raises:
            CorruptCheckpointError: no manifest, a damaged one, a link out of the folder, a file that is not
                regular, or a config.json that differs from the manifest's record.
        """
        folder = CheckpointFolder(manifest_folder(path), link_root=link_root)
        try:
            fd = folder.open(MANIFEST_NAME)
        except FileNotFoundError:
            raise missing_manifest(folder.path) from None
        try:
            raw = read_fd(fd)
            origin = folder.where(MANIFEST_NAME)
            parsed = manifest_from_bytes(raw, origin) if manifest is None else _same_digest(raw, manifest, origin)
            config = read_checkpoint_config(folder, parsed)
        except BaseException:
            os.close(fd)
            raise
        held = cls(folder, parsed, raw, config, {MANIFEST_NAME: fd})
        held._seen[MANIFEST_NAME] = _fingerprint(fd)
        return held

    @property
    def path(self) -> Path:
        return self.folder.path

    def open_data(self, names: list[str]) -> dict[str, int]:
        """Open (and hold) the data files `names`, checking each one's recorded size; returns their descriptors."""
        fds = open_data_files(self.folder, self.manifest, [n for n in names if n not in self.fds])
        for name, fd in fds.items():
            self.fds[name] = fd
            self._seen[name] = _fingerprint(fd)
        return {name: self.fds[name] for name in names}

    def replaced(self) -> str | None:
        """Why the checkpoint is no longer the one opened (None: it still is). Nothing is read again: each held
        file must still be the file at its path (same device and inode) and unmodified (same size and mtime)."""
        for name, seen in self._seen.items():
            fd = self.fds[name]
            if _fingerprint(fd) != seen:
                return f"{self.folder.where(name)} was modified while it was being loaded"
            held = os.fstat(fd)
            try:
                now = os.stat(self.folder.resolve(name))
                same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
            except (OSError, CorruptCheckpointError):
                same = False
            if not same:
                return f"the checkpoint at {self.folder.path} was replaced while it was being loaded ({name} changed)"
        return None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _same_digest(raw: bytes, manifest: Manifest, origin: str) -> Manifest:
    """`manifest` itself, once the bytes `raw` are shown to be a manifest with the same (recomputed) digest."""
    try:
        data = json.loads(raw)
        body = {k: v for k, v in data.items() if k != "digest"}
        same = data.get("digest") == manifest.digest == xxhash.xxh3_128_hexdigest(canonical_json(body))
    except (ValueError, AttributeError, RecursionError):
        same = False
    if not same:
        raise CorruptCheckpointError(
            f"{origin} is not the manifest fetched for this load (its digest differs); the checkpoint changed while it "
            "was being fetched: load again"
        )
    return manifest


__all__ = ["HeldCheckpoint"]
