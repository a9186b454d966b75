"""Context parallelism for the families whose attention takes a text mask (HunyuanVideo, HunyuanVideo 1.5,
HunyuanImage 2.1) and for Cosmos, with their built-in plans, at lengths the CP size does not divide.

Each input is a batch of two whose text rows are partly padding, by a different amount per sample (the model's
own mask: HunyuanVideo and HunyuanImage build one over the whole joined sequence before the split; HunyuanVideo
1.5 splits its text mask with the text and each attention builds a [queries, keys] mask from its rows), with 15
video/image tokens and 7 text rows. Ulysses=2 and ring=2 on 2 gloo ranks, tp=2 x ulysses=2 and tp=2 x ring=2 on
4, all equal to the unsharded model within 1e-5 in float32. Negative controls: the mask changes the unsharded
output (it really masks), and the sharded model with its CP attention ignoring the mask is wrong. Cosmos runs
with a timestep per sample and one per frame (Video2World: per-token embeddings, split). HunyuanVideo at ring=2
compiles (aot_eager, fullgraph) with the mask, and so does the CP attention with HunyuanVideo 1.5's kind of mask
(the model itself does not compile whole: it branches on its data). The token-replace I2V variant of HunyuanVideo
is refused on a CP mesh at conversion and at load, in one line.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from multiproc import error_of, init_gloo, run_ranks
from tiny_builtin import build
from tiny_diffusers import randomize, save

from preshard.converter.convert import convert_checkpoint
from preshard.errors import PlanError

TOL = 1e-5
MASKED = ["hunyuanvideo", "hunyuanvideo15", "hunyuanimage21"]
MODELS = [*MASKED, "cosmos"]
MESHES = {2: [(1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2), (2, 2, 1)]}  # world -> (tp, ring, ulysses)
ALL_MESHES = [m for ms in MESHES.values() for m in ms]
TEXT, REAL = 7, (4, 6)  # text rows, real rows of each sample
VIDEO = 15  # latent tokens: 1 x 3 x 5 (patch 1); Cosmos: 3 x 1 x 3 = 9 (patch 1, 2, 2)
COSMOS_TOKENS = 9
pytestmark = pytest.mark.timeout(900)


def _mask(rows: int, real: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([[1] * r + [0] * (rows - r) for r in real])


def inputs(name: str, variant: int = 0, *, unmasked: bool = False) -> dict[str, Any]:
    """A batch of two for `name`; `unmasked`: every text row marked real (for the control)."""
    g = torch.Generator().manual_seed(50 + variant)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    text_mask = torch.ones(2, TEXT, dtype=torch.long) if unmasked else _mask(TEXT, REAL)
    timestep = torch.tensor([500.0, 300.0])
    if name == "hunyuanvideo":
        return dict(
            hidden_states=r(2, 4, 1, 3, 5), timestep=timestep, encoder_hidden_states=r(2, TEXT, 16),
            encoder_attention_mask=text_mask, pooled_projections=r(2, 8), guidance=torch.tensor([4000.0] * 2),
        )  # fmt: skip
    if name == "hunyuanvideo15":  # the text: 4 image, 3 ByT5 (2 and 1 real) and 7 MLLM rows, valid ones first
        return dict(
            hidden_states=r(2, 5, 1, 3, 5), timestep=timestep, encoder_hidden_states=r(2, TEXT, 16),
            encoder_attention_mask=text_mask, encoder_hidden_states_2=r(2, 3, 12),
            encoder_attention_mask_2=torch.ones(2, 3, dtype=torch.long) if unmasked else _mask(3, (2, 1)),
            image_embeds=r(2, 4, 10),
        )  # fmt: skip
    if name == "hunyuanimage21":
        return dict(
            hidden_states=r(2, 4, 3, 5),
            timestep=timestep,
            encoder_hidden_states=r(2, TEXT, 16),
            encoder_attention_mask=text_mask,
        )
    if name == "cosmos":  # variant 1: a timestep per frame (Video2World), so the embeddings are per token
        cosmos_t = torch.tensor([0.5, 0.2]) if variant == 0 else torch.rand(2, 1, 3, 1, 1, generator=g)
        return dict(hidden_states=r(2, 4, 3, 2, 6), timestep=cosmos_t, encoder_hidden_states=r(2, TEXT, 16))
    raise KeyError(name)


VARIANTS = {"cosmos": (0, 1)}


def _runs(name: str) -> tuple[int, ...]:
    return VARIANTS.get(name, (0,))


def _token_replace():
    from diffusers import HunyuanVideoTransformer3DModel

    model, _ = build("hunyuanvideo")
    return randomize(HunyuanVideoTransformer3DModel(**{**dict(model.config), "image_condition_type": "token_replace"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[Any, str]:
    root = tmp_path_factory.mktemp("cp-masked")
    out: dict[Any, str] = {}
    for name in MODELS:
        source = save(build(name)[0], root / f"src-{name}")
        for tp in (1, 2):
            convert_checkpoint(source, root / f"{name}-tp{tp}", tp=tp, ulysses=2, progress=False)  # built-in plan
            out[(name, tp)] = str(root / f"{name}-tp{tp}")
    token_replace = save(_token_replace(), root / "src-token-replace")
    convert_checkpoint(token_replace, root / "token-replace", tp=1, progress=False)  # no CP: converts
    out["token_replace"] = str(root / "token-replace")
    out["token_replace_source"] = str(token_replace)
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    refs: dict[Any, torch.Tensor] = {}
    with torch.no_grad():
        for name in MODELS:
            model = build(name)[0]
            for v in _runs(name):
                refs[(name, v)] = model(**inputs(name, v), return_dict=False)[0]
            if name in MASKED:
                refs[(name, "unmasked")] = model(**inputs(name, unmasked=True), return_dict=False)[0]
    return refs


def _ignoring_masks(net) -> None:
    """Negative control: this model's CP attention drops every attention mask it is given."""
    runtime = net._preshard_cp
    attend = type(runtime).attend

    def attend_without_mask(name, query, key, value, attn_mask=None, *args, **kwargs):
        return attend(runtime, name, query, key, value, None, *args, **kwargs)

    runtime.attend = attend_without_mask


