"""load_sharded: in each rank of a torchrun job, build the model, read this rank's shard onto its device,
place the buffers no checkpoint holds, and attach the TP and CP forward hooks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from preshard.errors import MismatchError, PlanError, PreshardError, UsageError
from preshard.format.dtypes import DType, parse_load_dtype
from preshard.format.locate import is_url, local_path
from preshard.format.manifest import MANIFEST_NAME, Manifest
from preshard.format.mesh import MeshSpec, resolve_mesh
from preshard.format.quant import is_companion
from preshard.format.styles import Style
from preshard.process import one_line_errors_under_torchrun
from preshard.runtime import collectives, quant
from preshard.runtime.agreement import agree_on_checkpoint, agree_on_outcome
from preshard.runtime.changes import ModelChanges
from preshard.runtime.compile_cache import CompileOptions, compile_loaded
from preshard.runtime.consistency import parse_mode
from preshard.runtime.construct import (
    build_model,
    check_against_manifest,
    check_config,
    divide_heads,
    ignored_tensors,
    localise,
    localise_attributes,
)
from preshard.runtime.devices import RankDevice
from preshard.runtime.groups import MeshGroups, build_groups
from preshard.runtime.held import HeldCheckpoint
from preshard.runtime.hf_model import localise_kv_groups, retie, tied_parameters, tied_splits
from preshard.runtime.left_out import guard_left_out
from preshard.runtime.lora import attach_lora_loading
from preshard.runtime.reader import ShardReader
from preshard.runtime.rendezvous import DEFAULT_TIMEOUT_S, join_job
from preshard.runtime.report import REPORT_ATTRIBUTE, LoadReport
from preshard.runtime.surface import attach_model_surface
from preshard.runtime.tp import (
    ParallelEmbedding,
    ParallelLinear,
    parallelize_linear,
    parallelize_module,
    parallelize_norms,
    slice_head_masks,
    split_inputs,
    split_outputs,
)
from preshard.units import plural


def load_sharded(
    model: type | Callable[[], nn.Module] | nn.Module,
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
    revision: str | None = None,
    token: str | bool | None = None,
    subfolder: str | None = None,
    check_inputs: bool | str = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    replicate_over_cp: bool = False,
    compile: bool | CompileOptions = False,
) -> nn.Module:
    """Load this rank's shard of a converted checkpoint into `model`, with the TP and CP hooks attached.

    Every rank of the job calls this with the same arguments, then passes the same full inputs to the
    returned model, which computes the unsharded model's function.

    Args:
        model: a model class (built from the checkpoint's config.json), a zero-argument factory, or an
            instance (its parameters may be on the meta device).
        checkpoint: the folder `convert-checkpoint` wrote, a Hub repo id holding one, or an object-storage URL of one
            ("s3://bucket/h3-tp8", any fsspec URL: each rank fetches only its records, docs/object-storage.md).
        mesh, cp, ring, ulysses, order: the CP layout to run (default: the one converted for). The TP degree is
            the checkpoint's; CP does not change the weights, so it can differ from conversion time. Give a
            `MeshSpec` or the keywords, not both.
        device: "cpu", "cuda", "xla", "neuron" or a torch.device (default: CUDA if available, else CPU; XLA
            only when PJRT_DEVICE names an accelerator).
        torch_dtype: as diffusers' `from_pretrained(torch_dtype=...)`: cast floating parameters and buffers to
            bf16/fp16/fp32 (a torch dtype or a string), the modules the class lists in `_keep_in_fp32_modules` to
            float32, quantized weights as stored. Default (or "auto"): each tensor as stored, as transformers'
            default ("auto") keeps the checkpoint's dtype; diffusers' `from_pretrained` default is float32 instead:
            `torch_dtype=torch.float32` gives the numbers of `from_pretrained(source)` without torch_dtype.
        dtype: an alias of `torch_dtype` (both given and different: a `UsageError`).
        verify: check every chunk this rank reads against its xxh3_64, hashed beside the read (the default);
            False skips only that, for storage the caller vouches for (the structural and framing checks always
            run).
        revision, token: for a Hub repo.
        subfolder: the folder inside `checkpoint` (a Hub repo or a local folder) that holds the converted checkpoint,
            e.g. "transformer" for a pipeline repo.
        check_inputs: compare a fingerprint of the tensor inputs across ranks on every forward and refuse a
            difference (True, the default); False skips it; "broadcast" uses rank 0's inputs on every rank.
        timeout: seconds a rank waits for the others to join the job (default 60); before the process group is
            made, the ranks also agree on device kind, dtype, mesh, checkpoint and check_inputs.
        replicate_over_cp: run the model with TP only on a mesh with CP axes: each CP group holds a replica of the
            TP shards and runs it on the same full inputs (no CP hooks), e.g. a pipeline's text encoder on the
            transformer's tp x cp mesh. A model without a CP plan on such a mesh needs it.
        compile: return `torch.compile(model)` (True, or `CompileOptions(...)` for the backend, mode and cache), whose
            first call loads the programs a previous load with the same key compiled, or saves its own
            (`preshard.runtime.compile_cache`; they are code: see docs/compile-cache.md on trusting them).

    Returns:
        The model, with `model.preshard_report` describing what was read and which hooks sit where.

    Raises:
        CorruptCheckpointError: a damaged or edited checkpoint (manifest, data files, config.json).
        MismatchError: the model, its config or the job's world size disagrees with the checkpoint, or the ranks
            were called with different arguments.
        JobTimeoutError: a rank did not join within `timeout` seconds.
        UsageError, DeviceError, PlanError: bad arguments, an unavailable device, a plan that does not fit.
        Under torchrun, such an error that nothing catches prints as one line per rank, `error: rank R: ...`
        (`preshard.process.one_line_errors_under_torchrun`), and the job exits non-zero.
    """
    try:
        return _load_sharded(
            model, checkpoint, mesh=mesh, cp=cp, ring=ring, ulysses=ulysses, order=order, device=device,
            torch_dtype=torch_dtype, dtype=dtype, verify=verify, revision=revision, token=token, subfolder=subfolder,
            check_inputs=check_inputs, timeout=timeout, replicate_over_cp=replicate_over_cp, compile=compile,
        )  # fmt: skip
    except PreshardError:
        one_line_errors_under_torchrun()
        raise


def _load_sharded(
    model, checkpoint, *, mesh, cp, ring, ulysses, order, device, dtype, verify, revision, token, subfolder=None,
    torch_dtype=None,
    check_inputs=True,
    place_buffers=True,
    timeout=DEFAULT_TIMEOUT_S,
    replicate_over_cp=False,
    compile=False,
) -> nn.Module:  # fmt: skip
    """`load_sharded`, with a switch tests use to leave buffers where the model put them."""
    start = time.perf_counter()
    cast = input_mode = refused = None
    try:
        cast, input_mode = parse_load_dtype(torch_dtype, dtype), parse_mode(check_inputs)
    except PreshardError as exc:  # told to the other ranks as they join, so that none waits for this one
        refused = exc
    # First, with a bounded wait: a rank of a Hub checkpoint must know its TP coordinate (preshard.runtime.rendezvous).
    requests = {"dtype": cast and cast.name, "mesh": mesh.to_dict() if mesh else [cp, ring, ulysses, order],
                "checkpoint": [str(checkpoint), subfolder, revision], "check_inputs": input_mode}  # fmt: skip
    rank_device = join_job(device, requests, timeout=timeout, error=refused)

    # Open (and hold) everything this rank reads, then agree with the other ranks that it is the same checkpoint.
    held = commit = run_mesh = None
    error: BaseException | None = None
    try:
        opened = _open_checkpoint(checkpoint, revision, token, subfolder, rank_device, mesh, cp, ring, ulysses, order)
        held, commit, run_mesh = opened
    except Exception as exc:  # told to the other ranks first, so that none waits for this one
        error = exc
    try:
        digest = held and held.manifest.digest
        agree_on_checkpoint(
            rank_device, digest, commit, error, str(checkpoint), {"device": rank_device.kind, **requests}
        )
        net = _load_held(
            model, held, run_mesh, rank_device, cast, verify, place_buffers, start, input_mode, replicate_over_cp
        )
        return compile_loaded(net, compile, folder=held.path, remote=commit is not None, digest=held.manifest.digest)
    finally:
        if held is not None:
            held.close()


def _open_checkpoint(
    checkpoint, revision, token, subfolder, rank_device: RankDevice, mesh, cp, ring, ulysses, order
) -> tuple[HeldCheckpoint, str | None, MeshSpec]:
    """This rank's checkpoint, opened and held (a Hub repo's files fetched first), its Hub commit, the run mesh."""
    path = local_path(checkpoint, subfolder, revision, option="revision=")
    if is_url(checkpoint):
        held, commit = _open_object_rank(checkpoint, revision, subfolder, rank_device, mesh, cp, ring, ulysses, order)
    elif path is not None or not isinstance(checkpoint, str):
        path = path if path is not None else Path(checkpoint)  # a Path that does not exist: named missing below
        if path.is_file():
            hint = f"the folder {path.parent}" if path.name == MANIFEST_NAME else "the folder convert-checkpoint wrote"
            raise UsageError(f"checkpoint {checkpoint} is a file, not a checkpoint folder; pass {hint}")
        held, commit = HeldCheckpoint.open(path), None
    else:
        from huggingface_hub import constants

        from preshard.runtime.hub import fetch_rank_checkpoint

        def tp_rank_of(manifest: Manifest) -> int:
            return _run_mesh(manifest, rank_device, mesh, cp, ring, ulysses, order).coords(rank_device.rank)["tp"]

        fetched = fetch_rank_checkpoint(
            checkpoint, tp_rank=tp_rank_of, revision=revision, token=token, subfolder=subfolder
        )
        # Its links lead into the HF cache (preshard's own rank folder, or a snapshot): allowed there, nowhere else.
        held = HeldCheckpoint.open(fetched.folder, link_root=constants.HF_HUB_CACHE, manifest=fetched.manifest)
        commit = fetched.commit
    try:
        run_mesh = _run_mesh(held.manifest, rank_device, mesh, cp, ring, ulysses, order)
        held.open_data(held.manifest.files_for_tp_rank(run_mesh.coords(rank_device.rank)["tp"]))
    except BaseException:
        held.close()
        raise
    return held, commit, run_mesh


def _open_object_rank(
    url: str, revision, subfolder, rank_device: RankDevice, mesh, cp, ring, ulysses, order
) -> tuple[HeldCheckpoint, None]:
    """An object-storage checkpoint: this rank's records fetched into its local rank folder, then held."""
    from preshard.runtime.object_rank import fetch_rank_checkpoint as fetch_object_rank

    if revision is not None:
        raise UsageError(f"revision= applies to Hub repos, but {url} is an object-storage URL; drop revision=")

    def tp_rank_of(manifest: Manifest) -> int:
        return _run_mesh(manifest, rank_device, mesh, cp, ring, ulysses, order).coords(rank_device.rank)["tp"]

    fetched = fetch_object_rank(url, tp_rank=tp_rank_of, subfolder=subfolder)
    return HeldCheckpoint.open(fetched.folder, manifest=fetched.manifest), None


