"""Build the model with parameters on the meta device and real buffers, check it against the checkpoint,
then give it local shapes.

No rank ever allocates the full model: parameters are moved to meta the moment they are registered
(their `torch.empty` storage is never touched, so never paged in), while buffers computed in `__init__`
(MiniMax-H3's `rope.inv_freq`) keep their real values. The model must be the checkpoint's model: the same
tensors with the same shapes, and (for diffusers models) the same config, since a config value such as
`rope_theta` changes the function without changing a single shape.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.errors import CheckpointFileMissingError, CorruptCheckpointError, MismatchError, PlanError, UsageError
from preshard.format.fileio import pread_bytes
from preshard.format.folder import CheckpointFolder
from preshard.format.jsonio import parse_json_text
from preshard.format.manifest import Manifest
from preshard.format.plan import matches
from preshard.format.styles import SplitExperts, TPNorm, VocabParallel
from preshard.plans.model_class import is_transformers_config
from preshard.units import plural


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def read_checkpoint_config(checkpoint: Path | CheckpointFolder, manifest: Manifest) -> dict[str, Any] | None:
    """The checkpoint's config.json (read inside the folder, a regular file only), checked against the size and
    hash the manifest records.

    Raises:
        CorruptCheckpointError: config.json is missing, out of the folder, not a regular file, or differs from the
            one converted with.
    """
    record = manifest.config
    if record is None:
        return None
    folder = checkpoint if isinstance(checkpoint, CheckpointFolder) else CheckpointFolder(checkpoint)
    path = folder.path / record.name
    try:
        fd = folder.open(record.name)
    except FileNotFoundError:
        raise CheckpointFileMissingError(f"{path} is missing; copy the whole checkpoint folder again") from None
    try:
        extra = os.fstat(fd).st_size != record.size
        raw = b"" if extra else pread_bytes(fd, 0, record.size, str(path))
    finally:
        os.close(fd)
    if extra or not record.matches(raw):
        raise CorruptCheckpointError(
            f"{path} differs from the config the checkpoint was converted with (its xxh3_128 does not match the "
            "manifest); restore the original config.json or convert again"
        )
    config = parse_json_text(raw, str(path), CorruptCheckpointError, "restore it or convert again")
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object; restore it or convert again")
    return config


def build_model(
    model: type | Callable[[], nn.Module] | nn.Module, checkpoint: Path, config: dict[str, Any] | None
) -> nn.Module:
    """A class (built from the checkpoint's config.json, in eval mode), a zero-argument factory, or an instance
    (both as they come).

    Raises:
        UsageError: `model` is none of those. MismatchError: the class is not the checkpoint's class.
    """
    if isinstance(model, nn.Module):
        return model
    if inspect.isclass(model):
        if not issubclass(model, nn.Module):
            raise UsageError(f"model must be an nn.Module class, a factory or an instance, not class {model.__name__}")
        if config is None:
            raise MismatchError(
                f"{checkpoint} has no config.json to build {model.__name__} from; pass a factory or an instance"
            )
        if is_transformers_config(config):
            from preshard.runtime.hf_model import build_transformers_model

            return build_transformers_model(model, checkpoint, config, parameters_on_meta)
        declared = config.get("_class_name")
        if declared is None:
            raise MismatchError(
                f"{checkpoint}'s config.json names no model class (_class_name) to build {model.__name__} from; "
                "pass a factory (lambda: Model(...)) or an instance instead"
            )
        if declared != model.__name__:
            raise MismatchError(
                f"{checkpoint} holds a {declared} checkpoint, not {model.__name__}; pass the matching class"
            )
        kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
        try:  # in eval mode, as `from_pretrained` leaves it (T5FilmDecoder's dropout would otherwise be on)
            with parameters_on_meta():
                built = model.from_config(kwargs) if hasattr(model, "from_config") else model(**kwargs)
            return built.eval()
        except (TypeError, ValueError) as exc:
            raise MismatchError(f"cannot build {model.__name__} from {checkpoint}'s config.json: {exc}") from None
    if callable(model):
        with parameters_on_meta():
            built = model()
        if not isinstance(built, nn.Module):
            raise UsageError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise UsageError(f"model must be a model class, a factory or an nn.Module, not {type(model).__name__}")


def _plain(value: Any) -> Any:
    """JSON's view of a value (tuples become lists), so a config read from disk compares equal to one in memory."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def check_config(model: nn.Module, config: dict[str, Any] | None) -> None:
    """A diffusers model's own config must equal the checkpoint's on every key the checkpoint's config sets.

    Raises:
        MismatchError: naming the keys that differ and both values of the first.
    """
    own = getattr(model, "config", None)
    if config is None or own is None or not hasattr(own, "items"):
        return
    own = dict(own.items())
    differ = [
        key
        for key, value in config.items()
        if not key.startswith("_") and key in own and _plain(own[key]) != _plain(value)
    ]
    if differ:
        first = differ[0]
        raise MismatchError(
            f"the model's config differs from the checkpoint's in {', '.join(differ)} (e.g. {first}: model "
            f"{_plain(own[first])!r}, checkpoint {_plain(config[first])!r}); build the model from the checkpoint's "
            "config.json (pass the class), or convert the checkpoint this model belongs to"
        )


def ignored_tensors(model: nn.Module, manifest: Manifest) -> set[str]:
    """Checkpoint tensors the model has no place for and its class says to skip, as diffusers' `from_pretrained`
    does (`_keys_to_ignore_on_load_unexpected`: Wan I2V checkpoints carry an all-zero `norm_added_q` per block)."""
    patterns = getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or []
    expected = {**dict(model.named_parameters()), **persistent_buffers(model)}
    return {name for name in manifest.tensors if name not in expected and any(re.search(p, name) for p in patterns)}


def check_against_manifest(model: nn.Module, manifest: Manifest) -> None:
    """Every tensor the model expects is in the checkpoint and vice versa (but for `ignored_tensors`), with the
    same global shape."""
    expected = {**dict(model.named_parameters()), **persistent_buffers(model)}
    missing = sorted(set(expected) - set(manifest.tensors))
    unexpected = sorted(set(manifest.tensors) - set(expected) - ignored_tensors(model, manifest))
    if missing:
        raise MismatchError(f"the checkpoint lacks {plural(len(missing), 'tensor')} the model has: {_names(missing)}")
    if unexpected:
        raise MismatchError(
            f"the checkpoint has {plural(len(unexpected), 'tensor')} the model lacks: {_names(unexpected)}"
        )
    layouts = {name: record.layout for name, record in manifest.tensors.items()}
    wrong_shape = [
        f"{n} (model {list(t.shape)}, checkpoint {list(layouts[n].shape)})"
        for n, t in expected.items()
        if tuple(t.shape) != layouts[n].shape
    ]
    if wrong_shape:
        raise MismatchError(f"shapes disagree for {plural(len(wrong_shape), 'tensor')}: {_names(wrong_shape)}")
    wrong_kind = [
        f"{n} (model {str(t.dtype).removeprefix('torch.')}, checkpoint {str(layouts[n].dtype).removeprefix('torch.')})"
        for n, t in expected.items()
        if t.dtype.is_floating_point != layouts[n].dtype.is_floating_point
    ]
    if wrong_kind:
        raise MismatchError(f"dtypes disagree for {plural(len(wrong_kind), 'tensor')}: {_names(wrong_kind)}")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    result = {}
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                result[f"{module_name}.{name}" if module_name else name] = buf
    return result


def localise(model: nn.Module, manifest: Manifest) -> dict[str, nn.Module]:
    """Planned Linear layers, embeddings and norms take their local shapes (still on meta) before anything is
    allocated.

    Returns:
        The sharded modules by name (Linear layers, embeddings split by vocabulary, experts modules, and norms
        with a weight).

    Raises:
        PlanError: the plan splits a tensor of a module that is not an nn.Linear (or, for a norm style, a
            norm that style supports; for `vocab_parallel`, a supported nn.Embedding).
    """
    tp = manifest.tp
    modules: dict[str, nn.Module] = {}
    for name, record in manifest.tensors.items():
        layout = record.layout
        if layout.style.name == "replicate":
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        style = layout.style
        if module_name in modules:  # checked at its first tensor
            pass
        elif style.module_kind in ("norm", "embedding", "experts"):
            if isinstance(style, (TPNorm, VocabParallel, SplitExperts)):
                why = style.unsupported(module)
            else:
                why = f"is not a {style.module_kind} {style.name} applies to"
            if why is not None:
                raise PlanError(f"the plan gives {module_name} the {layout.style.name} style, but it {why}")
        elif not isinstance(module, nn.Linear):
            raise PlanError(f"the plan shards {module_name}, which is a {type(module).__name__}, not nn.Linear")
        modules[module_name] = module
        if layout.shard_dim is not None:
            if leaf in module._parameters:
                param = module._parameters[leaf]
                local = torch.empty(layout.local_shape(tp), dtype=param.dtype, device="meta")
                module._parameters[leaf] = nn.Parameter(local, requires_grad=False)
            else:  # a weight's scale (runtime/quant.py), a buffer of its Linear
                buffer = module._buffers[leaf]
                module._buffers[leaf] = torch.empty(layout.local_shape(tp), dtype=buffer.dtype, device="meta")
    for module in modules.values():
        localise_attributes(module)
    return modules


def localise_attributes(module: nn.Module) -> None:
    """A sharded Linear's or Embedding's size attributes follow its (local) weight."""
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = module.weight.shape[0]


def divide_heads(model: nn.Module, manifest: Manifest) -> dict[str, list[str]]:
    """Divide each planned attention module's head-count attributes by tp; returns what was divided where.

    Raises:
        PlanError: a rule matching no module, or an attribute that is missing or not divisible.
    """
    tp = manifest.tp
    divided: dict[str, list[str]] = {}
    for rule in manifest.plan.attention:
        hits = [(name, m) for name, m in model.named_modules() if matches(rule.match, name)]
        if not hits:
            raise PlanError(f"attention rule {rule.match!r} matches no module of {type(model).__name__}")
        for name, module in hits:
            for attr, value in rule.divided_values(name, module, tp).items():
                setattr(module, attr, value)
            if rule.divide:
                divided[name] = list(rule.divide)
            if rule.one_kv_head and tp > 1:
                divided.setdefault(name, []).extend(f"{attr}: one KV head" for attr, _ in rule.one_kv_head)
    return divided