def _compiled(net, name: str, reference: torch.Tensor) -> dict:
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(**inputs(name), return_dict=False)[0]
            again = compiled(**inputs(name), return_dict=False)[0]
        return {
            "diff": max((out - reference).abs().max().item(), (again - reference).abs().max().item()),
            "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "error": None,
        }
    except Exception:  # noqa: BLE001 - reported to the parent test
        return {"diff": None, "breaks": None, "error": traceback.format_exc()}


def _compiled_product_mask(net) -> dict:
    """HunyuanVideo 1.5's kind of mask (this rank's [queries, keys], a key and a query mask combined) through the CP
    attention compiled whole (the model itself does not compile: it branches on its data); a mask that is no such
    product fails the check inside the graph."""
    runtime = net._preshard_cp  # its sequence table is the last forward's: 15 video rows (8 here), 14 text (7)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 15, 8, generator=g) for _ in range(3))
    valid = torch.rand(2, 15, generator=g) > 0.3
    valid[:, 0] = True
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    bad = mask.clone()
    bad[0, 0, 1, 2] = ~bad[0, 0, 1, 2]
    torch._dynamo.reset()
    attend = torch.compile(lambda *a: runtime.attend("attn", *a), backend="aot_eager", fullgraph=True)
    eager = runtime.attend("attn", q, k, v, mask)
    return {"diff": (attend(q, k, v, mask) - eager).abs().max().item(), "bad": error_of(lambda: attend(q, k, v, bad))}


def _rank(rank: int, world: int, checkpoints: dict, references: dict, meshes) -> dict:
    from tiny_builtin import build

    from preshard.runtime.load import load_sharded

    init_gloo()
    results: dict[Any, Any] = {}
    for name in MODELS:
        cls = type(build(name)[0])
        for tp, ring, ulysses in meshes:
            net = load_sharded(cls, checkpoints[(name, tp)], ring=ring, ulysses=ulysses)
            run: dict[Any, Any] = {}
            with torch.no_grad():
                for v in _runs(name):
                    run[v] = (net(**inputs(name, v), return_dict=False)[0] - references[(name, v)]).abs().max().item()
            run["rows"] = dict(net.preshard_report.attention_rows)
            run["hooks"] = {m: list(h) for m, h in net.preshard_report.hooks.items()}
            if name in MASKED:
                _ignoring_masks(net)
                with torch.no_grad():
                    wrong = net(**inputs(name), return_dict=False)[0]
                run["mask_ignored"] = (wrong - references[(name, 0)]).abs().max().item()
            results[(name, tp, ring, ulysses)] = run
            if name == "hunyuanvideo15" and (tp, ring, ulysses) == (1, 1, 2):
                net = load_sharded(cls, checkpoints[(name, tp)], ulysses=2)
                with torch.no_grad():
                    net(**inputs(name), return_dict=False)
                    results["product_mask"] = _compiled_product_mask(net)
    if world == 2:
        from diffusers import HunyuanVideoTransformer3DModel

        net = load_sharded(HunyuanVideoTransformer3DModel, checkpoints[("hunyuanvideo", 1)], ring=2)
        results["compiled"] = _compiled(net, "hunyuanvideo", references[("hunyuanvideo", 0)])
        results["token_replace"] = error_of(
            lambda: load_sharded(HunyuanVideoTransformer3DModel, checkpoints["token_replace"], ulysses=2)
        )
    return results


