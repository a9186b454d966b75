"""A pipeline folder converted as one and loaded as one: a tiny Wan pipeline folder (`model_index.json`) and a tiny
MiniMax-H3 modular t2va pipeline folder (`modular_model_index.json`), both built offline, converted by one
`convert-checkpoint PIPELINE OUT --tp 2` each; `load_pipeline` on 2 gloo ranks (tp=2) and on 4 (tp=2 x ulysses=2)
gives every rank the unsharded pipeline's latents within 1e-5, with the transformer really sharded (its hooks and
reads counted); the H3 pipeline with its conditioner sharded too (TP2, replicated over the ulysses pair), its head
left out before sharding and recorded in its manifest.

Also: the copy is complete (every file of every component kept whole is in OUT, byte for byte, and the index is
the source's), per-component choices (skip, whole, tp=N, refused ones), a re-run that finds the job finished, an
interrupted conversion that leaves no output and resumes keeping what was written, the output lock, and the
one-line errors of loading what is not a converted pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5  # float32


def _wan_case():
    from tiny_pipelines import CASES

    return CASES["wan"]()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from preshard.examples import minimax_h3_pipeline as h3

    root = tmp_path_factory.mktemp("pipeline-sources")
    wan = _wan_case()
    wan.pipeline(wan.transformer(), wan.components()).save_pretrained(root / "wan")
    h3.save_pipeline_folder(root / "h3", h3.build_transformer(), h3.build_text_components())
    return {"wan": root / "wan", "h3": root / "h3"}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """The unsharded pipelines' latents from seed 0 (built in memory, not from the folders)."""
    from preshard.examples import minimax_h3_pipeline as h3

    wan = _wan_case()
    refs = {"wan": wan.run(wan.pipeline(wan.transformer(), wan.components()), torch.Generator().manual_seed(0))}
    refs["h3"] = h3.generate(h3.build_pipeline(h3.build_transformer(), h3.build_text_components()))
    return refs


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Path]:
    from clitools import cli_runner

    from preshard.cli import convert_checkpoint_command

    root = tmp_path_factory.mktemp("pipeline-converted")
    out = {}
    for name, source in sources.items():
        run = cli_runner().invoke(
            convert_checkpoint_command, [str(source), str(root / name), "--tp", "2", "--no-progress", "--json"]
        )
        assert run.exit_code == 0, run.stderr
        out[name] = root / name
    return out


def _max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def _rank(rank: int, world: int, converted: dict, refs: dict, ulysses: int, conditioner: Path) -> dict:
    from preshard.examples import minimax_h3_pipeline as h3
    from preshard.runtime.pipeline_load import load_pipeline

    init_gloo()
    results = {}
    wan = load_pipeline(converted["wan"], ulysses=ulysses)
    calls: list[int] = []
    wan.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    got = _wan_case().run(wan, torch.Generator().manual_seed(0))
    report = wan.preshard_sharded_components["transformer"]
    results["wan"] = {
        "diff": _max_diff(got, refs["wan"]),
        "calls": len(calls),
        "tp_hooks": len(report.modules_with("tp:")),
        "cp_hooks": len(report.modules_with("cp: attention")),
        "sharded": sorted(wan.preshard_sharded_components),
        "vae_device": str(next(wan.vae.parameters()).device),
    }
    processor = h3.build_text_components()["processor"]  # the folder holds none (see save_pipeline_folder)
    pipe = load_pipeline(
        converted["h3"], ulysses=ulysses, components={"processor": processor}, blocks=h3.pipeline_blocks()
    )
    report = pipe.preshard_sharded_components["transformer"]
    results["h3"] = {
        "diff": _max_diff(h3.generate(pipe), refs["h3"]),
        "tp_hooks": len(report.modules_with("tp:")),
        "cp_hooks": len(report.modules_with("cp: attention")),
        "sharded": sorted(pipe.preshard_sharded_components),
        "text_encoder": type(pipe.text_encoder).__name__,
    }
    results["conditioner"] = _conditioner_run(conditioner, refs["h3"], ulysses)
    return results


