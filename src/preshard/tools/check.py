"""`preshard check OUT --source SRC`: the sharded model and the unsharded one, on the same seeded inputs, compared
output by output.

Every rank of a torchrun job of the checkpoint's world size loads its shard (`load_sharded`, float32) and runs one
forward on the same inputs; then the lowest rank alone loads the unsharded source (`from_pretrained`, float32, on the
CPU: the whole model in its host's memory) and runs it on the same inputs, and compares each output: the largest
absolute difference, and whether it is within `tolerance` of the output's largest absolute value (at least 1).

The inputs: a file of named tensors the user gives (`.safetensors`, or a `torch.save`d dict of tensors, read with
`weights_only=True`), else inputs built from the model's forward signature and config (`build_inputs`), seeded.
Outside torchrun, `launch_check` starts the job itself (`torch.distributed.run`, one host, gloo on the CPU unless a
device is visible) and reads the lowest rank's result.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.errors import MismatchError, PreshardError, UsageError
from preshard.format.manifest import read_manifest
from preshard.plans.model_class import import_class_spec, import_model_class, is_transformers_config
from preshard.progress import note

TOLERANCE = 1e-4  # of the output's largest absolute value (at least 1): float32, summed in another order per rank
TEXT_TOKENS, IMAGE_TOKENS = 7, 16
_TEXT_WIDTH_KEYS = ("joint_attention_dim", "text_dim", "text_embed_dim", "caption_channels", "cross_attention_dim")


@dataclass(frozen=True)
class OutputDiff:
    """One output of the forward: its place in the flattened outputs, shape, and the difference found."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    max_abs: float
    within: bool


