"""Downloaded weights checked before a conversion reads them.

Why: huggingface_hub places a download in the cache once its length is right, and names an LFS file's blob after
the sha256 the Hub reports for it (`X-Linked-Etag`), but does not hash what arrived: a body of other bytes of the
same length (a proxy's error page padded out, a damaged transfer) became a source that converts "successfully",
its wrong weights found only by a later `verify --source`. So each weights file downloaded for a conversion is
hashed once, as it lands, against the sha256 its blob is named after; a file whose blob is not named by one (no
symlinks in the cache, a non-LFS file) is checked against its own safetensors header's byte layout (every byte
belongs to exactly one tensor). A file that fails is removed from the cache, blob and link, so nothing damaged
stays placed for the next run; the error names the file and says to retry.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from preshard.errors import SourceError
from preshard.sources.safetensors_file import read_header

BLOCK_BYTES = 16 << 20
SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_of(path: Path) -> str:
    """The file's sha256, read in 16 MiB blocks (hashlib releases the GIL on large buffers)."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def check_downloaded(snapshot: Path, paths: list[str], where: str) -> None:
    """Every downloaded file of `paths` (repo paths in `snapshot`) holds the bytes the Hub described.

    Raises:
        SourceError: a file whose sha256 differs from its blob's name, or (without one) whose safetensors layout is
            broken; the file has been removed from the cache.
    """
    for path in paths:
        link = snapshot / path
        blob = link.resolve()
        expected = blob.name if SHA256.fullmatch(blob.name) else None
        try:
            if expected is not None:
                actual = sha256_of(blob)
                if actual != expected:
                    raise SourceError(
                        f"downloaded {path} of {where} is damaged: its sha256 is {actual[:12]}..., the Hub's "
                        f"(X-Linked-Etag) is {expected[:12]}...; it was removed from the cache: run the command again "
                        "to download it again"
                    )
            elif path.endswith(".safetensors"):
                read_header(blob)
        except SourceError as exc:
            _remove(link, blob)
            if expected is None:
                raise SourceError(
                    f"downloaded {path} of {where} is damaged ({exc}); it was removed from the cache: run the "
                    "command again to download it again"
                ) from None
            raise


def _remove(link: Path, blob: Path) -> None:
    for target in {link, blob}:
        try:
            os.unlink(target)
        except OSError:
            pass


__all__ = ["check_downloaded", "sha256_of"]
