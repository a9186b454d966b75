"""`preshard plan SRC --check --tp N`: a proof that the plan computes the unsharded function, from config.json alone.

The model of SRC's config.json is built with every repeated stack cut to one block (each integer `num_*layers` /
`num_*blocks` key above 1 set to 1; a config with no such key is built whole), seeded random weights that each visibly
affect the output (norms 1 + 0.1 randn, Linears randn / sqrt(fan_in), biases 0.05 randn), and saved to a scratch
folder. That folder is converted at `tp` with the plan (`--plan`, else the one conversion would choose), and the
converted checkpoint is run sharded by `preshard check`'s own job (`launch_check`: `tp` gloo ranks on the loopback,
the runtime's real TP hooks) against the unsharded model on the same seeded inputs. What runs is what a conversion
and a load of the real checkpoint run, block for block; no weights of SRC are read.

Cost: the model of one block per stack at full width, held in float32 three times at the peak (the saved model, the
reference, each rank's shard) plus its files on a scratch disk (docs/models-and-plans.md gives MiniMax-H3's figures).
"""

from __future__ import annotations

import gc
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.converter.convert import convert_checkpoint
from preshard.errors import MismatchError, UsageError
from preshard.plans.model_class import import_class_spec, is_transformers_config
from preshard.progress import note
from preshard.tools.check import TOLERANCE, CheckResult, check_conversion, launch_check, model_class_of

_DEPTH_KEY = re.compile(r"^(num|n)_([a-z0-9]+_)*(layers|blocks)$|^depth$")


@dataclass
class PlanCheckResult:
    """What `check_plan` found: the check of the reduced model (`check`), and how the model was reduced."""

    source: str
    tp: int
    plan: str
    reduced: dict[str, int] = field(default_factory=dict)  # config key -> its value in SRC (now 1)
    check: CheckResult | None = None

    @property
    def ok(self) -> bool:
        return self.check is not None and self.check.ok

    @property
    def built(self) -> str:
        if not self.reduced:
            return "the whole model (its config.json has no layer count to reduce)"
        keys = ", ".join(f"{k} {v} -> 1" for k, v in self.reduced.items())
        return f"one block of each repeated stack ({keys})"

    def to_dict(self) -> dict[str, Any]:
        check = self.check.to_dict() if self.check is not None else None
        return {"source": self.source, "tp": self.tp, "plan": self.plan, "reduced": self.reduced, "built": self.built,
                "check": check, "ok": self.ok}  # fmt: skip

    def lines(self) -> list[str]:
        assert self.check is not None
        rows = self.check.lines()[:-1]
        verdict = "matches" if self.ok else "does NOT match"
        rows.append(
            f"plan check of {self.source}: {self.check.model_class} built with {self.built}, random weights; "
            f"sharded at tp={self.tp} by the plan {self.plan}, it {verdict} the unsharded model "
            f"(tolerance {self.check.tolerance:g} of each output's largest |value|)"
        )
        return rows


def reduced_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """config.json with every layer count above 1 (`num_layers`, `num_single_layers`, `num_hidden_layers`, ...)
    set to 1, and the keys changed with their values.

    Example:
        >>> reduced_config({"num_layers": 40, "num_single_layers": 38, "hidden_size": 8})[1]
        {'num_layers': 40, 'num_single_layers': 38}
    """
    counts = {k: v for k, v in config.items() if _DEPTH_KEY.match(k) and type(v) is int}  # bool is not a count
    changed = {k: v for k, v in counts.items() if v > 1}
    return {**config, **dict.fromkeys(changed, 1)}, changed