@pytest.mark.parametrize("world,ulysses", [(2, 1), (4, 2)], ids=["tp2", "tp2-ulysses2"])
def test_load_pipeline_gives_the_unsharded_latents(converted, conditioner_sharded, references, world, ulysses):
    """Also the H3 pipeline with its conditioner sharded (TP2; on tp2 x ulysses2 replicated over the ulysses pair:
    no CP hook in it): latents within 1e-5, and sharded, not a whole copy: its TP hooks counted and q_proj holding
    half the rows (the negative control: a whole encoder has neither); a later hidden state refused in one line."""
    ranks = run_ranks(_rank, world, converted, references, ulysses, conditioner_sharded, timeout=600)
    for rank, results in enumerate(ranks):
        r = results["conditioner"]
        assert r["diff"] <= TOL, (rank, r["diff"])
        assert r["calls"] >= 1 and r["sharded"] == ["text_encoder", "transformer"]
        assert r["tp_hooks"] > 0 and r["cp_hooks"] == 0
        assert r["q_rows"] * 2 == r["q_rows_whole"]
        assert r["left_out"] == ("lm_head",)
        assert "was left out of this conversion" in r["refused"] and "\n" not in r["refused"]
        wan, h3 = results["wan"], results["h3"]
        assert wan["diff"] <= TOL and h3["diff"] <= TOL, (rank, wan["diff"], h3["diff"])
        assert wan["calls"] == 2  # the pipeline ran the sharded transformer, twice
        assert wan["sharded"] == h3["sharded"] == ["transformer"]
        assert wan["tp_hooks"] > 0 and h3["tp_hooks"] > 0  # sharded, not a whole copy: TP hooks in place
        assert (wan["cp_hooks"] > 0) == (h3["cp_hooks"] > 0) == (ulysses > 1)
        assert wan["vae_device"] == "cpu"
        assert h3["text_encoder"] == "Qwen3VLForConditionalGeneration"


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.quick
@pytest.mark.parametrize("name", ["wan", "h3"])
def test_the_copy_is_complete(sources, converted, name):
    from preshard.format.manifest import read_manifest
    from preshard.format.pipeline_record import read_pipeline_record

    source, out = sources[name], converted[name]
    record = read_pipeline_record(out)
    assert record is not None and record.mesh["tp"] == 2
    assert {n: c.treatment for n, c in record.components.items() if c.treatment == "sharded"} == {
        "transformer": "sharded"
    }
    assert read_manifest(out / "transformer").mesh.tp == 2
    rewritten = {n for n, c in record.components.items() if c.left_out is not None}
    assert rewritten == ({"text_encoder"} if name == "h3" else set())  # MiniMax-H3 documents what it reads

    def kept(path: str) -> bool:
        return path.split("/")[0] not in {"transformer", *rewritten}

    want = {k: v for k, v in _files(source).items() if kept(k)}
    got = {k: v for k, v in _files(out).items() if kept(k) and k != "preshard_pipeline.json"}
    assert json.loads(got.pop(record.index_name)) == json.loads(want.pop(record.index_name))
    assert got == want  # every other file, byte for byte, and nothing else
    for n, c in record.components.items():
        assert c.treatment in ("sharded", "whole"), n
    for n in rewritten:  # the kept tensors byte for byte, the left-out ones absent
        from safetensors import safe_open

        left = record.components[n].left_out
        with (
            safe_open(source / n / "model.safetensors", "pt") as a,
            safe_open(out / n / "model.safetensors", "pt") as b,
        ):
            assert set(b.keys()) < set(a.keys()) and len(a.keys()) - len(b.keys()) == left.tensors
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in b.keys())
            assert "lm_head.weight" in a.keys() and "lm_head.weight" not in b.keys()


@pytest.mark.quick
def test_a_rerun_finds_the_job_finished_and_another_job_is_refused(sources, converted):
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.errors import OutputExistsError

    outcomes: dict = {}
    before = (converted["wan"] / "preshard_pipeline.json").read_bytes()
    convert_pipeline(sources["wan"], converted["wan"], tp=2, progress=False, outcomes=outcomes)
    assert outcomes["transformer"].status == "already converted"
    assert (converted["wan"] / "preshard_pipeline.json").read_bytes() == before  # nothing written
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert_pipeline(sources["wan"], converted["wan"], tp=2, components=["vae:skip"], progress=False)


