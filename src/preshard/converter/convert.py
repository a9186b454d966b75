"""convert_checkpoint: a source checkpoint -> per-TP-rank DCP shards + manifest, atomically and resumably.

The whole output layout (every record's file and offset) is derived from the plan and the source headers
before anything is written (`preshard.format.layout`). Then the source is read once, front to back, in
bands, through a pipeline (`pipeline`): a reader thread reads ahead, the bands are cut into pieces
(`preshard.format.slicing`), and one writer thread per data file stages, hashes and writes them
(`writer`). With `workers > 1`, or under torchrun (`parallel`), the data files are divided among
processes that each read only what their files need; the lowest rank journals and commits. The working
folder, lock, journal and commit are `workdir`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from preshard.converter.parallel import Coordinator, active_coordinator, owned_files, run_workers
from preshard.converter.pipeline import TensorWork, WritePipeline
from preshard.converter.signals import StopFlag, deferred_signals
from preshard.converter.workdir import (
    JOURNAL_NAME,
    Journal,
    OutputLock,
    check_output,
    check_space,
    commit,
    make_parents,
    open_workdir,
    partial_dir,
    resume,
)
from preshard.converter.writer import RecordFileWriter, stage_bytes
from preshard.errors import MismatchError, PreshardError, ResourceError, UsageError
from preshard.format import slicing
from preshard.format.dcp_metadata import dcp_metadata_bytes, write_dcp_metadata
from preshard.format.dtypes import DType, dtype_name, parse_cast
from preshard.format.jsonio import dumps_indented, fsync_file
from preshard.format.layout import ChunkRecord, FileLayout, TensorLayout, data_file_name, place_records
from preshard.format.locate import is_url
from preshard.format.manifest import (
    CONFIG_NAME,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    TensorRecord,
    created_now,
    read_manifest,
)
from preshard.format.mesh import MeshSpec, resolve_mesh
from preshard.format.plan import Plan, resolve_plan
from preshard.format.publish import publish_text
from preshard.format.quant import parse_quantize
from preshard.format.torch_record import RECORD_FRAMING_VERSION
from preshard.plans.model_class import (
    check_model_class,
    class_spec_of,
    import_class_spec,
    is_transformers_config,
    user_model_class,
)
from preshard.plans.registry import choose_plan, vouched_for
from preshard.progress import Progress, note, showing
from preshard.sources import ConversionSource, SourceRows, open_source

# Journal (so fsync) about 64 times per conversion, but no more often than every 512 MiB: each fsync also flushes the
# device's write cache (64 of them took a third of a 4.3 GB conversion on a virtual disk); a crash loses at most that.
SYNC_MIN_BYTES, SYNC_ROUNDS = 512 << 20, 64


@dataclass(frozen=True)
class ConversionPlan:
    """Everything decided before writing: source, plan, mesh, cast, every tensor's layout and every record's place."""

    source: ConversionSource
    plan: Plan
    mesh: MeshSpec
    cast: DType | None
    layouts: dict[str, TensorLayout]
    files: FileLayout
    write_order: list[str]
    quantize: str | None = None  # --quantize: the stored dtype of the weights quantized at conversion
    model_class: str | None = None  # --model-class: the user's own class, as `module:Class` (recorded, never imported)

    @property
    def output_bytes(self) -> int:
        return sum(self.files.file_sizes)

    @functools.cached_property
    def band_bytes(self) -> int:
        """The band size: `slicing.BAND_BYTES`, but no more than a quarter of the largest tensor (at least 1 MiB),
        so that the bands in flight and their buffers stay about the size of the largest tensor, however small.
        Computed once (a max over every tensor: asked once per tensor, it made planning quadratic)."""
        largest = max((layout.shape_bytes(source=True) for layout in self.layouts.values()), default=0)
        return min(slicing.BAND_BYTES, max(1 << 20, largest // 4))


@dataclass
class ConversionOutcome:
    """What a conversion found and did, for a caller that reports it (the CLI's summary line and --json): pass one
    to `convert_checkpoint(outcome=...)`, which fills it in."""

    status: str = "converted"  # "converted", "resumed" (an interrupted run's records kept) or "already converted"
    kept_tensors: int = 0  # resumed: the tensors kept from the earlier run, every record re-checked
    kept_bytes: int = 0  # resumed: the bytes of their records (not written again)
    details: dict[str, Any] = field(default_factory=dict)

    def record_kept(self, done: dict[str, list[ChunkRecord]]) -> None:
        if done:
            self.status = "resumed"
            self.kept_tensors = len(done)
            self.kept_bytes = sum(c.framing.length for chunks in done.values() for c in chunks)


def _lora_records(source: Any) -> list[dict[str, Any]]:
    """The LoRAs a source fuses (`preshard.converter.lora.FusedSource`), as the manifest records them."""
    loras = getattr(source, "loras", None)
    return [lora.to_dict() for lora in loras.records()] if loras is not None else []


def finished_conversion(job: ConversionPlan, output: Path) -> Manifest | None:
    """The manifest in `output` if it already holds exactly this conversion, else None.

    Exactly: the same plan, mesh (TP and CP layout) and cast, LoRAs, config.json, and source bytes: the same file names,
    sizes and headers, then the same xxh3_128 of every source file (one read of the source, cheaper than
    converting); and every data file is there at its recorded size. Anything else (another conversion, a damaged
    or foreign folder) returns None, and the usual output checks decide (`--overwrite` replaces it).
    """
    from preshard.sources.reader import hash_file

    headers = getattr(job.source, "files", None)
    if not (output / MANIFEST_NAME).is_file() or headers is None:
        return None
    try:
        manifest = read_manifest(output)
    except (PreshardError, OSError):
        return None
    recorded = {f.name: f for f in manifest.source.files}
    if (
        manifest.mesh != job.mesh
        or manifest.dtype != job.cast
        or manifest.quantize != job.quantize
        or manifest.model_class != job.model_class
        or manifest.plan.to_dict() != job.plan.to_dict()
        or manifest.derived_from is not None
        or _lora_records(job.source) != [lora.to_dict() for lora in manifest.source.loras]
        or [h.path.name for h in headers] != list(recorded)
        or any((h.size, h.text) != (recorded[h.path.name].size, recorded[h.path.name].header) for h in headers)
    ):
        return None
    config = job.source.config_bytes()
    if (config is None) != (manifest.config is None) or (config is not None and not manifest.config.matches(config)):
        return None
    for f in manifest.files:
        path = output / f.name
        if not path.is_file() or path.stat().st_size != f.size:
            return None
    if any(hash_file(h.path) != recorded[h.path.name].xxh3_128 for h in headers):
        return None
    return manifest


def as_loaded_names(src: ConversionSource) -> ConversionSource:
    """A transformers checkpoint under the names its model's modules have (transformers renames some keys on
    load: `hf_transformers.checkpoint_renames`); the source itself where none differs."""
    from preshard.plans.hf_transformers import checkpoint_renames  # torch and transformers
    from preshard.sources.renamed import RenamedSource

    renames = checkpoint_renames(src.config or {}, list(src.shapes()))
    return RenamedSource(src, renames) if renames else src


def plan_conversion(
    source: str | Path | ConversionSource,
    *,
    mesh: MeshSpec,
    plan: str | Path | Plan | None = None,
    dtype: str | DType | Any | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    check_model: bool = True,
    loras: Iterable[Any] | None = None,
    quantize: str | None = None,
    model_class: str | type | None = None,
) -> ConversionPlan:
    """Resolve source, plan, mesh and layout without writing anything (what a dry run shows).

    `check_model`: also check the plan's attention rules against the model class (which imports diffusers and
    builds the model on the meta device: seconds), unless the plan is a built-in one made for that class
    (`vouched_for`); `convert_checkpoint` does that while it converts instead.
    `loras`: LoRAs to fuse into the weights as they are read (`preshard.converter.lora`).
    `quantize`: "fp8" or "int8": store the plan's sharded Linear weights quantized (`preshard.converter.quantize`).
    `model_class`: the user's own model class (a class, or `module:Class` to import), for a checkpoint of a class
    diffusers does not have (`convert_checkpoint`).
    """
    cast = parse_cast(dtype)
    fmt = parse_quantize(quantize)
    user_class = resolve_model_class(model_class)
    if isinstance(source, (str, Path)):
        src = open_source(source, subfolder=subfolder, revision=revision, token=token)
    else:
        src = source
    if user_class is not None:
        check_model_class(user_class, src.config)
    with user_model_class(user_class):
        return _plan(src, mesh, plan, cast, fmt, token, check_model, loras, user_class)


def resolve_model_class(model_class: str | type | None, progress: bool | None = None) -> type | None:
    """`model_class` as a class: imported where it is a `module:Class` string (`import_class_spec`).

    Raises:
        UsageError: bad syntax, a module or attribute that is not there, not a class.
    """
    if model_class is None or isinstance(model_class, type):
        return model_class
    return import_class_spec(model_class, progress)


def _plan(
    src: ConversionSource,
    mesh: MeshSpec,
    plan: str | Path | Plan | None,
    cast: DType | None,
    fmt: str | None,
    token: str | bool | None,
    check_model: bool,
    loras: Iterable[Any] | None,
    user_class: type | None,
) -> ConversionPlan:
    if is_transformers_config(src.config):
        src = as_loaded_names(src)
    if loras:
        from preshard.converter.lora import with_loras

        src = with_loras(src, loras, token=token)
    chosen = choose_plan(plan, src.config, mesh.tp)
    quantized = None
    if fmt is not None:
        from preshard.converter.quantize import with_quantize

        src = quantized = with_quantize(src, chosen, fmt)
    else:
        from preshard.converter.quantize import with_scale_checks

        src = with_scale_checks(src)
    layouts = resolve_plan(chosen, src.shapes(), mesh.tp, cast=cast, config=src.config or {})
    if quantized is not None:
        layouts = quantized.layouts(layouts)
    if mesh.cp > 1:
        chosen.check_cp_config(src.config)  # from config.json alone: also where the model check is skipped
    if check_model and not vouched_for(chosen, src.config, layouts, mesh.cp):
        from preshard.plans.from_model import check_plan_against_model  # torch and diffusers: plan files only

        note(f"checking the plan {chosen.name} against the model class (built on the meta device)")
        check_plan_against_model(chosen, src.config, mesh.tp, mesh.cp)
    order = src.read_order()
    files = place_records([layouts[name] for name in order], mesh.tp)
    spec = class_spec_of(user_class) if user_class is not None else None
    return ConversionPlan(src, chosen, mesh, cast, layouts, files, order, fmt, model_class=spec)


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    plan: str | Path | Plan | None = None,
    dtype: str | DType | Any | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    workers: int = 1,
    loras: Iterable[Any] | None = None,
    outcome: ConversionOutcome | None = None,
    on_tensor: Callable[[str], None] | None = None,
    quantize: str | None = None,
    model_class: str | type | None = None,
) -> Manifest:
    """Convert a safetensors checkpoint into per-TP-rank DCP shards and a manifest, in `output`.

    Args:
        source: a `.safetensors` file, a diffusers weights folder (with or without `*.safetensors.index.json`),
            or a Hugging Face Hub repo id (a local path of the same spelling wins).
        output: the folder to create. Written atomically: it appears complete or not at all.
        mesh: the TP x CP mesh; or give `tp` (required) and `cp` (= Ulysses degree) or `ring`/`ulysses`, `order`.
        plan: a built-in plan name, a plan JSON file, or a `Plan`; default: from config.json's `_class_name`
            (a built-in plan, else the diffusers class's own `_tp_plan`).
        dtype: cast 16/32/64-bit floating tensors to bf16/fp16/fp32 (a string or torch dtype); default: keep each.
        subfolder, revision, token: for Hub repos (`subfolder` also for a local folder).
        overwrite: replace an existing `output` if it is what this command writes (any other folder is refused).
        wait: wait for another conversion into the same `output` to finish instead of failing at once.
        progress: show progress (default: when stderr is a terminal).
        workers: local processes to convert with (at most `tp`: each writes its share of the data files). The
            output is the same, byte for byte. Under torchrun (`torchrun -m preshard.torchrun_convert`) the
            job's processes are the workers.
        loras: LoRAs to fuse into the weights before slicing: paths (scale 1.0) or `(path, scale)` pairs, applied
            in order; each a local `.safetensors` file or a Hub `org/name[/file]`, in any key format diffusers'
            LoRA loader for the model class reads. Recorded in the manifest's source provenance.
        quantize: "fp8" (float8_e4m3fn) or "int8": store the plan's sharded Linear weights quantized, each with a
            float32 per-output-channel `weight_scale` computed on the whole row (every TP degree stores the same
            model); recorded in the manifest's `quantize`. See docs/quantized.md.
        model_class: the model's class where it is not in diffusers or transformers: the class itself, or
            `"module:Class"` to import (your code: only ever what you name here, never what a config.json names).
            config.json's `_class_name` must name it. Its plan is found as for a diffusers class (its `_tp_plan`,
            else inferred from its modules); recorded in the manifest's `model_class` (a record: `load_sharded`
            takes the class, as for any model). See docs/models-and-plans.md.
        outcome: filled in with what happened: converted, resumed (with what was kept), or already converted (an
            identical finished conversion is in `output`: nothing is written and its manifest is returned, without
            `overwrite`; see `finished_conversion`).
        on_tensor: called with each tensor's name, in write order, once its records are written by this process
            (in each worker process with `workers`); what it raises stops the conversion there, as a crash would
            (the journalled part is kept for a resume). For progress displays and for tests that stop between tensors.

    Returns:
        The manifest written to (or found in) `output/manifest.json`.

    Raises:
        UsageError: a bad mesh, dtype, quantize format or worker count. SourceError: a missing, malformed or
            changing source.
        PlanError: a plan that does not fit the checkpoint or the TP degree. MismatchError: a LoRA that does not
        fit the checkpoint. OutputError: an output that cannot be written (exists, locked, too little disk
        space). Interrupted: SIGINT/SIGTERM (the finished part is kept for a resume). WorkerError: a worker
        process died.
    """
    if is_url(output):  # converted into a local staging folder, then uploaded with the manifest last
        from preshard.converter.object_output import convert_to_url

        if active_coordinator() is not None:
            raise UsageError(
                "under torchrun, convert into a local folder on each host (or run convert-checkpoint without torchrun "
                "to write object storage)"
            )

        def into(staging: Path) -> Manifest:
            return convert_checkpoint(
                source, staging, mesh=mesh, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, plan=plan,
                dtype=dtype, subfolder=subfolder, revision=revision, token=token, overwrite=overwrite, wait=wait,
                progress=progress, workers=workers, loras=loras, outcome=outcome, on_tensor=on_tensor,
                quantize=quantize,
            )  # fmt: skip

        return convert_to_url(into, str(output), overwrite=overwrite)
    coordinator = active_coordinator()
    try:
        user_class = resolve_model_class(model_class, progress)
    except BaseException as exc:
        if coordinator is not None:
            coordinator.fail(exc)
        raise
    with user_model_class(user_class), showing(progress):
        return _convert(
            source, output, mesh=mesh, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, plan=plan, dtype=dtype,
            subfolder=subfolder, revision=revision, token=token, overwrite=overwrite, wait=wait, progress=progress,
            workers=workers, loras=loras, outcome=outcome, on_tensor=on_tensor, quantize=quantize,
            user_class=user_class, coordinator=coordinator,
        )  # fmt: skip


def _convert(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None,
    tp: int | None,
    cp: int | None,
    ring: int | None,
    ulysses: int | None,
    order: str | tuple[str, ...] | None,
    plan: str | Path | Plan | None,
    dtype: str | DType | Any | None,
    subfolder: str | None,
    revision: str | None,
    token: str | bool | None,
    overwrite: bool,
    wait: bool,
    progress: bool | None,
    workers: int,
    loras: Iterable[Any] | None,
    outcome: ConversionOutcome | None,
    on_tensor: Callable[[str], None] | None,
    quantize: str | None,
    user_class: type | None,
    coordinator: Coordinator | None,
) -> Manifest:
    """`convert_checkpoint`, the user's class (if any) imported and in scope."""
    try:
        mesh = resolve_mesh(mesh, tp, cp, ring, ulysses, order)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise UsageError(f"workers must be a positive integer, not {workers!r}")
        if coordinator is not None and workers != 1:
            raise UsageError("under torchrun the job's processes are the workers; drop --workers")
        if workers > mesh.tp:
            raise UsageError(
                f"--workers {workers} is more than --tp {mesh.tp}: each worker writes whole data files, one per "
                f"TP rank; use --workers {mesh.tp} or fewer"
            )
        job = plan_conversion(
            source,
            mesh=mesh,
            plan=plan,
            dtype=dtype,
            subfolder=subfolder,
            revision=revision,
            token=token,
            check_model=False,  # done while converting
            loras=loras,
            quantize=quantize,
            model_class=user_class,
        )
        finished = None if overwrite else finished_conversion(job, Path(output))
    except BaseException as exc:
        if coordinator is not None:
            coordinator.fail(exc)  # so that the other processes stop too
        raise
    outcome = outcome if outcome is not None else ConversionOutcome()
    if finished is not None:
        outcome.status = "already converted"
        return finished
    if workers > 1:
        return run_workers(
            write_conversion, job, Path(output), workers=workers, overwrite=overwrite, wait=wait, progress=progress,
            outcome=outcome, on_tensor=on_tensor,
        )  # fmt: skip
    return write_conversion(
        job, Path(output), overwrite=overwrite, wait=wait, progress=progress, coordinator=coordinator,
        check_model=True, outcome=outcome, on_tensor=on_tensor,
    )  # fmt: skip


