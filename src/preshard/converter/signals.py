"""SIGINT/SIGTERM during a conversion: stop at the next safe point instead of wherever the signal lands.

Python's default SIGINT handler raises KeyboardInterrupt at an arbitrary bytecode, which can tear a
record or surface from inside a library as a foreign traceback. While a conversion writes, both signals
only set a flag; the converter checks it between pieces of work and stops with `Interrupted`, leaving
the partial output consistent for a resume. A second signal of the same kind falls back to the handler
that was there before, so a stuck process can still be stopped.

Before and after the writing (planning, waiting for the output's lock, printing the summary) nothing is
half-written, so there a signal may stop the command at once: under `raising_signals` (the CLI's) both
raise `Interrupted`, so the command ends with one line and 130/143 instead of a KeyboardInterrupt
traceback or a silent death by SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from preshard.errors import Interrupted

_NAMES = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


class StopFlag:
    """Which signal asked the conversion to stop, if one did."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    def check(self) -> None:
        """Raise `Interrupted` if a signal arrived.

        Raises:
            Interrupted: carrying the signal's number (the CLI exits with 128 + it).
        """
        if self.signal_number is not None:
            raise Interrupted(
                f"{_NAMES[self.signal_number]}; the finished part is kept: re-run the same command to resume",
                self.signal_number,
            )


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopFlag]:
    """Within the block, SIGINT/SIGTERM set the returned flag (only from the main thread; elsewhere a no-op).

    A signal the process ignores (a background job's SIGINT, `nohup`) stays ignored.
    """
    flag = StopFlag()
    if not _in_main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame) -> None:
        if flag.signal_number == signum:  # asked twice: stop now, the way the process would have without us
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        flag.signal_number = signum

    for signum in _NAMES:
        old = signal.getsignal(signum)
        if old is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield flag
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(_NAMES[signum], signum)


@contextlib.contextmanager
def raising_signals(ignore_after: bool = False) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise `Interrupted` where they would have raised KeyboardInterrupt or
    killed the process without a word (a signal the process ignores stays ignored).

    For the stretches of a command where stopping at once is safe; `deferred_signals` takes over inside.

    Args:
        ignore_after: leave both signals ignored after the block instead of restoring them (for a program's
            last moments, once its outcome is decided).
    """
    if not _in_main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {}
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, _raise_interrupted)
    try:
        yield
    finally:
        for signum in defaults if ignore_after else ():
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, signal.SIG_IGN)
        for signum, old in previous.items() if not ignore_after else ():
            signal.signal(signum, old)