@pytest.mark.quick
def test_component_choices(sources, tmp_path):
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.errors import UsageError

    out = tmp_path / "out"
    record = convert_pipeline(sources["wan"], out, tp=2, components=["vae:skip", "transformer:tp=2"], progress=False)
    assert record.components["vae"].treatment == "skipped" and not (out / "vae").exists()
    assert json.loads((out / "model_index.json").read_text())["vae"] == [None, None]  # diffusers loads None
    assert record.components["transformer"].tp == 2
    from preshard.format.manifest import read_manifest

    assert read_manifest(out / "transformer").mesh.tp == 2
    whole = convert_pipeline(sources["wan"], tmp_path / "whole", tp=2, components=["transformer:whole"], progress=False)
    assert not whole.sharded()
    assert _files(tmp_path / "whole" / "transformer") == _files(sources["wan"] / "transformer")
    for bad, says in [
        ("nosuch:skip", "the pipeline has no such component; its components are"),
        ("vae:tp", "is not NAME:tp=N"),
        ("vae", "is not NAME:tp=N"),
        ("transformer_2:whole", "names no model for it"),
        ("scheduler:tp=2", "holds no .safetensors weights to shard; use scheduler:whole"),
        ("transformer:tp=1", "differs from the pipeline's --tp 2, and load_pipeline loads every sharded component"),
    ]:
        with pytest.raises(UsageError, match=says) as info:
            convert_pipeline(sources["wan"], tmp_path / "never", tp=2, components=[bad], progress=False)
        assert "\n" not in str(info.value)
    assert not (tmp_path / "never").exists()


@pytest.mark.quick
def test_an_interrupted_conversion_leaves_no_output_and_resumes(sources, tmp_path, monkeypatch):
    from preshard.converter import convert
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.converter.workdir import partial_dir

    out = tmp_path / "out"
    monkeypatch.setattr(convert, "SYNC_MIN_BYTES", 1)  # journal after every tensor
    written: list[str] = []

    def crash(name: str) -> None:
        written.append(name)
        if len(written) == 10:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_pipeline(sources["wan"], out, tp=2, progress=False, on_tensor=crash)
    assert not out.exists() and partial_dir(out).is_dir()  # nothing half-written at OUT
    from preshard.converter import pipeline_folder

    copies: list[str] = []
    real_copy = pipeline_folder.copy_component
    monkeypatch.setattr(
        pipeline_folder,
        "copy_component",
        lambda b, src, dst, work: (copies.append(dst.name), real_copy(b, src, dst, work)),
    )
    written.clear()
    outcomes: dict = {}
    convert_pipeline(sources["wan"], out, tp=2, progress=False, outcomes=outcomes, on_tensor=written.append)
    from preshard.format.manifest import read_manifest

    total = len(read_manifest(out / "transformer").tensors)
    assert outcomes["transformer"].status == "resumed" and outcomes["transformer"].kept_tensors >= 1
    assert len(written) < total  # the resumed run wrote only what was not kept
    # Copied before the crash (index order: scheduler, text_encoder, tokenizer, then the transformer), not again.
    assert copies == ["vae"], copies
    assert not list(out.glob(".*"))  # no marker left in the output
    assert not partial_dir(out).exists()


@pytest.mark.quick
def test_a_pipeline_being_converted_is_locked(sources, tmp_path):
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.converter.workdir import OutputLock
    from preshard.errors import OutputLockedError

    out = tmp_path / "out"
    with OutputLock(out.resolve()), pytest.raises(OutputLockedError):
        convert_pipeline(sources["wan"], out, tp=2, progress=False)
    assert not out.exists()


@pytest.mark.quick
def test_loading_what_is_not_a_converted_pipeline_is_one_line(sources, tmp_path):
    from preshard.errors import CheckpointNotFoundError, UsageError
    from preshard.runtime.pipeline_load import load_pipeline

    with pytest.raises(UsageError, match="not a converted pipeline") as info:
        load_pipeline(sources["wan"])  # the source folder: no record
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_pipeline(tmp_path / "missing")


