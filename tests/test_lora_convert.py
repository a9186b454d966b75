"""LoRAs fused at conversion (`convert-checkpoint --lora FILE [--lora-scale S]`): the converted checkpoint equals
diffusers' `fuse_lora` on the unsharded model (bit for bit in float32, within one rounding in bf16) and, bit for bit
in every dtype, preshard's own fuse of the whole tensors converted without the LoRA, however the tensors are cut into
bands; the LoRAs are recorded in the manifest, make another conversion for resume, show in the dry run, inspect and
verify; every LoRA that does not fit is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from clitools import assert_one_line, cli_runner
from safetensors.torch import load_file, save_file
from tiny_diffusers import build, save
from tiny_lora import diffusers_fused, linear_names, make_kohya_flux_lora, make_lora

from preshard.cli import convert_checkpoint_command, main
from preshard.converter import convert as convert_module
from preshard.converter.convert import ConversionOutcome, convert_checkpoint, plan_conversion
from preshard.converter.lora import TILE_ROWS, fuse_rows, fuse_state_dict, open_loras
from preshard.errors import MismatchError, OutputError, SourceError, UsageError
from preshard.format import slicing
from preshard.format.manifest import read_manifest
from preshard.format.mesh import MeshSpec
from preshard.sources import open_source
from preshard.tools.unshard import unshard_checkpoint
from preshard.tools.verify import verify_checkpoint


def _full(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted checkpoint, reassembled by torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    return torch.load(out)


def _source_tensors(source: Path) -> dict[str, torch.Tensor]:
    files = sorted(source.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny fp32 Flux checkpoint, two LoRAs on it (one on every Linear, one on the attention and output only)."""
    root = tmp_path_factory.mktemp("lora-flux")
    model, _ = build("flux")
    source = save(model, root / "src")
    every = make_lora(model, root / "every.safetensors", seed=1, bias=True)
    attn = make_lora(model, root / "attn.safetensors", pattern=r".*(attn\..*|proj_out)", rank=3, alpha=6.0, seed=2)
    return source, every, attn


@pytest.fixture(scope="module")
def flux_fused(flux, tmp_path_factory):
    source, every, attn = flux
    out = tmp_path_factory.mktemp("lora-flux-out") / "tp2"
    manifest = convert_checkpoint(source, out, tp=2, progress=False, loras=[(every, 0.5), (attn, -1.5)])
    return out, manifest


def test_a_fused_fp32_conversion_equals_diffusers_fuse_lora_on_the_unsharded_model_bit_for_bit(
    flux, flux_fused, tmp_path
):
    source, every, attn = flux
    out, _ = flux_fused
    model, _ = build("flux")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    reference = diffusers_fused(model, [(every, 0.5), (attn, -1.5)])
    converted = _full(out, tmp_path)
    assert set(converted) == set(reference)
    differ = [k for k in reference if not torch.equal(converted[k], reference[k])]
    assert not differ, differ[:5]
    # The LoRAs did something: every weight of a Linear they name (and the biases of the first) changed.
    changed = {k for k in base if not torch.equal(base[k], reference[k])}
    expected = {f"{m}.weight" for m in linear_names(model)} | {f"{m}.bias" for m in linear_names(model)}
    assert changed == expected


def test_the_loras_are_recorded_in_the_manifest_and_inspect(flux, flux_fused):
    from preshard.sources.reader import hash_file
    from preshard.tools.inspect import inspect_data, inspect_table

    _, every, attn = flux
    out, manifest = flux_fused
    again = read_manifest(out)
    assert again.source.loras == manifest.source.loras
    first, second = again.source.loras
    assert (first.name, first.scale, first.xxh3_128, first.size) == (
        every.name, 0.5, hash_file(every), every.stat().st_size
    )  # fmt: skip
    assert first.loader == "diffusers FluxLoraLoaderMixin" and not first.converted
    assert second.scale == -1.5
    module = first.modules["transformer_blocks.0.attn.to_q"]
    assert (module.rank, module.scaling, module.bias) == (4, 0.5 * 2.0 / 4, True)  # alpha / rank x scale
    assert second.modules["transformer_blocks.0.attn.to_q"].scaling == -1.5 * 6.0 / 3
    assert "transformer_blocks.0.ff.net.0.proj" not in second.modules
    assert "lora:    every.safetensors x 0.5 fused into" in inspect_table(again)
    assert inspect_data(again)["source"]["loras"][1]["name"] == "attn.safetensors"