@torch.no_grad()
def randomize_(model: nn.Module, seed: int) -> None:
    """Every parameter seeded and visible in the output: a norm weight left at 1, or a zero-initialised output
    layer, would hide a wrongly sliced tensor."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        shape = tuple(param.shape)
        if leaf == "bias":
            value = 0.05 * torch.randn(shape, generator=gen)
        elif param.dim() == 1 or "norm" in type(module).__name__.lower():
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = max(1, param[0].numel()) if param.dim() > 1 else 1
            value = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        param.copy_(value.to(param.dtype))


def _build(cls: type, config: dict[str, Any]) -> nn.Module:
    try:
        if is_transformers_config(config):
            from preshard.plans.hf_transformers import transformers_config

            return cls(transformers_config(cls, config)).float().eval()
        kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
        built = cls.from_config(kwargs) if hasattr(cls, "from_config") else cls(**kwargs)
        return built.float().eval()
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        detail = " ".join(str(exc).split())[:200]
        raise MismatchError(f"cannot build {cls.__name__} from the config with one block per stack: {detail}") from None


def _read_config(source: Path) -> dict[str, Any]:
    path = source / "config.json" if source.is_dir() else source.parent / "config.json"
    if not path.is_file():
        raise UsageError(f"{source} has no config.json to build the model from; --check needs the model's config.json")
    from preshard.sources.local import read_config

    return read_config(path)


def check_plan(
    source: str | Path,
    *,
    tp: int,
    plan: str | Path | None = None,
    model_class: str | type | None = None,
    subfolder: str | None = None,
    inputs: str | Path | None = None,
    tolerance: float = TOLERANCE,
    seed: int = 0,
    timeout: float = 3600.0,
    progress: bool | None = None,
) -> PlanCheckResult:
    """Prove (or disprove) the plan on one block of SRC's model at `tp`: see the module docstring.

    Args:
        source: a local checkpoint folder (or its weights file) with config.json; only the config is read.
        tp: the TP degree to check (the ranks launched).
        plan: as `convert_checkpoint` takes it (a built-in name, a plan file, `auto`); default: conversion's choice.
        model_class: the model's class, or `module:Class` (your code, as at conversion); default: config.json's.
        subfolder: the model's folder inside `source`.
        inputs: a file of the forward's named input tensors (as `preshard check --inputs`); default: built from the
            forward's signature and config (`build_inputs`).

    Example:
        >>> result = check_plan("FLUX.1-dev/transformer", tp=2)  # doctest: +SKIP
        >>> result.ok, result.check.outputs[0].max_abs_diff  # doctest: +SKIP

    Raises:
        UsageError: no config.json, a `tp` below 1, a bad `model_class`; MismatchError: config.json names no class
            or the reduced config cannot be built; whatever conversion refuses (a plan that does not divide by `tp`).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UsageError(f"--check needs the TP degree to check as a positive integer (--tp N), not {tp!r}")
    folder = Path(source) / subfolder if subfolder else Path(source)
    if not folder.exists():
        raise UsageError(f"{folder} does not exist; --check needs a local folder with the model's config.json")
    config = _read_config(folder)
    spec = model_class if isinstance(model_class, str) else None
    if isinstance(model_class, type):  # the ranks import it by name
        spec = f"{model_class.__module__}:{model_class.__qualname__}"
    user_class = import_class_spec(model_class, progress) if isinstance(model_class, str) else model_class
    names_class = is_transformers_config(config) or isinstance(config.get("_class_name"), str)
    if user_class is None and not names_class:
        raise MismatchError(
            f"{folder}'s config.json names no model class (_class_name or architectures); pass --model-class "
            "module:Class (your model's class)"
        )
    cls = model_class_of(config, user_class)
    small, reduced = reduced_config(config)
    note(f"plan check: building {cls.__name__} with one block per stack, random weights", progress)
    torch.manual_seed(seed)
    model = _build(cls, small)
    randomize_(model, seed)
    with tempfile.TemporaryDirectory(prefix="preshard-plan-check-") as scratch:
        src, out = Path(scratch) / "model", Path(scratch) / "sharded"
        # files of 1 GB: the writer's copy of them stays small
        model.save_pretrained(str(src), max_shard_size="1GB")  # type: ignore[operator]
        del model
        gc.collect()
        note(f"plan check: converting it at tp={tp}", progress)
        manifest = convert_checkpoint(src, out, tp=tp, plan=plan, progress=False, model_class=model_class)
        note(f"plan check: running it on {tp} ranks against the unsharded model", progress)
        if tp == 1:
            check = check_conversion(out, src, inputs=inputs, model_class=model_class, tolerance=tolerance, seed=seed)
        else:
            args = ["--source", str(src), "--tolerance", repr(tolerance), "--seed", str(seed), "--no-progress"]
            args += ["--model-class", spec] if spec is not None else []
            args += ["--inputs", str(Path(inputs).resolve())] if inputs is not None else []
            check = launch_check(out, args, timeout=timeout, progress=progress, one_line=True)
    check.checkpoint, check.source = f"{folder} (one block, tp={tp})", str(folder)
    return PlanCheckResult(str(folder), tp, manifest.plan.name, reduced, check)


__all__ = ["PlanCheckResult", "check_plan", "randomize_", "reduced_config"]
