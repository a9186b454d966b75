"""`preshard plan PIPELINE`: every component of a pipeline per rank, added up, and one mesh recommended.

At full size on MiniMax-H3's pipeline (safetensors headers over holes: the transformer at the class defaults and
the Qwen3-VL conditioner at Qwen3-VL-32B's shapes), the conditioner kept whole (`text_encoder:whole`) counts its
33.4 B parameters on every rank, so nothing fits 8 or 32 devices of 24 GiB; without it the transformer alone does.
Sharded (the default above 16 GiB), it counts its slices at each TP degree without its unread layers, and tp=8
fits 8 x 24 GiB, tp=2 x ulysses=2 fits 4 x 80 GiB. Each component's
figure is checked against what the one-model planner and the headers say, and the total is their sum.
"""

from __future__ import annotations

import json

import pytest

GIB = 1 << 30


@pytest.fixture(scope="module")
def h3_full(tmp_path_factory):
    from preshard.examples.minimax_h3_pipeline import write_full_size_pipeline

    return write_full_size_pipeline(tmp_path_factory.mktemp("h3-full") / "H3")


def _header_bytes(folder, keep=None) -> int:
    from preshard.converter.left_out import is_left_out
    from preshard.sources.safetensors_file import read_header

    return sum(
        e.nbytes
        for f in folder.glob("*.safetensors")
        for e in read_header(f).tensors.values()
        if keep is None or not is_left_out(e.name, keep)
    )


def test_what_leaving_out_the_unread_layers_saves(h3_full):
    """By default the conditioner keeps decoder layers 0-50 (MiniMax-H3 reads hidden_states[50]): 13 layers and
    the head, 7.1 B parameters, are not counted."""
    from preshard.tools.pipeline_plan import plan_pipeline_job

    whole, kept = _header_bytes(h3_full / "text_encoder"), _header_bytes(h3_full / "text_encoder", keep=51)
    assert 7.0e9 < (whole - kept) / 2 < 7.2e9  # bf16 parameters left out
    job = plan_pipeline_job(h3_full, devices=8, device_memory_gib=24, components=["text_encoder:whole"])
    assert {m.per_component["text_encoder"] for m in job.meshes} == {kept}
    assert job.recommended is None  # 48.9 GiB whole on every rank still fits no 24 GiB device


@pytest.mark.parametrize("devices", [8, 32])
def test_full_size_h3_on_24_gib_devices(h3_full, devices):
    from preshard.tools.pipeline_plan import plan_pipeline_job
    from preshard.tools.planner import plan_meshes

    job = plan_pipeline_job(
        h3_full,
        devices=devices,
        device_memory_gib=24,
        keep_layers=["text_encoder:all"],
        components=["text_encoder:whole"],
    )
    assert job.treatments == {
        "transformer": "sharded", "text_encoder": "whole", "scheduler": "whole", "audio_scheduler": "whole"
    }  # fmt: skip
    conditioner = _header_bytes(h3_full / "text_encoder")
    assert 33.3e9 < conditioner / 2 < 33.5e9  # bf16: the conditioner's 33.4 B parameters
    alone = {
        (m.tp, m.ring, m.ulysses): m for m in plan_meshes(h3_full, devices=devices, subfolder="transformer").meshes
    }
    assert job.meshes and all(m.world_size == devices for m in job.meshes)
    for m in job.meshes:
        assert m.per_component["transformer"] == alone[m.tp, m.ring, m.ulysses].weight_bytes_per_rank
        assert m.per_component["text_encoder"] == conditioner
        assert m.total == sum(m.per_component.values())
        assert m.fits is False  # the whole conditioner alone is 62 GiB
    assert job.recommended is None and "no mesh fits" in job.reason
    skipped = plan_pipeline_job(h3_full, devices=devices, device_memory_gib=24, components=["text_encoder:skip"])
    best = skipped.recommended
    assert best is not None and best.total <= 0.8 * 24 * GIB and best.world_size == devices
    assert "text_encoder" not in best.per_component
    assert all(m.tp >= best.tp for m in skipped.meshes if m.total <= 0.8 * 24 * GIB)  # the smallest TP that fits


def test_full_size_h3_on_4_gpus_of_80_gib_and_the_command(h3_full):
    from clitools import cli_runner

    from preshard.cli import main

    args = ["plan", str(h3_full), "--devices", "4", "--device-memory", "80", "--component", "text_encoder:whole"]
    args += ["--keep-layers", "text_encoder:all"]
    run = cli_runner().invoke(main, [*args, "--json"])
    assert run.exit_code == 0, run.stderr
    data = json.loads(run.stdout)
    best = data["recommended"]
    assert best["tp"] == 4 and best["total_bytes_per_rank"] <= 80 * GIB  # tp=2 with the whole conditioner: 93 GiB
    assert [m for m in data["meshes"] if m["fits"]] == [best]
    text = cli_runner().invoke(main, args).stdout
    assert "text_encoder" in text and "recommended: tp=4" in text
    # Without the unread layers (the default), tp=2 fits too, and is the smallest TP degree that does.
    data = json.loads(cli_runner().invoke(main, [*args[:-2], "--json"]).stdout)
    assert (data["recommended"]["tp"], data["recommended"]["ulysses"]) == (2, 2)


@pytest.mark.quick
def test_a_pipeline_plan_needs_devices(tmp_path):
    from clitools import cli_runner

    from preshard.cli import main

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    run = cli_runner().invoke(main, ["plan", str(tmp_path / "p")])
    assert run.exit_code == 2 and "pass --devices N" in run.stderr


def test_full_size_h3_with_its_conditioner_sharded(h3_full):
    """The default above 16 GiB: the conditioner sharded (TP only, replicated over CP), counted per rank at each
    mesh's TP degree without its unread layers; 8 x 24 GiB (trn2) gets tp=8, 4 x 80 GiB gets tp=2 x ulysses=2."""
    from preshard.tools.pipeline_plan import plan_pipeline_job

    kept = _header_bytes(h3_full / "text_encoder", keep=51)
    trn2 = plan_pipeline_job(h3_full, devices=8, device_memory_gib=24)
    assert trn2.treatments["text_encoder"] == "sharded"
    by_tp = {m.tp: m.per_component["text_encoder"] for m in trn2.meshes}
    assert by_tp[1] == kept  # one TP rank holds every kept tensor
    for tp, size in by_tp.items():
        assert kept / tp <= size <= kept / tp + 0.05 * kept  # its slices, plus what every rank holds whole
    for m in trn2.meshes:
        assert m.per_component["text_encoder"] == by_tp[m.tp] and m.total == sum(m.per_component.values())
    best = trn2.recommended
    assert best is not None and (best.tp, best.ring, best.ulysses) == (8, 1, 1) and best.total <= 0.8 * 24 * GIB
    gpus = plan_pipeline_job(h3_full, devices=4, device_memory_gib=80).recommended
    assert gpus is not None and (gpus.tp, gpus.ring, gpus.ulysses) == (2, 1, 2) and gpus.total <= 0.8 * 80 * GIB