def space_needed(job: ConversionPlan) -> int:
    """Bytes the output's file system must have free: the data files, config.json, 1 MiB for manifest and .metadata."""
    return job.output_bytes + len(job.source.config_bytes() or b"") + (1 << 20)


def write_conversion(
    job: ConversionPlan,
    output: Path,
    *,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    coordinator: Coordinator | None = None,
    external_stop: Any = None,
    check_model: bool = False,
    outcome: ConversionOutcome | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> Manifest:
    """Write a planned conversion into `output`, under the output's lock, atomically and resumably.

    With a `coordinator` this process writes its share of the data files and the lowest rank takes the lock,
    journals and commits (see `parallel`). `external_stop()` returning a signal number stops it as that
    signal would (a launcher relays signals this way). `check_model`: check the plan against the model class
    (`check_plan_against_model`) on a thread while converting, and commit only if it passes (not needed for a
    built-in plan made for the checkpoint's class: `vouched_for`). `outcome` (the lowest rank's) is told what a
    resume kept. `on_tensor(name)` is called as each tensor of this process is written (`convert_checkpoint`).
    """
    coord = coordinator or Coordinator()
    with ExitStack() as stack:
        stack.enter_context(_resources_as_errors("converting"))
        error = None
        if coord.rank == 0:
            try:
                check_output(output, job.source.input_paths(), overwrite)
                check_space(output, partial_dir(output), space_needed(job))  # before the lock file: before any write
                make_parents(output)
                stack.enter_context(OutputLock(output, wait=wait))
            except BaseException as exc:
                error = exc
        keys = coord.exchange(_job_key(job), error)
        if len(set(keys)) > 1:
            coord.failed = True  # every process sees the same keys and stops here
            raise MismatchError(
                "the conversion workers planned different conversions (source, plan, mesh or dtype differ); run "
                "every worker with the same arguments on the same source"
            )
        stop = stack.enter_context(deferred_signals())
        stop.check()  # a signal that came before, its exception swallowed (numpy's import does): stop before writing
        check = (
            check_model and coord.rank == 0 and not vouched_for(job.plan, job.source.config, job.layouts, job.mesh.cp)
        )
        background = _Background(check, job)
        conversion = _Conversion(job, output, coord, _stop_check(stop, external_stop, background), overwrite)
        conversion.outcome = outcome
        conversion.on_tensor = on_tensor or _nothing
        return conversion.run(progress)


@contextlib.contextmanager
def _resources_as_errors(doing: str) -> Iterator[None]:
    """Running out of memory or threads (a low `ulimit -v`) is one line, a `ResourceError`, not a traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        resource = ResourceError.of(exc, doing)
        if resource is None:
            raise
        raise resource from None


class _Background:
    """What the lowest rank does on a thread while it converts: check the plan against the model class
    (`check_plan_against_model`: imports diffusers and builds the model on the meta device, seconds of CPU).
    `poll` raises the check's error as soon as it failed; `result` waits for it (watching for a signal)."""

    def __init__(self, check_model: bool, job: ConversionPlan) -> None:
        self._check = (job.plan, job.source.config, job.mesh.tp, job.mesh.cp) if check_model else None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self._check is not None:
            # in this context: the user's model class (`user_model_class`) is seen by the check
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._run,), name="check model", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            from preshard.plans.from_model import check_plan_against_model

            check_plan_against_model(*self._check)
        except BaseException as exc:  # noqa: BLE001 - raised by poll/result in the calling thread
            self._error = exc

    def poll(self) -> None:
        if self._thread is not None and not self._thread.is_alive() and self._error is not None:
            raise self._error

    def result(self, check_stop=None, note: Callable[[str], None] | None = None) -> None:
        """Wait for the check (its error raised here); `note` is told, once, when there is a wait (a long phase that
        would otherwise print nothing: the model check takes 30-60 s on a small host)."""
        self.start()
        if note is not None and self._thread is not None and self._thread.is_alive():
            note("the data is written; waiting for the check of the plan against the model class (diffusers)")
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.1)
            if check_stop is not None:
                check_stop()
        if self._error is not None:
            raise self._error