def _load_held(
    model, held: HeldCheckpoint, run_mesh: MeshSpec, rank_device: RankDevice, cast, verify, place_buffers, start,
    input_mode: str, replicate_over_cp: bool = False,
) -> nn.Module:  # fmt: skip
    """Build the model and read this rank's shard from the files `held` opened (every rank agreed on them)."""
    manifest, checkpoint, config = held.manifest, held.path, held.config
    groups = build_groups(run_mesh, rank_device.rank)
    error: BaseException | None = None
    try:
        collectives.check_backend_supports(
            rank_device.backend,
            {axis: run_mesh.groups(axis) for axis in ("tp", "ring", "ulysses", "cp")},
            run_mesh.world_size,
            neuron=rank_device.kind == "neuron",
        )
        tp_rank = groups.coords["tp"]

        net = build_model(model, checkpoint, config)
        quantized = quant.quantized_weights(manifest, config)
        quant.prepare(net, manifest, quantized)
        left_out = manifest.source.left_out
        if left_out is not None:  # its head is not in the checkpoint: a module that refuses a call stands there
            guard_left_out(net, checkpoint.name, left_out)
        check_against_manifest(net, manifest)
        check_config(net, config)
        aliases = tied_parameters(net)
        tied = tied_splits(manifest, aliases)  # before reading: a plan that leaves one out is refused at once
        report = _new_report(rank_device, run_mesh, groups, checkpoint)
        report.manifest_digest = manifest.digest
        sharded = localise(net, manifest)
        report.heads_divided = divide_heads(net, manifest)
        for name, kv_groups in localise_kv_groups(net, manifest).items():
            report.heads_divided.setdefault(name, []).append(f"num_key_value_groups={kv_groups}")

        keep_fp32 = list(getattr(type(net), "_keep_in_fp32_modules", None) or [])
        skipped = ignored_tensors(net, manifest)
        locals_ = {
            name: torch.empty(
                record.layout.local_shape(manifest.tp),
                dtype=_target_dtype(name, record.layout.dtype, cast, keep_fp32),
                device=rank_device.device,
            )
            for name, record in manifest.tensors.items()
            if name not in skipped
        }
        fds = held.open_data(manifest.files_for_tp_rank(tp_rank))
        pin = rank_device.pin_host_memory
        with ShardReader(checkpoint, manifest, tp_rank, verify=verify, pin=pin, fds=fds) as reader:
            reader.read_all(locals_)
        quant.check_scales(locals_, quantized)
    except Exception as exc:  # told to the other ranks at the end of the load, so that none goes on alone
        error = exc
    # Every rank read what it agreed on; that checkpoint must still be the one at the path, on every rank.
    agree_on_outcome(rank_device, error, held.replaced() if error is None else None)
    for name, local in locals_.items():
        _assign(net, name, local)
    retie(net, aliases)
    report.bytes_read, report.chunks_read = reader.stats.bytes_read, reader.stats.chunks
    report.files_read, report.verified, report.read_seconds = reader.stats.files, verify, reader.stats.seconds

    if place_buffers:
        report.buffers_placed = place_unloaded_buffers(net, manifest, rank_device.device)
    check_placement(net, rank_device.device)
    # Norms are parallelised below, with the ones that have no weight; LoRA adapters only ever target linears.
    experts = {name: _experts_style(manifest, name) for name in sharded if f"{name}.weight" not in manifest.tensors}
    linears = {
        name: module
        for name, module in sharded.items()
        if name not in experts and manifest.tensors[f"{name}.weight"].layout.style.module_kind == "linear"
    }
    changes = ModelChanges.of(net)  # the record of every change below, each with its undo
    for module_name, module in linears.items():
        style = manifest.tensors[f"{module_name}.weight"].layout.style
        description = parallelize_linear(module, style, groups.tp, tp_rank, manifest.tp, changes, module_name)
        if description is not None:
            report.add_hook(module_name, description)
    for module_name, style in experts.items():
        module = sharded[module_name]
        description = parallelize_module(module, style, groups.tp, tp_rank, manifest.tp, changes, module_name)
        if description is not None:
            report.add_hook(module_name, description)
    embeddings = {  # split by vocabulary, and the modules tied to a split tensor (a tied lm_head)
        **{n: manifest.tensors[f"{n}.weight"].layout.style for n, m in sharded.items() if isinstance(m, nn.Embedding)},
        **tied,
    }
    for module_name, style in embeddings.items():
        module = net.get_submodule(module_name)
        if isinstance(module, (ParallelLinear, ParallelEmbedding)):  # one module under two names
            continue
        localise_attributes(module)
        description = parallelize_module(module, style, groups.tp, tp_rank, manifest.tp, changes, module_name)
        if description is not None:
            report.add_hook(module_name, description)
    tp_hooks = {
        **parallelize_norms(net, manifest.plan, groups.tp, tp_rank, manifest.tp, changes),
        **split_outputs(net, manifest.plan, tp_rank, manifest.tp, changes),
        **split_inputs(net, manifest.plan, tp_rank, manifest.tp, changes),
        **slice_head_masks(net, manifest.plan, tp_rank, manifest.tp, changes),
    }
    dequantize_to = quant.compute_dtype(net, cast.torch if cast is not None else None)
    tp_hooks.update(quant.attach(net, quantized, dequantize_to))
    for module_name, description in tp_hooks.items():
        report.add_hook(module_name, description)
    attach_lora_loading(net, linears, manifest, groups.tp, tp_rank, report)
    if run_mesh.cp > 1 and not replicate_over_cp:
        from preshard.runtime.cp import attach_context_parallel

        attach_context_parallel(net, manifest.plan, groups, rank_device, report)
    attach_model_surface(net, manifest, run_mesh, groups, rank_device, input_mode, report)
    quant.attach_state_views(net, quantized)
    net.requires_grad_(False)
    report.total_seconds = time.perf_counter() - start
    report.changes = changes
    changes.set_attribute(net, "", REPORT_ATTRIBUTE, report)
    return net


