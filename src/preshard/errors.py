"""User-facing errors.

Every mistake a user can make surfaces as a `PreshardError`: one line that names the problem and the
fix. The CLI prints it and exits with status 2; library callers can catch it.
"""


class PreshardError(ValueError):
    """A problem with the user's input, described in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ChecksumMismatch(PreshardError):
    """A file's bytes do not match the checksum the manifest records."""
