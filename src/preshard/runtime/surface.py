"""What a pipeline calls on its transformer, made to work (or refuse in one line) on a sharded model.

Attached last by load_sharded: the input check as the first forward pre-hook (consistency.py), full-tensor
state_dict / load_state_dict / save_pretrained (saving.py), and the refusal of moves to another device
(device_guard.py). Everything else a diffusers pipeline touches (`dtype`, `device`, `config`, casts,
`set_attn_processor` under TP, callbacks, any batch size) works unchanged on the sharded model.
"""

from __future__ import annotations

from torch import nn

from preshard.format.manifest import Manifest
from preshard.format.mesh import MeshSpec
from preshard.runtime import collectives
from preshard.runtime.consistency import attach_input_check
from preshard.runtime.device_guard import attach_device_guard
from preshard.runtime.devices import RankDevice
from preshard.runtime.groups import MeshGroups
from preshard.runtime.report import LoadReport
from preshard.runtime.saving import attach_saving


def attach_model_surface(
    model: nn.Module,
    manifest: Manifest,
    mesh: MeshSpec,
    groups: MeshGroups,
    rank_device: RankDevice,
    input_mode: str,
    report: LoadReport,
) -> None:
    """Attach the input check, the full-tensor state and the device guard to a loaded, sharded model."""
    members = collectives.group_ranks(groups.tp) if groups.tp is not None else [groups.rank]
    attach_saving(
        model,
        {name: record.layout for name, record in manifest.tensors.items()},
        tp=manifest.tp,
        tp_rank=groups.coords["tp"],
        tp_group=groups.tp,
        tp_members=[mesh.coords(r)["tp"] for r in members],
        rank=groups.rank,
        writer_group=0 in members,
        device=rank_device.device,
    )
    attach_device_guard(model, rank_device.device, mesh.world_size)
    if mesh.world_size > 1 and input_mode != "off":
        own_parts = tuple(manifest.plan.tp_split_inputs) if manifest.tp > 1 else ()  # each rank's part may differ
        attach_input_check(model, input_mode, rank_device.device, own_parts)
        what = "rank 0's broadcast to" if input_mode == "broadcast" else "fingerprints compared across"
        report.input_check = f"{what} ranks 0-{mesh.world_size - 1} on every forward"
