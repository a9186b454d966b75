"""The one answer to "is this a local path, an object-storage URL or a Hub repo id?", for sources and converted
checkpoints alike.

A URL (`scheme://...`: s3://, gs://, any fsspec protocol; `format.object_store.is_url`) is never a local path:
`local_path` returns None for it, and every caller then asks `is_url` before trying a Hub repo id.

A local path always wins over a repo id of the same spelling: `local_path` returns it (joined with `subfolder` inside
a folder) or None, and every caller then treats None as a Hub repo id if `sources.hub.is_repo_id` says it is one,
else as a missing path of its own kind (`SourceNotFoundError`, `CheckpointNotFoundError`). The same mistake gets
the same error everywhere: a revision given for a local path is a `UsageError`.
"""

from __future__ import annotations

from pathlib import Path

from preshard.errors import UsageError
from preshard.format.object_store import is_url
from preshard.format.path_text import check_path_text


def local_path(
    given: str | Path, subfolder: str | None = None, revision: str | None = None, option: str = "--revision"
) -> Path | None:
    """The local file or folder `given` names (with `subfolder` inside a folder), or None when there is none.

    Args:
        option: how the caller spells the revision (`--revision` on the command line, `revision=` in Python).

    Raises:
        UsageError: a revision was given for a local path (revisions are the Hub's), or a path that is empty, has
            a name of only whitespace, or is not UTF-8 (`path_text.check_path_text`).
    """
    if is_url(given):
        return None
    check_path_text(given, "the")
    path = Path(given)
    if subfolder and path.is_dir():
        path = path / subfolder
    if not path.exists():
        return None
    if revision is not None:
        raise UsageError(f"{option} applies to Hub repos, but {given} is a local path; drop {option}")
    return path


__all__ = ["is_url", "local_path"]