@dataclass
class CheckResult:
    """What `check_conversion` found: one `OutputDiff` per output (`ok`: every one within tolerance)."""

    checkpoint: str
    source: str
    model_class: str
    world_size: int
    tolerance: float
    inputs: dict[str, list[int]] = field(default_factory=dict)  # name -> shape
    outputs: list[OutputDiff] = field(default_factory=list)
    reported_here: bool = field(default=True, compare=False)  # the lowest rank's process (the one that reports)

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.within for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        data = {**asdict(self), "ok": self.ok}
        del data["reported_here"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        outputs = [OutputDiff(**{**o, "shape": tuple(o["shape"])}) for o in data["outputs"]]
        fields = {k: v for k, v in data.items() if k not in ("ok", "outputs")}
        return cls(**fields, outputs=outputs)

    def lines(self) -> list[str]:
        rows = [
            f"{o.name} {list(o.shape)}: max abs diff {o.max_abs_diff:.3e} (largest |value| {o.max_abs:.3g}) "
            + ("ok" if o.within else "BEYOND TOLERANCE")
            for o in self.outputs
        ]
        verdict = "matches" if self.ok else "does NOT match"
        rows.append(
            f"{self.checkpoint} on {self.world_size} ranks {verdict} the unsharded {self.model_class} from "
            f"{self.source} (tolerance {self.tolerance:g} of each output's largest |value|)"
        )
        return rows


def model_class_of(config: dict[str, Any] | None, model_class: type | None = None) -> type:
    """The class to build: `model_class` (the user's own, `--model-class`), else the diffusers class config.json's
    `_class_name` names, else the transformers class its `architectures` names. Never a class data names elsewhere.

    Raises:
        MismatchError: config.json names no class; PlanError: diffusers/transformers has no such class.
    """
    if model_class is not None:
        return model_class
    if is_transformers_config(config):
        from preshard.plans.hf_transformers import transformers_class

        return transformers_class(config or {})
    name = (config or {}).get("_class_name")
    if not isinstance(name, str):
        raise MismatchError("the checkpoint's config.json names no model class (_class_name or architectures)")
    return import_model_class(name)


def build_inputs(model: nn.Module, config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Seeded inputs for `model`'s forward, shaped from its signature and config: token ids for a transformers
    model; for a diffusers model `hidden_states` shaped by its first layer (a Conv3d/Conv2d patch embedding: a
    latent of 2 patches per axis; a Linear: 16 tokens of its width), `encoder_hidden_states` (7 tokens of the
    text width), `timestep`, position ids (`img_ids`/`txt_ids`, from `axes_dims_rope`), `pooled_projections`
    and `guidance` where the forward takes them; every other argument with a default is left out.

    Example:
        >>> inputs = build_inputs(model, dict(model.config), seed=0)  # doctest: +SKIP

    Raises:
        UsageError: a required argument it cannot shape (the message says to pass an inputs file).
    """
    g = torch.Generator().manual_seed(seed)
    params = inspect.signature(model.forward).parameters
    name = type(model).__name__
    if "input_ids" in params and "hidden_states" not in params:
        vocab = int(config.get("vocab_size") or getattr(getattr(model, "config", None), "vocab_size", 0) or 32)
        return {"input_ids": torch.randint(0, vocab, (1, TEXT_TOKENS), generator=g)}
    inputs: dict[str, Any] = {}
    tokens = IMAGE_TOKENS
    for arg, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or arg == "return_dict":
            continue
        value = _input(arg, model, config, g)
        if value is None and arg == "guidance" and config.get("guidance_embeds"):
            value = torch.full((1,), 3.5)
        if value is None:
            if param.default is inspect.Parameter.empty:
                raise UsageError(
                    f"cannot build {name}'s forward argument {arg!r} from its config; pass --inputs FILE (a "
                    "safetensors or torch file of the named input tensors)"
                )
            continue
        inputs[arg] = value
        if arg == "hidden_states" and value.dim() == 3:
            tokens = value.shape[1]
    axes = config.get("axes_dims_rope")
    if isinstance(axes, (list, tuple)) and axes:
        for arg, rows in (("img_ids", tokens), ("txt_ids", TEXT_TOKENS)):
            if arg in params:
                inputs[arg] = torch.randint(0, 8, (rows, len(axes)), generator=g).float()
    if "return_dict" in params:
        inputs["return_dict"] = False
    return inputs


def _input(arg: str, model: nn.Module, config: dict[str, Any], g: torch.Generator) -> torch.Tensor | None:
    if arg == "hidden_states":  # shaped by the top-level layer taking in_channels (else the first conv or Linear)
        kinds = (nn.Conv3d, nn.Conv2d, nn.Linear)
        layers = [m for m in model.children() if isinstance(m, kinds)]
        if not layers and config.get("in_channels") is None:  # no input layer at the top: the first Linear inside
            layers += [m for m in model.modules() if isinstance(m, nn.Linear)][:1]
        width = config.get("in_channels")
        taking = [m for m in layers if (m.in_features if isinstance(m, nn.Linear) else m.in_channels) == width]
        first = (taking or layers)[0] if layers else None
        if isinstance(first, (nn.Conv3d, nn.Conv2d)):
            size = [2 * int(k) for k in first.kernel_size]
            return torch.randn(1, first.in_channels, *size, generator=g)
        if isinstance(first, nn.Linear):
            width = first.in_features
        return torch.randn(1, IMAGE_TOKENS, int(width), generator=g) if isinstance(width, int) else None
    if arg == "encoder_hidden_states":
        width = next((config[k] for k in _TEXT_WIDTH_KEYS if isinstance(config.get(k), int)), None)
        return torch.randn(1, TEXT_TOKENS, width, generator=g) if width is not None else None
    if arg in ("timestep", "timesteps"):
        return torch.rand(1, generator=g)
    if arg == "pooled_projections" and isinstance(config.get("pooled_projection_dim"), int):
        return torch.randn(1, config["pooled_projection_dim"], generator=g)
    return None


def load_inputs(path: str | Path) -> dict[str, torch.Tensor]:
    """Named input tensors from a `.safetensors` file or a `torch.save`d dict of tensors (`weights_only=True`: no
    code runs).

    Raises:
        UsageError: no such file, not such a file, or not a dict of tensors named by strings.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"inputs file {path} does not exist; pass a .safetensors or torch file of named tensors")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            data: Any = load_file(str(path))
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file of another kind fails in its reader's own way
        raise UsageError(f"inputs file {path} cannot be read ({type(exc).__name__}): pass named tensors") from None
    named = isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items())
    if not named:
        raise UsageError(f"inputs file {path} is not a dict of tensors named by the forward's arguments")
    return dict(data)