@pytest.mark.quick
def test_subfolder_still_converts_one_component(sources, tmp_path):
    from clitools import cli_runner

    from preshard.cli import convert_checkpoint_command

    out = tmp_path / "one"
    args = [str(sources["wan"]), str(out), "--tp", "2", "--subfolder", "transformer", "--no-progress"]
    run = cli_runner().invoke(convert_checkpoint_command, args)
    assert run.exit_code == 0, run.stderr
    assert (out / "manifest.json").is_file() and not (out / "preshard_pipeline.json").exists()
    run = cli_runner().invoke(convert_checkpoint_command, [*args[:-1], "--component", "vae:skip"])
    assert run.exit_code != 0 and "--component and --keep-layers apply to a pipeline folder" in run.stderr


def test_the_conditioner_without_its_unread_layers(tmp_path):
    """MiniMax-H3 reads hidden_states[50]: of a 54-layer conditioner, layers 51-53 and the head are left out by
    default; hidden_states[0..50] equal the whole model's, a later one (or [-1], or the head) is refused in one
    line. Negative control: the whole model's hidden_states[51] differs from what the truncated one holds there."""
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.errors import UsageError
    from preshard.examples import minimax_h3_pipeline as h3
    from preshard.runtime.pipeline_load import load_pipeline

    components = h3.build_text_components(layers=54)
    h3.save_pipeline_folder(tmp_path / "src", h3.build_transformer(), components)
    record = convert_pipeline(tmp_path / "src", tmp_path / "out", tp=1, progress=False)
    left = record.components["text_encoder"].left_out
    assert left is not None and (left.keep_layers, left.layers, left.names) == (51, 54, ("lm_head",))
    assert left.tensors == 3 * 11 + 1  # three decoder layers of 11 tensors, and the head
    pipe = load_pipeline(
        tmp_path / "out", components={"processor": components["processor"]}, blocks=h3.pipeline_blocks()
    )
    encoder = pipe.text_encoder
    assert encoder.preshard_left_out == left and encoder.config.text_config.num_hidden_layers == 51
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        whole = components["text_encoder"].model(input_ids=ids, output_hidden_states=True, use_cache=False)
        truncated = encoder.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert torch.equal(truncated.hidden_states[50], whole.hidden_states[50])
    assert torch.equal(truncated.hidden_states[:51][7], whole.hidden_states[7])
    assert not torch.equal(tuple.__getitem__(truncated.hidden_states, 51), whole.hidden_states[51])  # why refuse
    for call in (
        lambda: truncated.hidden_states[51],
        lambda: truncated.hidden_states[-1],
        lambda: truncated.hidden_states[40:],
        lambda: encoder(input_ids=ids),  # the top-level forward needs the head
    ):
        with pytest.raises(UsageError, match="was left out of this conversion") as info:
            call()
        assert "\n" not in str(info.value) and "--keep-layers text_encoder:all" in str(info.value)
    kept_all = convert_pipeline(
        tmp_path / "src", tmp_path / "all", tp=1, progress=False, keep_layers=["text_encoder:all"]
    )
    assert kept_all.components["text_encoder"].left_out is None
    with pytest.raises(UsageError, match="applies to a text encoder"):
        convert_pipeline(tmp_path / "src", tmp_path / "no", tp=1, progress=False, keep_layers=["transformer:3"])


def test_wan_22_two_experts_are_both_sharded(sources, tmp_path):
    """Wan 2.2 A14B ships two experts (transformer, transformer_2): both are converted, and both load sharded."""
    import shutil

    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.runtime.pipeline_load import load_pipeline

    src = tmp_path / "wan22"
    shutil.copytree(sources["wan"], src)
    shutil.copytree(src / "transformer", src / "transformer_2")
    index = json.loads((src / "model_index.json").read_text())
    index["transformer_2"], index["boundary_ratio"] = ["diffusers", "WanTransformer3DModel"], 0.5
    (src / "model_index.json").write_text(json.dumps(index))
    record = convert_pipeline(src, tmp_path / "out", tp=1, progress=False)
    assert [c.name for c in record.sharded()] == ["transformer", "transformer_2"]
    pipe = load_pipeline(tmp_path / "out")
    assert sorted(pipe.preshard_sharded_components) == ["transformer", "transformer_2"]
    assert pipe.transformer_2 is not pipe.transformer and hasattr(pipe.transformer_2, "preshard_report")


