"""JSON files on disk: strict reading with one-line errors, and atomic, durable writing (through `format/publish.py`).

Every JSON file preshard reads (manifest, plan, config, index) can be hand-edited or damaged, so
reading never raises anything but the caller's `PreshardError` subclass: not a regular file (a FIFO is refused,
never waited on), not valid UTF-8, not JSON, nested too deeply for the parser, an integer of more digits than
Python converts (4300 by default: a `ValueError` from the parser), or of the wrong top-level type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from preshard.errors import PreshardError
from preshard.format.folder import read_regular
from preshard.format.publish import publish_text


def parse_json_text(text: str | bytes, where: str, error: type[PreshardError], fix: str) -> Any:
    """Parse JSON text; any failure is `error(f"{where} is not valid JSON (...); {fix}")`."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError:
        raise error(f"{where} is not UTF-8 text; {fix}") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply to be read; {fix}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where} is not valid JSON (line {exc.lineno}: {exc.msg}); {fix}") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise error(f"{where} holds a number too long to read ({str(exc).split(';')[0]}); {fix}") from None


def read_json(path: Path, where: str, error: type[PreshardError], fix: str, expect: type | None = dict) -> Any:
    """Read a JSON file, optionally requiring its top level to be of type `expect`."""
    try:
        raw = read_regular(path, where, error, fix)  # a FIFO is refused, never waited on
    except FileNotFoundError:
        raise error(f"{where} does not exist; {fix}") from None
    except OSError as exc:
        raise error(f"{where} cannot be read ({exc.strerror or exc}); {fix}") from None
    data = parse_json_text(raw, where, error, fix)
    if expect is not None and not isinstance(data, expect):
        kind = {dict: "object", list: "list"}.get(expect, expect.__name__)
        raise error(f"{where} must hold a JSON {kind}, not {type(data).__name__}; {fix}")
    return data


def canonical_json(data: Any) -> bytes:
    """The bytes a digest is taken over: sorted keys, no whitespace, so formatting never changes it."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def dumps_indented(data: Any) -> str:
    """`json.dumps(data, indent=1)`, byte for byte, in a fraction of its time.

    Why: with an indent, the json module encodes with its pure-Python encoder, which took most of the time of
    writing the manifest of 100 000 tensors. Plain data (dict with string keys, list, tuple, str, int, float,
    bool, None) is written here; anything else goes to the json module, as does a value it would reject.
    """
    out: list[str] = []
    append = out.append
    encode = _encode_str
    floats = _floatstr

    def value(v: Any, newline: str) -> None:
        kind = type(v)
        if kind is str:
            append(encode(v))
        elif v is None:
            append("null")
        elif v is True:
            append("true")
        elif v is False:
            append("false")
        elif kind is int:
            append(int.__repr__(v))
        elif kind is float:
            append(floats(v))
        elif kind is dict:
            if not v:
                append("{}")
                return
            inner = newline + " "
            separator = "{" + inner
            for key, item in v.items():
                if type(key) is not str:
                    raise _Unsupported
                append(separator + encode(key) + ": ")
                separator = "," + inner
                value(item, inner)
            append(newline + "}")
        elif kind is list or kind is tuple:
            if not v:
                append("[]")
                return
            inner = newline + " "
            separator = "[" + inner
            for item in v:
                append(separator)
                separator = "," + inner
                value(item, inner)
            append(newline + "]")
        else:
            raise _Unsupported

    try:
        value(data, "\n")
    except _Unsupported:
        return json.dumps(data, indent=1)
    return "".join(out)


class _Unsupported(Exception):
    """A value `dumps_indented` leaves to the json module."""


_encode_str = json.encoder.encode_basestring_ascii


def _floatstr(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    return float.__repr__(v)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as indented JSON through `publish_text`: readers see the old file or the new one."""
    publish_text(path, dumps_indented(data) + "\n")
