"""Hub arguments (repo id, revision, subfolder, a file path in a repo), checked before any huggingface_hub call.

Why: huggingface_hub joins a revision onto the cache folder to record which commit a branch or tag resolved to
(`refs/<revision>`); an absolute revision, `../../../../x`, `refs/../../../x` or `main/../../x` each wrote that refs
file wherever the value pointed, outside the cache. A revision may hold `/` (`refs/pr/1`, a branch `feature/x`),
so it is checked by its components: none may be empty, `.` or `..`, and none of the text may be absolute, hold a
backslash or a control character. The repo id and subfolder are held to the same rules. Each refusal is one
`UsageError` line naming the argument and the fix; nothing is asked of the Hub, nothing written.
"""

from __future__ import annotations

from preshard.errors import UsageError


def path_problem(text: object) -> str | None:
    """What makes `text` no relative '/'-separated path of plain names (None when nothing does)."""
    if not isinstance(text, str):
        return f"is {type(text).__name__}, not text"
    if not text:
        return "is empty"
    if text.startswith("/"):
        return "is an absolute path"
    if "\\" in text:
        return "holds a backslash"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        return "holds a control character"
    parts = text.split("/")
    if any(p in ("..", ".") for p in parts):
        return "holds a '.' or '..' component"
    if any(p == "" for p in parts):
        return "holds an empty component ('//' or a trailing '/')"
    if any(p != p.strip() for p in parts):
        return "holds a name that starts or ends with whitespace"
    return None


def check_revision(revision: str | None, option: str = "--revision") -> str | None:
    """`revision` (None: the default branch) if it is a branch, tag or commit name, else one `UsageError` line.

    A revision may hold `/` (`refs/pr/1`, `feature/x`); it may not traverse (`..`), be absolute, or hold empty
    components, backslashes or control characters.

    Raises:
        UsageError: naming the option and the fix.

    Example:
        >>> check_revision("refs/pr/1")
        'refs/pr/1'
    """
    if revision is None:
        return None
    problem = path_problem(revision)
    if problem is not None:
        raise UsageError(
            f"{option} {revision!r} {problem}; pass a branch, tag or commit sha (e.g. main, v1.0, refs/pr/1)"
        )
    return revision


def check_repo_id(repo_id: str, option: str = "repo id") -> str:
    """`repo_id` if it is `org/name` (or a bare `name`) of plain names, else one `UsageError` line.

    Raises:
        UsageError: naming it and the fix.
    """
    problem = path_problem(repo_id)
    if problem is None and repo_id.count("/") > 1:
        problem = "has more than one '/'"
    if problem is not None:
        raise UsageError(f"{option} {repo_id!r} {problem}; a Hub repo id is org/name")
    return repo_id


def check_subfolder(subfolder: str | None, option: str = "--subfolder") -> str | None:
    """`subfolder` (None, or blank: the repo's top) if it is a relative path inside the repo; a trailing `/` is
    dropped. Else one `UsageError` line.

    Raises:
        UsageError: naming the option and the fix.
    """
    if subfolder is None:
        return None
    if not isinstance(subfolder, str):
        raise UsageError(f"{option} {subfolder!r} is not text; pass a folder inside the repo, like 'transformer'")
    cleaned = subfolder.strip().rstrip("/")
    if not cleaned:
        return None
    problem = path_problem(cleaned)
    if problem is not None:
        raise UsageError(f"{option} {subfolder!r} {problem}; pass a folder inside the repo, like 'transformer'")
    return cleaned


def check_hub_arguments(
    repo_id: str, *, revision: str | None = None, subfolder: str | None = None, option: str = "--"
) -> str | None:
    """Check every Hub argument before a call; return the cleaned subfolder.

    Args:
        option: how options are spelled: `"--"` (`--revision`) on the command line, `"="` (`revision=`) in Python.

    Raises:
        UsageError: the first argument that is no plain Hub name, in one line.
    """

    def name(what: str) -> str:
        return f"{what}=" if option == "=" else f"--{what}"

    check_repo_id(repo_id)
    check_revision(revision, name("revision"))
    return check_subfolder(subfolder, name("subfolder"))


__all__ = ["check_hub_arguments", "check_repo_id", "check_revision", "check_subfolder", "path_problem"]
