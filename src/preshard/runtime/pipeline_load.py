"""load_pipeline: a converted pipeline folder back as the diffusers pipeline its index names, in every rank.

Each sharded component (the record `preshard_pipeline.json` says which) is loaded by `load_sharded` on the job's
mesh; a transformers text encoder (converted for TP alone) on the same ranks, TP over the transformer's TP groups
and replicated across its CP groups (`replicate_over_cp`: each CP group runs the encoder's TP shards on the same
prompt); the rest are loaded whole by diffusers from the folder (`DiffusionPipeline.from_pretrained`, or for a modular
pipeline `ModularPipeline.from_pretrained` + `load_components`) and moved to this rank's device, which a sharded
component refuses to be moved off (so `pipe.to(device)` is not the way: the loader places the whole ones itself).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from preshard.errors import (
    CheckpointFileMissingError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MismatchError,
    PreshardError,
    UsageError,
)
from preshard.format.dtypes import parse_load_dtype
from preshard.format.folder import CheckpointFolder
from preshard.format.hub_names import check_hub_arguments
from preshard.format.locate import local_path
from preshard.format.mesh import MeshSpec
from preshard.format.pipeline_files import FileCheck, check_files, unlisted_files, unlisted_problem
from preshard.format.pipeline_record import (
    PIPELINE_RECORD_NAME,
    ComponentRecord,
    PipelineRecord,
    library_problem,
    parse_pipeline_record,
)
from preshard.process import one_line_errors_under_torchrun
from preshard.runtime.agreement import agree_on_checkpoint, agree_on_outcome
from preshard.runtime.compile_cache import CompileOptions
from preshard.runtime.hub import names_repo
from preshard.runtime.left_out import guard_left_out
from preshard.runtime.load import load_sharded
from preshard.runtime.rank_bars import rank0_bars
from preshard.runtime.rendezvous import DEFAULT_TIMEOUT_S, join_job
from preshard.runtime.report import REPORT_ATTRIBUTE
from preshard.units import plural

SHARDED_ATTRIBUTE = "preshard_sharded_components"
CALL = "load_pipeline"


def component_class(component: ComponentRecord) -> type:
    """A sharded component's class: an attribute of its library, `diffusers` or `transformers` (never a module the
    record names: `library_problem` refuses any other), e.g. `diffusers.WanTransformer3DModel`.

    Raises:
        CorruptCheckpointError: another library, or not a plain class name. MismatchError: this environment's
        library has no such class.
    """
    problem = library_problem(component.name, component.library, component.class_name, component.treatment)
    if problem is not None or component.library not in ("diffusers", "transformers"):
        raise CorruptCheckpointError(f"{PIPELINE_RECORD_NAME}: {problem}; convert the pipeline again")
    import importlib

    library = importlib.import_module({"diffusers": "diffusers", "transformers": "transformers"}[component.library])
    cls = getattr(library, component.class_name, None)
    if not isinstance(cls, type):
        raise MismatchError(
            f"the pipeline's index names {component.library}.{component.class_name}, which this environment does not "
            f"have; install a {component.library} version that has it"
        )
    return cls


def _fetch_rest(repo_id: str, revision: str | None, token: str | bool | None, ignore: list[str]) -> Path:
    """A converted pipeline on the Hub: everything but the sharded components' data files, from one commit (the
    snapshot folder is named by it); each rank then fetches its own shards through `load_sharded`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    check_hub_arguments(repo_id, revision=revision, option="=")  # before any Hub call: nothing written outside
    try:
        return Path(snapshot_download(repo_id, revision=revision, token=token, ignore_patterns=ignore))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointNotFoundError(
            f"converted pipeline {repo_id} could not be fetched from the Hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); check the repo id, revision and token"
        ) from None


