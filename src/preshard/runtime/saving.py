"""A sharded model's state_dict(), load_state_dict() and save_pretrained() speak full tensors.

Each rank holds only its slices, but the model still answers to diffusers' and torch's names for the whole
thing, so what they return or write must be the whole thing too, never a rank's slices under the full
config. Every sharded tensor is gathered over its TP group and reassembled through its own layout (the
chunks its style cuts, `TensorLayout.boxes`, at their places in each rank's local tensor), so packed blocks,
row- and column-splits and any style that describes itself as a layout come back bit for bit.

- `state_dict()` (on the model or any submodule) returns the full tensors on every rank: a collective, so
  every rank must call it, like `torch.distributed` collectives; it holds the whole model on each rank.
  `local_state_dict(model)` gives this rank's slices instead, named as such.
- `load_state_dict()` accepts full tensors (each rank keeps its slices) as well as this rank's slices.
- `save_pretrained(dir)` is collective too, but streams: one output file at a time is gathered, on the ranks
  of rank 0's TP group only, and global rank 0 writes it, with diffusers' own file layout (the split of
  `huggingface_hub.split_torch_state_dict_into_shards`, safetensors with `{"format": "pt"}`, the index JSON,
  `save_config`), so the folder is byte for byte the one the unsharded model writes. The other ranks write
  nothing. Files land in a staged sibling folder and the folder is published in one step once all are
  written (`format/publish.FolderUpdate`): a failure or a crash leaves the earlier save whole, never a mix.

LoRA adapters (runtime/lora.py) are known: with adapters loaded, state_dict() has PEFT's names (a wrapped
layer's `base_layer`, each adapter's factors) and every tensor in full, as the unsharded model with the same
LoRA returns it; `load_lora_adapter` runs with this rank's slices as the model's state (diffusers and PEFT read
it while they build the adapters); save_pretrained refuses adapters in one line (fuse and unload them first).
Any other parameter added after loading (e.g. a fused projection) has no known layout: state_dict() and
save_pretrained refuse it rather than guessing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from preshard.errors import UsageError
from preshard.format.layout import TensorLayout
from preshard.format.publish import FolderUpdate
from preshard.format.styles import REPLICATE
from preshard.runtime import collectives
from preshard.runtime.changes import ModelChanges

SHARDING_ATTRIBUTE = "preshard_sharding"
_SHARD_FILE = re.compile(r"(.*?)-\d{5}-of-\d{5}")  # diffusers' numbered weight files
_LORA = re.compile(r"lora_(A|B|embedding_A|embedding_B|magnitude_vector)")  # PEFT's adapter containers
# A LoRA factor of a layer: `<layer>.lora_A.<adapter>.weight` (PEFT names; the adapter name has no dot).
_FACTOR = re.compile(r"(?P<layer>.+)\.(?P<factor>lora_[AB])\.(?P<adapter>[^.]+)\.(?P<leaf>weight|bias)")


@dataclass
class Sharding:
    """How this rank's tensors relate to the full ones: the model's state for gathering and slicing."""

    model: str  # class name, for messages
    layouts: dict[str, TensorLayout]  # every tensor preshard loaded, by its name in the model
    tp: int
    tp_rank: int
    tp_group: ProcessGroup | None
    tp_members: list[int]  # TP coordinate of each member of this rank's TP group, in group-rank order
    rank: int
    writer_group: bool  # in global rank 0's TP group: gathers when saving
    device: torch.device
    gather: bool = True  # False inside local_state_dict()
    hooks: list[Any] = field(default_factory=list)

    def full(self, name: str, local: torch.Tensor, layout: TensorLayout | None = None) -> torch.Tensor:
        """The whole tensor `name` (laid out as `layout`, by default its own) from every TP rank's `local` slices
        (collective over the TP group)."""
        layout = layout or self.layouts[name]
        if not layout.sharded or self.tp == 1:
            return local
        stacked = collectives.all_gather_equal(local.detach(), self.tp_group)
        whole = local.new_empty(layout.shape)
        d = layout.shard_dim
        for piece, tp_rank in zip(stacked, self.tp_members, strict=True):
            for offsets, sizes in layout.boxes(self.tp, tp_rank):
                start = layout.local_start((offsets, sizes), self.tp)
                whole.narrow(d, offsets[d], sizes[d]).copy_(piece.narrow(d, start, sizes[d]))
        return whole

    def local(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slices of the whole tensor `name`, in local order (no communication)."""
        layout = self.layouts[name]
        if not layout.sharded or self.tp == 1:
            return whole
        d = layout.shard_dim
        pieces = [whole.narrow(d, o[d], s[d]) for o, s in layout.boxes(self.tp, self.tp_rank)]
        return torch.cat(pieces, d) if len(pieces) > 1 else pieces[0].contiguous()

    def layout_of(self, name: str, local: torch.Tensor) -> TensorLayout | None:
        """The layout of `name` (this rank's slice `local`), also under PEFT's names: a wrapped layer's `base_layer`,
        and its adapters' factors, which runtime/lora.py sliced by the base layer's style (B's rows where the base
        splits its output, A's columns where it splits its input); None for a parameter of unknown layout."""
        plain = name.replace(".base_layer.", ".")
        if plain in self.layouts:
            return self.layouts[plain]
        factor = _FACTOR.fullmatch(plain)
        base = self.layouts.get(f"{factor['layer']}.weight") if factor else None
        if factor is None or base is None:
            return None
        up = factor["factor"] == "lora_B"
        if not base.sharded or up != (base.style.weight_dim == 0):  # this factor is whole on every rank
            return TensorLayout.make(name, REPLICATE, tuple(local.shape), local.dtype, local.dtype)
        if up:
            shape = (base.shape[0], local.shape[1]) if factor["leaf"] == "weight" else (base.shape[0],)
        else:
            shape = (local.shape[0], base.shape[1])
        leaf = f"{factor['layer']}.{factor['factor']}.{factor['leaf']}"
        return TensorLayout.make(leaf, base.style, shape, local.dtype, local.dtype)

    def unknown_parameters(self, module: nn.Module, prefix: str) -> list[str]:
        """Parameters of `module` (named as in the root model) whose layout is unknown (added after loading)."""
        return [prefix + n for n, p in module.named_parameters() if self.layout_of(prefix + n, p) is None]


