"""`preshard reshard IN OUT --tp N`: a converted checkpoint for another mesh, without the original source.

A TP change re-slices every sharded tensor: the input is read as a conversion source
(`preshard.sources.presharded`: rows assembled from the chunks, each chunk's framing and checksum checked)
and written by the converter's own writer (`plan_conversion` + `write_conversion`): the same plan (the
input manifest's), the same cast, the same atomic, resumable, locked output. The result is byte for byte
what converting the original source at the new degree gives (only the manifest's `created`,
`derived_from` and digest differ), and its manifest records the original source, so `preshard verify OUT
--source ORIGINAL` compares it with the original bit for bit.

A CP-only change (same TP degree) changes no weight: the data files, `.metadata` and `config.json` are
hard-linked where the file system allows (else copied) and only the manifest is written anew, for the new
mesh. Hard links share the input's bytes: preshard never modifies a file in place (a conversion into an
existing folder writes new files and swaps the folder), so neither checkpoint can change the other.
What is linked or copied is the file itself, never a symbolic link: a Hub checkpoint's snapshot folder is
made of links into the HF cache (relative ones, which would not resolve from the output), so each is
resolved first, within the input folder or the cache (`preshard.format.folder`), and the output stands on
its own when the cache is removed. `config.json` is linked only once it matches the manifest's record of it,
`.metadata` once it matches its record (an input written before manifests recorded it gets a `.metadata`
written afresh from the manifest, and the output records it).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from preshard.converter.convert import plan_conversion, resolve_mesh, space_needed, write_conversion
from preshard.converter.parallel import run_workers
from preshard.converter.workdir import check_output, commit, fresh_workdir
from preshard.errors import CorruptCheckpointError, OutputError, UsageError
from preshard.format.dcp_metadata import write_dcp_metadata
from preshard.format.jsonio import fsync_file, write_json_atomic
from preshard.format.manifest import DCP_METADATA_NAME, MANIFEST_NAME, FileRecord, Manifest, created_now
from preshard.format.mesh import MeshSpec
from preshard.format.plan import Plan
from preshard.plans.model_class import check_cp_plan, is_transformers_config
from preshard.sources.presharded import PreshardedSource, open_presharded
from preshard.tools.dry_run import WriteDryRun, disk_space, file_names, probe_rates
from preshard.tools.estimate import Work, estimate, input_cached, probe, timed_check
from preshard.units import human_bytes

# errno values for which a hard link cannot be made here and the file is copied instead
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


def reshard_checkpoint(
    input: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    workers: int = 1,
    on_tensor: Callable[[str], None] | None = None,
) -> Manifest:
    """Write `input` (a converted checkpoint) resharded for another mesh into `output`; the source is not needed.

    Args:
        input: a converted checkpoint folder, or a Hub repo id of one (a local path of the same spelling wins).
        output: the folder to create, atomically (it appears complete or not at all); a re-run resumes.
        mesh: the new mesh; or the keywords: `tp` (default: the input's), `cp` (= Ulysses) or `ring`/`ulysses`,
            `order`. Keywords left out keep the input's value (so `tp=4` alone keeps its CP layout).
        subfolder, revision, token: for a Hub repo.
        overwrite: replace an existing `output` if it is what this command writes (any other folder is refused).
        wait: wait for another conversion into `output` to finish instead of failing at once.
        progress: show progress (default: when stderr is a terminal).
        workers: local processes writing the new data files (at most the new TP degree), as for
            `convert_checkpoint`; the output is the same byte for byte. A CP-only change writes no data: ignored.
        on_tensor: as `convert_checkpoint`'s (not called for a CP-only change, which writes no data).

    Returns:
        The manifest written to `output/manifest.json` (with `derived_from` naming `input`).

    Raises:
        PlanError: the plan cannot split the tensors at the new TP degree (the message lists the degrees that work).
        CorruptCheckpointError / ChecksumMismatch: the input is incomplete or damaged (nothing is committed).
        UsageError, OutputError, SourceError, Interrupted: as `convert_checkpoint`.
    """
    source = open_presharded(input, subfolder=subfolder, revision=revision, token=token)
    new_mesh = resolve_mesh(mesh, tp, cp, ring, ulysses, order, default=source.manifest.mesh)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers:
        raise UsageError(f"workers must be a positive integer, not {workers!r}")
    if workers > new_mesh.tp:
        raise UsageError(
            f"--workers {workers} is more than --tp {new_mesh.tp}: each worker writes whole data files, one per TP "
            f"rank; use --workers {new_mesh.tp} or fewer"
        )
    output = Path(output)
    if new_mesh.tp == source.manifest.tp:
        # The data stay; only the CP layout can be new, and it needs a CP plan somewhere (the plan's or the class's):
        # known to exist where the input already has CP (its conversion checked), else checked here.
        if source.manifest.mesh.cp == 1:
            check_cp_plan(source.manifest.plan, source.config, new_mesh.cp)
        return _relink(source, output, new_mesh, overwrite=overwrite, wait=wait)
    refuse_quantized_at_another_degree(source, new_mesh.tp)
    plan: Plan | None = source.manifest.plan
    if is_transformers_config(source.config) and plan is not None and plan.name.endswith(".inferred"):
        plan = None  # inferred again at the new degree: grouped KV heads are split or kept whole depending on it
    job = plan_conversion(source, mesh=new_mesh, plan=plan, dtype=source.manifest.dtype)
    if workers > 1:
        return run_workers(
            write_conversion, job, output, workers=workers, overwrite=overwrite, wait=wait, progress=progress,
            on_tensor=on_tensor,
        )  # fmt: skip
    return write_conversion(job, output, overwrite=overwrite, wait=wait, progress=progress, on_tensor=on_tensor)


def refuse_quantized_at_another_degree(source: PreshardedSource, tp: int) -> None:
    """Raises UsageError when `source` was quantized at conversion: its scales were computed from the source's
    whole rows, which a reshard to another TP degree cannot see again."""
    if source.manifest.quantize is not None:
        raise UsageError(
            f"{source.given} was quantized at conversion (--quantize): reshard it to another TP degree by converting "
            f"the source again with --tp {tp} --quantize (the same model at every degree)"
        )


def reshard_dry_run(
    checkpoint: str | Path,
    output: str | Path,
    *,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    start_seconds: float = 0.0,
) -> WriteDryRun:
    """What `reshard_checkpoint` would do: the new mesh checked against the plan (the degrees that work are named
    otherwise), the output checked, the files it writes, the space and a time estimate; nothing is written.

    Raises:
        As `reshard_checkpoint`, before writing (too little space is in `space_error`).
    """
    source = open_presharded(checkpoint, subfolder=subfolder, revision=revision, token=token)
    manifest = source.manifest
    mesh = resolve_mesh(None, tp, cp, ring, ulysses, order, default=manifest.mesh)
    output = Path(output)
    inputs = [source.folder / f.name for f in manifest.files]
    input_bytes = sum(f.size for f in manifest.files)
    if mesh.tp != manifest.tp:
        refuse_quantized_at_another_degree(source, mesh.tp)
    if mesh.tp == manifest.tp:
        if manifest.mesh.cp == 1:
            check_cp_plan(manifest.plan, source.config, mesh.cp)
        check_output(output, source.input_paths(), overwrite)
        needed = 1 << 20  # a manifest; the data files are linked (copied where the file system cannot link)
        free, space_error = disk_space(output, needed)
        measured = estimate(Work(0, 0, 0, 0, 0), probe(None, None), start_seconds=start_seconds)
        notes = [f"the same TP degree: the data files ({human_bytes(input_bytes)}) are hard-linked, not written"]
        return WriteDryRun(
            "reshard", str(checkpoint), output, mesh, [], True, needed, free, space_error, measured, notes
        )
    job, check_s = timed_check(plan_conversion, source, mesh=mesh, plan=manifest.plan, dtype=manifest.dtype)
    check_output(output, source.input_paths(), overwrite)
    needed = space_needed(job)
    free, space_error = disk_space(output, needed)
    files = [(name, size) for name, size in zip(file_names(mesh.tp), job.files.file_sizes)]
    work = Work.conversion(input_bytes, input_cached(inputs), job.output_bytes)
    measured = estimate(
        work, probe_rates(inputs, output, space_error), start_seconds=start_seconds, check_seconds=check_s
    )
    return WriteDryRun("reshard", str(checkpoint), output, mesh, files, False, needed, free, space_error, measured)


def _relink(source: PreshardedSource, output: Path, mesh: MeshSpec, *, overwrite: bool, wait: bool) -> Manifest:
    """Same TP degree: link (or copy) the data, write a manifest for `mesh`, commit atomically."""
    from preshard import __version__

    manifest = source.manifest
    names = [f.name for f in manifest.files]
    metadata = manifest.metadata
    if metadata is not None:
        _check_metadata(source)
        names.append(DCP_METADATA_NAME)
    if manifest.config is not None:
        names.append(manifest.config.name)  # matched its record when the source was opened
    with fresh_workdir(output, source.input_paths(), overwrite=overwrite, wait=wait) as (work, stop):
        identity = source.identity()
        linking = True
        for i, name in enumerate(names):
            real = source.files.resolve(name)  # the file itself: a link in the input may not resolve from the output
            if linking:
                linking = _link(real, work / name)
                if not linking:  # this file system cannot link them: copy all that is left, if it fits
                    _check_free(output, sum(source.files.size(n) for n in names[i:]))
            if not linking:
                shutil.copyfile(real, work / name, follow_symlinks=False)
                fsync_file(work / name)
            stop.check()
        if metadata is None:  # an input from before manifests recorded .metadata: written afresh, and recorded
            metadata = FileRecord.of(DCP_METADATA_NAME, write_dcp_metadata(work, manifest))
        source.check_unchanged(identity)
        new = manifest.with_mesh(
            mesh, derived_from=source.derived_from, preshard_version=__version__, created=created_now(),
            metadata=metadata,
        )  # fmt: skip
        write_json_atomic(work / MANIFEST_NAME, new.to_dict())
        stop.check()
        commit(work, output)
    return new


def _check_metadata(source: PreshardedSource) -> None:
    """The input's `.metadata` matches the manifest's record of it (read inside the input folder).

    Raises:
        CorruptCheckpointError: it is missing, out of bounds, not a regular file, or differs.
    """
    record = source.manifest.metadata
    try:
        raw = source.files.read_bytes(DCP_METADATA_NAME, limit=record.size + 1)
    except FileNotFoundError:
        raw = None
    if raw is None or not record.matches(raw):
        raise CorruptCheckpointError(
            f"{source.given}: {DCP_METADATA_NAME} is missing or differs from the one written with the checkpoint; "
            "restore it, or convert again"
        )


def _link(src: Path, dst: Path) -> bool:
    """Hard-link the file `src` (a resolved path, never a symlink) to `dst`; False where this file system cannot."""
    try:
        os.link(src, dst, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return False
        raise


def _check_free(output: Path, needed: int) -> None:
    stat = os.statvfs(output.parent)
    free = stat.f_bavail * stat.f_frsize
    if needed > free:
        raise OutputError(
            f"{output.parent} cannot hard-link the input's files and has {human_bytes(free)} free for a copy of "
            f"{human_bytes(needed)}; free space or write elsewhere"
        )


__all__ = ["reshard_checkpoint", "reshard_dry_run"]