def test_a_converted_pipeline_loads_from_the_hub(sources, references, tmp_path, fake_hub):
    """Uploaded whole, a converted pipeline loads by its repo id: the components kept whole from one snapshot (no
    shard among them), the transformer's shards fetched by load_sharded, the latents the unsharded pipeline's."""
    from preshard.converter.pipeline_folder import convert_pipeline
    from preshard.errors import CheckpointNotFoundError
    from preshard.runtime.pipeline_load import load_pipeline

    out = tmp_path / "wan-tp1"
    convert_pipeline(sources["wan"], out, tp=1, progress=False)
    files = {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    fake_hub.add_repo("org/wan-tp1", files)
    pipe = load_pipeline("org/wan-tp1")
    got = _wan_case().run(pipe, torch.Generator().manual_seed(0))
    assert _max_diff(got, references["wan"]) <= TOL
    downloaded = fake_hub.downloaded("org/wan-tp1")
    assert sorted(p for p in downloaded if p.endswith(".distcp")) == ["transformer/__0_0.distcp"]  # fetched once
    assert "vae/diffusion_pytorch_model.safetensors" in downloaded
    with pytest.raises(CheckpointNotFoundError, match="could not be fetched from the Hub") as info:
        load_pipeline("org/no-such-pipeline")
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def conditioner_sharded(sources, tmp_path_factory) -> Path:
    """The tiny H3 pipeline with its conditioner sharded too (`--component text_encoder:tp=2`), its head left out
    before sharding (the pipeline documents hidden_states[50]: 51 layers kept, of 51, and no lm_head)."""
    from clitools import cli_runner

    from preshard.cli import convert_checkpoint_command

    out = tmp_path_factory.mktemp("conditioner") / "h3"
    args = [str(sources["h3"]), str(out), "--tp", "2", "--component", "text_encoder:tp=2", "--no-progress", "--json"]
    run = cli_runner().invoke(convert_checkpoint_command, args)
    assert run.exit_code == 0, run.stderr
    return out


def _conditioner_run(folder: Path, want: dict, ulysses: int) -> dict:
    """In a rank of `_rank`'s job: the H3 pipeline with its conditioner sharded, run and inspected."""
    from preshard.errors import UsageError
    from preshard.examples import minimax_h3_pipeline as h3
    from preshard.runtime.pipeline_load import load_pipeline

    processor = h3.build_text_components()["processor"]
    pipe = load_pipeline(folder, ulysses=ulysses, components={"processor": processor}, blocks=h3.pipeline_blocks())
    encoder = pipe.text_encoder
    calls: list[int] = []
    encoder.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    diff = _max_diff(h3.generate(pipe), want)
    report = pipe.preshard_sharded_components["text_encoder"]
    q_proj = encoder.model.language_model.layers[0].self_attn.q_proj
    try:
        encoder.model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True).hidden_states[51]
        refused = ""
    except UsageError as exc:
        refused = str(exc)
    return {
        "diff": diff,
        "calls": len(calls),
        "sharded": sorted(pipe.preshard_sharded_components),
        "tp_hooks": len(report.modules_with("tp:")),
        "cp_hooks": len(report.modules_with("cp:")),
        "q_rows": q_proj.weight.shape[0],
        "q_rows_whole": encoder.config.text_config.num_attention_heads * encoder.config.text_config.head_dim,
        "left_out": encoder.preshard_left_out.names,
        "refused": refused,
    }


