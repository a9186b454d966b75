"""preshard: pre-shard a diffusion-transformer checkpoint for a TP x CP mesh, load each rank's shard.

The public API is exported here; the heavy parts (torch) are imported lazily, on first use, so the CLI starts fast.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from preshard.errors import (
    CheckpointFileMissingError,
    CheckpointNotFoundError,
    ChecksumMismatch,
    CorruptCheckpointError,
    DeviceError,
    InconsistentInputsError,
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
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.converter.signals import command_scope
    from preshard.format.manifest import Manifest, read_manifest
    from preshard.format.mesh import MeshSpec
    from preshard.format.plan import Plan
    from preshard.runtime.devices import RankDevice, init_rank_device
    from preshard.runtime.load import load_sharded
    from preshard.runtime.pipeline_load import load_pipeline
    from preshard.tools.reshard import reshard_checkpoint
    from preshard.tools.unshard import unshard_checkpoint
    from preshard.tools.verify import VerifyResult, verify_checkpoint

__all__ = [
    "CheckpointFileMissingError",
    "CheckpointNotFoundError",
    "ChecksumMismatch",
    "CorruptCheckpointError",
    "DeviceError",
    "InconsistentInputsError",
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
    "RankDevice",
    "ResourceError",
    "SourceAccessError",
    "SourceError",
    "SourceNotFoundError",
    "SourceUnreachableError",
    "UsageError",
    "VerifyResult",
    "WorkerError",
    "__version__",
    "command_scope",
    "convert_checkpoint",
    "convert_pipeline",
    "init_rank_device",
    "load_pipeline",
    "load_sharded",
    "read_manifest",
    "reshard_checkpoint",
    "unshard_checkpoint",
    "verify_checkpoint",
]

try:  # the one place the version is written is pyproject.toml; an installed package carries it in its metadata
    __version__ = version("preshard")
except PackageNotFoundError:  # the source tree on PYTHONPATH without an install
    __version__ = "0+unknown"

_LAZY = {
    "convert_checkpoint": "preshard.converter.convert",
    "command_scope": "preshard.converter.signals",
    "load_sharded": "preshard.runtime.load",
    "load_pipeline": "preshard.runtime.pipeline_load",
    "convert_pipeline": "preshard.converter.pipeline_folder",
    "read_manifest": "preshard.format.manifest",
    "Manifest": "preshard.format.manifest",
    "MeshSpec": "preshard.format.mesh",
    "Plan": "preshard.format.plan",
    "verify_checkpoint": "preshard.tools.verify",
    "reshard_checkpoint": "preshard.tools.reshard",
    "unshard_checkpoint": "preshard.tools.unshard",
    "init_rank_device": "preshard.runtime.devices",
    "RankDevice": "preshard.runtime.devices",
    "VerifyResult": "preshard.tools.verify",
}


def __getattr__(name: str) -> Any:
    """Import the heavy parts (torch) only when used, so the CLI starts fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'preshard' has no attribute {name!r}")