def _experts_style(manifest: Manifest, module: str) -> Style:
    """The style of a sharded module without a `weight`: an experts module's (`split_experts`), by its parameters."""
    prefix = f"{module}."
    own = [r for n, r in manifest.tensors.items() if n.startswith(prefix) and "." not in n[len(prefix) :]]
    styles = {r.layout.style for r in own}
    kinds = [style for style in styles if style.module_kind == "experts"]
    if len(kinds) != 1 or len(styles) != 1:
        names = sorted(style.name for style in styles)
        raise PlanError(f"the plan splits {module}, which has no weight, with {names}; only split_experts splits that")
    return kinds[0]


def _run_mesh(manifest: Manifest, rank_device: RankDevice, mesh, cp, ring, ulysses, order) -> MeshSpec:
    saved = manifest.mesh
    run = resolve_mesh(mesh, None, cp, ring, ulysses, order, default=saved)  # the TP degree is the checkpoint's
    if run.tp != saved.tp:
        raise MismatchError(
            f"mesh tp={run.tp} differs from the checkpoint's tp={saved.tp}; reshard the checkpoint "
            f"(preshard reshard IN OUT --tp {run.tp}) or pass a mesh with tp={saved.tp}"
        )
    if run.world_size != rank_device.world_size:
        raise MismatchError(world_size_message(run, rank_device.world_size))
    return run


