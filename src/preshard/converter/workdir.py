"""The conversion's working folder: an exclusive lock, a journal for resuming, and an atomic commit.

Everything is written into a hidden sibling `.<out>.partial/`, guarded by an exclusive `flock` on
`.<out>.lock` for the whole run (a second conversion into the same output fails at once naming the
first one's pid, or waits; the kernel drops the lock of a process that dies, so no lock goes stale).
A journal records each finished tensor with its chunk checksums and a proof of the source bytes it
came from, once its bytes are durable (batched fsyncs). A re-run of the same job keeps a journalled
tensor only if the source still holds those bytes (the proof, re-derived from the source as it is now)
and its records are intact (re-checked completely, framing and data), and redoes the rest. Only when
every file is complete and fsynced, the manifest written last, is the folder renamed into place: a crash
leaves no output or the previous complete one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from preshard.converter.contained import remove_inside
from preshard.converter.signals import StopFlag, deferred_signals
from preshard.converter.writer import RecordFileWriter
from preshard.errors import (
    CorruptCheckpointError,
    DamagedRecord,
    OutputError,
    OutputExistsError,
    OutputLockedError,
    OutputPermissionError,
)
from preshard.format.layout import ChunkRecord, FileLayout, data_file_name
from preshard.format.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from preshard.format.path_text import check_path_text
from preshard.format.publish import publish_folder
from preshard.units import human_bytes

JOURNAL_NAME = "journal.jsonl"
JOB_NAME = "job.json"


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def lock_path(output: Path) -> Path:
    return output.parent / f".{output.name}.lock"


@dataclass(frozen=True)
class OutputKind:
    """What a command writes, so that `--overwrite` replaces only that and never a folder of something else."""

    noun: str
    recognise: Callable[[Path], bool]


def _is_checkpoint(folder: Path) -> bool:
    """A folder whose manifest.json says it is a preshard manifest (any version: a v1 checkpoint is replaceable)."""
    path = folder / MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        return False
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT


def _is_safetensors_folder(folder: Path) -> bool:
    entries = list(folder.iterdir())
    return any(e.name.endswith(".safetensors") for e in entries) and all(
        e.is_file() and not e.is_symlink() and e.name.endswith((".safetensors", ".json")) for e in entries
    )


CHECKPOINT = OutputKind(f"a preshard checkpoint (it has no preshard {MANIFEST_NAME})", _is_checkpoint)
SAFETENSORS_FOLDER = OutputKind(
    "a safetensors checkpoint (only *.safetensors and *.json files)", _is_safetensors_folder
)


def check_output(output: Path, source_paths: list[Path], overwrite: bool, kind: OutputKind = CHECKPOINT) -> Path:
    """The output folder to write, resolved; refuse what cannot work before anything is written.

    Args:
        kind: what the command writes; an existing non-empty output is replaced only if it is one of these.

    Raises:
        OutputError: the output is a file, overlaps the source, exists without `overwrite` (or with it, but is not
            of `kind`), is or holds the current directory, is a symlink, or its parent folder is missing.
    """
    given = output
    check_path_text(given, "output", OutputError)
    cwd = Path.cwd().resolve()
    if str(given) in ("", ".", "..") or Path(given).resolve() == cwd:
        raise OutputError(f"output {given} is the current folder; name a new folder for the converted checkpoint")
    if Path(given).resolve() in cwd.parents:
        raise OutputError(
            f"output {given} holds the current folder, which replacing it would delete; name a new folder"
        )
    if output.is_symlink():
        raise OutputError(f"output {given} is a symbolic link; pass the real folder it points to, or a new path")
    if output.exists() and not output.is_dir():
        raise OutputError(f"output {given} is a file; pass a directory path for the converted checkpoint")
    base = existing_ancestor(output)  # missing parents are created when writing begins (`make_parents`)
    if not base.is_dir():
        raise OutputError(f"{base} is a file, so {given} cannot be made under it; pass another output path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputPermissionError(
            f"cannot write in {base} (permission denied); pick an output folder this user can write to"
        )
    out = output.resolve()
    for source in source_paths:
        source = source.resolve()
        if out == source or out in source.parents or source in out.parents:
            raise OutputError(f"output {given} overlaps the source {source}; write the conversion elsewhere")
    if output.exists() and any(output.iterdir()):
        if not kind.recognise(output):  # --overwrite would refuse it too: never suggest it
            raise OutputExistsError(
                f"output {given} already exists and is not {kind.noun}; --overwrite replaces only that: "
                "remove the folder yourself or name a new one"
            )
        if not overwrite:
            raise OutputExistsError(f"output {given} already exists; pass --overwrite to replace it")
    return out


def existing_ancestor(path: Path) -> Path:
    """`path`'s parent if it exists, else the nearest ancestor that does (what a missing output is made in)."""
    base = Path(os.path.abspath(path)).parent
    while not base.exists() and base != base.parent:
        base = base.parent
    return base


