"""Stand-in for `torch.serialization._get_layout`, which a DCP `.metadata` pickle names for a tensor's layout
(`torch.strided`); pickled in its place, see `preshard.format._torch_names`."""

from __future__ import annotations

TORCH_MODULE = "torch.serialization"


class Layout(str):
    """A torch layout by its name (`torch.strided`); pickles as torch's does."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (_get_layout, (str(self),))


def _get_layout(name: str) -> Layout:
    return Layout(name)


strided = Layout("torch.strided")