def test_verify_compares_the_untouched_tensors_and_unshard_is_refused(flux, flux_fused, tmp_path):
    source, _, _ = flux
    out, manifest = flux_fused
    result = verify_checkpoint(out, source=source)
    assert result.ok, result.problems
    touched = manifest.source.lora_tensors()
    assert result.lora_tensors == len(touched) and result.source_tensors == len(manifest.tensors) - len(touched)
    with pytest.raises(UsageError, match="LoRA.* fused .*cannot be rebuilt"):
        unshard_checkpoint(out, tmp_path / "unsharded")
    assert not (tmp_path / "unsharded").exists()


def test_a_checkpoint_without_loras_keeps_its_manifest_bytes(flux, tmp_path):
    """No LoRA: no 'loras' key in the manifest, so conversions without one are unchanged (and older ones read)."""
    source, _, _ = flux
    manifest = convert_checkpoint(source, tmp_path / "plain", tp=2, progress=False)
    data = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert "loras" not in data["source"] and manifest.source.loras == ()


# ---------------------------------------------------------------------------------------------------------
# The arithmetic: independent of bands, one rounding in bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rows_do_not_depend_on_how_the_tensor_is_cut(dtype):
    g = torch.Generator().manual_seed(0)
    rows, cols, rank = 2 * TILE_ROWS + 37, 96, 5
    from preshard.converter.lora import LoraFactor

    factor = LoraFactor("m", torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g), None, 0.7)
    base = torch.randn(rows, cols, generator=g).to(dtype)
    whole = base.clone()
    fuse_rows(whole, 0, [(factor, "weight")], rows)
    for cuts in ([1, 2, 3], [TILE_ROWS - 1, TILE_ROWS + 1], [100, 300, rows - 1], list(range(1, rows, 41))):
        banded = base.clone()
        edges = [0, *cuts, rows]
        for lo, hi in zip(edges, edges[1:]):
            fuse_rows(banded[lo:hi], lo, [(factor, "weight")], rows)
        assert torch.equal(banded, whole), cuts
    # one rounding of the float32 sum
    exact = base.double() + (factor.up.double() @ factor.down.double()) * 0.7
    assert torch.allclose(whole.double(), exact, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


@pytest.fixture(scope="module")
def h3(tmp_path_factory, tiny_sources, tiny_models):
    root = tmp_path_factory.mktemp("lora-h3")
    model = tiny_models("float32")
    lora = make_lora(model, root / "h3.safetensors", seed=3)
    return lora


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "mixed"])
def test_h3_fused_at_tp2_equals_the_unsharded_fuse_converted_bit_for_bit_in_small_bands(
    kind, h3, tiny_sources, tmp_path, monkeypatch
):
    """Bands of a few rows (many not on a tile boundary, some of one row): the fused checkpoint equals preshard's
    fuse of the whole tensors, converted without the LoRA, bit for bit; and diffusers' fuse_lora within one
    rounding of the weight's dtype (exactly for float32 tensors)."""
    from preshard.examples.minimax_h3 import build_model

    source = tiny_sources(kind)
    monkeypatch.setattr(slicing, "BAND_BYTES", 1500)  # (ConversionPlan.band_bytes: at most this)
    out = tmp_path / "fused"
    convert_checkpoint(source, out, tp=2, progress=False, loras=[(h3, 0.75)])
    assert plan_conversion(source, mesh=MeshSpec(tp=2)).band_bytes == 1500
    converted = _full(out, tmp_path)
    lora_set = open_loras([(h3, 0.75)], open_source(source))
    ours = fuse_state_dict(_source_tensors(source), lora_set)
    assert all(torch.equal(converted[k], ours[k]) for k in ours)
    assert lora_set.terms and all(not torch.equal(ours[k], _source_tensors(source)[k]) for k in lora_set.terms)

    model = build_model(dtype=kind, seed=0)
    reference = diffusers_fused(model, [(h3, 0.75)], loader="MiniMaxH3LoraLoaderMixin")
    base = _source_tensors(source)
    for name, want in reference.items():
        got = converted[name]
        assert got.dtype == want.dtype, name
        if want.dtype == torch.float32 or name not in lora_set.terms:
            assert torch.equal(got, want), name
            continue
        # bf16: one rounding of the exact sum (half an ulp, plus the float32 accumulation's own error where the sum
        # cancels); diffusers holds the factors in bf16 and rounds the delta before adding it: never closer
        ((factor, _),) = lora_set.terms[name]
        delta = (factor.up.double() @ factor.down.double()) * factor.scaling
        exact = base[name].double() + delta
        ulp = torch.pow(2.0, torch.frexp(exact)[1].double() - 8)
        error = (got.double() - exact).abs()
        assert (error <= 0.5 * ulp + 2**-20 * (base[name].double().abs() + delta.abs())).all(), name
        assert error.max() <= (want.double() - exact).abs().max(), name


