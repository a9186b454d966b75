"""Checkpoints in object storage (s3://, gs://, any fsspec URL): where the bytes are, read and written through fsspec.

Why: a checkpoint served on many hosts usually lives in a bucket, not on a shared disk, and a rank needs only its
own bytes of it. So everything preshard does with a bucket is a handful of operations on one prefix, the
`ObjectStore`: the size of an object, a ranged read of `[start, end)`, a whole small object, an upload. fsspec picks
the client from the URL's scheme (s3fs for s3://, gcsfs for gs://), and the client reads the platform's own
configuration: for S3 the `AWS_*` environment (`AWS_ENDPOINT_URL` included), `~/.aws/config` and credentials files,
an instance role. No credential is ever passed here, written to a manifest, or shown in an error: a URL is shown
without any `user:password@` part.

Retries: the client retries what it knows to be transient (for S3, botocore's "standard" mode: 500/502/503/504,
`SlowDown`, throttling, connection errors, up to `PRESHARD_OBJECT_RETRIES` attempts), and each operation here is
retried again, up to as many tries, with exponential backoff (`PRESHARD_OBJECT_BACKOFF_S`, default 0.5 s, doubling,
capped at 20 s), on an answer cut short (fewer bytes than asked) or an error that is neither "not found" nor "not
allowed": at most PRESHARD_OBJECT_RETRIES squared requests for one read, however the store stumbles. What still
fails is one line naming the object: `ObjectNotFoundError`, `ObjectAccessError`, `ObjectUnreachableError`.

Example:
    >>> store = open_store("s3://bucket/h3-tp8")            # doctest: +SKIP
    >>> store.read_range("model-tp0.distcp", 0, 4096)      # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from preshard.errors import ObjectAccessError, ObjectNotFoundError, ObjectUnreachableError, UsageError

T = TypeVar("T")
CACHE_VAR = "PRESHARD_CACHE"
RETRIES_VAR = "PRESHARD_OBJECT_RETRIES"
BACKOFF_VAR = "PRESHARD_OBJECT_BACKOFF_S"
DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 20.0
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")
_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
log = logging.getLogger("preshard.objects")


def is_url(given: object) -> bool:
    """Whether `given` is an object-storage URL (`scheme://...`, not `file://`): the resolver's third answer, beside
    a local path and a Hub repo id (`format/locate.py`)."""
    if not isinstance(given, str):
        return False
    match = _URL.match(given)
    return match is not None and match.group(1).lower() not in ("file", "local")


def cache_root() -> Path:
    """Where local copies for object storage live (a rank's folder, a source's files, an output being staged):
    `PRESHARD_CACHE`, else `$XDG_CACHE_HOME/preshard`, else `~/.cache/preshard`."""
    given = os.environ.get(CACHE_VAR)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "preshard"


def url_key(url: str) -> str:
    """A folder name for `url` (hashed: no bucket name, endpoint or credential appears in a local path)."""
    return hashlib.sha256(shown(url).rstrip("/").encode()).hexdigest()[:24]


def shown(url: str) -> str:
    """`url` as it may appear in a message: without a `user:password@` part."""
    return _CREDENTIALS.sub(r"\1", url)


class _CutShort(OSError):
    """A ranged read answered with fewer bytes than asked (retried)."""

    def __init__(self, wanted: int, got: int) -> None:
        super().__init__(f"{got} of {wanted} bytes")
        self.wanted, self.got = wanted, got


def max_attempts() -> int:
    """Attempts per operation: `PRESHARD_OBJECT_RETRIES` (default 5), also the client's own attempts."""
    raw = os.environ.get(RETRIES_VAR, "")
    if not raw:
        return DEFAULT_RETRIES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{RETRIES_VAR}={raw!r} must be a whole number of attempts, 1 or more")
    return value


def _backoff() -> float:
    raw = os.environ.get(BACKOFF_VAR, "")
    try:
        value = float(raw) if raw else DEFAULT_BACKOFF_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"{BACKOFF_VAR}={raw!r} must be a number of seconds, 0 or more")
    return value


def _client_options(scheme: str) -> dict[str, Any]:
    """The client's own retry settings; credentials and endpoint stay the platform's configuration."""
    if _EXTRAS.get(scheme) == "s3fs":
        retries = {"max_attempts": max_attempts(), "mode": "standard"}
        # botocore retries throttling and 5xx with its backoff; s3fs's own loop would retry them again: once only
        return {"config_kwargs": {"retries": retries}, "skip_instance_cache": True}
    return {"skip_instance_cache": True}


