"""Stand-ins for torch DCP's metadata classes, pickled in their place (see `preshard.format.dcp_metadata`).

Each has the name, attribute order and pickled state of its torch counterpart in
`torch.distributed.checkpoint.metadata`, whose name is exactly as long as this module's: the writer pickles
these and puts torch's module name in place of this one's, which gives byte for byte the pickle of torch's own
objects without importing `torch.distributed.checkpoint` (about a CPU second of imports). The restricted reader
of `.metadata` gives these back in place of torch's classes, for the same reason.
"""

from __future__ import annotations

import enum
from typing import Any

from preshard.format._torch_names import DType, Size
from preshard.format._torch_serialization import Layout, strided

TORCH_MODULE = "torch.distributed.checkpoint.metadata"


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - torch's name
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class TensorProperties:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype
        self.layout: Layout = strided
        self.requires_grad = False
        self.memory_format = "torch.contiguous_format"  # torch's memory format, by name (it is pickled as its code)
        self.pin_memory = False

    def __getstate__(self) -> tuple:
        return (
            self.dtype,
            self.layout,
            self.requires_grad,
            _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            self.pin_memory,
        )

    def __setstate__(self, state: tuple) -> None:  # when read back (verify)
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = {
            _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: "torch.contiguous_format",
            _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: "torch.channels_last",
            _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: "torch.preserve_format",
        }[encoding]


class ChunkStorageMetadata:
    def __init__(self, offsets: Size, sizes: Size) -> None:
        self.offsets = offsets
        self.sizes = sizes


class TensorStorageMetadata:
    def __init__(self, properties: TensorProperties, size: Size, chunks: list[ChunkStorageMetadata]) -> None:
        self.properties = properties
        self.size = size
        self.chunks = chunks


class MetadataIndex:
    def __init__(self, fqn: str, offset: Size, index: int) -> None:  # torch sets them in this order
        self.fqn = fqn
        self.index = index
        self.offset = Size(offset)


class Metadata:
    def __init__(self, state_dict_metadata: dict, planner_data: Any, storage_data: Any) -> None:
        self.state_dict_metadata = state_dict_metadata
        self.planner_data = planner_data
        self.storage_data = storage_data
        self.storage_meta = None
        self.version = None


class BytesStorageMetadata:  # read back only (a .metadata torch wrote may hold it)
    pass


class StorageMeta:  # read back only
    pass
