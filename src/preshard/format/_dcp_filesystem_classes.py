"""Stand-in for torch DCP's `_StorageInfo` (`torch.distributed.checkpoint.filesystem`, a module name exactly as
long as this one's), pickled in its place; see `preshard.format._dcp_metadata_classes`."""

from __future__ import annotations

TORCH_MODULE = "torch.distributed.checkpoint.filesystem"


class _StorageInfo:  # noqa: N801 - torch's name
    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path = relative_path
        self.offset = offset
        self.length = length
        self.transform_descriptors = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}