def test_a_kohya_flux_lora_is_converted_by_diffusers_and_fused_as_diffusers_fuses_it(flux, tmp_path):
    source, _, _ = flux
    kohya = make_kohya_flux_lora(tmp_path / "kohya.safetensors", inner=64)
    manifest = convert_checkpoint(source, tmp_path / "out", tp=2, progress=False, loras=[kohya])
    record = manifest.source.loras[0]
    assert record.converted and set(record.modules) == {
        "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
        "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.proj_out",
    }  # fmt: skip
    model, _ = build("flux")
    reference = diffusers_fused(model, [(kohya, 1.0)])
    converted = _full(tmp_path / "out", tmp_path)
    assert all(torch.equal(converted[k], reference[k]) for k in reference)


def test_workers_write_the_same_bytes_with_a_lora(flux, tmp_path):
    source, every, _ = flux
    one = tmp_path / "one"
    two = tmp_path / "two"
    convert_checkpoint(source, one, tp=2, progress=False, loras=[every])
    convert_checkpoint(source, two, tp=2, progress=False, loras=[every], workers=2)
    for f in read_manifest(one).files:
        assert (one / f.name).read_bytes() == (two / f.name).read_bytes()


# ---------------------------------------------------------------------------------------------------------
# Resume: another LoRA set is another conversion


def _crash_after(out: Path, tensors: int, monkeypatch, **kwargs) -> None:
    monkeypatch.setattr(convert_module, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    written: list[str] = []

    def crash(name: str) -> None:
        written.append(name)
        if len(written) == tensors:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(output=out, progress=False, on_tensor=crash, **kwargs)


@pytest.mark.parametrize("change", ["same", "scale", "another file", "none"])
def test_resume_only_with_the_same_loras(flux, tmp_path, monkeypatch, change):
    source, every, attn = flux
    out = tmp_path / "out"
    _crash_after(out, 30, monkeypatch, source=source, tp=2, loras=[(every, 0.5)])
    loras = {"same": [(every, 0.5)], "scale": [(every, 0.25)], "another file": [(attn, 0.5)], "none": None}[change]
    written: list[str] = []
    outcome = ConversionOutcome()
    convert_checkpoint(source, out, tp=2, progress=False, loras=loras, outcome=outcome, on_tensor=written.append)
    total = len(read_manifest(out).tensors)
    # Resumed (the tensors journalled before the crash), or redone from the start. The writer threads run ahead of
    # the callback that crashed, and what they had made durable by then is journalled too, so a loaded machine can
    # keep more than the 30 the callback saw (CI once kept 70): the bound is the job, not 30.
    kept = outcome.kept_tensors
    assert (0 < kept < total) if change == "same" else kept == 0, (kept, total)
    assert len(written) == total - kept
    fresh = tmp_path / "fresh"
    convert_checkpoint(source, fresh, tp=2, progress=False, loras=loras)
    for f in read_manifest(fresh).files:
        assert (out / f.name).read_bytes() == (fresh / f.name).read_bytes()


@pytest.mark.parametrize("change", ["same", "scale", "none"])
def test_a_finished_conversion_is_already_converted_only_with_the_same_loras(flux, tmp_path, change):
    source, every, _ = flux
    out = tmp_path / "out"
    convert_checkpoint(source, out, tp=2, progress=False, loras=[(every, 0.5)])
    loras = {"same": [(every, 0.5)], "scale": [(every, 0.25)], "none": None}[change]
    outcome = ConversionOutcome()
    if change == "same":
        convert_checkpoint(source, out, tp=2, progress=False, loras=loras, outcome=outcome)
        assert outcome.status == "already converted"
        return
    with pytest.raises(OutputError, match="--overwrite"):  # another conversion: never "nothing to do"
        convert_checkpoint(source, out, tp=2, progress=False, loras=loras, outcome=outcome)
    assert outcome.status != "already converted"


# ---------------------------------------------------------------------------------------------------------
# What does not fit is one line


def _bad_file(tmp_path: Path, name: str, state: dict) -> Path:
    path = tmp_path / name
    save_file(state, str(path))
    return path


def _flux_lora_state(flux_source: Path) -> dict[str, torch.Tensor]:
    model, _ = build("flux")
    path = make_lora(model, flux_source.parent / "ok.safetensors", pattern=r"transformer_blocks\.0\.attn\.to_[qkv]")
    return load_file(str(path))


@pytest.mark.parametrize(
    "case, error, fragments",
    [
        ("missing", SourceError, ["nope.safetensors does not exist"]),
        ("not safetensors", SourceError, ["is not a .safetensors file"]),
        ("garbage", SourceError, ["garbage.safetensors", "not safetensors"]),
        ("unknown module", MismatchError, ["transformer_blocks.7.attn.to_q", "does not have"]),
        ("shapes", MismatchError, ["do not fit its weight [64, 64]"]),
        ("another model", MismatchError, ["is not for this FluxTransformer2DModel checkpoint"]),
        ("text encoder", MismatchError, ["also holds 2 tensors for text_encoder"]),
        ("dora", MismatchError, ["DoRA"]),
        ("half", MismatchError, ["only one of lora_A and lora_B"]),
        ("bad scale", UsageError, ["must be a finite number"]),
    ],
)
def test_every_lora_that_does_not_fit_is_one_line(flux, tmp_path, tiny_models, case, error, fragments):
    source, every, _ = flux
    ok = _flux_lora_state(source)
    to_q = "transformer.transformer_blocks.0.attn.to_q"
    scale = 1.0
    if case == "missing":
        path = tmp_path / "nope.safetensors"
    elif case == "not safetensors":
        path = tmp_path / "lora.bin"
        torch.save(ok, path)
    elif case == "garbage":
        path = tmp_path / "garbage.safetensors"
        path.write_bytes(b"\xff" * 64)
    elif case == "unknown module":
        extra = {k.replace(".0.", ".7."): v.clone() for k, v in ok.items() if ".to_q." in k}
        path = _bad_file(tmp_path, "x.safetensors", {**ok, **extra})
    elif case == "shapes":
        path = _bad_file(tmp_path, "x.safetensors", {**ok, f"{to_q}.lora_A.weight": torch.zeros(4, 32)})
    elif case == "another model":
        path = make_lora(tiny_models("float32"), tmp_path / "h3.safetensors")
    elif case == "text encoder":
        te = {
            "text_encoder.layer.lora_A.weight": torch.zeros(4, 8),
            "text_encoder.layer.lora_B.weight": torch.zeros(8, 4),
        }
        path = _bad_file(tmp_path, "x.safetensors", {**ok, **te})
    elif case == "dora":
        path = _bad_file(tmp_path, "x.safetensors", {**ok, f"{to_q}.lora_magnitude_vector": torch.ones(64)})
    elif case == "half":
        path = _bad_file(tmp_path, "x.safetensors", {k: v for k, v in ok.items() if k != f"{to_q}.lora_B.weight"})
    else:
        path, scale = every, math.nan
    with pytest.raises(error) as caught:
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False, loras=[(path, scale)])
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out").exists()