@pytest.fixture(scope="module")
def runs(checkpoints, references) -> dict:
    merged: dict[Any, list] = {}
    for world, meshes in MESHES.items():
        per_rank = run_ranks(_rank, world, checkpoints, references, meshes, timeout=800)
        for key in per_rank[0]:
            merged[(world, key) if isinstance(key, str) else key] = [r[key] for r in per_rank]
    return merged


def _id(mesh) -> str:
    return "tp{}-ring{}-uly{}".format(*mesh)


@pytest.mark.parametrize("mesh", ALL_MESHES, ids=_id)
@pytest.mark.parametrize("name", MODELS)
def test_equals_unsharded_at_uneven_lengths_with_the_text_mask(runs, name, mesh):
    tp, ring, ulysses = mesh
    cp = ring * ulysses
    for rank, run in enumerate(runs[(name, *mesh)]):
        for v in _runs(name):
            assert run[v] <= TOL, (rank, v, run[v])
        rows = run["rows"]
        assert rows, "no attention ran context parallel"
        if name == "cosmos":  # self-attention over this rank's video rows; the text cross-attention stays local
            assert set(rows) == {"transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}
            assert set(rows.values()) == {-(-COSMOS_TOKENS // cp)}
            assert any("split input temb" in h for h in run["hooks"]["norm_out"])
        else:  # joint attention over this rank's video rows and text rows
            assert set(rows.values()) == {-(-VIDEO // cp) + -(-TEXT * (2 if name == "hunyuanvideo15" else 1) // cp)}
            assert not any(n.startswith("context_embedder") for n in rows)  # the text refiner sees the whole text
        assert any(h.startswith("cp: all-gather output") for h in run["hooks"]["proj_out"])
        assert any(
            h.startswith(f"cp: attention {'ulysses' if ulysses > 1 else 'ring'}")
            for hs in run["hooks"].values()
            for h in hs
        )


@pytest.mark.parametrize("mesh", ALL_MESHES, ids=_id)
@pytest.mark.parametrize("name", MASKED)
def test_the_mask_masks_and_cp_attention_applies_it(runs, references, name, mesh):
    assert (references[(name, "unmasked")] - references[(name, 0)]).abs().max() > 1e-3  # the padding matters
    for run in runs[(name, *mesh)]:
        assert run["mask_ignored"] > 1e-3, run["mask_ignored"]  # ignoring it under CP gives a wrong output
        assert run[0] <= TOL


def test_hunyuanvideo_compiles_whole_with_the_mask_at_ring2(runs):
    for result in runs[(2, "compiled")]:
        assert result["error"] is None, result["error"]
        assert result["breaks"] == 0 and result["diff"] <= TOL, result


def test_a_product_mask_compiles_and_a_mask_that_is_none_is_refused_in_the_graph(runs):
    for result in runs[(2, "product_mask")]:
        assert result["diff"] <= 1e-6, result
        assert result["bad"] is not None and "not a key mask and a query mask combined" in result["bad"], result


def test_token_replace_hunyuanvideo_is_refused_on_a_cp_mesh(checkpoints, runs, tmp_path):
    message = (
        r"built-in plan hunyuanvideo: context parallelism works for config image_condition_type = None or "
        r"'latent_concat', not 'token_replace' \(see the plan's description\); use ring=1 and ulysses=1 \(--cp 1\)"
    )
    with pytest.raises(PlanError, match=message):
        convert_checkpoint(checkpoints["token_replace_source"], tmp_path / "out", tp=1, ulysses=2, progress=False)
    assert not (tmp_path / "out").exists()
    for error in runs[(2, "token_replace")]:
        assert error is not None and error.startswith("PlanError") and "\n" not in error, error
        assert "not 'token_replace'" in error
