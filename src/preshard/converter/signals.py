"""SIGINT/SIGTERM during a conversion: stop at the next safe point instead of wherever the signal lands.

Python's default SIGINT handler raises KeyboardInterrupt at an arbitrary bytecode, which can tear a
record or surface from inside a library as a foreign traceback. While a conversion writes, both signals
only set a flag; the converter checks it between pieces of work and stops with `Interrupted`, leaving
the partial output consistent for a resume. A second signal of the same kind falls back to the handler
that was there before, so a stuck process can still be stopped.

Before and after the writing (planning, waiting for the output's lock, printing the summary) nothing is
half-written, so there a signal may stop the command at once: under `raising_signals` both raise `Interrupted`,
so the command ends with one line and 130/143 instead of a KeyboardInterrupt traceback or a silent death by SIGTERM.

None of this is a side effect of a library call. The caller enters `command_scope` (the CLI does, for every
command; a Python caller may, `with preshard.command_scope(): convert_checkpoint(...)`), and only inside it do the
converter's `deferred_signals` blocks take the signals over. Outside it a library call leaves the handlers as they
are: Ctrl-C raises KeyboardInterrupt wherever it lands, as in any Python library (a conversion stopped so is
resumed as any interrupted one: a resume re-checks every record it keeps).

A signal is never lost. An exception raised by a handler can be swallowed by the code it lands in (numpy's
import, run by `import torch`, catches it; so does any `except Exception`), so the raising handler also
records what it received: `deferred_signals` starts with that signal already set (the command stops at its
first safe point, before writing), and `raising_signals` raises it again when its block would otherwise end
normally. A signal deferred until after the last safe point (the output committed) is delivered to the
handler that was there before once the block ends. So a command that received SIGINT or SIGTERM never exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from preshard.errors import Interrupted

_NAMES: dict[int, str] = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


class StopFlag:
    """Which signal asked the conversion to stop, if one did."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self.raised = False  # `check` raised for it: the signal has been acted on

    def check(self) -> None:
        """Raise `Interrupted` if a signal arrived.

        Raises:
            Interrupted: carrying the signal's number (the CLI exits with 128 + it).
        """
        if self.signal_number is not None:
            self.raised = True
            raise Interrupted(
                f"{_NAMES[self.signal_number]}; the finished part is kept: re-run the same command to resume",
                self.signal_number,
            )


class _DeferringHandler:
    """`deferred_signals`' handler: records the signal in the flag; asked twice, acts as the handler from before."""

    def __init__(self, flag: StopFlag, previous: dict[int, Any]) -> None:
        self.flag, self.previous = flag, previous

    def __call__(self, signum, frame) -> None:
        if self.flag.signal_number == signum:  # asked twice: stop now, the way the process would have without us
            signal.signal(signum, self.previous[signum])
            signal.raise_signal(signum)
        self.flag.signal_number = signum


class _RaisingHandler:
    """`raising_signals`' handler: raises `Interrupted`, and remembers the signal in case the exception is swallowed."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum, frame) -> None:
        self.received = signum
        raise Interrupted(_NAMES[signum], signum)


def received_signal() -> int | None:
    """The signal a `raising_signals` handler in place has received (and raised), if any: what a command that is
    ending for another reason must report instead (the reason may be the signal's exception, swallowed and turned
    into another error by the code it landed in)."""
    for signum in _NAMES:
        handler = signal.getsignal(signum)
        if isinstance(handler, _RaisingHandler) and handler.received is not None:
            return handler.received
    return None


def interruption(signum: int) -> Interrupted:
    return Interrupted(_NAMES[signum], signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopFlag]:
    """Within the block, SIGINT/SIGTERM set the returned flag, where the caller entered `command_scope` (its
    handlers are in place) and only from the main thread; elsewhere the handlers are left alone and the flag never
    set. A signal the process ignores (a background job's SIGINT, `nohup`) stays ignored.
    """
    flag = StopFlag()
    if not _in_main_thread():
        yield flag
        return
    previous: dict[int, Any] = {}
    handler = _DeferringHandler(flag, previous)
    for signum in _NAMES:
        old = signal.getsignal(signum)
        if isinstance(old, (_RaisingHandler, _DeferringHandler)):  # the caller's scope, or an outer deferral
            previous[signum] = signal.signal(signum, handler)
        if isinstance(old, _RaisingHandler) and old.received == signum and flag.signal_number is None:
            flag.signal_number = signum  # received before, and its exception swallowed: stop at the first check
    completed = False
    try:
        yield flag
        completed = True
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        if completed and flag.signal_number is not None and not flag.raised:
            # Deferred past the last check (the work is done): the handler from before acts on it now.
            signal.raise_signal(flag.signal_number)


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
    handler = _RaisingHandler()
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
        if handler.received is not None:  # raised, and swallowed where it landed: the command must not succeed
            raise interruption(handler.received)
    finally:
        for signum in defaults if ignore_after else ():
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, signal.SIG_IGN)
        for signum, old in previous.items() if not ignore_after else ():
            signal.signal(signum, old)


@contextlib.contextmanager
def command_scope(program: bool = False) -> Iterator[None]:
    """The one scoped context in which a command changes process-wide settings; the CLI enters it for every command.

    Within it SIGINT and SIGTERM raise `Interrupted` (`raising_signals`), and the converter's writing phases defer
    them to their next safe point (`deferred_signals`), so a command ends with one line and 130/143; the cyclic
    garbage collector is paused (`preshard.process.gc_paused`). Everything is restored when the block ends.

    Args:
        program: the process runs this one command and ends after it: signals stay ignored after the block (the
            outcome is printed, a signal during the interpreter's shutdown would only garble it), and the objects
            made so far are frozen out of the last collections (`gc.freeze`: about 1 s of exit with torch loaded).

    Raises:
        Interrupted: a signal arrived in the block whose exception was swallowed where it landed.
    """
    import gc

    from preshard.process import gc_paused

    try:
        with gc_paused(), raising_signals(ignore_after=program):
            yield
    finally:
        if program:
            gc.freeze()