def test_a_lora_on_quantised_weights_is_refused(tmp_path):
    model, _ = build("flux")
    source = save(model, tmp_path / "src")
    weights = source / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["transformer_blocks.0.attn.to_q.weight"] = state["transformer_blocks.0.attn.to_q.weight"].to(
        torch.float8_e4m3fn
    )
    save_file(state, str(weights))
    lora = make_lora(model, tmp_path / "q.safetensors", pattern=r"transformer_blocks\.0\.attn\.to_q")
    with pytest.raises(MismatchError, match="float8_e4m3fn: a LoRA cannot be fused into quantised"):
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False, loras=[lora])


def test_a_source_without_a_model_class_is_refused(tmp_path):
    model, _ = build("flux")
    source = save(model, tmp_path / "src")
    (source / "config.json").unlink()
    lora = make_lora(model, tmp_path / "l.safetensors", pattern=r"transformer_blocks\.0\.attn\.to_q")
    with pytest.raises(MismatchError, match="--lora needs the checkpoint's config.json"):
        convert_checkpoint(source, tmp_path / "out", tp=2, plan=_flux_plan_file(tmp_path), progress=False, loras=[lora])


def _flux_plan_file(tmp_path: Path) -> Path:
    from preshard.plans.from_model import plan_from_model

    model, _ = build("flux")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_from_model(model).to_dict()))
    return path


# ---------------------------------------------------------------------------------------------------------
# The command line


