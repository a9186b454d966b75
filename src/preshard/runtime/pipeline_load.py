"""load_pipeline: a converted pipeline folder back as the diffusers pipeline its index names, in every rank.

Each sharded component (the record `preshard_pipeline.json` says which) is loaded by `load_sharded` on the job's
mesh; a transformers text encoder (converted for TP alone) on the same ranks, TP over the transformer's TP groups
and replicated across its CP groups (`replicate_over_cp`: each CP group runs the encoder's TP shards on the same
prompt); the rest are loaded whole by diffusers from the folder (`DiffusionPipeline.from_pretrained`, or for a modular
pipeline `ModularPipeline.from_pretrained` + `load_components`) and moved to this rank's device, which a sharded
component refuses to be moved off (so `pipe.to(device)` is not the way: the loader places the whole ones itself).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.errors import CheckpointNotFoundError, MismatchError, PreshardError, UsageError
from preshard.format.dtypes import parse_cast
from preshard.format.locate import local_path
from preshard.format.mesh import MeshSpec
from preshard.format.pipeline_record import PIPELINE_RECORD_NAME, PipelineRecord, read_pipeline_record
from preshard.runtime.compile_cache import CompileOptions
from preshard.runtime.hub import names_repo
from preshard.runtime.left_out import guard_left_out
from preshard.runtime.load import load_sharded
from preshard.runtime.rendezvous import DEFAULT_TIMEOUT_S, join_job

SHARDED_ATTRIBUTE = "preshard_sharded_components"


def _import_class(library: str, class_name: str) -> type:
    """The component class the index names (`diffusers.WanTransformer3DModel`)."""
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise MismatchError(
            f"the pipeline's index names {library}.{class_name}, which this environment does not have; install a "
            f"{library} version that has it"
        ) from None


def _fetch_rest(repo_id: str, revision: str | None, token: str | bool | None, ignore: list[str]) -> Path:
    """A converted pipeline on the Hub: everything but the sharded components' data files, from one commit (the
    snapshot folder is named by it); each rank then fetches its own shards through `load_sharded`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id, revision=revision, token=token, ignore_patterns=ignore))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointNotFoundError(
            f"converted pipeline {repo_id} could not be fetched from the Hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); check the repo id, revision and token"
        ) from None


def _open_record(
    checkpoint: str | Path, revision: str | None = None, token: str | bool | None = None
) -> tuple[Path, PipelineRecord, str | None]:
    """The converted pipeline's folder and record, and its Hub commit (None for a local folder)."""
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
    record = read_pipeline_record(path)
    if record is None:
        raise UsageError(
            f"{checkpoint} holds no {PIPELINE_RECORD_NAME}, so it is not a converted pipeline; convert it with "
            f"convert-checkpoint PIPELINE OUT --tp N, or load one model with load_sharded"
        )
    return path, record, commit


