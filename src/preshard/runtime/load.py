"""load_sharded: in each rank of a torchrun job, build the model, read this rank's shard onto its
device, place the buffers no checkpoint holds, and attach the TP and CP forward hooks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from preshard.errors import PreshardError
from preshard.manifests.io import read_manifest
from preshard.manifests.schema import Manifest
from preshard.mesh import MeshGroups, MeshSpec, build_groups
from preshard.plans.styles import Style
from preshard.runtime.construct import build_model, check_against_manifest, divide_heads, localise_linear
from preshard.runtime.devices import RankDevice, init_rank_device
from preshard.runtime.reader import ShardReader
from preshard.runtime.report import REPORT_ATTRIBUTE, LoadReport
from preshard.runtime.tp import make_row_parallel


def load_sharded(
    model: type | Callable[[], nn.Module] | nn.Module,
    checkpoint: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    order: str | tuple[str, ...] | None = None,
    verify: bool = False,
    place_buffers: bool = True,
) -> nn.Module:
    """Load this rank's shard of a converted checkpoint into `model` (a class, a factory or an instance).

    The TP degree is the checkpoint's; `ring`, `ulysses` and `order` default to the mesh it was
    converted for and may be changed here, since context parallelism does not change the weights.
    `dtype` casts floating parameters (not those the model keeps in float32). `verify` checks every
    chunk this rank reads against its checksum. Every rank passes the same full inputs to the
    returned model.
    """
    start = time.perf_counter()
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    rank_device = init_rank_device(device)
    mesh = _load_mesh(manifest, rank_device, ring, ulysses, order)
    groups = build_groups(mesh, rank_device.rank)
    tp_rank = groups.coords["tp"]

    net = build_model(model, checkpoint, manifest)
    check_against_manifest(net, manifest)
    report = _new_report(rank_device, mesh, groups, checkpoint)
    _localise(net, manifest)
    report.heads_divided = divide_heads(net, manifest.plan.get("attention", []), mesh.tp)

    keep_fp32 = list(getattr(type(net), "_keep_in_fp32_modules", None) or [])
    with ShardReader(checkpoint, manifest, tp_rank, verify=verify, pin=rank_device.pin_host_memory) as reader:
        for name, tensor in manifest.tensors.items():
            local = torch.empty(
                _local_shape(tensor.shape, tensor.shard_dim, mesh.tp),
                dtype=_target_dtype(name, tensor.dtype, dtype, keep_fp32),
                device=rank_device.device,
            )
            reader.read(name, local)
            _assign(net, name, local)
    report.bytes_read, report.chunks_read = reader.stats.bytes_read, reader.stats.chunks
    report.files_read, report.verified, report.read_seconds = reader.stats.files, verify, reader.stats.seconds

    if place_buffers:
        report.buffers_placed = place_unloaded_buffers(net, manifest, rank_device.device)
    check_placement(net, rank_device.device)
    _attach_tp(net, manifest, groups, report)
    if mesh.cp > 1:
        from preshard.runtime.cp import attach_context_parallel

        attach_context_parallel(net, manifest.plan, groups, rank_device, report)
    net.requires_grad_(False)
    report.total_seconds = time.perf_counter() - start
    setattr(net, REPORT_ATTRIBUTE, report)
    return net


def _load_mesh(manifest: Manifest, rank_device: RankDevice, ring, ulysses, order) -> MeshSpec:
    saved = MeshSpec.from_dict(manifest.mesh)
    if ring is None and ulysses is None:
        ring, ulysses = saved.ring, saved.ulysses
    mesh = MeshSpec(tp=saved.tp, ring=ring or 1, ulysses=ulysses or 1, order=order_tuple(order) or saved.order)
    if mesh.world_size != rank_device.world_size:
        raise PreshardError(
            f"world size {rank_device.world_size} does not match the mesh {mesh.describe()} = {mesh.world_size} ranks; "
            f"launch {mesh.world_size} ranks (torchrun --nproc-per-node {mesh.world_size}) or pass ring=/ulysses= "
            f"whose product with tp={mesh.tp} is {rank_device.world_size}"
        )
    return mesh


def order_tuple(order: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if isinstance(order, str):
        return tuple(p.strip() for p in order.split(",") if p.strip())
    return tuple(order) if order else None


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


def _local_shape(shape: list[int], shard_dim: int | None, tp: int) -> list[int]:
    local = list(shape)
    if shard_dim is not None:
        local[shard_dim] //= tp
    return local


def _target_dtype(name: str, stored: str, requested: torch.dtype | None, keep_fp32: list[str]) -> torch.dtype:
    dtype = getattr(torch, stored)
    if requested is None or not dtype.is_floating_point or dtype.itemsize == 1:
        return dtype
    if any(part in name.split(".") for part in keep_fp32):
        return dtype
    return requested


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _localise(net: nn.Module, manifest: Manifest) -> None:
    """Planned Linear layers take their local shapes before anything is allocated."""
    shard_dims: dict[str, dict[str, int | None]] = {}
    for name, tensor in manifest.tensors.items():
        if tensor.shard_dim is not None:
            module, leaf = _split(name)
            shard_dims.setdefault(module, {})[leaf] = tensor.shard_dim
    for module_name, dims in shard_dims.items():
        module = net.get_submodule(module_name)
        if not isinstance(module, nn.Linear):
            raise PreshardError(f"the plan shards {module_name}, which is a {type(module).__name__}, not nn.Linear")
        localise_linear(module, dims, manifest.tp)


def _assign(net: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, leaf = _split(name)
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
        raise PreshardError(f"{len(wrong)} tensors are not on {device} after loading: {shown}")


def _attach_tp(net: nn.Module, manifest: Manifest, groups: MeshGroups, report: LoadReport) -> None:
    tp_rank = groups.coords["tp"]
    for name, tensor in manifest.tensors.items():
        style = Style(tensor.style)
        if not name.endswith(".weight") or not style.input_sharded:
            continue
        module_name, _ = _split(name)
        description = make_row_parallel(
            net.get_submodule(module_name), groups.tp, tp_rank, manifest.tp,
            slice_input=style is Style.REPLICATED_INPUT_ROWWISE,
        )  # fmt: skip
        report.add_hook(module_name, description)
