"""A conversion source, or its row reader, wrapped to change a part of what it gives (LoRAs fused, weights
quantized, layers left out): what the wrapper does not change is the base's, by delegation, in one place."""

from __future__ import annotations

from typing import Any


class Wrapped:
    """Everything this class does not define is `self.base`'s."""

    base: Any

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (unpickling, a failed __init__): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.base, name)


class WrappedRows(Wrapped):
    """A row reader over `self.base`'s: files, hashes and closing are the base's."""

    def file_of(self, name: str) -> str:
        return self.base.file_of(name)

    def file_hashes(self, names: set[str] | None = None) -> dict[str, str]:
        return self.base.file_hashes(names)

    def close(self) -> None:
        self.base.close()


__all__ = ["Wrapped", "WrappedRows"]
