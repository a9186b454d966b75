"""A diffusers pipeline folder converted as one: its sharded components converted, the rest copied.

`convert_pipeline(PIPELINE, OUT, tp=...)` reads the pipeline's index (`model_index.json`, or the modular
pipelines' `modular_model_index.json`) and decides per component:

- **sharded**: a diffusers model with a plan (a built-in plan for its class, or a class whose name says it is a
  transformer: its own `_tp_plan` is read at conversion), e.g. Wan 2.2's `transformer` and `transformer_2`. It is
  converted by `convert_checkpoint` into `OUT/<component>/`, with its own manifest and plan.
- **sharded, TP only**: a transformers text encoder with more than `SHARD_TEXT_ENCODER_BYTES` of weights (or any
  one the user names with `NAME:tp=N`), its plan inferred from its blocks (`plans/hf_transformers.py`). It is
  converted for TP alone (at load it runs TP over the transformer's TP ranks, replicated across the CP groups);
  `--keep-layers` applies first: the kept layers are written to a hidden copy in the working folder (removed
  before the commit), which is converted, and what was left out is recorded in its manifest (`source.left_out`).
- **whole**: everything else with files (VAE, smaller text encoders, schedulers, tokenizers, processors) is
  copied as it is, so that OUT is a pipeline folder again.
- **skipped**: a component the user leaves out (`NAME:skip`); the output's index names it `[null, null]`, which
  diffusers loads as None.

`components` overrides the choice per component (`NAME:tp=4`, `NAME:whole`, `NAME:skip`; `parse_component_choice`).

The whole conversion is one job, like a single one: an exclusive lock on OUT, everything written into the hidden
sibling `.<OUT>.partial/` and renamed into place last (the record `preshard_pipeline.json` written just before),
and a re-run of the same job resumes there (each component's conversion resumes or is found finished; a component
already copied from unchanged source files is not copied again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from preshard.converter.contained import inside, remove_inside
from preshard.converter.convert import (
    ConversionOutcome,
    convert_checkpoint,
    finished_conversion,
    plan_conversion,
    resolve_mesh,
)
from preshard.converter.left_out import KeptLayersSource, copy_keeping_layers, documented_keep, parse_keep_layers_all
from preshard.converter.pipeline_copy import SourceBoundary, copy_component, copy_file
from preshard.converter.workdir import (
    JOB_NAME,
    OutputKind,
    OutputLock,
    check_output,
    commit,
    make_parents,
    open_workdir,
    partial_dir,
)
from preshard.errors import PlanError, PreshardError, SourceError, SourceNotFoundError, UsageError
from preshard.format.component_name import check_component_name
from preshard.format.jsonio import dumps_indented, fsync_file
from preshard.format.manifest import CONFIG_NAME, MANIFEST_NAME, created_now
from preshard.format.mesh import MeshSpec
from preshard.format.pipeline_record import (
    PIPELINE_RECORD_NAME,
    ComponentRecord,
    LeftOut,
    PipelineIndex,
    PipelineRecord,
    is_pipeline_record,
    library_problem,
    read_pipeline_index,
    read_pipeline_record,
)
from preshard.format.pipeline_seal import seal_pipeline_record
from preshard.format.publish import fsync_dir
from preshard.plans.model_class import is_transformers_config
from preshard.plans.registry import builtin_plan_for_class
from preshard.sources import open_source

# A transformers text encoder above this (its safetensors bytes) is sharded by default: 16 GiB shards FLUX.2's
# Mistral (48 GB), LTX-2's Gemma-3 12B (24 GB) and MiniMax-H3's Qwen3-VL (62 GiB), and leaves T5-XXL's and UMT5-XXL's
# encoders (9-11 GB) whole, which fit beside a transformer shard on an 80 GiB GPU.
SHARD_TEXT_ENCODER_BYTES = 16 << 30
PIPELINE = OutputKind(f"a converted pipeline (it has no {PIPELINE_RECORD_NAME})", is_pipeline_record)
CHOICE_HELP = "NAME:tp=N (shard at TP degree N), NAME:whole (copy it as it is) or NAME:skip (leave it out)"


@dataclass(frozen=True)
class ComponentChoice:
    """What the user asks for one component: `treatment` "sharded" (at `tp`, default the job's), "whole", "skipped"."""

    treatment: str
    tp: int | None = None


def parse_component_choice(text: str) -> tuple[str, ComponentChoice]:
    """`NAME:tp=4`, `NAME:whole` or `NAME:skip` -> (name, choice).

    Raises:
        UsageError: anything else.
    """
    name, sep, what = text.partition(":")
    bad = UsageError(f"--component {text!r} is not {CHOICE_HELP}")
    if not sep or not name:
        raise bad
    check_component_name(name, "--component")
    if what == "whole":
        return name, ComponentChoice("whole")
    if what == "skip":
        return name, ComponentChoice("skipped")
    key, eq, value = what.partition("=")
    if key != "tp" or not eq or not (value.isascii() and value.isdigit()) or len(value) > 6 or int(value) < 1:
        raise bad  # ASCII digits only: str.isdigit also accepts '²', which int() then refuses
    return name, ComponentChoice("sharded", int(value))


def parse_component_choices(texts: Iterable[str]) -> dict[str, ComponentChoice]:
    """Every `--component` given -> {name: choice}; the same choice given twice is one.

    Raises:
        UsageError: a choice `parse_component_choice` refuses, or two different choices for one component (the
            last one silently winning would convert something other than what was asked).
    """
    choices: dict[str, ComponentChoice] = {}
    given: dict[str, str] = {}
    for text in texts:
        name, choice = parse_component_choice(text)
        if name in choices and choices[name] != choice:
            raise UsageError(
                f"--component {given[name]} and --component {text} choose differently for {name}; give one choice "
                "per component"
            )
        choices[name], given[name] = choice, text
    return choices


def is_hub_pipeline_id(source: str | Path) -> bool:
    """Whether `source` could name a Hub pipeline repo: a repo id `org/name` that names no local path."""
    from preshard.sources.hub import is_repo_id

    return isinstance(source, str) and is_repo_id(source)


def is_pipeline_folder(path: str | Path) -> bool:
    """Whether `path` is a local diffusers pipeline folder (it holds a pipeline index)."""
    folder = Path(path)
    return folder.is_dir() and read_pipeline_index(folder) is not None


@dataclass(frozen=True)
class ComponentPlan:
    """One component's decision: its record, and whether its folder is there to convert or copy."""

    record: ComponentRecord
    folder: Path | None  # the component's subfolder in the source (None: the index names no files for it)


def _weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# What a model component's weights are stored as: a component with a config.json and none of these cannot be loaded.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".index.json")


# Components that hold no weights by nature (a tokenizer folder may carry a config.json of its model's too).
WEIGHTLESS_KINDS = ("Tokenizer", "Processor", "Scheduler", "FeatureExtractor", "Extractor", "Guider")


def _lacks_weights(class_name: str, files: Iterable[str]) -> bool:
    """A model component (a config.json, a class that is no tokenizer, processor or scheduler) without weights."""
    names = list(files)
    if CONFIG_NAME not in names or any(kind in class_name for kind in WEIGHTLESS_KINDS):
        return False
    return not any(name.endswith(WEIGHT_SUFFIXES) for name in names)


def is_text_encoder(library: str, folder: Path) -> bool:
    """A transformers model (its config.json says so), sharded with TP only."""
    if library != "transformers" or not (folder / CONFIG_NAME).is_file():
        return False
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except ValueError:
        return False
    return is_transformers_config(config if isinstance(config, dict) else None)


def _shards_by_default(library: str, class_name: str, folder: Path, text_encoder_bytes: int) -> bool:
    """A diffusers model with a plan (a built-in one for its class, or a transformer class: its own `_tp_plan`),
    or a transformers text encoder above `text_encoder_bytes`."""
    if not (folder / CONFIG_NAME).is_file() or not _weights_bytes(folder):
        return False
    if library == "transformers":
        return _weights_bytes(folder) > text_encoder_bytes and is_text_encoder(library, folder)
    if library != "diffusers":
        return False
    return builtin_plan_for_class(class_name) is not None or "Transformer" in class_name


def _component_mesh(record: ComponentRecord, folder: Path | None, job_mesh: MeshSpec) -> MeshSpec:
    """A diffusers component's mesh is the job's (its TP degree changed where the user chose one); a text
    encoder's is TP alone."""
    assert record.tp is not None
    if folder is not None and is_text_encoder(record.library, folder):
        return MeshSpec.build(record.tp)
    return job_mesh if record.tp == job_mesh.tp else MeshSpec.build(record.tp)


def plan_pipeline(
    source: Path,
    index: PipelineIndex,
    mesh: MeshSpec,
    choices: dict[str, ComponentChoice],
    text_encoder_bytes: int = SHARD_TEXT_ENCODER_BYTES,
) -> list[ComponentPlan]:
    """Every component's treatment, the user's choices applied (text encoders above `text_encoder_bytes` sharded).

    Raises:
        UsageError: a choice names no component of the pipeline, or asks to shard one that has no weights; a
            component with a config.json but no weights (nothing diffusers could load from a copy).
        SourceError: a link out of the pipeline folder, or a FIFO, socket or device, in a component used
            (`pipeline_copy.SourceBoundary`): checked for every component before anything is written.
    """
    boundary = SourceBoundary(source)
    names = {c.name for c in index.components}
    unknown = sorted(set(choices) - names)
    if unknown:
        raise UsageError(
            f"--component {unknown[0]}: the pipeline has no such component; its components are "
            f"{', '.join(sorted(names))}"
        )
    planned = []
    for c in index.components:
        folder = source / c.name
        if c.library is None or c.class_name is None:
            if c.name in choices:
                raise UsageError(f"--component {c.name}: the pipeline's index names no model for it ([null, null])")
            continue  # the pipeline does without it: the index says so already
        choice = choices.get(c.name)
        problem = library_problem(c.name, c.library, c.class_name, choice.treatment if choice else "whole")
        if problem is not None:  # checked before anything reads the component: no module the index names is imported
            raise SourceError(f"{index.file_name}: {problem}; fix the pipeline's index")
        if choice is not None and choice.treatment == "skipped":  # its folder need not be there (nor fetched)
            planned.append(ComponentPlan(ComponentRecord(c.name, c.library, c.class_name, "skipped"), None))
            continue
        if not folder.is_dir():
            raise SourceNotFoundError(
                f"the pipeline's index names {c.name} ({c.library}.{c.class_name}), but {folder} does not exist; "
                f"complete the pipeline folder, or leave it out with --component {c.name}:skip"
            )
        files = boundary.source_files(folder)  # links out of the folder, FIFOs: refused before anything is written
        if _lacks_weights(c.class_name, files):
            raise UsageError(
                f"{c.name} ({c.library}.{c.class_name}) has a {CONFIG_NAME} but no weights, so a copy could not be "
                f"loaded; add its weights to {folder}, or leave it out with --component {c.name}:skip"
            )
        if choice is None:
            shard = _shards_by_default(c.library, c.class_name, folder, text_encoder_bytes)
            choice = ComponentChoice("sharded" if shard else "whole")
        tp = None
        if choice.treatment == "sharded":
            if not _weights_bytes(folder) and not any(folder.glob("*.safetensors.index.json")):
                raise UsageError(
                    f"--component {c.name}:tp=...: {c.name} holds no .safetensors weights to shard; use {c.name}:whole"
                )
            tp = choice.tp or mesh.tp
        record = ComponentRecord(c.name, c.library, c.class_name, choice.treatment, tp, _weights_bytes(folder))
        planned.append(ComponentPlan(record, folder))
    return planned


def _job_key(
    source: Path, mesh: MeshSpec, planned: list[ComponentPlan], dtype: Any, plan: Any, keeps: dict[str, int]
) -> str:
    what = {
        "keep_layers": keeps,
        "source": str(source.resolve()),
        "mesh": mesh.to_dict(),
        "components": {p.record.name: p.record.to_dict() for p in planned},
        "dtype": str(dtype),
        "plan": str(plan),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _source_stamp(boundary: SourceBoundary, folder: Path) -> dict[str, list[int]]:
    stamp = {}
    for name, real in boundary.source_files(folder).items():
        st = real.stat()
        stamp[name] = [st.st_size, st.st_mtime_ns]
    return stamp


def _copy_once(boundary: SourceBoundary, folder: Path, target: Path, work: Path, keep: int | None) -> LeftOut | None:
    """Copy a whole component into the working folder (without its unread layers where `keep` says), unless an
    earlier run of this job already did from the same source files (sizes and modification times, kept in a
    hidden marker beside it): a resume does not copy a 62 GiB conditioner again."""
    marker = inside(work, work / f".{target.name}.copied")
    stamp = _source_stamp(boundary, folder)
    if marker.is_file() and target.is_dir():
        try:
            done = json.loads(marker.read_text())
        except ValueError:
            done = None
        if isinstance(done, dict) and done.get("source") == stamp:
            left = done.get("left_out")
            return None if left is None else LeftOut.from_dict(left)
    remove_inside(work, marker)
    remove_inside(work, target)
    left = copy_keeping_layers(folder, inside(work, target), keep) if keep is not None else None
    if left is None:
        copy_component(boundary, folder, target, work)  # copies, not links: a later edit of the source stays out
    marker.write_text(json.dumps({"source": stamp, "left_out": None if left is None else left.to_dict()}))
    return left


def _output_index(index: PipelineIndex, planned: list[ComponentPlan]) -> str:
    """The source index with skipped components set to [null, null] (diffusers then loads None for them)."""
    data = dict(index.data)
    for p in planned:
        if p.record.treatment == "skipped" and isinstance(data.get(p.record.name), list):
            entry = list(data[p.record.name])
            entry[0] = entry[1] = None
            data[p.record.name] = entry
    return json.dumps(data, indent=2) + "\n"


def layers_to_keep(
    index: PipelineIndex, planned: list[ComponentPlan], given: Iterable[str] | dict[str, int | None] | None
) -> dict[str, int]:
    """Layers to keep per text encoder (copied whole or sharded): the user's `--keep-layers`, else what the pipeline
    documents."""
    asked = dict(given) if isinstance(given, dict) else parse_keep_layers_all(given or [])
    by_name = {p.record.name: p for p in planned}
    keeps: dict[str, int] = {}

    def applies(p: ComponentPlan) -> bool:
        return p.record.treatment == "whole" or (
            p.record.treatment == "sharded" and p.folder is not None and is_text_encoder(p.record.library, p.folder)
        )

    for name, keep in asked.items():
        p = by_name.get(name)
        if p is None or not applies(p):
            what = "no such component" if p is None else f"{name} is {p.record.treatment}"
            raise UsageError(f"--keep-layers {name}: {what}; it applies to a text encoder (copied whole or sharded)")
        if keep is not None:
            keeps[name] = keep
    for p in planned:
        if p.record.name not in asked and applies(p):
            documented = documented_keep(index.pipeline_class, p.record.name, index.data)
            if documented is not None:
                keeps[p.record.name] = documented
    return keeps


def _finished_pipeline(
    src: Path, output: Path, job: str, planned: list[ComponentPlan], mesh: MeshSpec, plan: Any, dtype: Any
) -> PipelineRecord | None:
    """The record in `output` if it holds exactly this job, finished: the same choices, every sharded component
    exactly its conversion (`finished_conversion`: the source bytes re-hashed), every copied file there at its size
    and modification time (copies keep the source's)."""
    try:
        record = read_pipeline_record(output) if output.is_dir() else None
    except PreshardError:
        return None
    if record is None or record.job != job:
        return None
    for p in planned:
        if p.folder is None or p.record.treatment == "skipped":
            continue
        if p.record.treatment == "sharded":
            existing = record.components.get(p.record.name)
            if existing is not None and existing.left_out is not None:  # converted from its kept copy, since removed:
                if not (output / p.record.name / MANIFEST_NAME).is_file():  # its manifest must be there (the job key
                    return None  # holds the choice; the source is not re-read)
                continue
            component_mesh = _component_mesh(p.record, p.folder, mesh)
            conversion = plan_conversion(
                src, mesh=component_mesh, plan=plan, dtype=dtype, subfolder=p.record.name, check_model=False
            )
            if finished_conversion(conversion, output / p.record.name) is None:
                return None
            continue
        if existing := record.components.get(p.record.name):
            if existing.left_out is not None:  # rewritten, not copied: its folder must be there (the job key holds
                if not (output / p.record.name / CONFIG_NAME).is_file():  # the choice; the source is not re-read)
                    return None
                continue
        try:
            files = SourceBoundary(src).source_files(p.folder)
        except PreshardError:
            return None
        for name, f in files.items():
            copy = output / p.record.name / name
            a, b = f.stat(), copy.stat() if copy.is_file() and not copy.is_symlink() else None
            if b is None or (a.st_size, a.st_mtime_ns) != (b.st_size, b.st_mtime_ns):
                return None
    return record


def _pipeline_source(source: str | Path, revision: str | None, token: str | bool | None, skip: frozenset[str]) -> Path:
    """The local pipeline folder `source` names, or a Hub pipeline repo's snapshot folder, fetched."""
    folder = Path(source)
    if folder.is_dir():
        if revision is not None:
            raise UsageError(f"--revision applies to Hub repos, but {source} is a local folder; drop --revision")
        return folder
    from preshard.sources.hub import download_pipeline, is_repo_id  # huggingface_hub: imported when needed

    if isinstance(source, str) and not folder.exists() and is_repo_id(source):
        snapshot = download_pipeline(source, revision=revision, token=token, skip=skip)
        if snapshot is None:
            raise SourceError(
                f"Hub repo {source} holds no model_index.json or modular_model_index.json, so it is no diffusers "
                "pipeline; convert one model with --subfolder NAME"
            )
        return snapshot.folder
    raise SourceNotFoundError(f"pipeline folder {source} does not exist; pass a diffusers pipeline folder")


USAGE_FAILURES = (UsageError, PlanError)  # the job as asked cannot work: a re-run would fail the same way


@contextlib.contextmanager
def _partial_on_failure(out: Path) -> Iterator[None]:
    """A conversion that fails for a usage error removes the partial copies it made (a re-run of the same job would
    fail the same way, and they can be GBs); any other failure keeps them for a resume and says where."""
    work = partial_dir(out)
    try:
        yield
    except USAGE_FAILURES:
        remove_inside(out.parent, work)
        raise
    except PreshardError as exc:
        if not work.is_dir() or str(work) in str(exc):
            raise
        kept = f"{exc}; the partial conversion is kept in {work}: re-run the same command to resume it"
        try:
            again = type(exc)(kept)
        except TypeError:
            raise exc from None
        again.__dict__.update(exc.__dict__)
        raise again from exc.__cause__
    except OSError as exc:
        if work.is_dir():
            exc.add_note(f"the partial conversion is kept in {work}: re-run the same command to resume it")
        raise


def convert_pipeline(
    source: str | Path,
    output: str | Path,
    *,
    mesh: MeshSpec | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    components: dict[str, ComponentChoice] | Iterable[str] | None = None,
    plan: str | Path | None = None,
    dtype: Any = None,
    overwrite: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    workers: int = 1,
    outcomes: dict[str, ConversionOutcome] | None = None,
    keep_layers: Iterable[str] | dict[str, int | None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    text_encoder_bytes: int = SHARD_TEXT_ENCODER_BYTES,
    revision: str | None = None,
    token: str | bool | None = None,
) -> PipelineRecord:
    """Convert a diffusers pipeline folder into OUT: sharded components converted, the rest copied.

    Args:
        source: a local pipeline folder (with `model_index.json` or `modular_model_index.json`), or a Hub repo id
            of one: only what the conversion reads is fetched, once, into the HF cache (`download_pipeline`: the
            index, top-level files, the folders of the components not skipped), the sharded components converted
            from there and the rest copied from there.
        revision, token: for a Hub repo (a revision is refused for a local folder).
        output: the folder to create; written atomically (it appears complete or not at all), resumably.
        mesh, tp, cp, ring, ulysses, order: the mesh the sharded components are converted for (as
            `convert_checkpoint`); a component's own `tp=` choice changes only its TP degree.
        components: per-component choices, as `{name: ComponentChoice}` or strings `NAME:tp=N|whole|skip`.
        plan: a plan for the sharded components (default: each one's own, from its config.json); only where one
            component is sharded.
        dtype, progress, workers: as `convert_checkpoint`, for each sharded component.
        overwrite: replace an existing converted pipeline at `output`.
        wait: wait for another conversion into `output` instead of failing at once.
        outcomes: filled in with each sharded component's `ConversionOutcome` (converted, resumed, already converted).
        keep_layers: `{name: K}` or strings `NAME:K` keep a whole text encoder's first K decoder layers and leave out
            the rest and its head (`converter/left_out.py`); `NAME:all` (None) leaves nothing out. Default: where the
            pipeline documents the hidden state it reads (MiniMax-H3: hidden_states[50], so 51 layers of 64).
        on_tensor: as `convert_checkpoint`, for each sharded component's tensors.
            pipeline documents the hidden state it reads (MiniMax-H3: hidden_states[50], so 51 layers of 64). A
            sharded text encoder has its layers left out before it is sharded (recorded in its manifest).
        text_encoder_bytes: a transformers text encoder with more weight bytes than this is sharded (TP only)
            unless `components` says otherwise (default `SHARD_TEXT_ENCODER_BYTES`, 16 GiB).

    Returns:
        The pipeline record written to `output/preshard_pipeline.json`.

    Raises:
        SourceError: not a pipeline folder. UsageError: a bad choice or mesh. OutputError: an output that cannot be
        written (exists, locked). Whatever `convert_checkpoint` raises for a component.
    """
    if components is None:
        choices: dict[str, ComponentChoice] = {}
    elif isinstance(components, dict):
        choices = {check_component_name(name, "components="): choice for name, choice in components.items()}
    else:
        choices = parse_component_choices(components)
    skipped = frozenset(name for name, c in choices.items() if c.treatment == "skipped")
    src = _pipeline_source(source, revision, token, skipped)
    index = read_pipeline_index(src)
    if index is None:
        raise SourceError(
            f"{source} is not a pipeline folder (no model_index.json or modular_model_index.json); pass the "
            "pipeline's folder, or convert one model's weights folder on its own"
        )
    job_mesh = resolve_mesh(mesh, tp, cp, ring, ulysses, order)
    planned = plan_pipeline(src, index, job_mesh, choices, text_encoder_bytes)
    for p in planned:  # load_pipeline loads every sharded component on the job's mesh: refuse what it would refuse
        if p.record.treatment == "sharded" and p.record.tp != job_mesh.tp:
            raise UsageError(
                f"--component {p.record.name}:tp={p.record.tp} differs from the pipeline's --tp {job_mesh.tp}, and "
                f"load_pipeline loads every sharded component on the job's mesh; drop the choice, or use "
                f"{p.record.name}:tp={job_mesh.tp} or {p.record.name}:whole"
            )
    keeps = layers_to_keep(index, planned, keep_layers)
    sharded = [p for p in planned if p.record.treatment == "sharded"]
    if plan is not None and len(sharded) != 1:
        raise UsageError(
            f"--plan applies to one component, but {len(sharded)} are sharded; convert one with --subfolder NAME "
            "--plan ..., or leave --plan out"
        )
    boundary = SourceBoundary(src)
    boundary.top_level_files({index.file_name, PIPELINE_RECORD_NAME})  # links out refused before anything is written
    job = _job_key(src, job_mesh, planned, dtype, plan, keeps)
    if not overwrite:
        finished = _finished_pipeline(src, Path(output), job, planned, job_mesh, plan, dtype)
        if finished is not None:
            for p in sharded:
                if outcomes is not None:
                    outcomes.setdefault(p.record.name, ConversionOutcome()).status = "already converted"
            return finished
    out = check_output(Path(output), [src], overwrite, PIPELINE)
    make_parents(out)
    with OutputLock(out, wait=wait), _partial_on_failure(out):
        work = partial_dir(out)
        left_out: dict[str, LeftOut | None] = {}
        open_workdir(work, job)
        for p in planned:
            if p.folder is None or p.record.treatment == "skipped":
                continue
            target = inside(work, work / p.record.name)
            if p.record.treatment == "whole":
                left_out[p.record.name] = _copy_once(boundary, p.folder, target, work, keeps.get(p.record.name))
                continue
            component_mesh = _component_mesh(p.record, p.folder, job_mesh)
            keep = keeps.get(p.record.name)
            kept_copy = inside(work, work / f".{p.record.name}.kept")
            left = _copy_once(boundary, p.folder, kept_copy, work, keep) if keep is not None else None
            left_out[p.record.name] = left
            if left is None:
                remove_inside(work, kept_copy)
            component_source: Any = src
            if left is not None:
                component_source = KeptLayersSource(open_source(work / f".{p.record.name}.kept"), left, str(p.folder))
            convert_checkpoint(
                component_source, target, mesh=component_mesh, subfolder=p.record.name if left is None else None,
                plan=plan, dtype=dtype, progress=progress, workers=min(workers, component_mesh.tp),
                outcome=outcomes.setdefault(p.record.name, ConversionOutcome()) if outcomes is not None else None,
                on_tensor=on_tensor,
            )  # fmt: skip
        tops = boundary.top_level_files({index.file_name, PIPELINE_RECORD_NAME})  # the README, LICENSE: as they are
        for name, real in tops.items():
            copy_file(real, src / name, work, work / name)
        (work / index.file_name).write_text(_output_index(index, planned))
        record = PipelineRecord(
            index_name=index.file_name,
            pipeline_class=index.pipeline_class,
            mesh=job_mesh.to_dict(),
            components={p.record.name: replace(p.record, left_out=left_out.get(p.record.name)) for p in planned},
            source=str(source),
            created=created_now(),
            job=job,
        )
        (work / JOB_NAME).unlink(missing_ok=True)
        for marker in work.glob(".*.copied"):
            remove_inside(work, marker)
        for kept in work.glob(".*.kept"):  # the text encoders' kept layers, converted: not part of the output
            remove_inside(work, kept)
        record = seal_pipeline_record(work, record)  # every file no manifest covers hashed, the record sealed
        path = work / PIPELINE_RECORD_NAME  # last: a partial folder without it is never mistaken for an output
        path.write_text(dumps_indented(record.to_dict()) + "\n")
        fsync_file(path)
        fsync_dir(work)
        commit(work, out)
    return record