def _stop_check(stop: StopFlag, external: Any, background: _Background):
    def check() -> None:
        if stop.signal_number is None and external is not None:
            stop.signal_number = external()
        stop.check()
        background.poll()

    check.background = background
    return check


def _job_key(job: ConversionPlan) -> str:
    """What must match for a partial conversion to be resumed (cheap: the source's identity, plan, mesh, cast)."""
    h = hashlib.sha256(job.source.identity().encode())
    h.update(json.dumps(job.plan.to_dict(), sort_keys=True).encode())
    h.update(f"tp={job.mesh.tp}:cast={job.cast}:records={RECORD_FRAMING_VERSION}".encode())
    if job.quantize is not None:  # (also in the source's identity; here so that no reader of the key misses it)
        h.update(f":quantize={job.quantize}".encode())
    if job.model_class is not None:
        h.update(f":model_class={job.model_class}".encode())
    return h.hexdigest()


class _Conversion:
    """One process's part of a conversion, under the output's lock (held by the lowest rank): set up, write
    this process's data files, and (the lowest rank) commit. Every step ends in an exchange with the other
    processes (`Coordinator.exchange`, immediate for a single process), which carries any failure."""

    def __init__(self, job: ConversionPlan, output: Path, coord: Coordinator, check_stop, overwrite: bool) -> None:
        self.job, self.output, self.coord, self.check_stop, self.overwrite = job, output, coord, check_stop, overwrite
        self.work = partial_dir(output)
        self.mine = {data_file_name(r) for r in owned_files(job.mesh.tp, coord.world, coord.rank)}
        self.writers: dict[str, RecordFileWriter] = {}
        self.done: dict[str, list[ChunkRecord]] = {}
        self.sums: dict[str, dict[int, str]] = {}  # the lowest rank: every chunk checksum written, from the points
        self.proofs: dict[str, str] = {}  # the lowest rank: what each tensor was read from (journalled with it)
        self.reader: SourceRows | None = None
        self.journal: Journal | None = None
        self.identity = self.config_bytes = None
        self.outcome: ConversionOutcome | None = None
        self.on_tensor: Callable[[str], None] = _nothing

    def _note(self, text: str) -> None:
        """One line on stderr where progress is shown (`progress=None`: when stderr is a terminal)."""
        if self.progress or (self.progress is None and sys.stderr.isatty()):
            print(text, file=sys.stderr, flush=True)

    def run(self, progress: bool | None) -> Manifest:
        self.progress = progress
        try:
            self._setup()
            gathered = self._write(progress)
        finally:
            if self.journal is not None:
                self.journal.close()
            if self.reader is not None:
                self.reader.close()
            for w in self.writers.values():
                w.abandon()
        return self._commit(gathered)

    def _setup(self) -> None:
        """The lowest rank prepares the working folder (re-checking what an earlier run left, when resuming);
        the others then adopt the records of their files that it kept."""
        job, tp, src = self.job, self.job.mesh.tp, self.job.source
        error = shared = None
        if self.coord.rank == 0:
            try:
                check_output(self.output, src.input_paths(), self.overwrite)  # again, now that we hold the lock
                self.config_bytes = src.config_bytes()
                check_space(self.output, self.work, space_needed(job))
                self.identity = src.identity()
                open_workdir(self.work, _job_key(job))  # another job's partial is cleared: nothing to resume
                if (self.work / JOURNAL_NAME).is_file():  # seconds to minutes: every kept record re-read
                    self._note("resuming: re-checking what the interrupted run wrote (every kept record re-read)")
                self.reader = src.open_reader()  # first: it proves (re-reading) what the journal may keep
                done, opened = resume(
                    self.work, job.write_order, job.files, tp, self.check_stop, prove=self.reader.prove
                )
                for r, w in opened.items():
                    if data_file_name(r) in self.mine:
                        self.writers[data_file_name(r)] = w
                    else:
                        w.abandon()
                shared = {name: [c.xxh3_64 for c in chunks] for name, chunks in done.items()}
                if self.outcome is not None:
                    self.outcome.record_kept(done)
            except BaseException as exc:
                error = exc
        shared = self.coord.exchange(shared, error)[0]
        self.done = {
            name: [_with_checksum(c, s) for c, s in zip(job.files.chunks[name], sums)] for name, sums in shared.items()
        }
        error = None
        try:
            if self.coord.rank != 0:
                self.writers = _adopt(self.work, self.done, self.mine)
            for w in self.writers.values():
                w.resize_stage(stage_bytes(len(self.writers)))
            if self.reader is None:
                self.reader = src.open_reader()
            if self.coord.rank == 0:
                self.journal = Journal(self.work, keep_lines=len(self.done))
        except BaseException as exc:
            error = exc
        self.coord.exchange(None, error)

    def _write(self, progress: bool | None) -> list:
        """Every process writes its files through the pipeline; returns every process's file checksums and
        source hashes."""
        job, done, coord = self.job, self.done, self.coord
        hashed = _hashed_here(job, self.reader, coord, done)
        points = _sync_points(job, done)

        def exchange(point: int, checksums: dict, failure: BaseException | None) -> list:
            # With the source proofs of what this process read whole since the last point (see SourceReader).
            return coord.exchange((checksums, self.reader.take_proofs()), failure)

        def claim(point: int, gathered: list) -> None:
            for part, proofs in gathered:
                for name, by_position in part.items():
                    self.sums.setdefault(name, {}).update(by_position)
                self.proofs.update(proofs)
            if self.journal is not None:
                low = points[point - 1] + 1 if point else 0
                names = [n for n in job.write_order[low : points[point] + 1] if n not in done]
                chunks = {n: [self.sums[n][i] for i in range(len(job.files.chunks[n]))] for n in names}
                proofs = {n: self.proofs.pop(n, None) for n in names}
                self.journal.append([{"tensor": n, "chunks": chunks[n], "source": proofs[n]} for n in names])

        mine = [c for chunks in job.files.chunks.values() for c in chunks if c.file in self.mine]
        kept = sum(c.framing.length for chunks in done.values() for c in chunks if c.file in self.mine)
        shown = progress if coord.rank == 0 else False  # the lowest rank shows its own share
        bar = Progress(sum(c.framing.length for c in mine), "converting", shown, initial=kept)
        error = payload = None
        try:
            pipeline = WritePipeline(
                start_band=self.reader.start_band,
                finish_band=self.reader.finish_band,
                writers=self.writers,
                work=_tasks(job, self.reader, done, self.mine, hashed, self.check_stop),
                points=points,
                exchange=exchange,
                journal=claim,
                on_tensor=self.on_tensor,
                on_bytes=bar.update,
                check_stop=self.check_stop,
                band_bytes=job.band_bytes,
            )
            self.check_stop.background.start()
            pipeline.run()
            del pipeline  # its buffers, before the commit
            checksums = {name: w.close() for name, w in sorted(self.writers.items())}
            payload = (checksums, self.reader.file_hashes(hashed))
        except BaseException as exc:
            if coord.failed:  # the failure has been exchanged already (by the pipeline, or a peer's)
                raise
            error = exc
        finally:
            bar.close()
        return coord.exchange(payload, error)

    def _commit(self, gathered: list) -> Manifest:
        """The lowest rank writes .metadata, config.json and the manifest, and commits; the others wait for it."""
        job, work = self.job, self.work
        error = manifest = None
        if self.coord.rank == 0:
            try:
                self.check_stop()  # (which also raises a failed model check)
                self.check_stop.background.result(self.check_stop, note=self._note)
                job.source.check_unchanged(self.identity)
                checksums = {k: v for part, _ in gathered for k, v in part.items()}
                source_hashes = {k: v for _, part in gathered for k, v in part.items()}
                files = [checksums[data_file_name(r)] for r in range(job.mesh.tp)]
                manifest, text, metadata = in_thread(
                    lambda: self._final_files(files, source_hashes), self.check_stop
                )  # seconds for 100 000 tensors: a signal is acted on meanwhile
                if self.config_bytes is not None:
                    (work / CONFIG_NAME).write_bytes(self.config_bytes)
                    fsync_file(work / CONFIG_NAME)
                write_dcp_metadata(work, manifest, metadata)
                for name in ("journal.jsonl", "job.json"):
                    (work / name).unlink(missing_ok=True)
                publish_text(work / MANIFEST_NAME, text)
                self.check_stop()
                commit(work, self.output)
            except BaseException as exc:
                error = exc
        self.coord.exchange(None, error)
        if manifest is None:
            manifest = read_manifest(self.output)
        return manifest

    def _final_files(self, files: list[str], source_hashes: dict[str, str]) -> tuple[Manifest, str, bytes]:
        """The manifest (recording `.metadata`'s size and hash), its JSON text and the DCP metadata (everything in
        memory, nothing written)."""
        job = self.job
        records = dict(self.done)
        for name, by_position in self.sums.items():
            records[name] = [_with_checksum(c, by_position[i]) for i, c in enumerate(job.files.chunks[name])]
        manifest = _manifest(job, records, files, source_hashes, self.config_bytes)
        metadata = dcp_metadata_bytes(manifest)  # of the tensors alone: the manifest records its size and hash
        manifest, data = replace(manifest, metadata=FileRecord.of(DCP_METADATA_NAME, metadata)).sealed_dict()
        return manifest, dumps_indented(data) + "\n", metadata