@dataclass(frozen=True)
class ObjectStore:
    """One prefix in object storage (a checkpoint folder's equivalent), and the fsspec file system serving it."""

    url: str  # as given, without a trailing slash (shown without credentials)
    fs: Any  # fsspec.AbstractFileSystem
    root: str  # the prefix in the file system's own spelling

    def where(self, name: str = "") -> str:
        """The URL of the object `name` under this prefix, as messages show it."""
        return shown(f"{self.url}/{name}" if name else self.url)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def child(self, subfolder: str | None) -> ObjectStore:
        """The prefix `subfolder` below this one (e.g. a pipeline's "transformer")."""
        if not subfolder:
            return self
        clean = subfolder.strip("/")
        if not clean or any(part in ("", ".", "..") for part in clean.split("/")):
            raise UsageError(f"subfolder {subfolder!r} must be a relative folder name such as 'transformer'")
        return ObjectStore(f"{self.url}/{clean}", self.fs, f"{self.root}/{clean}")

    # -- reads

    def size(self, name: str) -> int:
        """The object's size in bytes."""
        info = self.call(name, "look up", lambda: self.fs.info(self.path(name)))
        if info.get("type") == "directory":
            raise ObjectNotFoundError(f"{self.where(name)} is a folder (prefix), not an object")
        return int(info["size"])

    def exists(self, name: str) -> bool:
        """Whether the object `name` exists (a lookup error other than "not found" is raised, in one line)."""
        try:
            self.size(name)
        except ObjectNotFoundError:
            return False
        return True

    def read(self, name: str) -> bytes:
        """The whole object `name` (for small ones: a manifest, config.json, an index)."""
        return self.call(name, "read", lambda: bytes(self.fs.cat_file(self.path(name))))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of the object `name`, in one ranged request (retried whole if cut short)."""

        def one() -> bytes:
            if end <= start:
                return b""
            data = self.fs.cat_file(self.path(name), start=start, end=end)
            if len(data) != end - start:
                raise _CutShort(end - start, len(data))
            return bytes(data)

        return self.call(name, f"read bytes {start}..{end} of", one)

    def download(self, name: str, target: Path) -> None:
        """Copy the object `name` to the local file `target` (replaced whole; retried whole)."""

        def one() -> None:
            self.fs.get_file(self.path(name), str(target))

        self.call(name, "download", one)

    # -- writes

    def upload(self, source: Path, name: str) -> None:
        """Upload the local file `source` as the object `name` (an object appears whole when its upload ends)."""
        self.call(name, "upload", lambda: self.fs.put_file(str(source), self.path(name)))

    def remove(self, name: str) -> None:
        """Delete the object `name` if it is there."""

        def one() -> None:
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass

        self.call(name, "delete", one)

    def names(self) -> list[str]:
        """The names of the objects under this prefix, recursively (relative, '/'-separated)."""
        found = self.call("", "list", lambda: self.fs.find(self.root))
        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    # -- retries and errors

    def call(self, name: str, doing: str, operation: Callable[[], T]) -> T:
        """`operation()`, retried with backoff on transient errors; a lasting failure as one line naming the object."""
        attempts, wait = max_attempts(), _backoff()
        for attempt in range(1, attempts + 1):
            try:
                return operation()
            except FileNotFoundError:
                raise ObjectNotFoundError(
                    f"{self.where(name)} does not exist; check the URL, or upload the whole folder again"
                ) from None
            except PermissionError:
                raise ObjectAccessError(
                    f"not allowed to {doing} {self.where(name)}; check the credentials the platform provides "
                    "(for S3: AWS_* variables, ~/.aws/config, the instance role)"
                ) from None
            except Exception as exc:  # transient until the budget is spent
                if not _transient(exc):
                    raise
                if attempt == attempts:
                    raise ObjectUnreachableError(
                        f"could not {doing} {self.where(name)} after {attempts} tries, each retried by the client "
                        f"({_describe(exc)}); "
                        "check the endpoint and network, then run again"
                    ) from None
                delay = min(MAX_BACKOFF_S, wait * 2 ** (attempt - 1))
                log.warning("retrying %s %s in %.1f s (%s)", doing, self.where(name), delay, _describe(exc))
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


_CLIENT_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "google", "fsspec", "gcsfs", "s3fs")


def _transient(exc: BaseException) -> bool:
    """An error of the store or the network (retried), not a bug of the caller's (raised as it is)."""
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    return type(exc).__module__.split(".")[0] in _CLIENT_MODULES


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _CutShort):
        return f"the answer ended early: {exc}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {shown(text)[:200]}" if text else type(exc).__name__


def open_store(url: str) -> ObjectStore:
    """The object store at `url` (s3://bucket/prefix, gs://..., any fsspec URL).

    Raises:
        UsageError: no fsspec implementation is installed for the URL's scheme (the message names the package).
    """
    match = _URL.match(url)
    if match is None:
        raise UsageError(f"{shown(url)} is not a URL of object storage (scheme://bucket/prefix)")
    scheme = match.group(1).lower()
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - fsspec comes with huggingface_hub
        raise UsageError("object storage needs fsspec: pip install 'preshard[s3]'") from None
    try:
        fs, root = url_to_fs(url.rstrip("/"), **_client_options(scheme))
    except ImportError:
        extra = _EXTRAS.get(scheme)
        package = extra or f"the fsspec implementation for {scheme}://"
        hint = "pip install 'preshard[s3]'" if extra == "s3fs" else f"pip install {package}"
        raise UsageError(f"{scheme}:// URLs need {package}, which is not installed: {hint}") from None
    except ValueError as exc:
        if "Protocol not known" in str(exc) or scheme not in fsspec.available_protocols():
            raise UsageError(
                f"{scheme}:// is not a storage protocol fsspec knows; use s3://, gs:// or a path"
            ) from None
        raise UsageError(f"{shown(url)} is not a usable URL: {_describe(exc)}") from None
    if _EXTRAS.get(scheme) == "s3fs":
        fs.retries = 1  # s3fs's own loop (a class attribute) would retry what botocore retried already
    return ObjectStore(shown(url.rstrip("/")), fs, str(root).rstrip("/"))


__all__ = ["ObjectStore", "cache_root", "url_key", "is_url", "max_attempts", "open_store", "shown"]