def load_pipeline(
    checkpoint: str | Path,
    *,
    mesh: MeshSpec | None = None,
    cp: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    device: str | torch.device | None = None,
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
    """Load a converted pipeline: every sharded component on this rank's shard, the rest whole.

    Every rank of the torchrun job calls this with the same arguments and then runs the pipeline with the same
    inputs and the same seed.

    Args:
        checkpoint: the folder `convert-checkpoint PIPELINE OUT` wrote, or a Hub repo id holding one (uploaded
            whole): the components kept whole come from one snapshot, each rank fetches only its own shards.
        revision, token: for a Hub repo.
        mesh, cp, ring, ulysses, order: the CP layout the sharded components run (default: the one converted for).
        device, verify, check_inputs: as `load_sharded`, for each sharded component; `device` also places the
            whole ones.
        dtype: cast the sharded components (as `load_sharded`) and load the whole ones in it (`torch_dtype`).
        components: components given in memory instead of read from the folder (as diffusers' `from_pretrained`
            takes them), e.g. a processor the folder does not hold.
        timeout: seconds a rank waits for the others to join the job (as `load_sharded`); the ranks also agree on
            the pipeline, dtype and mesh before the process group is made.
        blocks: for a modular pipeline, the blocks to run (`blocks.init_pipeline(folder)`; default: the blocks the
            index names, `ModularPipeline.from_pretrained`).
        compile: as `load_sharded`, for each sharded component (each keeps its own cache entries).
        **kwargs: passed to diffusers' `from_pretrained` (standard pipelines) or `load_components` (modular).

    Returns:
        The pipeline named by the folder's index; `pipe.preshard_sharded_components` maps each sharded component's
        name to its `preshard_report`. A component converted without its later layers (`--keep-layers`) refuses
        what would need them and says what was left out in `component.preshard_left_out`.

    Raises:
        CheckpointNotFoundError, UsageError: no converted pipeline at `checkpoint`. MismatchError: a component
        class this environment lacks, or one converted at a TP degree the job's mesh does not run. Whatever
        `load_sharded` raises for a component.
    """
    error: PreshardError | None = None
    try:
        folder, record, commit = _open_record(checkpoint, revision, token)
        cast = parse_cast(dtype, "dtype=")
    except PreshardError as exc:  # told to the other ranks as they join, so that none waits for this one
        error = exc
    # The bounded join load_sharded makes, here first: the process group is made once, by the pipeline's ranks.
    requests: dict[str, object] = {
        "pipeline": [str(checkpoint), revision], "dtype": None if dtype is None else str(dtype),
        "mesh": mesh.to_dict() if mesh else [cp, ring, ulysses, order],
    }  # fmt: skip
    rank_device = join_job(device, requests, timeout=timeout, error=error)
    job_tp = int(record.mesh["tp"])
    if mesh is None:
        job_mesh = MeshSpec.build(job_tp, cp, ring, ulysses, order, default=MeshSpec.from_dict(record.mesh))
    elif any(v is not None for v in (cp, ring, ulysses, order)):
        raise UsageError("pass either mesh=MeshSpec(...) or cp/ring/ulysses/order, not both")
    else:
        job_mesh = mesh
    sharded: dict[str, nn.Module] = {}
    for component in record.sharded():
        if component.tp != job_tp:
            raise MismatchError(
                f"component {component.name} was converted at tp={component.tp}, the pipeline at tp={job_tp}; this "
                f"version loads every sharded component on the job's mesh: convert it at tp={job_tp} or whole "
                f"(--component {component.name}:whole)"
            )
        cls = _import_class(component.library, component.class_name)
        where = (checkpoint, component.name) if commit is not None else (folder / component.name, None)
        sharded[component.name] = load_sharded(
            cls, where[0], subfolder=where[1], revision=commit, token=token if commit else None, mesh=job_mesh,
            device=device, dtype=dtype, verify=verify, check_inputs=check_inputs,
            replicate_over_cp=component.library == "transformers", compile=compile,
        )  # fmt: skip
    given = dict(components or {})
    overlap = sorted(set(given) & set(sharded))
    if overlap:
        raise UsageError(f"components= gives {overlap[0]}, which the folder holds sharded; leave it out of components=")
    skipped = {c.name: None for c in record.components.values() if c.treatment == "skipped"}
    given = {**skipped, **given}
    torch_dtype = None if cast is None else cast.torch
    if record.index_name == "model_index.json":
        import diffusers

        if blocks is not None:
            raise UsageError("blocks= is for modular pipelines; this folder holds a standard one: leave it out")
        pipeline_class = getattr(diffusers, record.pipeline_class, None)
        if pipeline_class is None:
            raise MismatchError(
                f"the pipeline's index names diffusers.{record.pipeline_class}, which this diffusers does not have; "
                "install a diffusers version that has it"
            )
        options = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
        pipe = pipeline_class.from_pretrained(folder, **sharded, **given, **options, **kwargs)
    else:
        from diffusers import ModularPipeline

        pipe = ModularPipeline.from_pretrained(str(folder)) if blocks is None else blocks.init_pipeline(str(folder))
        whole = [c.name for c in record.components.values() if c.treatment == "whole" and c.name not in given]
        options = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
        if whole:
            pipe.load_components(names=whole, pretrained_model_name_or_path=str(folder), **options, **kwargs)
        pipe.update_components(**sharded, **given)
    for name, component in dict(pipe.components).items():
        if name not in sharded and isinstance(component, nn.Module):
            component.to(rank_device.device)
    for c in record.components.values():
        model = getattr(pipe, c.name, None)
        if c.left_out is not None and isinstance(model, nn.Module) and c.name not in given and c.name not in sharded:
            guard_left_out(model, c.name, c.left_out)
    setattr(pipe, SHARDED_ATTRIBUTE, {name: net.preshard_report for name, net in sharded.items()})
    return pipe
