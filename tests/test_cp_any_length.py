"""Context parallelism at any sequence length for models whose forward splits several sequences.

Flux splits text and image at its root and joins them in every attention; LTX-2 splits video and audio and
attends within each and across them (audio-to-video, video-to-audio). With lengths the CP size does not
divide (13 image and 5 text rows, as the issue asks, and more), each sequence is padded on its own, every
collective stays equal-sized (checked by the Neuron rule checker), and the output equals the unsharded model
within 1e-5: Flux at tp=2 x ulysses=2, tp=2 x ring=2, ring=2 x ulysses=2, ulysses=3 and ring=2; LTX-2 (the
built-in plan, tp=1: tp=2 x CP is in test_video_plans.py) at ulysses=2, ring=2 and ulysses=3.

Negative controls: with Flux's join order reversed the output is wrong (so the order is what finds the
padding), and with no join order the forward is refused in one line that speaks to pipeline users. What a
pipeline does to the attention modules (set_attention_backend, set_attn_processor, enable_parallelism) works
or is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from multiproc import error_of, init_gloo, run_ranks
from tiny_builtin import build as build_builtin
from tiny_diffusers import build, save

from preshard.converter.convert import convert_checkpoint

TOL = 1e-5
FLUX_LENGTHS = [(13, 5), (5, 13), (7, 1), (12, 8)]  # (image, text): uneven both, a text shorter than cp, even
EVEN = (24, 12)  # divides by every CP size here
LTX_LENGTHS = [((2, 2, 3), 5), ((1, 3, 3), 4), ((2, 2, 2), 6)]  # (frames, height, width) video, audio frames
FLUX_MESHES = {2: [(1, 2, 1)], 3: [(1, 1, 3)], 4: [(2, 1, 2), (2, 2, 1), (1, 2, 2)]}  # world -> (tp, ring, ulysses)
LTX_MESHES = {2: [(1, 1, 2), (1, 2, 1)], 3: [(1, 1, 3)]}
SD3_LENGTHS = [((10, 6), 5), ((6, 6), 7), ((8, 8), 8)]  # (latent height, width): 15, 9, 16 image tokens; text rows
pytestmark = pytest.mark.timeout(900)


def flux_inputs(image: int, text: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return dict(
        hidden_states=torch.randn(1, image, 4, generator=g),
        encoder_hidden_states=torch.randn(1, text, 32, generator=g),
        pooled_projections=torch.randn(1, 24, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randint(0, 5, (image, 3), generator=g).float(),
        txt_ids=torch.zeros(text, 3),
    )


LTX_CONFIG = dict(
    in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
    audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=4, audio_attention_head_dim=4,
    audio_cross_attention_dim=16, num_layers=2, caption_channels=24, rope_type="split",
)  # fmt: skip


def ltx_model():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**LTX_CONFIG).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight matters, outputs stay O(1)
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in name else 0.0))
    return model


def ltx_inputs(video: tuple[int, int, int], audio: int, seed: int = 0) -> dict[str, Any]:
    frames, height, width = video
    g = torch.Generator().manual_seed(200 + seed)
    return dict(
        hidden_states=torch.randn(1, frames * height * width, 8, generator=g),
        audio_hidden_states=torch.randn(1, audio, 6, generator=g),
        encoder_hidden_states=torch.randn(1, 7, 24, generator=g),
        audio_encoder_hidden_states=torch.randn(1, 7, 24, generator=g),
        timestep=torch.tensor([500.0]),
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio,
    )


def sd3_inputs(latent: tuple[int, int], text: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """SD3 (built-in plan; it joins image before text): a latent of `latent` pixels (patch 2) and `text` rows."""
    g = torch.Generator().manual_seed(300 + seed)
    return dict(
        hidden_states=torch.randn(1, 4, *latent, generator=g),
        encoder_hidden_states=torch.randn(1, text, 16, generator=g),
        pooled_projections=torch.randn(1, 8, generator=g),
        timestep=torch.tensor([500.0]),
    )


def _split(dims: int = 3) -> dict[str, int]:
    return {"dim": 1, "expected_dims": dims}


ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")


# A plan file with a join order (round-tripped below): video and audio split at the root and at every RoPE.
LTX_PLAN = {
    "format": 1,
    "name": "ltx2-video-audio-cp (test)",
    "model_classes": ["LTX2VideoTransformer3DModel"],
    "linear": [],
    "attention": [
        {"match": f"transformer_blocks.*.{name}", "context_parallel": cp}
        for name, cp in [
            ("attn1", True),
            ("audio_attn1", True),
            ("audio_to_video_attn", True),
            ("video_to_audio_attn", True),
            ("attn2", False),
            ("audio_attn2", False),
        ]
    ],  # fmt: skip
    "cp_plan": {
        "": {"split_inputs": {"hidden_states": _split(), "audio_hidden_states": _split()}},
        **{rope: {"split_outputs": {"0": _split(), "1": _split()}} for rope in ROPES},
        "proj_out": {"gather_output": _split()},
        "audio_proj_out": {"gather_output": _split()},
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("any-length")
    flux = save(build("flux")[0], root / "src-flux")
    sd3 = save(build_builtin("sd3")[0], root / "src-sd3")
    convert_checkpoint(sd3, root / "sd3", tp=1, progress=False)  # the built-in plan
    ltx = save(ltx_model(), root / "src-ltx2")
    for tp in (1, 2):
        convert_checkpoint(flux, root / f"flux-tp{tp}", tp=tp, progress=False)
    convert_checkpoint(ltx, root / "ltx2", tp=1, progress=False)  # the built-in plan
    return {
        "flux1": str(root / "flux-tp1"), "flux2": str(root / "flux-tp2"), "ltx2": str(root / "ltx2"),
        "sd3": str(root / "sd3"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def references() -> dict:
    flux = build("flux")[0]
    ltx = ltx_model()
    sd3 = build_builtin("sd3")[0]
    with torch.no_grad():
        return {
            "sd3": {n: sd3(**sd3_inputs(*n), return_dict=False)[0] for n in SD3_LENGTHS},
            "flux": {n: flux(**flux_inputs(*n), return_dict=False)[0] for n in [*FLUX_LENGTHS, EVEN]},
            "ltx2": {lengths: ltx(**ltx_inputs(*lengths), return_dict=False) for lengths in LTX_LENGTHS},
        }


def _checked_forward(net, inputs) -> tuple[Any, list[str], list]:
    from preshard.runtime.collectives import NeuronRuleChecker

    with torch.no_grad(), NeuronRuleChecker() as checker:
        out = net(**inputs, return_dict=False)
    return out, checker.violations, [(c.op, c.shape) for c in checker.calls if c.op == "all_gather_cat"]


def _flux_rank(rank: int, world: int, checkpoints: dict, references: dict, meshes) -> dict:
    from diffusers import FluxTransformer2DModel

    from preshard.runtime.load import load_sharded

    init_gloo()
    results: dict[Any, Any] = {}
    for tp, ring, ulysses in meshes:
        net = load_sharded(FluxTransformer2DModel, checkpoints[f"flux{tp}"], ring=ring, ulysses=ulysses)
        run: dict[str, Any] = {"lengths": {}}
        for lengths in FLUX_LENGTHS:
            out, violations, gathers = _checked_forward(net, flux_inputs(*lengths))
            run["lengths"][lengths] = {
                "diff": (out[0] - references["flux"][lengths]).abs().max().item(),
                "violations": violations,
                "gathers": gathers,
                "rows": dict(net.preshard_report.attention_rows),
            }
        runtime = net._preshard_cp
        runtime.join_order = ("hidden_states", "encoder_hidden_states")  # the wrong order
        with torch.no_grad():
            wrong = net(**flux_inputs(13, 5), return_dict=False)[0]
        run["wrong_order_diff"] = (wrong - references["flux"][(13, 5)]).abs().max().item()
        runtime.join_order = ()
        run["no_order_error"] = error_of(lambda net=net: net(**flux_inputs(13, 5), return_dict=False))
        with torch.no_grad():  # lengths the CP size divides need no join order
            even = net(**flux_inputs(*EVEN), return_dict=False)[0]
        run["no_order_even_diff"] = (even - references["flux"][EVEN]).abs().max().item()
        results[(tp, ring, ulysses)] = run
    return results


def _ltx_rank(rank: int, world: int, checkpoints: dict, references: dict, meshes) -> dict:
    from diffusers import LTX2VideoTransformer3DModel

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for tp, ring, ulysses in meshes:
        net = load_sharded(LTX2VideoTransformer3DModel, checkpoints["ltx2"], ring=ring, ulysses=ulysses)
        run = {}
        for lengths in LTX_LENGTHS:
            out, violations, _ = _checked_forward(net, ltx_inputs(*lengths))
            want = references["ltx2"][lengths]
            run[lengths] = {
                "diff": max((a - b).abs().max().item() for a, b in zip(out, want)),
                "violations": violations,
                "rows": dict(net.preshard_report.attention_rows),
            }
        results[(tp, ring, ulysses)] = run
    return results


def _sd3_rank(rank: int, world: int, checkpoints: dict, references: dict) -> dict:
    from diffusers import SD3Transformer2DModel

    from preshard.runtime.load import load_sharded

    init_gloo()
    results = {}
    for ring, ulysses in ((1, 2), (2, 1)):
        net = load_sharded(SD3Transformer2DModel, checkpoints["sd3"], ring=ring, ulysses=ulysses)
        for lengths in SD3_LENGTHS:
            out, violations, _ = _checked_forward(net, sd3_inputs(*lengths))
            results[(ring, ulysses, lengths)] = ((out[0] - references["sd3"][lengths]).abs().max().item(), violations)
    return results


def _pipeline_calls_rank(rank: int, world: int, checkpoints: dict, references: dict) -> dict:
    """What a pipeline may do to the attention modules of a sharded Flux (ulysses=2): works or one line."""
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from preshard.runtime.load import load_sharded

    init_gloo()
    net = load_sharded(FluxTransformer2DModel, checkpoints["flux1"], ulysses=2)
    inputs, want = flux_inputs(13, 5), references["flux"][(13, 5)]

    def diff() -> float:
        with torch.no_grad():
            return (net(**inputs, return_dict=False)[0] - want).abs().max().item()

    out: dict[str, Any] = {}
    net.set_attention_backend("native")
    out["native"] = diff()
    net.set_attention_backend("_native_math")
    out["native_math"] = diff()
    net.reset_attention_backend()
    net.set_attn_processor(FluxAttnProcessor())
    out["set_attn_processor"] = diff()
    net.set_attention_backend("flex")
    out["flex"] = error_of(diff)
    net.reset_attention_backend()

    class NoSDPA:  # a processor that computes attention some other way
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
            return (hidden_states, encoder_hidden_states) if encoder_hidden_states is not None else hidden_states

    net.set_attn_processor(NoSDPA())
    out["no_sdpa"] = error_of(diff)
    net.set_attn_processor(FluxAttnProcessor())
    for module in net.modules():  # what enable_parallelism leaves on every processor
        if hasattr(module, "processor"):
            module.processor._parallel_config = object()
    out["enable_parallelism"] = error_of(diff)
    return out


@pytest.fixture(scope="module")
def flux_runs(checkpoints, references) -> dict:
    merged: dict = {}
    for world, meshes in FLUX_MESHES.items():
        for rank_result in [run_ranks(_flux_rank, world, checkpoints, references, meshes, timeout=600)]:
            for mesh in meshes:
                merged[mesh] = [r[mesh] for r in rank_result]
    return merged


@pytest.fixture(scope="module")
def ltx_runs(checkpoints, references) -> dict:
    merged: dict = {}
    for world, meshes in LTX_MESHES.items():
        per_rank = run_ranks(_ltx_rank, world, checkpoints, references, meshes, timeout=600)
        for mesh in meshes:
            merged[mesh] = [r[mesh] for r in per_rank]
    return merged


def _mesh_id(mesh) -> str:
    return "tp{}-ring{}-uly{}".format(*mesh)


FLUX_ALL = [m for ms in FLUX_MESHES.values() for m in ms]
LTX_ALL = [m for ms in LTX_MESHES.values() for m in ms]


@pytest.mark.parametrize("lengths", FLUX_LENGTHS, ids=lambda x: f"image{x[0]}-text{x[1]}")
@pytest.mark.parametrize("mesh", FLUX_ALL, ids=_mesh_id)
def test_flux_equals_unsharded_at_any_length(flux_runs, mesh, lengths):
    tp, ring, ulysses = mesh
    cp = ring * ulysses
    for rank, run in enumerate(flux_runs[mesh]):
        got = run["lengths"][lengths]
        assert got["diff"] <= TOL, (rank, got["diff"])
        assert got["violations"] == []  # equal-sized collectives, contiguous all-to-all groups
        image_rows, text_rows = (-(-n // cp) for n in lengths)
        assert [shape[1] for _, shape in got["gathers"]] == [image_rows]  # proj_out: this rank's image rows
        assert set(got["rows"].values()) == {image_rows + text_rows}  # every attention: this rank's text + image


@pytest.mark.parametrize("mesh", FLUX_ALL, ids=_mesh_id)
def test_flux_join_order_is_what_finds_the_padding(flux_runs, mesh):
    for run in flux_runs[mesh]:
        assert run["wrong_order_diff"] > 1e-3, run["wrong_order_diff"]
        error = run["no_order_error"]
        assert error is not None and error.startswith("UsageError") and "\n" not in error, error
        assert "13 tokens" in error and "5 tokens" in error and "max_sequence_length" in error and "height" in error
        assert run["no_order_even_diff"] <= TOL


@pytest.mark.parametrize("lengths", LTX_LENGTHS, ids=lambda x: f"video{'x'.join(map(str, x[0]))}-audio{x[1]}")
@pytest.mark.parametrize("mesh", LTX_ALL, ids=_mesh_id)
def test_ltx2_video_and_audio_equal_unsharded_at_any_length(ltx_runs, mesh, lengths):
    cp = mesh[1] * mesh[2]
    video = lengths[0][0] * lengths[0][1] * lengths[0][2]
    for rank, run in enumerate(ltx_runs[mesh]):
        got = run[lengths]
        assert got["diff"] <= TOL, (rank, got["diff"])
        assert got["violations"] == []
        rows = got["rows"]
        assert sorted(n.rsplit(".", 1)[1] for n in rows) == sorted(
            ["attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn"] * LTX_CONFIG["num_layers"]
        )
        for name, n in rows.items():  # queries: this rank's video rows, or its audio rows
            queries = video if name.endswith((".attn1", ".audio_to_video_attn")) else lengths[1]
            assert n == -(-queries // cp), (name, n, queries)


@pytest.fixture(scope="module")
def sd3_runs(checkpoints, references) -> list[dict]:
    return run_ranks(_sd3_rank, 2, checkpoints, references, timeout=600)


@pytest.mark.parametrize("lengths", SD3_LENGTHS, ids=lambda x: f"latent{x[0][0]}x{x[0][1]}-text{x[1]}")
@pytest.mark.parametrize("ring, ulysses", [(1, 2), (2, 1)], ids=["uly2", "ring2"])
def test_sd3_built_in_plan_joins_image_before_text_at_any_length(sd3_runs, ring, ulysses, lengths):
    for rank, run in enumerate(sd3_runs):
        diff, violations = run[(ring, ulysses, lengths)]
        assert diff <= TOL, (rank, diff)
        assert violations == []


@pytest.fixture(scope="module")
def pipeline_calls(checkpoints, references) -> list[dict]:
    return run_ranks(_pipeline_calls_rank, 2, checkpoints, references, timeout=600)


def test_attention_backends_and_processors_work_or_are_refused_in_one_line(pipeline_calls):
    for out in pipeline_calls:
        assert out["native"] <= TOL and out["native_math"] <= TOL and out["set_attn_processor"] <= TOL
        for case, fix in [("flex", "set_attention_backend('native')"), ("no_sdpa", "native attention backend"),
                          ("enable_parallelism", "drop the enable_parallelism call")]:  # fmt: skip
            error = out[case]
            assert error is not None and error.startswith("UsageError") and "\n" not in error, (case, error)
            assert fix in error, (case, error)


def test_plan_file_join_order_round_trips(tmp_path: Path):
    from preshard.errors import PlanError
    from preshard.format.plan import Plan

    plan = Plan.from_dict({**LTX_PLAN, "cp_join_order": ["hidden_states", "audio_hidden_states"]})
    assert plan.cp_join_order == ("hidden_states", "audio_hidden_states")
    assert Plan.from_dict(plan.to_dict()).cp_join_order == plan.cp_join_order
    assert Plan.from_dict(LTX_PLAN).cp_join_order is None and "cp_join_order" not in Plan.from_dict(LTX_PLAN).to_dict()
    with pytest.raises(PlanError, match=r"'cp_join_order' names \['text'\], which no cp_plan entry splits"):
        Plan.from_dict({**LTX_PLAN, "cp_join_order": ["hidden_states", "text"]})
    with pytest.raises(PlanError, match="two or more split input names"):
        Plan.from_dict({**LTX_PLAN, "cp_join_order": "hidden_states"})


# --- the sequence table, on one process (no collective runs) ------------------------------------------


def _runtime(cp: int = 2, join: tuple[str, ...] = ("encoder_hidden_states", "hidden_states")):
    from preshard.runtime.cp import CPRuntime
    from preshard.runtime.cp_attention import CPGroups

    return CPRuntime(CPGroups(object(), cp, 0, None, 1, 0), None, list(range(cp)), join_order=join)


def test_rows_per_rank_keep_sequences_apart_and_layouts_follow_the_join_order():
    from preshard.errors import PreshardError
    from preshard.runtime.cp_attention import KeySequence

    rt = _runtime()
    assert rt.rows_for(6, "hidden_states", "image") == 3
    assert rt.rows_for(5, "encoder_hidden_states", "text") == 4  # 3 rows would not tell text from image
    assert rt.rows_for(6, None, "img_ids") == 3  # a companion of the image: the same rows
    assert rt.key_layout(3, "attn") == (KeySequence(6, 3),)
    assert rt.key_layout(4, "attn") == (KeySequence(5, 4),)
    assert rt.key_layout(7, "attn") == (KeySequence(5, 4), KeySequence(6, 3))  # text, then image
    with pytest.raises(PreshardError, match="none of the sequences this forward split"):
        rt.key_layout(9, "attn")
    with pytest.raises(PreshardError, match="hidden_states had 6 earlier"):
        rt.rows_for(8, "hidden_states", "image again")
    rt.begin_forward()
    assert rt.sequences == {} and rt.named == {}


def test_without_padding_every_key_is_real_whatever_the_join():
    from preshard.runtime.cp_attention import KeySequence

    rt = _runtime(join=())
    rt.rows_for(8, "hidden_states", "image")
    rt.rows_for(4, "encoder_hidden_states", "text")
    assert rt.key_layout(6, "attn") == (KeySequence(12, 6),)


def test_a_join_sum_never_equals_a_sequence():
    from preshard.runtime.cp_attention import KeySequence

    rt = _runtime(cp=2, join=("encoder_hidden_states", "hidden_states"))
    rt.rows_for(3, "encoder_hidden_states", "text")  # 2 rows
    rt.rows_for(2, "hidden_states", "image")  # 1 row: text + image = 3 rows
    rows = rt.rows_for(5, "audio_hidden_states", "audio")  # 3 rows would equal the join: one more
    assert rows == 4
    assert rt.key_layout(3, "attn") == (KeySequence(3, 2), KeySequence(2, 1))
    assert rt.key_layout(4, "attn") == (KeySequence(5, 4),)


def test_attention_masks_are_cut_into_each_ranks_key_rows_or_refused_in_one_line():
    """A mask over the whole joined key sequence (image then text) becomes each CP rank's mask over its key rows; a
    mask per head, one that depends on the query over the whole sequence, one of neither size, and a [queries, keys]
    mask that is not a key mask and a query mask combined are refused naming the module."""
    from preshard.errors import UsageError
    from preshard.runtime.cp_attention import KeySequence

    rt = _runtime(cp=2, join=("hidden_states", "encoder_hidden_states"))
    rt.rows_for(6, "hidden_states", "image")  # 3 rows each: nothing padded
    rt.rows_for(4, "encoder_hidden_states", "text")  # 2 rows each
    assert rt.key_layout(5, "attn") == (KeySequence(10, 5),)  # unmasked: every key is real, the order is moot
    layout = rt.key_layout(5, "attn", exact=True)  # masked: the keys by position
    assert layout == (KeySequence(6, 3), KeySequence(4, 2))
    full = torch.tensor([[True] * 6 + [True, False, True, False]])  # image 6, then text 4 with rows 1 and 3 padding
    q = k = torch.zeros(1, 1, 5, 4)
    masks, queries = rt._key_masks("attn", full[:, None, None, :], q, k, layout)
    assert queries is None and masks.shape == (2, 1, 5)
    assert masks[0, 0].tolist() == [True, True, True, True, False]  # image rows 0-2, text rows 0-1
    assert masks[1, 0].tolist() == [True, True, True, True, False]  # image rows 3-5, text rows 2-3
    bias = torch.where(full, 0.0, float("-inf"))
    assert torch.equal(rt._key_masks("attn", bias, q, k, layout)[0][1, 0], bias[0, [3, 4, 5, 8, 9]])
    for mask, says in [
        (torch.ones(1, 2, 1, 10, dtype=torch.bool), "the same for every head"),
        (torch.ones(1, 1, 10, 10, dtype=torch.bool), "cannot split"),
        (torch.ones(1, 1, 1, 7, dtype=torch.bool), "the whole 10 keys or this rank's 5"),
        (torch.eye(5, dtype=torch.bool)[None, None], "not a key mask and a query mask combined"),
    ]:
        with pytest.raises(UsageError, match=says) as caught:
            rt._key_masks("blocks.0.attn", mask, q, k, layout)
        assert "blocks.0.attn" in str(caught.value) and "\n" not in str(caught.value)
