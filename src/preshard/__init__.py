"""preshard: pre-shard a diffusion-transformer checkpoint for a TP x CP mesh, load each rank's shard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from preshard.errors import PreshardError

if TYPE_CHECKING:
    from preshard.converter.convert import convert_checkpoint
    from preshard.manifests.io import read_manifest
    from preshard.mesh import MeshSpec
    from preshard.runtime.load import load_sharded

__all__ = ["MeshSpec", "PreshardError", "convert_checkpoint", "load_sharded", "read_manifest"]
__version__ = "0.1.0"

_LAZY = {
    "convert_checkpoint": "preshard.converter.convert",
    "load_sharded": "preshard.runtime.load",
    "read_manifest": "preshard.manifests.io",
    "MeshSpec": "preshard.mesh",
}


def __getattr__(name: str) -> Any:
    """Import the heavy parts (torch) only when used, so the CLI starts fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'preshard' has no attribute {name!r}")
