"""`convert-checkpoint --quantize fp8|int8` (converter/quantize.py): the plan's sharded Linear weights stored
quantized with per-output-channel float32 scales computed on the whole row, so tp=1 and tp=2 store one model, equal
to the unsharded model quantized the same way; the rest kept as it is; resumable and parallel; verify, unshard,
reshard and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from safetensors.torch import load_file, save_file
from tiny_diffusers import build

from preshard.converter import convert as convert_module
from preshard.converter.convert import ConversionOutcome, convert_checkpoint, plan_conversion, resolve_mesh
from preshard.errors import PlanError, UsageError
from preshard.format.manifest import read_manifest
from preshard.format.quant import quantize_rows

SOURCE_FILE = "diffusion_pytorch_model.safetensors"


def _config(model) -> dict:
    return {"_class_name": type(model).__name__, **{k: v for k, v in model.config.items() if not k.startswith("_")}}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantize")
    model, _ = build("wan")
    source = root / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(_config(model)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(source / SOURCE_FILE))
    made = {"src": source}
    for key, tp, fmt in (("fp8-tp1", 1, "fp8"), ("fp8-tp2", 2, "fp8"), ("int8-tp2", 2, "int8")):
        made[key] = root / key
        convert_checkpoint(source, made[key], tp=tp, quantize=fmt, progress=False)
    return made


def _reference(source: Path, weights: list[str], fmt: str, slices: int = 1) -> torch.nn.Module:
    """The unsharded float32 model with `weights` quantized as --quantize does (with `slices` > 1: each row's scale
    from its own 1/slices of the row, as a rank that quantized only its column slice would: a negative control)."""
    state = load_file(str(source / SOURCE_FILE))
    for name in weights:
        parts = state[name].chunk(slices, dim=1)
        state[name] = torch.cat([q.float() * s[:, None] for q, s in (quantize_rows(p, fmt) for p in parts)], dim=1)
    model, _ = build("wan")
    model.load_state_dict(state)
    return model


def _forward(net, inputs) -> torch.Tensor:
    with torch.no_grad():
        return net(**inputs, return_dict=False)[0]


def _rank(rank: int, world: int, converted: dict[str, Path]) -> dict:
    from preshard.runtime.load import load_sharded

    _, inputs = build("wan")
    out = {}
    for key in ("fp8-tp2", "int8-tp2"):
        net = load_sharded(type(build("wan")[0]), converted[key])
        out[key] = _forward(net, inputs)
        out[f"{key} weight dtypes"] = sorted({str(getattr(m, "preshard_weight_format", "")) for m in net.modules()})
    return out


@pytest.fixture(scope="module")
def tp2(converted) -> list[dict]:
    return run_ranks(_rank, 2, converted, timeout=300)


def test_tp1_and_tp2_store_one_model_equal_to_the_unsharded_model_quantized_the_same_way(converted, tp2):
    from preshard.runtime.load import load_sharded

    model, inputs = build("wan")
    weights = sorted(read_manifest(converted["fp8-tp2"]).quantized_at_conversion())
    assert weights == sorted(read_manifest(converted["fp8-tp1"]).quantized_at_conversion())
    tp1 = _forward(load_sharded(type(model), converted["fp8-tp1"]), inputs)
    dense = _forward(model, inputs)
    for fmt in ("fp8", "int8"):
        want = _forward(_reference(converted["src"], weights, fmt), inputs)
        for rank in tp2:
            got = rank[f"{fmt}-tp2"]
            assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
            assert "torch.float8_e4m3fn" in rank["fp8-tp2 weight dtypes"] or fmt == "int8"
        if fmt == "fp8":
            assert (tp1 - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
            assert (tp1 - tp2[0]["fp8-tp2"]).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
            # within fp8 error of the dense model, but not equal to it: the weights really are quantized
            relative = ((want - dense).abs().max() / dense.abs().max()).item()
            assert 1e-4 < relative < 0.1, relative
            # Negative control: scales from each rank's half of a row give another model, which the check tells.
            halves = _forward(_reference(converted["src"], weights, fmt, slices=2), inputs)
            assert (halves - want).abs().max().item() > 1e-4


@pytest.mark.quick
def test_the_manifest_records_it_only_sharded_linear_weights_are_quantized_and_dry_run_counts_the_bytes(converted):
    manifest = read_manifest(converted["fp8-tp2"])
    assert manifest.quantize == "float8_e4m3fn"
    assert json.loads((converted["fp8-tp2"] / "manifest.json").read_text())["quantize"] == "float8_e4m3fn"
    made = manifest.quantized_at_conversion()
    source = load_file(str(converted["src"] / SOURCE_FILE))
    for name, record in manifest.tensors.items():
        layout = record.layout
        if name in made:
            assert layout.dtype.name == "float8_e4m3fn" and layout.sharded and name.endswith(".weight")
            scale = manifest.tensors[made[name]].layout
            assert scale.dtype.name == "float32" and scale.shape == (layout.shape[0],)
        elif name not in made.values():  # norms, embeddings, biases, replicated weights: as the source stored them
            assert layout.dtype.name == str(source[name].dtype).removeprefix("torch.")
            assert not (layout.sharded and name.endswith(".weight") and len(layout.shape) == 2), name
    assert any(n.startswith("condition_embedder") for n in manifest.tensors if n not in made)
    job = plan_conversion(converted["src"], mesh=resolve_mesh(None, 2, None, None, None, None), quantize="fp8")
    assert job.output_bytes == sum(f.size for f in manifest.files)
    dense = plan_conversion(converted["src"], mesh=resolve_mesh(None, 2, None, None, None, None))
    assert sum(job.layouts[w].nbytes for w in made) * 4 == sum(dense.layouts[w].nbytes for w in made)


@pytest.mark.quick
def test_verify_source_recomputes_the_quantized_weights_and_unshard_refuses_in_one_line(converted, tmp_path):
    from preshard.tools.unshard import unshard_checkpoint
    from preshard.tools.verify import verify_checkpoint

    result = verify_checkpoint(converted["int8-tp2"], source=converted["src"])
    assert result.ok, result.problems
    made = read_manifest(converted["int8-tp2"]).quantized_at_conversion()
    assert result.quantize_scales == len(made) and result.source_tensors == len(result_tensors(converted)) - len(made)
    with pytest.raises(UsageError, match=r"quantized at conversion .*cannot be rebuilt") as e:
        unshard_checkpoint(converted["int8-tp2"], tmp_path / "back")
    assert "\n" not in str(e.value)
    from preshard.tools.reshard import reshard_checkpoint

    with pytest.raises(UsageError, match=r"quantized at conversion .*--tp 1 --quantize"):
        reshard_checkpoint(converted["int8-tp2"], tmp_path / "tp1", tp=1)


def result_tensors(converted) -> list[str]:
    return list(read_manifest(converted["int8-tp2"]).tensors)


def test_an_interrupted_or_parallel_quantized_conversion_gives_the_same_bytes(converted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    written: list[str] = []

    def crash(name: str) -> None:
        written.append(name)
        if len(written) == 30:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(converted["src"], out, tp=2, quantize="fp8", progress=False, on_tensor=crash)
    outcome = ConversionOutcome()
    convert_checkpoint(converted["src"], out, tp=2, quantize="fp8", progress=False, outcome=outcome)
    assert outcome.status == "resumed" and outcome.kept_tensors > 0
    kept = read_manifest(out)
    assert any(kept.tensors[s].layout for s in kept.quantized_at_conversion().values())
    for f in read_manifest(converted["fp8-tp2"]).files:
        assert (out / f.name).read_bytes() == (converted["fp8-tp2"] / f.name).read_bytes()
    again = ConversionOutcome()  # the same conversion again: already converted
    convert_checkpoint(converted["src"], out, tp=2, quantize="fp8", progress=False, outcome=again)
    assert again.status == "already converted"
    # two worker processes (each reads only its own rows of a weight, and computes its scales from them): the same
    parallel = tmp_path / "parallel"
    convert_checkpoint(converted["src"], parallel, tp=2, quantize="fp8", progress=False, workers=2)
    for f in read_manifest(converted["fp8-tp2"]).files:
        assert (parallel / f.name).read_bytes() == (converted["fp8-tp2"] / f.name).read_bytes()


@pytest.mark.quick
def test_quantize_on_a_quantized_source_and_an_unknown_format_are_refused_in_one_line(converted, tmp_path):
    state = load_file(str(converted["src"] / SOURCE_FILE))
    state["blocks.0.attn1.to_q.weight"] = state["blocks.0.attn1.to_q.weight"].to(torch.float8_e4m3fn)
    folder = tmp_path / "fp8"
    folder.mkdir()
    (folder / "config.json").write_text((converted["src"] / "config.json").read_text())
    save_file(state, str(folder / SOURCE_FILE))
    with pytest.raises(PlanError, match=r"already quantized \(blocks.0.attn1.to_q.weight is float8_e4m3fn\)") as e:
        convert_checkpoint(folder, tmp_path / "out", tp=2, quantize="fp8", progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="'fp4' is not a format preshard quantizes to; use one of: fp8, int8"):
        convert_checkpoint(converted["src"], tmp_path / "out", tp=2, quantize="fp4", progress=False)


@pytest.mark.quick
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_source_row_holding_nan_or_inf_is_refused_naming_the_tensor_and_row(converted, tmp_path, value, fmt):
    """Its scale would be NaN/Inf (the whole row's weights with it): refused in one line, nothing committed."""
    from preshard.errors import SourceError

    state = load_file(str(converted["src"] / SOURCE_FILE))
    name = "blocks.0.ffn.net.0.proj.weight"
    state[name] = state[name].clone()
    state[name][5, 3] = value
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text((converted["src"] / "config.json").read_text())
    save_file(state, str(folder / SOURCE_FILE))
    with pytest.raises(SourceError, match=rf"row 5 of {name} holds NaN or Inf; --quantize cannot scale it") as e:
        convert_checkpoint(folder, tmp_path / "out", tp=2, quantize=fmt, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    convert_checkpoint(folder, tmp_path / "plain", tp=2, progress=False)  # the control: without --quantize it converts