def _open_record(
    checkpoint: str | Path, revision: str | None = None, token: str | bool | None = None
) -> tuple[CheckpointFolder, PipelineRecord, str | None]:
    """The converted pipeline's folder and record (its seal checked), and its Hub commit (None for a local folder)."""
    path = local_path(checkpoint, revision=revision, option="revision=")
    commit = None
    if path is None and isinstance(checkpoint, str) and names_repo(checkpoint):
        path = _fetch_rest(checkpoint, revision, token, ["*.distcp"])  # no rank's shards: each fetches its own
        commit = path.name
    if path is None:
        raise CheckpointNotFoundError(
            f"converted pipeline {checkpoint} does not exist; pass the folder convert-checkpoint PIPELINE OUT wrote "
            "or a Hub repo id (org/name) holding one"
        )
    folder = CheckpointFolder(path)  # regular files, no link out of it (a Hub snapshot's: into the HF cache only)
    try:
        raw = folder.read_bytes(PIPELINE_RECORD_NAME)
    except FileNotFoundError:
        raise UsageError(
            f"{checkpoint} holds no {PIPELINE_RECORD_NAME}, so it is not a converted pipeline; convert it with "
            f"convert-checkpoint PIPELINE OUT --tp N, or load one model with load_sharded"
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{folder.where(PIPELINE_RECORD_NAME)} cannot be read ({exc})") from None
    return folder, parse_pipeline_record(raw, folder.where(PIPELINE_RECORD_NAME)), commit


def _fingerprint(value: Any) -> str:
    """What a value given to load_pipeline is, the same on every rank that was given the same: its class, and a hash
    of its configuration (diffusers' `config`, transformers' `to_dict()`) and, for a module, of its tensors' names,
    shapes, dtypes and (on the CPU) bytes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return json.dumps(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    digest = xxhash.xxh3_64()

    def add(data: Any) -> None:
        digest.update(json.dumps(data, sort_keys=True, default=lambda o: type(o).__name__).encode())

    try:
        config = getattr(value, "config", None)
        if isinstance(config, Mapping):
            add(dict(config))
        elif config is not None and callable(getattr(config, "to_dict", None)):
            add(config.to_dict())
        elif callable(getattr(value, "to_dict", None)):
            add(value.to_dict())
        elif isinstance(value, (list, tuple, dict)):
            add(value)
        if isinstance(value, nn.Module):
            for name, tensor in value.state_dict().items():
                add([name, list(tensor.shape), str(tensor.dtype)])
                if tensor.device.type == "cpu":
                    digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    except Exception:  # noqa: BLE001 - what cannot be described is compared by its class alone
        pass
    return f"{type(value).__qualname__} {digest.hexdigest()[:12]}"


def _loader_requests(components: dict[str, Any], blocks: Any, kwargs: dict[str, Any], verify: bool, check_inputs):
    """What every rank must pass alike beyond load_sharded's arguments: components=, blocks=, the loader's
    keywords, verify= and check_inputs= (a scheduler of another shift on one rank would give another image)."""
    return {
        "components=": {name: _fingerprint(value) for name, value in sorted(components.items())},
        "loader arguments": {
            "blocks": None if blocks is None else _fingerprint(blocks),
            "verify": bool(verify),
            "check_inputs": check_inputs if isinstance(check_inputs, (bool, str)) else repr(check_inputs),
            **{name: _fingerprint(value) for name, value in sorted(kwargs.items())},
        },
    }


class _FilesCheck:
    """The record's files checked (sizes; with `hash`, xxh3_128) in a thread while the sharded components load, and
    no unlisted file in a component kept whole (`format/pipeline_files.py`)."""

    def __init__(self, folder: CheckpointFolder, record: PipelineRecord, hash: bool) -> None:
        self.folder, self.record, self.hash = folder, record, hash
        self.cancel = threading.Event()
        self.check: FileCheck | None = None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="preshard-pipeline-files", daemon=True)

    def _run(self) -> None:
        try:
            self.check = check_files(self.folder, self.record.files, hash=self.hash, cancel=self.cancel)
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.failure = exc

    def start(self) -> _FilesCheck:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.cancel.set()
        self.thread.join()

    def result(self) -> FileCheck:
        """The check, or the first problem it found as one line.

        Raises:
            CheckpointFileMissingError: a listed file is missing. CorruptCheckpointError: any other difference.
        """
        self.thread.join()
        if self.failure is not None:
            raise self.failure
        assert self.check is not None
        problems = list(self.check.problems)
        missing = bool(problems) and " is missing (" in problems[0]
        names = unlisted_files(self.folder.path, self.record.files, [c.name for c in self.record.whole()])
        problems += [unlisted_problem(self.folder.where(n), n.split("/")[0]) for n in names]
        if problems:
            more = (
                f" ({plural(len(problems) - 1, 'more problem')}: preshard verify {self.folder.path} lists them)"
                if len(problems) > 1 else ""
            )  # fmt: skip
            cls = CheckpointFileMissingError if missing else CorruptCheckpointError
            raise cls(problems[0] + more)
        return self.check


def _whole_failure(exc: Exception, folder: CheckpointFolder) -> PreshardError:
    """diffusers' or transformers' error loading the components kept whole, as one line."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:600]
    fix = f"check the folder with preshard verify {folder.path}, and the arguments given to load_pipeline"
    if isinstance(exc, OSError):
        return CorruptCheckpointError(f"the components kept whole in {folder.path} could not be loaded ({text}); {fix}")
    return MismatchError(f"diffusers could not load the components kept whole in {folder.path} ({text}); {fix}")


@rank0_bars  # under torchrun, diffusers' and transformers' bars on rank 0 only (runtime/rank_bars.py)
def load_pipeline(
    checkpoint: str | Path,
    *,
    mesh: MeshSpec | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    device: str | torch.device | None = None,
    torch_dtype: str | torch.dtype | None = None,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    check_inputs: bool | str = True,
    revision: str | None = None,
    token: str | bool | None = None,
    components: dict[str, Any] | None = None,
    blocks: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    compile: bool | CompileOptions = False,
    **kwargs: Any,
) -> Any:
    """Load a converted pipeline: every sharded component on this rank's shard, the rest whole, every file checked.

    Every rank of the torchrun job calls this with the same arguments and then runs the pipeline with the same
    inputs and the same seed.

    Args:
        checkpoint: the folder `convert-checkpoint PIPELINE OUT` wrote, or a Hub repo id holding one (uploaded
            whole): the components kept whole come from one snapshot, each rank fetches only its own shards.
        revision, token: for a Hub repo.
        mesh, cp, ring, ulysses, order: the CP layout the sharded components run (default: the one converted for).
        device, check_inputs: as `load_sharded`, for each sharded component; `device` also places the whole ones.
        verify: check every byte read against the conversion's checksums (the default): each sharded component's
            chunks as `load_sharded` does, and every other file of the folder (the components kept whole, the
            index) against its size and xxh3_128 in the sealed `preshard_pipeline.json`, hashed in a thread while
            the sharded components load. `verify=False` (for storage you vouch for) skips the hashing; the record's
            seal, each listed file's presence and size, and each sharded component's manifest are checked always.
        torch_dtype: as diffusers' `from_pretrained`: the sharded components cast as `load_sharded(torch_dtype=)`
            casts, the whole ones loaded in it. Default (or "auto"): the sharded components as stored, the whole
            ones as diffusers' `from_pretrained` loads them without torch_dtype (float32).
        dtype: an alias of `torch_dtype` (both given and different: a `UsageError`).
        components: components given in memory instead of read from the folder (as diffusers' `from_pretrained`
            takes them), e.g. a processor the folder does not hold.
        timeout: seconds a rank waits for the others to join the job (as `load_sharded`); the ranks also agree on
            the pipeline record, dtype, mesh, components=, blocks= and the loader's keywords before anything loads.
        blocks: for a modular pipeline, the blocks to run (`blocks.init_pipeline(folder)`; default: the blocks the
            index names, `ModularPipeline.from_pretrained`).
        compile: as `load_sharded`, for each sharded component (each keeps its own cache entries).
        **kwargs: passed to diffusers' `from_pretrained` (standard pipelines) or `load_components` (modular).

    Returns:
        The pipeline named by the folder's index; `pipe.preshard_sharded_components` maps each sharded component's
        name to its `preshard_report`. A component converted without its later layers (`--keep-layers`) refuses
        what would need them and says what was left out in `component.preshard_left_out`.

    Raises:
        CheckpointNotFoundError, UsageError: no converted pipeline at `checkpoint`. CorruptCheckpointError: the record
        edited or of an older version, a file that is not the one converted (naming it), a library other than
        diffusers or transformers. CheckpointFileMissingError: a listed file missing. MismatchError: a component
        class this environment lacks, one converted at a TP degree the job's mesh does not run, or ranks given
        different arguments or seeing different records. JobTimeoutError: a rank gone (killed) during the load.
        Whatever `load_sharded` raises for a component. A failure on one rank is raised on every rank, one line.

    Example:
        >>> pipe = load_pipeline("wan-tp4", ulysses=2)  # doctest: +SKIP
    """
    try:
        return _load_pipeline(
            checkpoint, mesh=mesh, cp=cp, ring=ring, ulysses=ulysses, order=order, device=device,
            torch_dtype=torch_dtype, dtype=dtype, verify=verify, check_inputs=check_inputs, revision=revision,
            token=token, components=components, blocks=blocks, timeout=timeout, compile=compile, kwargs=kwargs,
        )  # fmt: skip
    except PreshardError:
        one_line_errors_under_torchrun()
        raise


def _load_pipeline(
    checkpoint, *, mesh, cp, ring, ulysses, order, device, torch_dtype, dtype, verify, check_inputs, revision, token,
    components, blocks, timeout, compile, kwargs,
) -> Any:  # fmt: skip
    error: PreshardError | None = None
    given = dict(components or {})
    folder = record = commit = cast = None
    classes: dict[str, type] = {}
    try:
        folder, record, commit = _open_record(checkpoint, revision, token)
        cast = parse_load_dtype(torch_dtype, dtype)
        job_tp = int(record.mesh["tp"])
        for component in record.sharded():
            if component.tp != job_tp:
                raise MismatchError(
                    f"component {component.name} was converted at tp={component.tp}, the pipeline at tp={job_tp}; "
                    f"this version loads every sharded component on the job's mesh: convert it at tp={job_tp} or "
                    f"whole (--component {component.name}:whole)"
                )
            classes[component.name] = component_class(component)
        overlap = sorted(set(given) & set(classes))
        if overlap:
            raise UsageError(
                f"components= gives {overlap[0]}, which the folder holds sharded; leave it out of components="
            )
        if blocks is not None and record.index_name == "model_index.json":
            raise UsageError("blocks= is for modular pipelines; this folder holds a standard one: leave it out")
    except PreshardError as exc:  # told to the other ranks as they join, so that none waits for this one
        error = exc
    # The bounded join load_sharded makes, here first: the process group is made once, by the pipeline's ranks.
    requests: dict[str, object] = {
        "pipeline": [str(checkpoint), revision], "dtype": [str(torch_dtype), str(dtype)],
        "mesh": mesh.to_dict() if mesh else [cp, ring, ulysses, order],
        **_loader_requests(given, blocks, kwargs, verify, check_inputs),
    }  # fmt: skip
    rank_device = join_job(device, requests, timeout=timeout, error=error, call=CALL)
    assert folder is not None and record is not None  # join_job raised this rank's error otherwise
    # The same record on every rank (its digest; a Hub snapshot's commit), or every rank refuses.
    agree_on_checkpoint(rank_device, record.digest, commit, None, str(checkpoint), requests, what="pipeline record",
                        call=CALL)  # fmt: skip
    job_tp = int(record.mesh["tp"])
    if mesh is None:
        job_mesh = MeshSpec.build(job_tp, cp, ring, ulysses, order, default=MeshSpec.from_dict(record.mesh))
    elif any(v is not None for v in (cp, ring, ulysses, order)):
        raise UsageError("pass either mesh=MeshSpec(...) or cp/ring/ulysses/order, not both")
    else:
        job_mesh = mesh
    files = _FilesCheck(folder, record, hash=verify).start()  # hashed while the sharded components are read
    sharded: dict[str, nn.Module] = {}
    try:
        for component in record.sharded():
            where = (checkpoint, component.name) if commit is not None else (folder.path / component.name, None)
            sharded[component.name] = load_sharded(
                classes[component.name], where[0], subfolder=where[1], revision=commit,
                token=token if commit else None, mesh=job_mesh, device=device,
                torch_dtype=None if cast is None else cast.torch, verify=verify,
                check_inputs=check_inputs, replicate_over_cp=component.library == "transformers", timeout=timeout,
                compile=compile,
            )  # fmt: skip
    except BaseException:
        files.stop()  # load_sharded failed on every rank alike
        raise
    error = None
    checked: FileCheck | None = None
    try:
        for name, net in sharded.items():
            loaded, recorded = getattr(net, REPORT_ATTRIBUTE).manifest_digest, record.components[name].manifest_digest
            if loaded != recorded:
                raise CorruptCheckpointError(
                    f"{folder.where(name)}'s manifest is not the one {PIPELINE_RECORD_NAME} records (digest "
                    f"{loaded[:12]}, recorded {recorded}): the component was replaced after conversion; copy the "
                    "converted pipeline again, or convert again"
                )
        checked = files.result()
    except PreshardError as exc:
        error = exc
    finally:
        files.stop()
    agree_on_outcome(rank_device, error, None, "while checking the pipeline's files")
    pipe = None
    error = None
    try:
        pipe = _load_whole(folder, record, sharded, given, blocks, None if cast is None else cast.torch, kwargs)
        for name, component in dict(pipe.components).items():
            if name not in sharded and isinstance(component, nn.Module):
                component.to(rank_device.device)
        changed = checked.changed_since() if checked is not None else None
        if changed is not None:
            raise CorruptCheckpointError(
                f"{folder.where(changed)} was replaced or changed while the pipeline loaded (after its check); load "
                "again once the folder is no longer being written"
            )
    except PreshardError as exc:
        error = exc
    except Exception as exc:  # diffusers' or transformers' own error: one line, on every rank
        error = _whole_failure(exc, folder)
    agree_on_outcome(rank_device, error, None, "while loading the components kept whole")
    assert pipe is not None
    for c in record.components.values():
        model = getattr(pipe, c.name, None)
        if c.left_out is not None and isinstance(model, nn.Module) and c.name not in given and c.name not in sharded:
            guard_left_out(model, c.name, c.left_out)
    setattr(pipe, SHARDED_ATTRIBUTE, {name: getattr(net, REPORT_ATTRIBUTE) for name, net in sharded.items()})
    return pipe


def _load_whole(
    folder: CheckpointFolder,
    record: PipelineRecord,
    sharded: dict[str, nn.Module],
    given: dict[str, Any],
    blocks: Any,
    torch_dtype: torch.dtype | None,
    kwargs: dict[str, Any],
) -> Any:
    """The pipeline, its sharded components and those given passed in, the rest loaded whole by diffusers."""
    skipped = {c.name: None for c in record.components.values() if c.treatment == "skipped"}
    given = {**skipped, **given}
    options = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    if record.index_name == "model_index.json":
        import diffusers

        pipeline_class: Any = getattr(diffusers, record.pipeline_class, None)
        if not callable(getattr(pipeline_class, "from_pretrained", None)):
            raise MismatchError(
                f"the pipeline's index names diffusers.{record.pipeline_class}, which this diffusers does not have; "
                "install a diffusers version that has it"
            )
        return pipeline_class.from_pretrained(folder.path, **sharded, **given, **options, **kwargs)
    from diffusers import ModularPipeline

    path = str(folder.path)
    pipe = ModularPipeline.from_pretrained(path) if blocks is None else blocks.init_pipeline(path)
    whole = [c.name for c in record.whole() if c.name not in given]
    if whole:
        pipe.load_components(names=whole, pretrained_model_name_or_path=path, **options, **kwargs)
    pipe.update_components(**sharded, **given)
    return pipe
