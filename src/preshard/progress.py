"""Progress reporting shared by every long command: a tqdm bar on a terminal, plain periodic lines otherwise.

`enabled=None` means "on when stderr is a terminal"; a log file or CI output then gets one line every few
seconds instead of a redrawn bar.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar

from preshard.units import human_bytes

LINE_INTERVAL_S = 10.0


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool | None = None, initial: int = 0) -> None:
        terminal = sys.stderr.isatty()
        self.enabled = terminal if enabled is None else enabled
        self.total, self.desc, self.done = total, desc, initial
        self._bar = None
        self._last = time.monotonic()
        if self.enabled and terminal:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last >= LINE_INTERVAL_S:
            self._last = time.monotonic()
            self._line()

    def _line(self) -> None:
        share = self.done / self.total if self.total else 1.0
        print(f"{self.desc}: {share:.0%} ({human_bytes(self.done)} of {human_bytes(self.total)})", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            self._line()


# What `note(..., None)` does within `showing(enabled)`: a command's --progress/--no-progress, for the lines of code
# that cannot be handed it (a model class imported deep in planning). None: whether stderr is a terminal.
_SHOWING: ContextVar[bool | None] = ContextVar("preshard_progress_showing", default=None)


@contextlib.contextmanager
def showing(enabled: bool | None) -> Iterator[None]:
    """Within the block, `note(text)` (no `enabled` of its own) follows `enabled` (None: no change). Scoped to this
    context, as `contextvars` scope: a thread started inside takes it only through `copy_context()`."""
    if enabled is None:
        yield
        return
    token = _SHOWING.set(enabled)
    try:
        yield
    finally:
        _SHOWING.reset(token)


def shown(enabled: bool | None) -> bool:
    """Whether progress is shown: `enabled`; where it is None, the enclosing `showing(...)`, else whether stderr is
    a terminal."""
    if enabled is None:
        enabled = _SHOWING.get()
    return sys.stderr.isatty() if enabled is None else bool(enabled)


def note(text: str, enabled: bool | None = None) -> None:
    """One line on stderr where progress is shown (`shown(enabled)`): for a phase that would otherwise be silent
    for seconds (a resume's re-check, a model check, an import, planning)."""
    if shown(enabled):
        print(text, file=sys.stderr, flush=True)
