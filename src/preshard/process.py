"""What a command changes for its whole process, in one place and scoped: the cyclic garbage collector paused.

A library call leaves the process as it found it. The one context that changes process-wide settings for a
command is `preshard.converter.signals.command_scope`, which the CLI enters (and a Python caller may); it pauses
the collector with `gc_paused` below and installs the signal handlers. `tools/estimate.py` times the model check
under the same pause, so the dry run measures what the command will pay.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector within the block; restore it as it was after.

    The commands make no reference cycles to speak of, while importing torch and diffusers makes many objects, and
    each full collection walks all of them (about 0.3 CPU s of a start-up, 0.7 CPU s of the model check).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


__all__ = ["gc_paused"]
