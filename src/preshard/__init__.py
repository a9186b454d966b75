"""preshard: pre-shard a diffusion-transformer checkpoint for a TP x CP mesh, load each rank's shard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from preshard.errors import (
    CheckpointFileMissingError,
    CheckpointNotFoundError,
    ChecksumMismatch,
    CorruptCheckpointError,
    DeviceError,
    Interrupted,
    MismatchError,
    OutputError,
    OutputExistsError,
    OutputLockedError,
    OutputPermissionError,
    PlanError,
    PreshardError,
    ResourceError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
    UsageError,
    WorkerError,
)

if TYPE_CHECKING:
    from preshard.converter.convert import convert_checkpoint
    from preshard.format.manifest import Manifest, read_manifest
    from preshard.format.mesh import MeshSpec
    from preshard.format.plan import Plan
    from preshard.runtime.load import load_sharded
    from preshard.tools.verify import VerifyResult, verify_checkpoint

__all__ = [
    "CheckpointFileMissingError",
    "CheckpointNotFoundError",
    "ChecksumMismatch",
    "CorruptCheckpointError",
    "DeviceError",
    "Interrupted",
    "Manifest",
    "MeshSpec",
    "MismatchError",
    "OutputError",
    "OutputExistsError",
    "OutputLockedError",
    "OutputPermissionError",
    "Plan",
    "PlanError",
    "PreshardError",
    "ResourceError",
    "SourceAccessError",
    "SourceError",
    "SourceNotFoundError",
    "SourceUnreachableError",
    "UsageError",
    "VerifyResult",
    "WorkerError",
    "convert_checkpoint",
    "load_sharded",
    "read_manifest",
    "verify_checkpoint",
]
__version__ = "0.2.0"

_LAZY = {
    "convert_checkpoint": "preshard.converter.convert",
    "load_sharded": "preshard.runtime.load",
    "read_manifest": "preshard.format.manifest",
    "Manifest": "preshard.format.manifest",
    "MeshSpec": "preshard.format.mesh",
    "Plan": "preshard.format.plan",
    "verify_checkpoint": "preshard.tools.verify",
    "VerifyResult": "preshard.tools.verify",
}


def __getattr__(name: str) -> Any:
    """Import the heavy parts (torch) only when used, so the CLI starts fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'preshard' has no attribute {name!r}")