def in_thread(fn, check_stop, poll_s: float = 0.1):
    """`fn()` computed on a helper thread while this one watches `check_stop` (so that a signal is acted on within
    `poll_s` however long `fn` runs, as long as it only computes); its result, or its exception.

    Raises:
        Whatever `check_stop` raises (the helper is left to finish on its own: it writes nothing), or `fn` raised.
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="compute", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        check_stop()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _with_checksum(c: ChunkRecord, xxh3_64: str) -> ChunkRecord:
    """`replace(c, xxh3_64=...)` in a fifth of the time (once per chunk: 100 000s of them)."""
    return ChunkRecord(c.tensor, c.owner, c.box, c.file, c.offset, c.framing, xxh3_64)


def _adopt(work: Path, done: dict[str, list[ChunkRecord]], mine: set[str]) -> dict[str, RecordFileWriter]:
    """Writers for this process's files, each adopting (re-checking) the records the lowest rank kept."""
    kept: dict[str, list[ChunkRecord]] = {name: [] for name in mine}
    for chunks in done.values():
        for c in chunks:
            if c.file in mine:
                kept[c.file].append(c)
    writers: dict[str, RecordFileWriter] = {}
    try:
        for name in sorted(mine):
            writers[name] = RecordFileWriter(work / name)
            writers[name].keep(sorted(kept[name], key=lambda c: c.offset))
    except BaseException:
        for w in writers.values():
            w.abandon()
        raise
    return writers


