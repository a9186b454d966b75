"""JSON files on disk: strict reading with one-line errors, and atomic, durable writing.

Every JSON file preshard reads (manifest, plan, config, index) can be hand-edited or damaged, so
reading never raises anything but the caller's `PreshardError` subclass: not a regular file (a FIFO is refused,
never waited on), not valid UTF-8, not JSON, nested too deeply for the parser, or of the wrong top-level type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from preshard.errors import PreshardError
from preshard.format.folder import read_regular


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write, flush and fsync a sibling, then rename over `path`: readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
