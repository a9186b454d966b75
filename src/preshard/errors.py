"""User-facing errors.

Every mistake a user can make surfaces as a `PreshardError`: one line that names the problem and the
fix. The CLI prints it and exits with status 2; library callers can catch the base class, one of the
kinds below, or the builtin category each kind also belongs to, as they would for any Python library:

    PreshardError                                       Exception
    ├── UsageError                                      ValueError
    ├── PlanError                                       ValueError
    ├── SourceError                                     ValueError
    │   ├── SourceNotFoundError                         FileNotFoundError
    │   ├── SourceAccessError                           PermissionError
    │   ├── SourceUnreachableError                      ConnectionError
    │   └── PipelineRepoError                           (a Hub repo asked for as one model is a whole pipeline)
    ├── OutputError                                     ValueError
    │   ├── OutputExistsError                           FileExistsError
    │   ├── OutputPermissionError                       PermissionError
    │   └── OutputLockedError                           BlockingIOError
    ├── CheckpointNotFoundError                         FileNotFoundError
    ├── CorruptCheckpointError                          ValueError
    │   ├── ChecksumMismatch
    │   ├── CheckpointFileMissingError                  FileNotFoundError
    │   └── DamagedRecord                               (internal: a resume catches it and redoes the record)
    ├── MismatchError                                   ValueError
    │   └── InconsistentInputsError                     (the ranks of a sharded model were given other inputs)
    ├── DeviceError                                     RuntimeError
    ├── WorkerError                                     RuntimeError
    ├── ResourceError                                   MemoryError (out of memory, or no thread can start)
    └── Interrupted                                     (SIGINT/SIGTERM; carries the signal number)

    CollectiveRuleViolation                             RuntimeError: a bug, not a user's mistake (no PreshardError)

So `except FileNotFoundError` catches a missing source path, Hub repo or file and a missing checkpoint, and
`except PreshardError` still catches everything preshard raises on purpose. An error of an OSError category
carries only its message (`errno`, `filename` are None): the path is in the message, with the fix.
"""

from __future__ import annotations


class PreshardError(Exception):
    """A problem with the user's input, described in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))

    def __str__(self) -> str:  # OSError's own __str__ would show "None: message" for some argument forms
        return str(self.args[0]) if self.args else ""


class UsageError(PreshardError, ValueError):
    """An argument or option that cannot work (a mesh size of 0, an unknown dtype or device name)."""


class PlanError(PreshardError, ValueError):
    """A sharding plan that is malformed, matches nothing, or cannot shard this model at this TP degree."""


class SourceError(PreshardError, ValueError):
    """The source checkpoint is malformed, or changed while it was being converted."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The source path, Hub repo, revision, or a file the source names does not exist."""


class SourceAccessError(SourceError, PermissionError):
    """A gated or private Hub repo that the token used (or no token) may not read."""


class SourceUnreachableError(SourceError, ConnectionError):
    """The Hub cannot be reached (or HF_HUB_OFFLINE is set) and what is needed is not in the local cache."""


class PipelineRepoError(SourceError):
    """A Hub repo asked for as one model is a diffusers pipeline (its index at the top, no weights there): the
    command line converts it whole instead."""


class OutputError(PreshardError, ValueError):
    """The output path cannot be used: it overlaps the source, is a file or link, or the disk is too small."""


class OutputExistsError(OutputError, FileExistsError):
    """The output exists and --overwrite was not given (or it is not something --overwrite may replace)."""


class OutputPermissionError(OutputError, PermissionError):
    """The output's folder cannot be written by this user."""


class OutputLockedError(OutputError, BlockingIOError):
    """Another conversion holds the output's lock (pass --wait to wait for it)."""


class CheckpointNotFoundError(PreshardError, FileNotFoundError):
    """The converted checkpoint (a folder or Hub repo id) does not exist."""


class CorruptCheckpointError(PreshardError, ValueError):
    """A converted checkpoint is incomplete, damaged or edited: its files disagree with its manifest."""


class ChecksumMismatch(CorruptCheckpointError):
    """A file's or chunk's bytes do not match the checksum the manifest records."""


class ManifestVersionError(CorruptCheckpointError):
    """A manifest of a past or future format version: convert again, or upgrade preshard (verify cannot judge it)."""


class CheckpointFileMissingError(CorruptCheckpointError, FileNotFoundError):
    """A file the checkpoint needs (its manifest, a rank's data file, config.json) is missing."""


class DamagedRecord(CorruptCheckpointError):
    """A record kept from an earlier run is damaged; `tensor` names it (a resume redoes it and what follows)."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class MismatchError(PreshardError, ValueError):
    """The model, its config, or the running job disagrees with the checkpoint (tensors, shapes, world size)."""


class InconsistentInputsError(MismatchError):
    """The ranks of one sharded model were given different inputs (shapes, dtypes or values)."""


class DeviceError(PreshardError, RuntimeError):
    """The requested device or backend is not available, or the launch does not fit it."""


class JobTimeoutError(PreshardError, TimeoutError):
    """A rank of the job did not join within the time allowed (killed, crashed or still starting)."""


class WorkerError(PreshardError, RuntimeError):
    """A process of a parallel conversion died or could not be reached (the finished part is kept)."""


class Interrupted(PreshardError):
    """SIGINT or SIGTERM stopped a conversion at a safe point; re-running the same command resumes it."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.signal_number = signal_number


class ResourceError(PreshardError, MemoryError):
    """The machine ran out of what the command needs (memory, threads): nothing half-written is kept as complete."""

    @classmethod
    def of(cls, exc: BaseException, doing: str) -> ResourceError | None:
        """The one-line form of `exc` when it is the machine running out (MemoryError, a thread that cannot start),
        else None; `doing` says what ran out of it ("converting", "loading"). A ResourceError is itself (it is a
        MemoryError too, and may already say that a thread could not start)."""
        if isinstance(exc, ResourceError):
            return exc
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


class ObjectStoreError(PreshardError, ValueError):
    """An object of a checkpoint or source in object storage (s3://, gs://, any fsspec URL) cannot be used."""


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """The object (or bucket) a URL names does not exist."""


class ObjectAccessError(ObjectStoreError, PermissionError):
    """The platform's credentials may not read or write the object."""


class ObjectUnreachableError(ObjectStoreError, ConnectionError):
    """The object store did not answer, or kept failing, after every retry."""


class CollectiveRuleViolation(RuntimeError):
    """A collective that Neuron/XLA would reject (or hang on), caught before it is issued by the rule checker
    (`runtime.collectives.NeuronRuleChecker`): a bug in preshard, so not a PreshardError."""


__all__ = [
    "CheckpointFileMissingError",
    "CheckpointNotFoundError",
    "ChecksumMismatch",
    "CollectiveRuleViolation",
    "CorruptCheckpointError",
    "DamagedRecord",
    "DeviceError",
    "InconsistentInputsError",
    "Interrupted",
    "JobTimeoutError",
    "ManifestVersionError",
    "MismatchError",
    "ObjectAccessError",
    "ObjectNotFoundError",
    "ObjectStoreError",
    "ObjectUnreachableError",
    "OutputError",
    "OutputExistsError",
    "OutputLockedError",
    "OutputPermissionError",
    "PipelineRepoError",
    "PlanError",
    "PreshardError",
    "ResourceError",
    "SourceAccessError",
    "SourceError",
    "SourceNotFoundError",
    "SourceUnreachableError",
    "UsageError",
    "WorkerError",
]