def world_size_message(run: MeshSpec, world: int) -> str:
    """The job has `world` ranks, the mesh needs another number: say how to launch it, and, where the job's size can
    work (a multiple of the TP degree), which CP layout would fit it instead."""
    how = "this process runs alone (not under torchrun)" if world == 1 else f"the job has {plural(world, 'rank')}"
    message = (
        f"the mesh {run.describe()} needs {plural(run.world_size, 'rank')} but {how}; launch it with torchrun "
        f"--nproc-per-node {run.world_size} (or --nnodes N --nproc-per-node {run.world_size}/N across N hosts)"
    )
    if world > 1 and world % run.tp == 0:
        message += f", or pass cp={world // run.tp} (or ring=/ulysses= with that product) to run on {world} ranks"
    elif world > 1 and world % run.tp:
        message += f"; the checkpoint's tp={run.tp} needs a multiple of {run.tp} ranks"
    return message


def _new_report(rank_device: RankDevice, mesh: MeshSpec, groups: MeshGroups, checkpoint: Path) -> LoadReport:
    return LoadReport(
        rank=rank_device.rank,
        world_size=rank_device.world_size,
        mesh=mesh.to_dict(),
        coords=groups.coords,
        groups=dict(groups.ranks),
        device=str(rank_device.device),
        backend=rank_device.backend,
        checkpoint=str(checkpoint),
    )


