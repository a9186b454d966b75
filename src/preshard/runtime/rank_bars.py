"""Under torchrun, diffusers' and transformers' progress bars on the lowest rank only, by default.

Every rank of a job loads the same pipeline, so every rank would draw the same loading bars (and, running the
pipeline, the same denoising bar), interleaved on one terminal. `bars_on_rank0(rank)` is a scoped change: within the
block, a rank other than 0 has diffusers' and transformers' bars off (`diffusers.utils.logging.disable_progress_bar`,
`transformers.utils.logging.disable_progress_bar`), and each is put back as it was when the block ends; nothing is
set at import. `quiet_pipeline(pipe, rank)` turns off a pipeline's own denoising bar on a rank other than 0
(`pipe.set_progress_bar_config(disable=True)`, that pipeline only). `PRESHARD_ALL_RANK_BARS=1` keeps every rank's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from preshard.process import under_torchrun

ALL_RANKS_ENV = "PRESHARD_ALL_RANK_BARS"
F = TypeVar("F", bound=Callable[..., Any])


def job_rank() -> int | None:
    """This process's rank in the torchrun job it is part of; None outside torchrun."""
    if not under_torchrun():
        return None
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _libraries() -> list[Any]:
    """The logging modules of diffusers and transformers that are imported (importing neither here)."""
    found = []
    for name in ("diffusers.utils.logging", "transformers.utils.logging"):
        if name.split(".")[0] in sys.modules:
            with contextlib.suppress(ImportError):
                found.append(__import__(name, fromlist=["disable_progress_bar"]))
    return found


@contextlib.contextmanager
def bars_on_rank0(rank: int | None) -> Iterator[None]:
    """Within the block, on a rank other than 0 (None: not a job, nothing changes), diffusers' and transformers'
    progress bars are off; each is restored on exit. Import both libraries before entering (those not imported
    are left alone).

    Example:
        >>> with bars_on_rank0(job_rank()):  # doctest: +SKIP
        ...     pipe = FluxPipeline.from_pretrained(folder, transformer=sharded)
    """
    if rank in (None, 0) or os.environ.get(ALL_RANKS_ENV) == "1":
        yield
        return
    changed = [lib for lib in _libraries() if lib.is_progress_bar_enabled()]
    for lib in changed:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in changed:
            lib.enable_progress_bar()


def quiet_pipeline(pipe: Any, rank: int | None) -> Any:
    """`pipe` with its own progress bar (the denoising loop's) off on a rank other than 0; `pipe` itself."""
    if rank not in (None, 0) and os.environ.get(ALL_RANKS_ENV) != "1" and hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe


def rank0_bars(fn: F) -> F:
    """`fn` (a loader) run within `bars_on_rank0(job_rank())`, its result passed through `quiet_pipeline`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import diffusers.utils.logging  # noqa: F401  (so that its bars are scoped too)

        with contextlib.suppress(ImportError):
            import transformers.utils.logging  # noqa: F401
        rank = job_rank()
        with bars_on_rank0(rank):
            return quiet_pipeline(fn(*args, **kwargs), rank)

    return wrapper  # type: ignore[return-value]


__all__ = ["ALL_RANKS_ENV", "bars_on_rank0", "job_rank", "quiet_pipeline", "rank0_bars"]
