"""Paths as the user typed them, checked before they reach the file system.

Why: an empty path is the current folder to `pathlib` (`Path("") == Path(".")`), a name of only spaces is a
legal, invisible folder, and a name that is not UTF-8 (bytes the OS allows, which Python keeps as surrogates)
passed every check and then failed as a traceback when the manifest, which records it, was encoded. Each is
one line here instead, naming the path as `repr` shows it.
"""

from __future__ import annotations

from pathlib import Path

from preshard.errors import PreshardError, UsageError


def check_path_text(given: str | Path, what: str, error: type[PreshardError] = UsageError) -> None:
    """Refuse an empty path, a component of only whitespace, or a path that is not UTF-8.

    Args:
        what: what the path is, for the message ("output", "source", "checkpoint").

    Raises:
        `error` (UsageError by default): naming the path and the fix.
    """
    text = str(given) if isinstance(given, Path) else given
    if not isinstance(text, str):
        raise error(f"{what} {text!r} is not a path; pass a folder or file path as a string")
    if not text.strip():
        raise error(f"{what} path {text!r} is empty or only whitespace; name a folder or file")
    if any(part and not part.strip() for part in text.split("/")):
        raise error(f"{what} path {text!r} has a name of only whitespace; name it with visible characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise error(
            f"{what} path {shown!r} is not UTF-8 (the manifest records paths as UTF-8 text); rename it"
        ) from None


__all__ = ["check_path_text"]
