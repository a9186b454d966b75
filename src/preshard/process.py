"""What preshard changes for its whole process, in one place: the cyclic garbage collector paused (scoped), and
under torchrun, preshard's own errors printed as one line per rank.

A library call leaves the process as it found it. The one context that changes process-wide settings for a
command is `preshard.converter.signals.command_scope`, which the CLI enters (and a Python caller may); it pauses
the collector with `gc_paused` below and installs the signal handlers. `tools/estimate.py` times the model check
under the same pause, so the dry run measures what the command will pay.

Under torchrun an uncaught error is a traceback on every rank, 20 lines each for what preshard says in one. So when
a `PreshardError` leaves `load_sharded` in a process torchrun started, `one_line_errors_under_torchrun` installs a
`sys.excepthook` that prints such an error, if nothing catches it, as `error: rank R: <message>` (the process still
exits with status 1, so the job fails); any other exception goes to the hook that was there before.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from types import TracebackType

from preshard.errors import PreshardError


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


class _OneLineErrors:
    """The excepthook `one_line_errors_under_torchrun` installs: a PreshardError as one line, the rest as before."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, PreshardError):
            # One write of the whole line: ranks share torchrun's stderr pipe, and a write under PIPE_BUF bytes is
            # atomic there, while print's separate newline let two ranks' lines run together.
            line = f"error: rank {os.environ.get('RANK', '?')}: {value}\n"
            try:
                descriptor = sys.stderr.fileno()
            except (AttributeError, OSError, ValueError):  # stderr replaced by an object with no descriptor
                sys.stderr.write(line)
                return
            sys.stderr.flush()
            os.write(descriptor, line.encode(errors="replace"))
        else:
            self.previous(kind, value, tb)


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def one_line_errors_under_torchrun() -> None:
    """In a process torchrun started, print an uncaught PreshardError as one line, `error: rank R: <message>`,
    instead of a traceback (once; a caller's own excepthook is kept for every other exception). Elsewhere nothing."""
    if under_torchrun() and not isinstance(sys.excepthook, _OneLineErrors):
        sys.excepthook = _OneLineErrors(sys.excepthook)


__all__ = ["gc_paused", "one_line_errors_under_torchrun", "under_torchrun"]
