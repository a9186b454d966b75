"""Editing a checkpoint's manifest.json the way a hostile user would: plainly (the digest then no longer
matches) or re-sealed (the digest recomputed, so only the structural cross-checks stand in the way)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from preshard.format.jsonio import canonical_json


def reseal(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its digest recomputed over everything else."""
    body = {k: v for k, v in data.items() if k != "digest"}
    return {**body, "digest": xxhash.xxh3_128_hexdigest(canonical_json(body))}


def edit_manifest(checkpoint: Path, edit: Callable[[dict], Any], *, sealed: bool = True) -> dict:
    path = Path(checkpoint) / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    if sealed:
        data = reseal(data)
    path.write_text(json.dumps(data))
    return data
