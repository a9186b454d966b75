"""A text encoder converted without its later layers and head refuses, in one line, what would need them.

A stack truncated to K decoder layers computes `hidden_states[0 .. K-1]` exactly as the whole model does (each is
the input of a kept layer); `hidden_states[K]` is post-norm there and the whole model's later states do not exist,
so a plain truncated model would return a plausible, wrong tensor for `hidden_states[-1]` or `[K]`. So every
`hidden_states` tuple the model returns (from the model or its inner `.model`) becomes one that refuses those
indices, and the head left out is a module whose call is refused. `model.preshard_left_out` says what was left out.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from preshard.errors import UsageError
from preshard.format.pipeline_record import LeftOut

LEFT_OUT_ATTRIBUTE = "preshard_left_out"


def _refusal(component: str, left: LeftOut, what: str) -> UsageError:
    return UsageError(
        f"{what} of {component} was left out of this conversion (it keeps decoder layers 0-{left.keep_layers - 1} "
        f"of {left.layers} and no {', '.join(left.names) or 'head'}: --keep-layers {component}:{left.keep_layers}); "
        f"read hidden_states[0..{left.keep_layers - 1}], or convert again with --keep-layers {component}:all"
    )


class KeptHiddenStates(tuple):
    """`hidden_states` of a truncated stack: the kept indices as a tuple, the rest refused in one line."""

    component: str
    left: LeftOut

    def __getitem__(self, key: Any) -> Any:
        limit = self.left.keep_layers
        if isinstance(key, int):
            if key < 0 or key >= limit:
                raise _refusal(self.component, self.left, f"hidden_states[{key}]")
        elif isinstance(key, slice):
            start, stop, _ = key.start or 0, key.stop, key.step
            if stop is None or stop > limit or start < 0 or stop < 0:
                raise _refusal(self.component, self.left, f"hidden_states[{start}:{stop}]")
        return tuple.__getitem__(self, key)

    def __iter__(self):  # iterating would reach the post-norm state: refused too
        raise _refusal(self.component, self.left, "iterating over hidden_states (it reaches the last layers)")


def _kept(states: tuple, component: str, left: LeftOut) -> KeptHiddenStates:
    kept = KeptHiddenStates(states)
    kept.component, kept.left = component, left
    return kept


class LeftOutHead(nn.Module):
    """Stands where the language-model head was: calling it is refused."""

    def __init__(self, component: str, left: LeftOut, name: str) -> None:
        super().__init__()
        self.component, self.left, self.name = component, left, name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _refusal(self.component, self.left, f"{self.name} (called by the model's top-level forward)")


def _guard_output(component: str, left: LeftOut):
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        states = getattr(output, "hidden_states", None)
        if isinstance(states, tuple) and not isinstance(states, KeptHiddenStates):
            output.hidden_states = _kept(states, component, left)
        return output

    return hook


def guard_left_out(model: nn.Module, component: str, left: LeftOut) -> None:
    """Make `model` (a whole text encoder converted with `--keep-layers`) refuse what was left out of it.

    Args:
        model: the loaded component (its config already has `left.keep_layers` layers).
        component: its name in the pipeline, for the messages.
        left: what the conversion recorded.
    """
    for name in left.names:
        if isinstance(getattr(model, name, None), nn.Module):
            setattr(model, name, LeftOutHead(component, left, name))
    hook = _guard_output(component, left)
    model.register_forward_hook(hook)
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):  # MiniMax-H3's encoder calls text_encoder.model directly
        inner.register_forward_hook(hook)
    setattr(model, LEFT_OUT_ATTRIBUTE, left)