def flat_outputs(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Every tensor a forward returned, named by its place (`output[0]`, `output.last_hidden_state`)."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if hasattr(out, "keys") and hasattr(out, "__getitem__"):  # a diffusers/transformers output (an ordered dict)
        return [item for key in out.keys() for item in flat_outputs(out[key], f"{prefix}.{key}")]
    if isinstance(out, (tuple, list)):
        return [item for i, value in enumerate(out) for item in flat_outputs(value, f"{prefix}[{i}]")]
    return []


def compare(got: Any, want: Any, tolerance: float) -> list[OutputDiff]:
    """Each output of `got` against `want`'s of the same place (float32).

    Raises:
        MismatchError: the two forwards return different outputs (names or shapes).
    """
    a, b = flat_outputs(got), flat_outputs(want)
    if [(n, tuple(t.shape)) for n, t in a] != [(n, tuple(t.shape)) for n, t in b]:
        raise MismatchError(
            f"the sharded model returns {[(n, list(t.shape)) for n, t in a]}, the unsharded one "
            f"{[(n, list(t.shape)) for n, t in b]}"
        )
    diffs = []
    for (name, x), (_, y) in zip(a, b):
        x, y = x.detach().float().cpu(), y.detach().float().cpu()
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        largest = y.abs().max().item() if y.numel() else 0.0
        within = bool(diff == diff and diff <= tolerance * max(1.0, largest))  # NaN is never within
        diffs.append(OutputDiff(name, tuple(x.shape), diff, largest, within))
    return diffs


def check_conversion(
    checkpoint: str | Path,
    source: str | Path,
    *,
    inputs: str | Path | dict[str, Any] | None = None,
    model_class: type | str | None = None,
    tolerance: float = TOLERANCE,
    seed: int = 0,
    device: str | None = None,
    progress: bool | None = None,
) -> CheckResult:
    """Compare the sharded model with the unsharded source on the same inputs; in every rank of a torchrun job of
    the checkpoint's world size (world size 1: this process alone). Every rank returns the lowest rank's result.

    Args:
        checkpoint: a folder `convert-checkpoint` wrote (one model; for a pipeline, one of its components).
        source: the unsharded checkpoint it was converted from, as `from_pretrained` reads it.
        inputs: a file of named tensors (or the dict itself); default: `build_inputs` (seeded by `seed`).
        model_class: the model's class, or `module:Class` to import (for a class of your own, as at conversion);
            default: the class config.json names, in diffusers or transformers.
        tolerance: the largest difference allowed, as a share of each output's largest absolute value (at least 1).
        device: where the sharded model runs (as `load_sharded`); the reference runs on the CPU.

    Example:
        >>> result = check_conversion("wan-tp2", "Wan/transformer")  # doctest: +SKIP
        >>> result.ok, [o.max_abs_diff for o in result.outputs]  # doctest: +SKIP

    Raises:
        UsageError: a pipeline folder, bad inputs, a world size other than the checkpoint's; whatever
            `load_sharded` and `from_pretrained` raise.
    """
    import torch.distributed as dist

    from preshard.runtime.construct import read_checkpoint_config
    from preshard.runtime.load import load_sharded

    folder = Path(checkpoint)
    if (folder / "pipeline.json").is_file() or (folder / "model_index.json").is_file():
        raise UsageError(
            f"{folder} is a converted pipeline; check one component at a time: preshard check {folder}/transformer "
            "--source SRC/transformer"
        )
    manifest = read_manifest(folder)
    config = read_checkpoint_config(folder, manifest) or {}
    rank = int(os.environ.get("RANK", "0"))
    shown = progress if rank == 0 else False
    user_class = import_class_spec(model_class, shown) if isinstance(model_class, str) else model_class
    cls = model_class_of(config, user_class)
    note(f"check: loading the sharded {cls.__name__} ({manifest.mesh.describe()})", shown)
    with torch.no_grad():
        sharded = load_sharded(cls, folder, device=device, torch_dtype=torch.float32)
        given = load_inputs(inputs) if isinstance(inputs, (str, Path)) else inputs
        feed = dict(given) if given is not None else build_inputs(sharded, config, seed)
        note("check: the sharded forward", shown)
        got = _to_cpu(_forward(sharded, _on(feed, next(sharded.parameters()).device), given is None))
        del sharded
        result = None
        if rank == 0:
            note(f"check: loading the unsharded {cls.__name__} from {source} (float32, CPU)", shown)
            reference = _from_pretrained(cls, source)
            note("check: the unsharded forward", shown)
            want = _forward(reference, feed, given is None)
            shapes = {k: list(v.shape) for k, v in feed.items() if isinstance(v, torch.Tensor)}
            result = CheckResult(
                str(checkpoint), str(source), cls.__name__, manifest.mesh.world_size, tolerance, shapes,
                compare(got, want, tolerance),
            )  # fmt: skip
    if dist.is_available() and dist.is_initialized():
        box: list[Any] = [result.to_dict() if result is not None else None]
        dist.broadcast_object_list(box, src=0)
        result = CheckResult.from_dict(box[0])
        result.reported_here = rank == 0
    assert result is not None
    return result


def world_size_of(checkpoint: str | Path) -> int:
    """The world size of the mesh `checkpoint` was converted for (its manifest's): the ranks a check runs."""
    return read_manifest(checkpoint).mesh.world_size


def write_result(result: CheckResult, path: str | Path) -> None:
    """The result as JSON, for the process that launched the job (`launch_check`)."""
    Path(path).write_text(json.dumps(result.to_dict()))


def _forward(model: nn.Module, feed: dict[str, Any], built: bool) -> Any:
    """`model(**feed)`; where the inputs were built (not given), a forward that fails on them is one line."""
    if not built:
        return model(**feed)
    try:
        return model(**feed)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(
            f"{type(model).__name__}'s forward fails on the inputs built from its signature ({type(exc).__name__}: "
            f"{detail}); pass --inputs FILE (a safetensors or torch file of the named input tensors)"
        ) from None


def _from_pretrained(cls: type, source: str | Path) -> nn.Module:
    if not hasattr(cls, "from_pretrained"):
        raise UsageError(f"{cls.__name__} has no from_pretrained to load the unsharded source with")
    key = "torch_dtype"  # diffusers' name; transformers 5 names it dtype
    try:
        from transformers import PreTrainedModel

        key = "dtype" if issubclass(cls, PreTrainedModel) else key
    except ImportError:
        pass
    try:
        return cls.from_pretrained(str(source), **{key: torch.float32}).eval()
    except (OSError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise UsageError(f"cannot load the unsharded {cls.__name__} from {source}: {detail}") from None


def _on(feed: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in feed.items()}


def _to_cpu(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, (tuple, list)):
        return type(out)(_to_cpu(v) for v in out) if isinstance(out, tuple) else [_to_cpu(v) for v in out]
    if hasattr(out, "keys") and hasattr(out, "__getitem__"):
        return {k: _to_cpu(out[k]) for k in out.keys()}
    return out


def launch_check(
    checkpoint: str | Path,
    args: list[str],
    *,
    timeout: float = 3600.0,
    progress: bool | None = None,
    one_line: bool = False,
) -> CheckResult:
    """Run `preshard check CHECKPOINT ARGS` under torchrun with as many ranks as the checkpoint's mesh (one host)
    and return the lowest rank's result. The ranks' own lines (progress, errors) go to this process's stderr;
    `one_line`: they are kept, and a failed job raises with the first rank's error line alone.

    Raises:
        PreshardError: the job failed (its ranks' errors are above, or in the message) or did not finish within
            `timeout` s.
    """
    world = world_size_of(checkpoint)
    note(f"check: launching torchrun with {world} ranks", progress)
    with tempfile.TemporaryDirectory(prefix="preshard-check-") as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "preshard", "check",
            str(checkpoint), *args, "--result-file", str(result_path),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        stderr = subprocess.PIPE if one_line else None
        try:
            done = subprocess.run(
                command, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=stderr, check=False, text=True
            )
        except subprocess.TimeoutExpired:
            raise PreshardError(f"check: the torchrun job did not finish within {timeout:.0f} s") from None
        if one_line and (done.returncode != 0 or not result_path.is_file()):
            lines = (done.stderr or "").splitlines()
            errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
            if errors:
                raise PreshardError(errors[0])
            raise PreshardError(f"check: the torchrun job of {world} ranks failed (exit status {done.returncode})")
        if done.returncode != 0 or not result_path.is_file():
            raise PreshardError(
                f"check: the torchrun job of {world} ranks failed (exit status {done.returncode}); its errors are above"
            )
        return CheckResult.from_dict(json.loads(result_path.read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = [
    "TOLERANCE", "CheckResult", "OutputDiff", "build_inputs", "check_conversion", "compare", "flat_outputs",
    "launch_check", "load_inputs", "model_class_of", "world_size_of", "write_result",
]  # fmt: skip