def _hashed_here(job: ConversionPlan, reader: SourceRows, coord: Coordinator, done: dict) -> set[str]:
    """The source files this process hashes (and so proves each tensor of, for the journal): round robin over the
    processes in read order, except that a file part of which is kept from an earlier run is the lowest rank's,
    whose resume check read that part in order (its hash goes on from there)."""
    files = list(dict.fromkeys(reader.file_of(name) for name in job.write_order))
    resumed = {reader.file_of(name) for name in done}
    return {f for i, f in enumerate(files) if (coord.rank == 0 if f in resumed else i % coord.world == coord.rank)}


def _tasks(
    job: ConversionPlan, reader: SourceRows, done: dict, mine: set[str], hashed: set[str], check_stop=None
) -> list[TensorWork]:
    """The tensors this process reads, in write order: those with chunks in its files, and, read whole for their
    hash and proofs, the rest of the source files it hashes. `check_stop` is called every few thousand tensors (a
    signal stops a long plan too)."""
    tasks = []
    for index, name in enumerate(job.write_order):
        if check_stop is not None and not index % 4096:
            check_stop()
        if name in done:
            continue
        planned = job.files.chunks[name]
        own = [c for c in planned if c.file in mine]
        whole = reader.file_of(name) in hashed
        if own or whole:
            layout = job.layouts[name]
            bands = slicing.band_plan(layout, own, whole=whole, band_bytes=job.band_bytes)
            tasks.append(TensorWork(index, layout, planned, own, bands))
    return tasks


