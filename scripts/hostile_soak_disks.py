"""Hostile soak, full disks (issue 36): class `fulldisks`.

The output goes to a small tmpfs (`mount -t tmpfs -o size=4m`, as root; where mounting is not permitted the class
has no cases and says so) that another writer fills right after preshard's up-front free-space check passed, leaving
a third of what the command needs (a pipeline's copies, which have no check: just before the first copy): the
write runs out of space mid-way. A conversion of a single checkpoint and of a pipeline folder, a reshard to another
TP degree and an unshard each must fail with one line naming the full disk and the fix, commit
no output, and succeed once the space is freed (the conversion resuming from its partial folder, which it keeps).

Run: `python scripts/hostile_soak.py --classes fulldisks` (as root).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import crash_soak
from hostile_soak import Case, Soak, build_checkpoint, one_line, run_cli

DISK_BYTES = 4 << 20


@contextlib.contextmanager
def small_disk(folder: Path, size: int = DISK_BYTES) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `folder/disk` for the block; unmounted after."""
    disk = folder / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True, capture_output=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False, capture_output=True)


def mount_permitted(folder: Path) -> bool:
    """Whether this process may mount a tmpfs (root in a container that allows it)."""
    probe = folder / "mount-probe"
    probe.mkdir(exist_ok=True)
    try:
        with small_disk(probe, 1 << 20):
            return True
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError):
        return False


@contextlib.contextmanager
def filled_after_check(disk: Path, targets: list[tuple[object, str]]) -> Iterator[Path]:
    """Each free-space check in `targets` (module, function name) runs on the disk as it was (the filler of an
    earlier check removed first), then the disk is filled to leave a third of what the check was asked for, at
    most 8 KiB: after the command's last check, the data it writes runs out of space mid-way. Yields the filler
    file, which the caller removes to free the space."""
    filler = disk / "filler"
    saved = [(module, name, getattr(module, name)) for module, name in targets]

    def fill(leave: int) -> None:
        stat = os.statvfs(disk)
        filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))

    def wrap(real: Callable[..., None]) -> Callable[..., None]:
        def check(*args: object) -> None:
            if not isinstance(args[-1], int):  # a copy, not a check: the disk fills before its first copy
                if not filler.exists():
                    fill(8 << 10)
                real(*args)
                return
            filler.unlink(missing_ok=True)
            real(*args)
            fill(min(args[-1] // 3, 8 << 10))

        return check

    for module, name, real in saved:
        setattr(module, name, wrap(real))
    try:
        yield filler
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def _checks() -> list[tuple[object, str]]:
    import preshard.converter.convert as convert
    import preshard.converter.pipeline_folder as pipeline_folder
    import preshard.tools.reshard as reshard
    import preshard.tools.unshard as unshard

    checks = [(convert, "check_space"), (unshard, "check_space"), (reshard, "_check_free")]
    return [*checks, (pipeline_folder, "copy_component")]  # a pipeline's copies (no check of their own)


def full_disk_case(args: Callable[[Path, Path], list[str]], *, resumes: bool) -> Callable[[Path], str | None]:
    """The command `args(folder, out)` into a disk filled mid-write: one line naming the full disk and the fix, no
    committed output; after the filler is removed the same command succeeds (and `verify` passes on what it
    wrote, for the converter's output)."""

    def run(folder: Path) -> str | None:
        with small_disk(folder) as disk:
            out = disk / "out"
            command = args(folder, out)
            with filled_after_check(disk, _checks()) as filler:
                failed = run_cli(*command)
            why = one_line(failed, "disk is full", "free space")
            if why is not None:
                return why
            if out.exists():
                return f"{out.name} was committed on a full disk: {sorted(p.name for p in out.iterdir())}"
            kept = [p.name for p in disk.iterdir() if p.name != "filler"]
            if resumes and not kept:
                return "the conversion kept no partial folder to resume from"
            filler.unlink()
            again = run_cli(*command)
            if again.status != 0:
                return f"the re-run with space freed failed: {again.stderr.strip()[-300:]}"
            if not out.is_dir():
                return "the re-run committed no output"
            if resumes:
                checked = run_cli("verify", out)
                if checked.status != 0:
                    return f"the resumed output does not verify: {checked.stdout.strip()[-300:]}"
        return None

    return run


def _source(folder: Path) -> tuple[Path, Path]:
    source = crash_soak.build_source(folder / "src", blocks=6, width=128, files=2)
    return source, folder / "plan.json"


def _convert(folder: Path, out: Path) -> list[str]:
    source, plan = _source(folder)
    return ["convert", str(source), str(out), "--tp", "2", "--plan", str(plan), "--quiet"]


def _reshard(folder: Path, out: Path) -> list[str]:
    _, _, checkpoint = build_checkpoint(folder / "ck1", tp=1)
    return ["reshard", str(checkpoint), str(out), "--tp", "2", "--no-progress"]


def _unshard(folder: Path, out: Path) -> list[str]:
    _, _, checkpoint = build_checkpoint(folder / "ck2", tp=2)
    return ["unshard", str(checkpoint), str(out), "--no-progress"]


def _pipeline(folder: Path, out: Path) -> list[str]:
    from hostile_soak_pipelines import safetensors_bytes, write_pipeline

    vae = {"config.json": b"{}", "diffusion_pytorch_model.safetensors": safetensors_bytes(1 << 19)}  # 2 MiB
    source = write_pipeline(folder / "pipe", extra={"vae": vae})
    return ["convert", str(source), str(out), "--tp", "2", "--quiet"]


def fulldisk_cases(soak: Soak) -> list[Case]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="soak-mount-") as probe:
        if not mount_permitted(Path(probe)):
            print("fulldisks: mounting a tmpfs is not permitted here (run as root): no cases")
            return []
    return [
        Case("fulldisks", "convert-single-checkpoint", full_disk_case(_convert, resumes=True)),
        Case("fulldisks", "reshard-tp1-to-tp2", full_disk_case(_reshard, resumes=False)),
        Case("fulldisks", "unshard", full_disk_case(_unshard, resumes=False)),
        Case("fulldisks", "convert-pipeline-folder", full_disk_case(_pipeline, resumes=False)),
    ]


CASES: dict[str, Callable[[Soak], list[Case]]] = {"fulldisks": fulldisk_cases}