@pytest.mark.quick
def test_the_conditioner_sharded_is_recorded_and_copied_nowhere(conditioner_sharded):
    from preshard.format.manifest import read_manifest
    from preshard.format.pipeline_record import read_pipeline_record

    record = read_pipeline_record(conditioner_sharded)
    assert record is not None
    encoder = record.components["text_encoder"]
    assert (encoder.treatment, encoder.tp) == ("sharded", 2)
    manifest = read_manifest(conditioner_sharded / "text_encoder")
    assert manifest.mesh.world_size == 2 and manifest.source.left_out == encoder.left_out  # TP only, recorded
    assert encoder.left_out is not None and encoder.left_out.names == ("lm_head",)
    assert not any(n.startswith("lm_head") for n in manifest.tensors)
    assert manifest.source.path.endswith("text_encoder") and ".kept" not in manifest.source.path
    assert not list(conditioner_sharded.glob(".*")) and not list(
        (conditioner_sharded / "text_encoder").glob("*.safetensors")
    )


@pytest.mark.quick
def test_a_text_encoder_above_the_threshold_is_sharded_by_default(sources):
    """Below `SHARD_TEXT_ENCODER_BYTES` the tiny conditioner is copied whole; with a threshold under its size it is
    sharded, TP only on a tp2 x ulysses2 job (its mesh has no CP axis: the plan has none for it)."""
    from preshard.converter.pipeline_folder import SHARD_TEXT_ENCODER_BYTES, _component_mesh, plan_pipeline
    from preshard.format.mesh import MeshSpec
    from preshard.format.pipeline_record import read_pipeline_index

    index = read_pipeline_index(sources["h3"])
    assert index is not None
    job = MeshSpec.build(2, ulysses=2)
    whole = {p.record.name: p for p in plan_pipeline(sources["h3"], index, job, {})}
    assert whole["text_encoder"].record.treatment == "whole" and SHARD_TEXT_ENCODER_BYTES == 16 << 30
    planned = {p.record.name: p for p in plan_pipeline(sources["h3"], index, job, {}, text_encoder_bytes=0)}
    encoder = planned["text_encoder"]
    assert (encoder.record.treatment, encoder.record.tp) == ("sharded", 2)
    assert _component_mesh(encoder.record, encoder.folder, job) == MeshSpec.build(2)
    transformer = planned["transformer"]
    assert _component_mesh(transformer.record, transformer.folder, job) == job


@pytest.mark.quick
@pytest.mark.parametrize(
    "bad,message",
    [
        ({"keep_layers": 0}, "keep_layers must be between 1 and layers"),
        ({"keep_layers": 60}, "keep_layers must be between 1 and layers"),
        ({"modules": "lm_head"}, "modules must be a list"),
        ({"tensors": -1}, "tensors must be a whole number"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_a_bad_left_out_record_is_refused(conditioner_sharded, tmp_path, bad, message):
    """`source.left_out` is validated like every manifest field, even resealed (the digest recomputed)."""
    import shutil

    from manifests import edit_manifest

    from preshard.errors import CorruptCheckpointError
    from preshard.format.manifest import read_manifest

    folder = tmp_path / "text_encoder"
    shutil.copytree(conditioner_sharded / "text_encoder", folder)
    edit_manifest(folder, lambda data: data["source"]["left_out"].update(bad))
    with pytest.raises(CorruptCheckpointError, match=message):
        read_manifest(folder)


def _rank_refused_early(rank: int, world: int, folder: str) -> str | None:
    from multiproc import error_of

    from preshard.runtime.pipeline_load import load_pipeline

    given = folder if rank == 0 else folder + "-missing"  # rank 1 mistyped it: it fails before any group exists
    return error_of(lambda: load_pipeline(given, timeout=30))


def test_a_rank_that_fails_before_the_group_exists_fails_every_rank_at_once(converted):
    """load_pipeline joins the job as load_sharded does (bounded, the early error told to every rank), instead of
    making the process group first: without the join, rank 0 would sit in init_process_group for torch's timeout."""
    errors = run_ranks(_rank_refused_early, 2, str(converted["wan"]), timeout=120)
    assert all(e is not None and e.startswith("CheckpointNotFoundError") and "-missing" in e for e in errors), errors
