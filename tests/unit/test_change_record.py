"""runtime/changes.py on plain modules: a method's wrappers compose in METHOD_LAYERS order whichever is added
first, and every kind of change (class, attribute, hook, method) is undone back to the module as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from preshard.errors import UsageError
from preshard.runtime.changes import METHOD_LAYERS, ModelChanges, undo_sharding

LORA, LOCAL = METHOD_LAYERS["load_lora_adapter"]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.calls: list[str] = []

    def load_lora_adapter(self, name: str) -> str:
        self.calls.append("own")
        return name


def _layer(model: Model, label: str):
    def wrap(inner):
        def method(*args):
            model.calls.append(label)
            return inner(*args)

        return method

    return wrap


@pytest.mark.parametrize("first", [LORA, LOCAL])
def test_wrappers_compose_in_one_fixed_order_whichever_comes_first(first):
    model = Model()
    changes = ModelChanges.of(model)
    for layer in (first, LOCAL if first == LORA else LORA):
        changes.wrap_method("load_lora_adapter", layer, _layer(model, layer))
    assert model.load_lora_adapter("x") == "x"
    assert model.calls == [LOCAL, LORA, "own"]  # the outermost last in METHOD_LAYERS runs first
    assert changes.method_layers("load_lora_adapter") == [LORA, LOCAL]
    assert sum(c.kind == "method" for c in changes.changes) == 1  # wrapped once, however many layers


def test_an_unknown_layer_is_refused():
    with pytest.raises(ValueError, match="not a known layer"):
        ModelChanges.of(Model()).wrap_method("load_lora_adapter", "mine", lambda inner: inner)


def test_undo_takes_back_every_kind_of_change():
    model = Model()
    model.proj.tag = "theirs"  # an instance attribute preshard overwrites: restored, not deleted
    changes = ModelChanges.of(model)
    sub = type("Sub", (nn.Linear,), {})
    changes.swap_class(model.proj, "proj", sub, "Sub")
    changes.set_attribute(model.proj, "proj", "tag", "ours")
    changes.set_attribute(model.proj, "proj", "preshard_style", "rowwise")
    changes.hook("proj", "a hook", model.proj.register_forward_hook(lambda m, a, o: o * 0))
    changes.wrap_method("load_lora_adapter", LORA, _layer(model, LORA))
    changes.wrap_method("_apply", METHOD_LAYERS["_apply"][0], lambda inner: inner)
    assert torch.all(model.proj(torch.ones(1, 2)) == 0) and type(model.proj) is sub
    assert len(changes.describe()) == len(changes.changes) == 7

    assert undo_sharding(model) is model
    assert type(model.proj) is nn.Linear and model.proj.tag == "theirs"
    assert not hasattr(model.proj, "preshard_style") and not hasattr(model, "preshard_changes")
    assert not model.proj._forward_hooks and torch.any(model.proj(torch.ones(1, 2)) != 0)
    assert "load_lora_adapter" not in vars(model) and "_apply" not in vars(model)
    model.load_lora_adapter("x")
    assert model.calls == ["own"]


def test_undo_of_a_model_preshard_did_not_load_is_one_line():
    with pytest.raises(UsageError, match="not loaded by preshard.load_sharded"):
        undo_sharding(Model())


def test_a_method_the_class_lacks_is_added_and_removed_again():
    model = nn.Linear(2, 2)  # no save_pretrained
    changes = ModelChanges.of(model)
    changes.wrap_method("save_pretrained", METHOD_LAYERS["save_pretrained"][0], lambda own: lambda path: own)
    assert model.save_pretrained("x") is None
    changes.undo()
    assert not hasattr(model, "save_pretrained")