def test_cli_pairs_each_scale_with_the_lora_before_it_and_reports_in_the_dry_run(flux, tmp_path):
    source, every, attn = flux
    out = tmp_path / "out"
    args = [str(source), str(out), "--tp", "2", "--lora", str(every), "--lora", str(attn), "--lora-scale", "0.25"]
    result = cli_runner().invoke(convert_checkpoint_command, [*args, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(r["path"], r["scale"]) for r in report["loras"]] == [(str(every), 1.0), (str(attn), 0.25)]
    assert report["loras"][0]["modules"] == len(linear_names(build("flux")[0]))
    assert not out.exists()
    text = cli_runner().invoke(convert_checkpoint_command, [*args, "--dry-run"])
    assert f"lora:      {attn} x 0.25, fused into" in text.stdout
    result = cli_runner().invoke(main, ["convert", *args])
    assert result.exit_code == 0, result.output
    assert [(r.name, r.scale) for r in read_manifest(out).source.loras] == [(every.name, 1.0), (attn.name, 0.25)]


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--lora-scale", "2", "--lora", "X"], ["each --lora-scale follows the --lora it scales"]),
        (["--lora", "X", "--lora-scale", "2", "--lora-scale", "3"], ["each --lora-scale follows"]),
        (["--lora", "missing.safetensors"], ["LoRA file missing.safetensors does not exist"]),
        (["--lora", "X", "--lora-scale", "inf"], ["must be a finite number"]),
        (["--lora", "X", "--lora-scale", "abc"], ["--lora-scale"]),
    ],
)
def test_cli_errors_are_one_line(flux, tmp_path, extra, fragments):
    source, every, _ = flux
    extra = [str(every) if e == "X" else e for e in extra]
    for dry in ([], ["--dry-run"]):
        result = cli_runner().invoke(
            convert_checkpoint_command, [str(source), str(tmp_path / "o"), "--tp", "2", *extra, *dry]
        )
        assert_one_line(result.exit_code, result.stderr, 2, *fragments, stdout=result.stdout)
    assert not (tmp_path / "o").exists()


def test_hub_lora_is_downloaded_with_huggingface_hub(flux, tmp_path, fake_hub):
    """`--lora org/name/file.safetensors` (no such local path) comes through hf_hub_download, commit recorded."""
    source, every, _ = flux
    fake_hub.add_repo("org/loras", {"style/every.safetensors": every.read_bytes()})
    manifest = convert_checkpoint(
        source, tmp_path / "out", tp=2, progress=False, loras=[("org/loras/style/every.safetensors", 1.0)]
    )
    record = manifest.source.loras[0]
    assert (record.repo_id, record.name, record.path) == (
        "org/loras",
        "every.safetensors",
        "org/loras/style/every.safetensors",
    )
    assert record.commit and len(record.commit) == 40
    local = convert_checkpoint(source, tmp_path / "local", tp=2, progress=False, loras=[every])
    for f in local.files:
        assert (tmp_path / "out" / f.name).read_bytes() == (tmp_path / "local" / f.name).read_bytes()
    with pytest.raises(SourceError, match="Hub download failed"):
        convert_checkpoint(source, tmp_path / "x", tp=2, progress=False, loras=["org/loras/nothing.safetensors"])


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("nan in A", ["lora_A factor of", "NaN or Inf"]),
        ("inf in B", ["lora_B factor of", "NaN or Inf"]),
        ("nan alpha", ["scaling of", "alpha"]),
        ("inf alpha", ["scaling of", "alpha"]),
        ("overflowing scale", ["scaling of"]),
        ("overflowing product", ["makes its weight not finite", "--lora-scale"]),
    ],
)
def test_a_lora_that_is_not_numbers_is_refused_before_anything_is_committed(flux, tmp_path, case, fragments):
    source, _, _ = flux
    ok = _flux_lora_state(source)
    to_q = "transformer.transformer_blocks.0.attn.to_q"
    state, scale = dict(ok), 1.0
    if case == "nan in A":
        state[f"{to_q}.lora_A.weight"] = ok[f"{to_q}.lora_A.weight"].clone().index_fill_(1, torch.tensor([3]), math.nan)
    elif case == "inf in B":
        state[f"{to_q}.lora_B.weight"] = ok[f"{to_q}.lora_B.weight"].clone().index_fill_(0, torch.tensor([1]), math.inf)
    elif case in ("nan alpha", "inf alpha"):
        state[f"{to_q}.alpha"] = torch.tensor(math.nan if case == "nan alpha" else math.inf)
    elif case == "overflowing scale":
        scale = 1e300  # finite as a Python float, not as float32
    else:  # factors finite in float32, their product not
        state[f"{to_q}.lora_B.weight"] = torch.full_like(ok[f"{to_q}.lora_B.weight"], 3e38)
        state[f"{to_q}.lora_A.weight"] = torch.full_like(ok[f"{to_q}.lora_A.weight"], 10.0)
    path = _bad_file(tmp_path, "x.safetensors", state)
    with pytest.raises(SourceError) as caught:
        convert_checkpoint(source, tmp_path / "out", tp=2, progress=False, loras=[(path, scale)])
    message = str(caught.value)
    assert "\n" not in message and "transformer_blocks.0.attn.to_q" in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out").exists()
