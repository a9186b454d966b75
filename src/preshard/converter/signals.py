"""SIGINT/SIGTERM during a conversion: stop at the next safe point instead of wherever the signal lands.

Python's default SIGINT handler raises KeyboardInterrupt at an arbitrary bytecode, which can tear a
record or surface from inside a library as a foreign traceback. While a conversion runs, both signals
only set a flag; the converter checks it between pieces of work and stops with `Interrupted`, leaving
the partial output consistent for a resume. A second signal of the same kind falls back to the default
behaviour, so a stuck process can still be stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from preshard.errors import Interrupted

_NAMES = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


class StopFlag:
    def __init__(self) -> None:
        self.signal_number: int | None = None

    def check(self) -> None:
        """Raise `Interrupted` if a signal arrived."""
        if self.signal_number is not None:
            raise Interrupted(
                f"{_NAMES[self.signal_number]}; the finished part is kept: re-run the same command to resume",
                self.signal_number,
            )


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopFlag]:
    """Within the block, SIGINT/SIGTERM set the returned flag (only from the main thread; elsewhere a no-op)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame) -> None:
        if flag.signal_number == signum:  # asked twice: stop now
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        flag.signal_number = signum

    for signum in _NAMES:
        previous[signum] = signal.signal(signum, handler)
    try:
        yield flag
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
