"""A conversion source whose tensors carry the names the model's modules have, not the names stored.

transformers renames checkpoint keys on load (a vision-language model's text layers stored as `model.layers.*`
live at `model.language_model.layers.*`); preshard's plans, manifests and the runtime all speak module names, so
the converter reads the source through this view. Bytes, files, hashes and proofs are the base's: only names are
translated, in both directions. The identity adds the renames, so a resume under other renames starts over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from preshard.errors import SourceError
from preshard.format.dtypes import DType
from preshard.format.manifest import Source
from preshard.sources import ConversionSource, SourceRows


class RenamedRows:
    """The base reader's rows, asked for by module name."""

    def __init__(self, base: SourceRows, stored: dict[str, str]) -> None:
        self.base, self.stored = base, stored  # module name -> stored name (only those that differ)
        self.module = {v: k for k, v in stored.items()}

    def _s(self, name: str) -> str:
        return self.stored.get(name, name)

    def read_rows(self, name: str, start: int, count: int, out: np.ndarray) -> None:
        self.base.read_rows(self._s(name), start, count, out)

    def start_band(self, name: str, start: int, count: int, buffer: np.ndarray) -> Any:
        return self.base.start_band(self._s(name), start, count, buffer)

    def finish_band(self, band: Any) -> np.ndarray:
        return self.base.finish_band(band)

    def file_of(self, name: str) -> str:
        return self.base.file_of(self._s(name))

    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]:
        return self.base.file_hashes(names)  # file names, not tensor names

    def take_proofs(self) -> dict[str, str]:
        return {self.module.get(k, k): v for k, v in self.base.take_proofs().items()}

    def prove(self, kept: list[tuple[str, str | None]], check_stop: Any = None) -> int:
        return self.base.prove([(self._s(name), proof) for name, proof in kept], check_stop)

    def close(self) -> None:
        self.base.close()


class RenamedSource:
    """`base` with tensor names `renames` (stored -> module name) applied; everything else is the base's."""

    def __init__(self, base: ConversionSource, renames: dict[str, str]) -> None:
        targets = list(renames.values())
        clash = sorted(
            {t for t in targets if targets.count(t) > 1} | (set(targets) & (set(base.shapes()) - set(renames)))
        )
        if clash:
            raise SourceError(
                f"renaming the checkpoint's tensors as transformers loads them gives {clash[0]} twice; the "
                "checkpoint holds the same tensor under two names: remove one"
            )
        self.base, self.renames = base, dict(renames)
        self.stored = {v: k for k, v in renames.items()}

    @property
    def config(self) -> dict[str, Any] | None:
        return self.base.config

    def _m(self, name: str) -> str:
        return self.renames.get(name, name)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {self._m(name): value for name, value in self.base.shapes().items()}

    def read_order(self) -> list[str]:
        return [self._m(name) for name in self.base.read_order()]

    def input_paths(self) -> list[Path]:
        return self.base.input_paths()

    def config_bytes(self) -> bytes | None:
        return self.base.config_bytes()

    def identity(self) -> str:
        digest = hashlib.sha256(json.dumps(sorted(self.renames.items())).encode()).hexdigest()[:16]
        return f"{self.base.identity()}+renamed:{digest}"

    def check_unchanged(self, identity: str) -> None:
        self.base.check_unchanged(identity.rpartition("+renamed:")[0])

    def open_reader(self) -> RenamedRows:
        return RenamedRows(self.base.open_reader(), self.stored)

    def source_record(self, file_hashes: dict[str, str]) -> Source:
        return self.base.source_record(file_hashes)