def _target_dtype(name: str, stored: DType, requested: DType | None, keep_fp32: list[str]) -> torch.dtype:
    """torch's dtype for the parameter: the stored one, or the requested cast (floating ones); as diffusers'
    `from_pretrained(torch_dtype=...)`, float32 for the modules the class keeps in float32."""
    if requested is None or not stored.is_floating_point or stored.itemsize == 1 or is_companion(name):
        return stored.torch
    if any(part in name.split(".") for part in keep_fp32):
        return torch.float32
    return requested.torch


def _assign(net: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = net.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def place_unloaded_buffers(net: nn.Module, manifest: Manifest, device: torch.device) -> list[str]:
    """Move every buffer that no checkpoint holds (computed in __init__) to the device, keeping its dtype."""
    placed = []
    for module_name, module in net.named_modules():
        for leaf, buf in module._buffers.items():
            name = f"{module_name}.{leaf}" if module_name else leaf
            if buf is None or name in manifest.tensors or buf.device.type == "meta":
                continue
            if buf.device != device:
                module._buffers[leaf] = buf.to(device)
            placed.append(name)
    return placed


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_placement(net: nn.Module, device: torch.device) -> None:
    """Nothing may remain on meta or on another device: name the tensors that do."""
    wrong = [
        f"{name} ({t.device})"
        for name, t in [*net.named_parameters(), *net.named_buffers()]
        if not _same_device(t.device, device)
    ]
    if wrong:
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise MismatchError(
            f"{plural(len(wrong), 'tensor')} {'is' if len(wrong) == 1 else 'are'} not on {device} after loading: "
            f"{shown}"
        )