def attach_saving(
    model: nn.Module,
    layouts: dict[str, TensorLayout],
    *,
    tp: int,
    tp_rank: int,
    tp_group: ProcessGroup | None,
    tp_members: list[int],
    rank: int,
    writer_group: bool,
    device: torch.device,
) -> Sharding:
    """Make state_dict / load_state_dict / save_pretrained of `model` work in full tensors.

    Args:
        model: the loaded, sharded model.
        layouts: the manifest's layout of every tensor loaded into it.
        tp, tp_rank, tp_group, tp_members: the TP degree, this rank's TP coordinate, its TP group and the TP
            coordinate of each member of that group in group-rank order.
        rank: this rank's global rank (0 writes).
        writer_group: whether this rank is in global rank 0's TP group.
        device: the rank's device (for the final status exchange).

    Returns:
        The sharding state, also at `model.preshard_sharding`.
    """
    sharding = Sharding(
        model=type(model).__name__, layouts=dict(layouts), tp=tp, tp_rank=tp_rank, tp_group=tp_group,
        tp_members=list(tp_members), rank=rank, writer_group=writer_group, device=device,
    )  # fmt: skip
    modules = dict(model.named_modules())
    by_module: dict[str, dict[str, str]] = {}
    for name, layout in layouts.items():
        if layout.sharded and tp > 1:
            module_name, _, leaf = name.rpartition(".")
            by_module.setdefault(module_name, {})[leaf] = name
    changes = ModelChanges.of(model)
    for module_name, leaves in by_module.items():
        module = modules[module_name]
        hooks = [
            ("state_dict: gathered", module.register_state_dict_post_hook(_gather_hook(sharding, leaves))),
            ("load_state_dict: sliced", module.register_load_state_dict_pre_hook(_slice_hook(sharding, leaves))),
        ]
        for what, handle in hooks:
            sharding.hooks.append(changes.hook(module_name, what, handle))
    root_prefix = {id(m): n + "." if n else "" for n, m in modules.items()}
    for module_name, module in modules.items():
        # Refuse before any gather starts: a parameter of unknown layout anywhere under the module asked.
        hooks = [
            ("state_dict: unknown parameters refused", module.register_state_dict_pre_hook(
                _refuse_unknown_hook(sharding, root_prefix)
            )),
            ("state_dict: adapters gathered", module.register_state_dict_post_hook(
                _gather_adapters_hook(sharding, root_prefix)
            )),
        ]  # fmt: skip
        for what, handle in hooks:
            sharding.hooks.append(changes.hook(module_name, what, handle))
    changes.set_attribute(model, "", SHARDING_ATTRIBUTE, sharding)
    changes.wrap_method(
        "save_pretrained", "saving: collective, full tensors", lambda own: _bound_save_pretrained(model, sharding)
    )
    if callable(getattr(model, "load_lora_adapter", None)):
        changes.wrap_method(
            "load_lora_adapter",
            "saving: this rank's slices as state_dict",
            lambda inner: _with_local_state(model, inner),
        )
    return sharding


