"""huggingface_hub calls retried on transient Hub errors, as huggingface_hub's own backoff retries, in one line each.

Why: huggingface_hub retries some requests itself (a 429 on a download or its metadata, a listing's 5xx, a
connection lost mid-body: resumed) but not others: the repo info that resolves a revision, and a download answered
with a 5xx or a body that ends early, fail at once (one HTTP 503 failed a conversion). What it does retry it reports
in two lines per try, with the URL. So each huggingface_hub call preshard makes goes through `retried`:

- what huggingface_hub's `http_backoff` counts as transient (its default status codes: 408, 429, 5xx) and a body
  that ended early, a reset connection or a read timeout is retried with `http_backoff`'s own schedule (its default
  wait, doubling, capped at its default maximum; `Retry-After` + 1 s when the Hub sends one, as it waits);
- the retries huggingface_hub made itself inside the call count towards the same budget, `PRESHARD_HUB_RETRIES`
  (default: `http_backoff`'s own, 5), so a stumbling Hub is not retried twice over;
- a refused connection is not retried (no Hub there: the caller falls back to the cache at once, as before);
- huggingface_hub's retry messages are rewritten, while the call runs, into one line per retry naming the file (a
  logging filter on its two loggers, removed when the call returns), and preshard's own retries say the same.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import http_backoff

from preshard.errors import UsageError

try:  # the HTTP client huggingface_hub 2.x is built on
    import httpx2

    TRANSIENT_TRANSPORT: tuple[type[BaseException], ...] = (
        httpx2.RemoteProtocolError,
        httpx2.ReadError,
        httpx2.WriteError,
        httpx2.ReadTimeout,
        httpx2.WriteTimeout,
        httpx2.PoolTimeout,
    )
except ImportError:  # pragma: no cover - other huggingface_hub releases
    TRANSIENT_TRANSPORT = (ConnectionResetError,)

T = TypeVar("T")
RETRIES_VAR = "PRESHARD_HUB_RETRIES"
RETRY_AFTER_CAP = 60.0  # a Retry-After of hours is waited a minute at most: the budget of tries still bounds it
_BACKOFF = inspect.signature(http_backoff).parameters
MAX_RETRIES: int = _BACKOFF["max_retries"].default
BASE_WAIT: float = _BACKOFF["base_wait_time"].default
MAX_WAIT: float = _BACKOFF["max_wait_time"].default
RETRY_STATUSES: tuple[int, ...] = tuple(_BACKOFF["retry_on_status_codes"].default)
HF_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download")
CUT_SHORT = re.compile(r"Consistency check failed: file should be of size (\d+) but has size (\d+)")
RESOLVE_URL = re.compile(r"/resolve/[^/]+/(.+)$")
log = logging.getLogger("preshard.hub")


class _BodyCutShort(OSError):
    """An answer whose body ended before the bytes asked for: transient, retried here, never shown to a user as it
    is (so not one of errors.py's classes)."""

    def __init__(self, wanted: int, got: int) -> None:
        super().__init__(f"the answer ended early: {got} of {wanted} bytes")
        self.wanted = wanted
        self.got = got


BodyCutShort = _BodyCutShort


def max_retries() -> int:
    """PRESHARD_HUB_RETRIES as set now (default: huggingface_hub's http_backoff's max_retries).

    Raises:
        UsageError: the variable is not a whole number from 0 to 100.
    """
    text = os.environ.get(RETRIES_VAR, "").strip()
    if not text:
        return MAX_RETRIES
    if not text.isdigit() or int(text) > 100:
        raise UsageError(f"{RETRIES_VAR}={text!r} is not a number of retries; set it to a whole number from 0 to 100")
    return int(text)


def transient(exc: BaseException) -> BaseException | None:
    """The transient Hub error in `exc` or its causes (huggingface_hub wraps some), or None when there is none."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, HfHubHTTPError) and _status(cause) in RETRY_STATUSES:
            return cause
        if isinstance(cause, (BodyCutShort, *TRANSIENT_TRANSPORT)):
            return cause
        if isinstance(cause, OSError) and CUT_SHORT.search(str(cause)):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def retried(what: str, call: Callable[[], T]) -> T:
    """`call()`, retried on transient Hub errors; what the last try raised when the retries are spent.

    Args:
        what: the file or repo the call fetches, for the retry lines (e.g. "config.json of Hub repo org/name").
        call: one huggingface_hub call; safe to repeat (downloads resume, finished files are not fetched again).

    Returns:
        What `call` returned.

    Raises:
        Whatever `call` raised last, unchanged (the caller makes it one line); UsageError for a bad
        PRESHARD_HUB_RETRIES.
    """
    budget = max_retries()
    wait = BASE_WAIT
    with one_line_retries() as counter:
        while True:
            try:
                return call()
            except Exception as exc:
                cause = transient(exc)
                if cause is None or counter.retries >= budget:
                    raise
                counter.retries += 1
                after = _retry_after(cause)
                pause = min(float(after) + 1, RETRY_AFTER_CAP) if after is not None else wait  # as http_backoff
                asked = url_path(request_url(cause))
                target = what if asked is None or asked in what else f"{asked} of {what.rsplit(' of ', 1)[-1]}"
                log.warning(
                    "the Hub stumbled on %s (%s): retrying in %gs [retry %d of %d]",
                    target,
                    describe(cause),
                    pause,
                    counter.retries,
                    budget,
                )
                time.sleep(pause)
                wait = min(MAX_WAIT, wait * 2)


def describe(exc: BaseException) -> str:
    """A transient error in a few words: "HTTP 503", "cut short: 100 of 200 bytes", "RemoteProtocolError"."""
    if isinstance(exc, HfHubHTTPError):
        return f"HTTP {_status(exc)}"
    if isinstance(exc, BodyCutShort):
        return f"cut short: {exc.got} of {exc.wanted} bytes"
    match = CUT_SHORT.search(str(exc))
    if match:
        return f"cut short: {match.group(2)} of {match.group(1)} bytes"
    return type(exc).__name__


def url_path(url: object) -> str | None:
    """The repo path in a Hub file URL (`.../resolve/<revision>/<path>`), or None."""
    match = RESOLVE_URL.search(str(url).split("?", 1)[0])
    return match.group(1) if match else None


class _RetryCounter:
    def __init__(self) -> None:
        self.retries = 0


class _OneLine(logging.Filter):
    """huggingface_hub's retry messages as one line per retry; it counts them into the call's retries."""

    def __init__(self, counter: _RetryCounter) -> None:
        super().__init__()
        self.counter = counter
        self.cause = ""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        first = text.split("\n", 1)[0]
        if "thrown while requesting" in first:  # the cause; the "Retrying"/"Rate limited" line follows
            status = re.match(r"HTTP Error (\d+)", first)
            target = url_path(first.rsplit(" ", 1)[-1]) or first.rsplit(" ", 1)[-1]
            self.cause = f"{target} (HTTP {status.group(1)})" if status else f"{target} (connection error)"
            return False
        retry = re.match(r"(?:Rate limited\. Waiting|Retrying in) (\S+?)s? .*\[Retry (\d+)/(\d+)\]", first)
        if retry:
            self.counter.retries += 1
            self._rewrite(record, f"the Hub stumbled on {self.cause or 'a request'}: retrying in {retry.group(1)}s")
            return True
        if first.startswith("Error while downloading from "):
            if text.rstrip().endswith("Max retries exceeded."):
                return False  # the caller's one-line error follows
            self.counter.retries += 1
            url = first[len("Error while downloading from ") :].split(": ", 1)[0]
            self._rewrite(record, f"the download of {url_path(url) or url} broke off: resuming it")
            return True
        return True

    @staticmethod
    def _rewrite(record: logging.LogRecord, message: str) -> None:
        record.msg = message
        record.args = ()


@contextmanager
def one_line_retries() -> Iterator[_RetryCounter]:
    """While the block runs, huggingface_hub's retry messages are one line each and counted."""
    counter = _RetryCounter()
    drop = _OneLine(counter)
    loggers = [logging.getLogger(name) for name in HF_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield counter
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def request_url(exc: BaseException) -> str:
    """The URL of the request an httpx2 error or an HTTP error answer belongs to ("" when it has none)."""
    for holder in (getattr(exc, "response", None), exc):
        try:
            request = getattr(holder, "request", None)
        except RuntimeError:  # httpx2 raises when an error carries no request
            continue
        if request is not None:
            return str(request.url)
    return ""


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _retry_after(exc: BaseException) -> int | None:
    """The Retry-After seconds of an HTTP answer (the delay-seconds form only, as huggingface_hub reads it)."""
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    value = str(headers.get("Retry-After", "")).strip()
    return int(value) if value.isdigit() else None


__all__ = [
    "BodyCutShort",
    "describe",
    "max_retries",
    "one_line_retries",
    "request_url",
    "retried",
    "transient",
    "url_path",
]
