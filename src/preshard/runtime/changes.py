"""The one record of what load_sharded changed on a model, each change with its undo.

Loading rewires a model in several places (TP's and CP's hooks and swapped classes, the input check, full-tensor
saving, the LoRA loader, the device guard), each owned by its own module. Every one of them makes its change
through the model's `ModelChanges` (`model.preshard_changes`), so the model carries one list of what was done,
which `model.preshard_report.changes` shows, and `undo()` takes it all back in reverse order, leaving a plain
module of the model's own classes with no attribute, hook or method of preshard's. (Its weights stay this rank's
slices with their local shapes: at tp=1 that is the unsharded model.) In the manner of diffusers' `HookRegistry`,
written here because that registry only wraps forwards.

Instance methods several modules change are composed here, in one fixed order (`METHOD_LAYERS`), whichever
module attaches first, so `load_lora_adapter` is replaced once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from preshard.errors import UsageError

CHANGES_ATTRIBUTE = "preshard_changes"
# Each method's wrappers, innermost first: the LoRA slicing runs around diffusers' own loader, with this rank's
# slices as the model's state outside it (diffusers reads state_dict() while it builds the adapters).
METHOD_LAYERS: dict[str, tuple[str, ...]] = {
    "load_lora_adapter": ("lora: load the adapters sliced", "saving: this rank's slices as state_dict"),
    "add_adapter": ("lora: refused",),
    "save_lora_adapter": ("lora: refused",),
    "save_pretrained": ("saving: collective, full tensors",),
    "_apply": ("device guard: moves to another device refused",),
}
_ABSENT = object()


@dataclass(frozen=True)
class Change:
    """One change: where (a module's name, "" for the model), what kind, what it does, and how to undo it."""

    module: str
    kind: str  # "hook", "class", "attribute" or "method"
    what: str
    undo: Callable[[], None] = field(repr=False, compare=False)

    def describe(self) -> str:
        return f"{self.module or '(model)'}: {self.kind}: {self.what}"


class ModelChanges:
    """Everything preshard changed on one model, in order, each with its undo (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.changes: list[Change] = []
        self._methods: dict[str, dict[str, Callable[[Any], Callable]]] = {}
        self._originals: dict[str, Any] = {}

    @classmethod
    def of(cls, model: nn.Module) -> ModelChanges:
        """The model's record, made (and attached, as the first change) on first use."""
        changes = getattr(model, CHANGES_ATTRIBUTE, None)
        if not isinstance(changes, ModelChanges):
            changes = cls(model)
            changes.set_attribute(model, "", CHANGES_ATTRIBUTE, changes)
        return changes

    def hook(self, module: str, what: str, handle: Any) -> Any:
        """Record a hook torch registered (`handle` is its `RemovableHandle`); returns the handle."""
        self.changes.append(Change(module, "hook", what, handle.remove))
        return handle

    def swap_class(self, module: nn.Module, where: str, cls: type, what: str) -> None:
        """Switch `module` to `cls` (a subclass of its own, so `isinstance` holds)."""
        original = type(module)
        module.__class__ = cls

        def undo() -> None:
            module.__class__ = original

        self.changes.append(Change(where, "class", f"{original.__name__} -> {what}", undo))

    def set_attribute(self, module: nn.Module, where: str, name: str, value: Any) -> None:
        """Set an attribute on `module`, remembering whether (and with what) the instance had it."""
        previous = vars(module).get(name, _ABSENT)
        setattr(module, name, value)

        def undo() -> None:
            if previous is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, previous)

        self.changes.append(Change(where, "attribute", name, undo))

    def wrap_method(self, name: str, layer: str, wrap: Callable[[Any], Callable]) -> None:
        """Add `layer` to the model's method `name`: `wrap(inner)` returns the method around `inner`. The layers
        are composed in `METHOD_LAYERS` order whichever is added first, around the model's own method (None where
        its class has none: `save_pretrained` on a plain `nn.Module`)."""
        order = METHOD_LAYERS[name]
        if layer not in order:
            raise ValueError(f"{layer!r} is not a known layer of {name} (METHOD_LAYERS)")
        model = self.model
        if name not in self._originals:
            self._originals[name] = vars(model).get(name, _ABSENT)

            def undo() -> None:
                original = self._originals.pop(name)
                self._methods.pop(name, None)
                if original is _ABSENT:
                    delattr(model, name)
                else:
                    setattr(model, name, original)

            self.changes.append(Change("", "method", name, undo))
        self._methods.setdefault(name, {})[layer] = wrap
        original = self._originals[name]
        if original is _ABSENT:  # the class's (bound), or None where the class has none (a plain nn.Module)
            own = getattr(type(model), name, None)
            method = own.__get__(model) if own is not None else None
        else:
            method = original
        for key in order:
            if key in self._methods[name]:
                method = self._methods[name][key](method)
        setattr(model, name, method)

    def method_layers(self, name: str) -> list[str]:
        """The layers wrapped around the model's method `name`, innermost first."""
        return [key for key in METHOD_LAYERS.get(name, ()) if key in self._methods.get(name, {})]

    def describe(self) -> list[str]:
        """One line per change, in the order made (a method's line names its layers)."""
        lines = []
        for change in self.changes:
            if change.kind == "method":
                lines.append(f"{change.describe()}: {', '.join(self.method_layers(change.what))}")
            else:
                lines.append(change.describe())
        return lines

    def undo(self) -> nn.Module:
        """Take back every change, last first; returns the model, a plain module of its own classes."""
        while self.changes:
            self.changes.pop().undo()
        return self.model


def undo_sharding(model: nn.Module) -> nn.Module:
    """Take back everything load_sharded changed on `model` (see `ModelChanges.undo`).

    Args:
        model: a model load_sharded returned.

    Returns:
        The same model, with its own classes and forwards and no attribute, hook or method of preshard's; its
        weights are still this rank's slices (at tp=1, the whole model).

    Raises:
        UsageError: `model` carries no record of preshard's changes.
    """
    changes = getattr(model, CHANGES_ATTRIBUTE, None)
    if not isinstance(changes, ModelChanges):
        raise UsageError(f"{type(model).__name__} was not loaded by preshard.load_sharded, so there is nothing to undo")
    return changes.undo()


__all__ = ["CHANGES_ATTRIBUTE", "METHOD_LAYERS", "Change", "ModelChanges", "undo_sharding"]