def _with_local_state(model: nn.Module, load_lora_adapter):
    """`load_lora_adapter` with this rank's slices as the model's state: diffusers and PEFT read the model's
    state_dict() while they build adapters (for its names and the local layers' shapes), and a gather there would
    hold the whole model on every rank for nothing."""

    @functools.wraps(load_lora_adapter)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with local_state_dict(model):
            return load_lora_adapter(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def local_state_dict(model: nn.Module) -> Iterator[None]:
    """Inside, `model.state_dict()` returns this rank's slices (no communication), for code that handles them.

    Raises:
        UsageError: `model` is not a model load_sharded returned.
    """
    sharding = _sharding_of(model)
    previous, sharding.gather = sharding.gather, False
    try:
        yield
    finally:
        sharding.gather = previous


def _sharding_of(model: nn.Module) -> Sharding:
    sharding = getattr(model, SHARDING_ATTRIBUTE, None)
    if not isinstance(sharding, Sharding):
        raise UsageError(f"{type(model).__name__} was not loaded by preshard.load_sharded")
    return sharding


def _gather_hook(sharding: Sharding, leaves: dict[str, str]):
    def hook(module, state_dict, prefix, local_metadata):
        if not sharding.gather:
            return
        for leaf, name in leaves.items():
            if prefix + leaf in state_dict:
                state_dict[prefix + leaf] = sharding.full(name, state_dict[prefix + leaf])

    return hook


def _slice_hook(sharding: Sharding, leaves: dict[str, str]):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for leaf, name in leaves.items():
            value = state_dict.get(prefix + leaf)
            layout = sharding.layouts[name]
            if isinstance(value, torch.Tensor) and tuple(value.shape) == layout.shape:
                state_dict[prefix + leaf] = sharding.local(name, value)

    return hook


def _gather_adapters_hook(sharding: Sharding, root_prefix: dict[int, str]):
    """At the top of a state_dict() call: the LoRA factors (added after loading, so no hook of their own) in full."""

    def hook(module, state_dict, prefix, local_metadata):
        if not sharding.gather or (prefix and root_prefix[id(module)]) or sharding.tp == 1:
            return
        for key in [k for k in state_dict if k.startswith(prefix) and _is_factor(k)]:
            name = root_prefix[id(module)] + key[len(prefix) :]
            layout = sharding.layout_of(name, state_dict[key])
            if layout is not None and layout.sharded:
                state_dict[key] = sharding.full(name, state_dict[key], layout)

    return hook


def _is_factor(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _refuse_unknown_hook(sharding: Sharding, root_prefix: dict[int, str]):
    def hook(module, prefix, keep_vars):
        # At the top of a state_dict() call (a module's own prefix is ""), or whenever it reaches the root model.
        if not sharding.gather or (prefix and root_prefix[id(module)]):
            return
        refuse_unknown(sharding, module, root_prefix[id(module)])

    return hook


def refuse_unknown(sharding: Sharding, module: nn.Module, prefix: str) -> None:
    """Raise, before any gather starts, if `module` holds a parameter preshard did not load.

    Raises:
        UsageError: naming the parameters of unknown layout.
    """
    unknown = sharding.unknown_parameters(module, prefix)
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise UsageError(
            f"{sharding.model}: the state of a sharded model is gathered into full tensors, but {shown} was added "
            "after load_sharded, so how it is split across ranks is unknown; save before adding it, or read this "
            "rank's tensors with preshard.runtime.saving.local_state_dict(model)"
        )


def refuse_adapters(sharding: Sharding, model: nn.Module) -> None:
    """Raise if LoRA adapters are loaded: what save_pretrained would write (base_layer and factor names) is no
    checkpoint from_pretrained can read, on a sharded model or not.

    Raises:
        UsageError: naming the adapters and the two ways out.
    """
    adapters = _adapter_names([name for name, _ in model.named_parameters()])
    if adapters:
        raise UsageError(
            f"{sharding.model}: LoRA adapters are loaded ({', '.join(adapters)}), so save_pretrained would write "
            "PEFT's wrapped names, which from_pretrained cannot read; fuse them and drop the adapters first "
            "(model.fuse_lora(); model.unload_lora()), or fuse the LoRA into the checkpoint: convert-checkpoint SRC "
            "OUT --lora FILE"
        )


def _adapter_names(names: list[str]) -> list[str]:
    """The PEFT adapters among parameter names (`...to_q.lora_A.<adapter>.weight`)."""
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(parts[i + 1] for i in range(len(parts) - 1) if _LORA.fullmatch(parts[i]))
    return sorted(found)


def _bound_save_pretrained(model: nn.Module, sharding: Sharding):
    def save_pretrained(
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        save_function: Any = None,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str = "10GB",
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """diffusers' `save_pretrained`, collective: call it on every rank; global rank 0 writes the full model.

        Args:
            save_directory: the folder to write (created if missing).
            is_main_process: accepted for diffusers' signature; the writer is always global rank 0.
            safe_serialization, variant, max_shard_size: as diffusers (safetensors or torch.save files, a
                variant infix, the largest file).
            save_function, push_to_hub, kwargs: not supported by a sharded model (refused).

        Raises:
            UsageError: an unsupported option, or a parameter added after loading.
            OSError: rank 0 could not write (raised on every rank, nothing is left half-written).
        """
        unsupported = [k for k, v in {"save_function": save_function, "push_to_hub": push_to_hub}.items() if v]
        unsupported += [k for k, v in kwargs.items() if v]
        if unsupported:
            raise UsageError(
                f"save_pretrained of a sharded {sharding.model} does not support {', '.join(unsupported)}; save to a "
                "folder, then upload it with huggingface_hub (HfApi().upload_folder)"
            )
        save_sharded(model, sharding, Path(save_directory), safe_serialization, variant, max_shard_size)

    return save_pretrained


def _add_variant(name: str, variant: str | None) -> str:
    """diffusers' naming: the variant goes before the last extension."""
    if not variant:
        return name
    stem, _, ext = name.rpartition(".")
    return f"{stem}.{variant}.{ext}"


def _weights_name(safe_serialization: bool, variant: str | None) -> str:
    return _add_variant("diffusion_pytorch_model." + ("safetensors" if safe_serialization else "bin"), variant)


def _index_name(safe_serialization: bool, variant: str | None) -> str:
    ext = "safetensors" if safe_serialization else "bin"
    return _add_variant(f"diffusion_pytorch_model.{ext}.index.json", variant)


def save_sharded(
    model: nn.Module,
    sharding: Sharding,
    directory: Path,
    safe_serialization: bool = True,
    variant: str | None = None,
    max_shard_size: int | str = "10GB",
) -> None:
    """Write the full model as diffusers' save_pretrained does, from every rank's slices (collective)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    if directory.is_file():
        raise UsageError(f"save_pretrained: {directory} is a file; give a folder")
    refuse_adapters(sharding, model)
    refuse_unknown(sharding, model, "")
    with local_state_dict(model):
        local = model.state_dict()
    shapes = {
        name: torch.empty(sharding.layouts[name].shape if name in sharding.layouts else t.shape, dtype=t.dtype,
                          device="meta")
        for name, t in local.items()
    }  # fmt: skip
    weights_name = _weights_name(safe_serialization, variant)
    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size, filename_pattern=pattern)

    # Rank 0's file work may fail; the gathers must go on regardless (the other ranks are in them), so a
    # failure is kept, the remaining writes skipped, and every rank learns of it in the last exchange.
    files = _Staging(directory) if sharding.rank == 0 else None
    for filename, names in split.filename_to_tensors.items():
        if not sharding.writer_group:
            continue  # the ranks of other TP groups hold the same slices: nothing of theirs is needed
        host = {}
        for n in names:  # one full tensor on the device at a time, one file in rank 0's host memory
            whole = sharding.full(n, local[n]) if n in sharding.layouts else local[n]
            if files is not None and files.ok:
                host[n] = whole.detach().cpu().contiguous()
            del whole
        if files is not None:
            files.run(_write_file, filename, host, safe_serialization)
        del host
    if files is not None:
        if split.is_sharded:
            index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
            files.run(
                _write_text, _index_name(safe_serialization, variant), json.dumps(index, indent=2, sort_keys=True)
            )
        files.run(lambda path: model.save_config(path.parent), "config.json")
        stale_index = None if split.is_sharded else _index_name(safe_serialization, variant)
        files.commit(weights_name, set(split.filename_to_tensors), stale_index)
    failure = files.failure if files is not None else None
    failed_somewhere = failure is not None
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        status = torch.tensor([int(failed_somewhere)], dtype=torch.int64, device=sharding.device)
        failed_somewhere = bool(collectives.all_reduce_sum(status, None).item())
    if failure is not None:
        raise failure
    if failed_somewhere:
        raise OSError(f"save_pretrained of {sharding.model} to {directory} failed on rank 0 (see its error)")


class _Staging:
    """Rank 0's files, written into a staged sibling of the target (`format/publish.FolderUpdate`) and published
    with what the folder keeps in one step, once all exist: a failure or crash leaves the earlier save whole."""

    def __init__(self, directory: Path) -> None:
        self.update: FolderUpdate | None = None
        self.failure: BaseException | None = None
        try:
            self.update = FolderUpdate(directory, "preshard-save")
        except BaseException as exc:  # noqa: BLE001 - reported after the collectives
            self.failure = exc

    @property
    def ok(self) -> bool:
        return self.failure is None

    def run(self, write, name: str, *args: Any) -> None:
        if self.ok and self.update is not None:
            try:
                write(self.update.path / name, *args)
            except BaseException as exc:  # noqa: BLE001 - reported after the collectives
                self.failure = exc

    def commit(self, weights_name: str, keep: set[str], stale_index: str | None) -> None:
        if self.update is None:
            return
        if not self.ok:
            self.update.abandon()
            return
        directory = self.update.target

        def drop(name: str) -> bool:  # an unsharded save: an earlier index would point at removed files
            return name == stale_index or _stale(directory / name, weights_name, keep)

        try:
            self.update.commit(drop)
        except BaseException as exc:  # noqa: BLE001 - reported after the collectives
            self.failure = exc


def _write_text(path: Path, text: str) -> None:
    path.write_text(text + "\n")


def _write_file(path: Path, tensors: dict[str, torch.Tensor], safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def _stale(path: Path, weights_name: str, keep: set[str]) -> bool:
    """A numbered weight file of an earlier save that this one does not write, as diffusers removes them."""
    stem = weights_name.replace(".bin", "").replace(".safetensors", "")
    if path.name in keep or not path.is_file():
        return False
    bare = path.name.replace(".bin", "").replace(".safetensors", "")
    return path.name.startswith(stem) and _SHARD_FILE.fullmatch(bare) is not None
