"""A pipeline component's name, as an index, a record or an option gives it: one plain path component.

Why: a component name is joined onto the source folder, the partial folder and OUT. A name from a hand-edited or
hostile `model_index.json` such as `..`, `../victim`, an absolute path, `.` or `""` made that join point at the
folder holding OUT (removed before a copy), at a sibling, or at the partial folder itself. So a name is checked
where it is read, before any path is made from it: it must be one plain file name.
"""

from __future__ import annotations

from preshard.errors import PreshardError, UsageError

FIX = "a component name is one plain folder name (letters, digits, '_' or '-', e.g. text_encoder)"


def component_name_problem(name: object) -> str | None:
    """What is wrong with `name` as a component name (None when nothing is).

    Refused: not a string, empty, `.` or `..`, a leading `.` (a hidden folder, where preshard keeps its own
    working files), a `/` or `\\`, a NUL or any other control character, leading or trailing whitespace, a name
    that is not UTF-8.
    """
    if not isinstance(name, str):
        return f"is {type(name).__name__}, not text"
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "names a folder above or the folder itself"
    if name.startswith("."):
        return "starts with '.' (a hidden folder)"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "holds a control character"
    if name != name.strip():
        return "starts or ends with whitespace"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not UTF-8"
    return None


def check_component_name(name: object, where: str, error: type[PreshardError] = UsageError) -> str:
    """`name` if it is one plain path component, else `error` in one line.

    Args:
        where: what names it, for the message ("model_index.json", "--component").

    Returns:
        The name, unchanged.

    Raises:
        `error`: naming the component as `repr` shows it, what is wrong and the fix.

    Example:
        >>> check_component_name("text_encoder", "model_index.json")
        'text_encoder'
    """
    problem = component_name_problem(name)
    if problem is not None:
        raise error(f"{where}: component name {name!r} {problem}; {FIX}")
    assert isinstance(name, str)
    return name


__all__ = ["FIX", "check_component_name", "component_name_problem"]