def make_parents(output: Path) -> None:
    """Create the output's missing parent folders (`mkdir -p`), once the checks passed and writing begins."""
    output.parent.mkdir(parents=True, exist_ok=True)


def check_space(output: Path, work: Path, needed: int) -> None:
    """Refuse up front when the output's file system cannot hold the conversion (what a partial holds counts).

    Raises:
        OutputError: naming what is needed and what is free.
    """
    present = sum(f.stat().st_size for f in work.glob("*.distcp")) if work.is_dir() else 0
    base = existing_ancestor(output)
    stat = os.statvfs(base)
    free = stat.f_bavail * stat.f_frsize
    missing = needed - present
    if missing > free:
        raise OutputError(
            f"the conversion needs {human_bytes(missing)} more on the file system of {base}, which has "
            f"{human_bytes(free)} free; free space or write elsewhere"
        )


# When the lock is taken but its holder's pid cannot be read yet (it has locked but not yet written it, or the
# file still names a process that died), look again for up to this long before naming no one.
HOLDER_READ_S = 1.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_holder(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file, once it names a live process ("unknown" if never)."""
    deadline = time.monotonic() + HOLDER_READ_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit() and _pid_alive(int(text)):
            return text
        if time.monotonic() >= deadline:
            return "unknown"
        time.sleep(0.01)


class OutputLock:
    """An exclusive `flock` on `.<out>.lock` beside the output, held for the whole conversion.

    The kernel drops the lock when its holder exits or dies, so a lock left by a killed conversion is simply
    taken over. The holder writes its pid into the file, so a second conversion can name it; on release the
    holder unlinks the file while still holding it, and a waiter that then wins the unlinked file sees the
    inode change and locks the file that now stands at the path instead. That re-check makes unlinking a lock
    file nobody holds safe too, which is how a conversion stopped by a signal halfway into taking the lock
    cleans up after itself.
    """

    def __init__(self, output: Path, wait: bool = False) -> None:
        self.path = lock_path(output)
        self.output = output
        self.wait = wait
        self.fd = -1

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputError(
                    f"the lock file {self.path} is a symbolic link; remove it (preshard creates it itself)"
                ) from None
            raise

    def __enter__(self) -> OutputLock:
        """Take the lock (waiting for it when `wait`).

        Raises:
            OutputError: another process holds it (naming its pid), or the lock file is a symbolic link.
        """
        try:
            while True:
                fd = self._open()
                try:
                    if self._lock(fd):
                        self.fd = fd
                except BaseException:  # refused, or a signal while waiting
                    self._drop(fd)
                    raise
                if self.fd >= 0:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    return self
                os.close(fd)  # the holder removed the file as we waited on it: lock the one at the path now
        except BaseException:  # a signal can land anywhere here: leave no lock file that nobody holds
            if self.fd >= 0:
                self._drop(self.fd)
            else:
                self._remove_unheld()
            raise

    def _remove_unheld(self) -> None:
        """Unlink the lock file if nobody holds it (one we created just before a signal stopped us)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        self._drop(fd)

    def _lock(self, fd: int) -> bool:
        """Lock `fd`; False when the file was unlinked meanwhile (by a holder releasing it)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise OutputLockedError(
                f"another conversion (pid {_read_holder(fd)}) is writing {self.output}; wait for it to finish, "
                "or pass --wait"
            ) from None
        try:
            return os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return False

    def _drop(self, fd: int) -> None:
        """Close `fd`, first unlinking the lock file if this process holds (or can take) its lock."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds if we hold it or nobody does
            if os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)
            self.fd = -1

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:  # unlinked while still held, so a waiter notices (see __enter__); no lock file is left
            self._drop(self.fd)


def open_workdir(work: Path, job: str) -> bool:
    """Make sure `work` exists for `job`; True when it holds an earlier run of the same job to resume."""
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        remove_inside(work.parent, work)  # the one helper every removal goes through (`converter/contained.py`)
    if work.is_dir():
        try:
            same = json.loads((work / JOB_NAME).read_text()).get("job") == job
        except (OSError, ValueError, AttributeError):
            same = False
        if same:
            return True
        remove_inside(work.parent, work)
    work.mkdir()
    (work / JOB_NAME).write_text(json.dumps({"job": job}))
    return False


def read_journal(work: Path) -> list[dict]:
    """The journal's complete lines (a line cut short by a crash, and everything after it, is dropped)."""
    try:
        text = (work / JOURNAL_NAME).read_text()
    except OSError:
        return []
    entries = []
    for line in text.split("\n")[:-1]:  # the last element is "" after a complete line, a fragment otherwise
        try:
            entry = json.loads(line)
        except ValueError:
            break
        if not isinstance(entry, dict):
            break
        entries.append(entry)
    return entries


