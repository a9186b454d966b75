"""User-facing errors.

Every mistake a user can make surfaces as a `PreshardError`: one line that names the problem and the
fix. The CLI prints it and exits with status 2; library callers can catch the base class or one of
the subclasses below when they want to react to one kind of problem.
"""

from __future__ import annotations


class PreshardError(ValueError):
    """A problem with the user's input, described in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class UsageError(PreshardError):
    """An argument or option that cannot work (a mesh size of 0, an unknown dtype or device name)."""


class SourceError(PreshardError):
    """The source checkpoint is missing, malformed, or changed while it was being converted."""


class PlanError(PreshardError):
    """A sharding plan that is malformed, matches nothing, or cannot shard this model at this TP degree."""


class OutputError(PreshardError):
    """The output path cannot be written: it exists, overlaps the source, is locked, or the disk is too small."""


class CorruptCheckpointError(PreshardError):
    """A converted checkpoint is incomplete, damaged or edited: its files disagree with its manifest."""


class ChecksumMismatch(CorruptCheckpointError):
    """A file's or chunk's bytes do not match the checksum the manifest records."""


class MismatchError(PreshardError):
    """The model, its config, or the running job disagrees with the checkpoint (tensors, shapes, world size)."""


class DeviceError(PreshardError):
    """The requested device or backend is not available, or the launch does not fit it."""


class WorkerError(PreshardError):
    """A process of a parallel conversion died or could not be reached (the finished part is kept)."""


class Interrupted(PreshardError):
    """SIGINT or SIGTERM stopped a conversion at a safe point; re-running the same command resumes it."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.signal_number = signal_number


class ResourceError(PreshardError):
    """The machine ran out of what the command needs (memory, threads): nothing half-written is kept as complete."""

    @classmethod
    def of(cls, exc: BaseException, doing: str) -> ResourceError | None:
        """The one-line form of `exc` when it is the machine running out (MemoryError, a thread that cannot start),
        else None; `doing` says what ran out of it ("converting", "loading")."""
        if isinstance(exc, MemoryError):
            return cls(
                f"out of memory while {doing}; free memory or raise the process's limit (ulimit -v), then re-run"
            )
        if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
            return cls(
                f"cannot start a thread while {doing} (the process's thread or memory limit is reached); raise the "
                "limit (ulimit -u, ulimit -v) or free memory, then re-run"
            )
        return None
