"""Build the model with parameters on the meta device and real buffers, then give it local shapes.

No rank ever allocates the full model: parameters are moved to meta the moment they are registered
(their `torch.empty` storage is never touched, so never paged in), while buffers computed in
`__init__` (MiniMax-H3's `rope.inv_freq`) keep their real values.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.errors import PreshardError
from preshard.manifests.schema import CONFIG_NAME, Manifest
from preshard.plans.resolve import matches


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


def build_model(model: type | Callable[[], nn.Module] | nn.Module, checkpoint: Path, manifest: Manifest) -> nn.Module:
    """A class (built from the checkpoint's config.json), a zero-argument factory, or an instance."""
    if isinstance(model, nn.Module):
        return model
    if inspect.isclass(model):
        config = _read_config(checkpoint, manifest, model.__name__)
        with parameters_on_meta():
            if hasattr(model, "from_config"):
                return model.from_config(config)
            return model(**{k: v for k, v in config.items() if not k.startswith("_")})
    if callable(model):
        with parameters_on_meta():
            built = model()
        if not isinstance(built, nn.Module):
            raise PreshardError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise PreshardError(f"model must be a model class, a factory or an nn.Module, not {type(model).__name__}")


def _read_config(checkpoint: Path, manifest: Manifest, class_name: str) -> dict[str, Any]:
    if manifest.config is None or not (checkpoint / manifest.config).is_file():
        raise PreshardError(
            f"{checkpoint} has no {CONFIG_NAME} to build {class_name} from; pass a factory or an instance instead"
        )
    try:
        config = json.loads((checkpoint / manifest.config).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PreshardError(f"{checkpoint / manifest.config} is not valid JSON; convert the checkpoint again") from None
    declared = config.get("_class_name")
    if declared and declared != class_name:
        raise PreshardError(f"{checkpoint} holds a {declared} checkpoint, not {class_name}; pass the matching class")
    return config


def check_against_manifest(model: nn.Module, manifest: Manifest) -> None:
    """Every tensor the model expects is in the checkpoint and vice versa, with the same global shape."""
    expected = {**dict(model.named_parameters()), **_persistent_buffers(model)}
    missing = sorted(set(expected) - set(manifest.tensors))
    unexpected = sorted(set(manifest.tensors) - set(expected))
    if missing:
        raise PreshardError(f"the checkpoint lacks {len(missing)} tensors the model has: {_names(missing)}")
    if unexpected:
        raise PreshardError(f"the checkpoint has {len(unexpected)} tensors the model lacks: {_names(unexpected)}")
    wrong_shape = [
        f"{n} (model {list(t.shape)}, checkpoint {manifest.tensors[n].shape})"
        for n, t in expected.items()
        if list(t.shape) != manifest.tensors[n].shape
    ]
    if wrong_shape:
        raise PreshardError(f"shapes disagree for {len(wrong_shape)} tensors: {_names(wrong_shape)}")
    wrong_kind = [
        f"{n} (model {_dtype(t)}, checkpoint {manifest.tensors[n].dtype})"
        for n, t in expected.items()
        if t.dtype.is_floating_point != getattr(torch, manifest.tensors[n].dtype).is_floating_point
    ]
    if wrong_kind:
        raise PreshardError(f"dtypes disagree for {len(wrong_kind)} tensors: {_names(wrong_kind)}")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    result = {}
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                result[f"{module_name}.{name}" if module_name else name] = buf
    return result


def localise_linear(module: nn.Linear, shard_dims: dict[str, int | None], tp: int) -> None:
    """Give a planned Linear its local parameter shapes (still on meta) and matching feature counts."""
    for pname, dim in shard_dims.items():
        param = module._parameters.get(pname)
        if param is None or dim is None:
            continue
        shape = list(param.shape)
        shape[dim] //= tp
        module._parameters[pname] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), False)
    module.out_features = module.weight.shape[0]
    module.in_features = module.weight.shape[1]


def divide_heads(model: nn.Module, attention_rules: list[dict], tp: int) -> dict[str, list[str]]:
    """Divide each planned attention module's head-count attributes by tp; returns what was divided where."""
    divided: dict[str, list[str]] = {}
    for rule in attention_rules:
        hits = [(name, m) for name, m in model.named_modules() if matches(rule["match"], name)]
        if not hits:
            raise PreshardError(f"attention rule {rule['match']!r} matches no module of {type(model).__name__}")
        for name, module in hits:
            for attr in rule.get("divide", ["heads"]):
                value = getattr(module, attr, None)
                if not isinstance(value, int):
                    raise PreshardError(f"{name} has no integer attribute {attr!r} to divide by tp={tp}")
                if value % tp:
                    raise PreshardError(f"{name}.{attr} = {value} does not divide by tp={tp}")
                setattr(module, attr, value // tp)
            divided[name] = list(rule.get("divide", ["heads"]))
    return divided