class Journal:
    """Appends one line per finished tensor, each line flushed and fsynced."""

    def __init__(self, work: Path, keep_lines: int) -> None:
        path = work / JOURNAL_NAME
        lines = path.read_text().split("\n")[:keep_lines] if path.exists() else []
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        self.file = open(path, "a")

    def append(self, entries: list[dict]) -> None:
        if entries:
            self.file.write("".join(json.dumps(e) + "\n" for e in entries))
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def commit(work: Path, output: Path) -> None:
    """Put the finished folder in place (`format/publish.publish_folder`): a crash leaves the old or the new
    checkpoint at `output`, never a mix; the old one is then removed."""
    publish_folder(work, output)


def open_writers(
    work: Path, tp: int, done: dict[str, list[ChunkRecord]], check_stop: Callable[[], None] | None = None
) -> dict[int, RecordFileWriter]:
    """One writer per rank file, each adopting (and re-checking, framing and data) the records of `done`;
    `check_stop` is called between records, so a signal stops a long re-check.

    Raises:
        DamagedRecord: a kept record does not match what the journal says was written.
    """
    writers = {r: RecordFileWriter(work / data_file_name(r)) for r in range(tp)}
    kept: dict[str, list[ChunkRecord]] = {data_file_name(r): [] for r in range(tp)}
    for chunks in done.values():
        for c in chunks:
            kept[c.file].append(c)
    try:
        for r, writer in writers.items():
            records = sorted(kept[data_file_name(r)], key=lambda c: c.offset)
            try:
                writer.keep(records, check_stop)
            except CorruptCheckpointError as exc:  # the writer stands at the end of the last intact record
                bad = next(c for c in records if c.offset == writer.position)
                raise DamagedRecord(str(exc), bad.tensor) from None
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    return writers


def resume(
    work: Path,
    write_order: list[str],
    files: FileLayout,
    tp: int,
    check_stop: Callable[[], None] | None = None,
    prove: Callable[[list[tuple[str, str | None]], Callable[[], None] | None], int] | None = None,
) -> tuple[dict[str, list[ChunkRecord]], dict[int, RecordFileWriter]]:
    """The journalled tensors that are still intact (a prefix of the write order, every record re-checked) and
    still what the source holds, and writers positioned right after them: a damaged record, a tensor whose source
    bytes changed, and everything written after either is redone.

    Args:
        prove: `prove([(tensor, journalled source proof), ...], check_stop)` says how many leading tensors the
            source proves unchanged (`SourceRows.prove`); without it nothing is kept.
    """
    done: dict[str, list[ChunkRecord]] = {}
    proofs: list[tuple[str, str | None]] = []
    for name, entry in zip(write_order, read_journal(work)):
        planned = files.chunks[name]
        sums = entry.get("chunks")
        if entry.get("tensor") != name or not isinstance(sums, list) or len(sums) != len(planned):
            break
        if not all(isinstance(s, str) for s in sums):
            break
        done[name] = [
            ChunkRecord(c.tensor, c.owner, c.box, c.file, c.offset, c.framing, s) for c, s in zip(planned, sums)
        ]
        source = entry.get("source")
        proofs.append((name, source if isinstance(source, str) else None))
    proven = prove(proofs, check_stop) if prove is not None and proofs else 0
    done = {name: done[name] for name, _ in proofs[:proven]}
    while True:
        try:
            return done, open_writers(work, tp, done, check_stop)
        except DamagedRecord as exc:
            names = list(done)
            done = {n: done[n] for n in names[: names.index(exc.tensor)]}


@contextlib.contextmanager
def fresh_workdir(
    output: Path, inputs: list[Path], *, overwrite: bool, wait: bool, kind: OutputKind = CHECKPOINT
) -> Iterator[tuple[Path, StopFlag]]:
    """For writers with nothing to resume (relinking, unsharding): the output checked and locked, signals deferred,
    an empty partial folder; the body fills it and calls `commit`. On any failure the partial folder is removed.

    Raises:
        OutputError: as `check_output`, or the output is locked by another run (without `wait`).
    """
    check_output(output, inputs, overwrite, kind)
    make_parents(output)
    with OutputLock(output, wait=wait), deferred_signals() as stop:
        stop.check()  # a signal that came before, its exception swallowed: stop before writing
        check_output(output, inputs, overwrite, kind)  # again, now that we hold the lock
        work = partial_dir(output)
        remove_inside(work.parent, work)
        work.mkdir()
        try:
            yield work, stop
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