def _sync_points(job: ConversionPlan, done: dict) -> list[int]:
    """Write-order positions after which every process makes its files durable and the journal claims the
    tensors up to there: about every 1/SYNC_ROUNDS of the job, and after its last tensor."""
    threshold = max(SYNC_MIN_BYTES, job.output_bytes // SYNC_ROUNDS)
    points, unsynced, last = [], 0, None
    for index, name in enumerate(job.write_order):
        if name in done:
            continue
        unsynced += job.layouts[name].nbytes
        last = index
        if unsynced >= threshold:
            points.append(index)
            unsynced = 0
    if last is not None and (not points or points[-1] != last):
        points.append(last)
    return points


def _nothing(name: str) -> None:
    """The default `on_tensor`."""


def _manifest(
    job: ConversionPlan,
    records: dict[str, list[ChunkRecord]],
    checksums: list[str],
    source_hashes: dict[str, str],
    config_bytes: bytes | None,
) -> Manifest:
    from preshard import __version__

    config = FileRecord.of(CONFIG_NAME, config_bytes) if config_bytes is not None else None
    tensors = {name: TensorRecord(job.layouts[name], tuple(records[name])) for name in sorted(records)}
    files = tuple(FileRecord(data_file_name(r), job.files.file_sizes[r], checksums[r]) for r in range(job.mesh.tp))
    return Manifest(
        source=job.source.source_record(source_hashes),
        mesh=job.mesh,
        plan=job.plan,
        tensors=tensors,
        files=files,
        config=config,
        dtype=job.cast,
        derived_from=getattr(job.source, "derived_from", None),
        preshard_version=__version__,
        created=created_now(),
        quantize=job.quantize,
        model_class=job.model_class,
    )


__all__ = [
    "ConversionOutcome",
    "ConversionPlan",
    "convert_checkpoint",
    "finished_conversion",
    "dtype_name",
    "plan_conversion",
    "resolve_mesh",
    "space_needed",
]
