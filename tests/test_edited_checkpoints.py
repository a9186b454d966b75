"""A hand-edited checkpoint never loads wrong weights: it is refused, or the edit was harmless.

Each edit is tried two ways: plainly (the manifest's digest no longer matches, which alone refuses it) and
re-sealed, with the digest recomputed the way a determined user would, so that only the structural
cross-checks (plan re-resolution, derived chunk boxes and owners, record tiling, dtype/cast rules, the rank
table) and the runtime's framing and config checks stand in the way. The named tamper classes are refused
by a default `load_sharded` on real gloo ranks and flagged by `verify`; random mutations are fuzzed through
the same readers, asserting for every one that it is refused or that every rank's local tensors (and, for
loads of the whole model, the forward output) are bit-identical to the untouched checkpoint's.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from fuzz import json_paths, mutated
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from manifests import edit_manifest, reseal
from multiproc import init_gloo, run_ranks

from preshard.errors import MismatchError, PreshardError
from preshard.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from preshard.runtime.reader import ShardReader
from preshard.tools.verify import verify_checkpoint

OUT0 = "transformer_blocks.0.attn.to_out.0.weight"  # rowwise, bf16
Q0 = "transformer_blocks.0.attn.to_q.weight"  # colwise, bf16
REPLICATED = "proj_in.weight"  # replicated, fp32


def _style_edit(m: dict) -> None:
    m["tensors"][OUT0]["style"] = "colwise"


def _style_edit_everywhere(m: dict) -> None:
    """rowwise -> colwise with every derived field made consistent too, and the plan rule changed to match."""
    t = m["tensors"][OUT0]
    rows, cols = t["shape"]
    t["style"], t["shard_dim"], t["split_blocks"] = "colwise", 0, [rows]
    for r, chunk in enumerate(t["chunks"]):
        chunk["offsets"], chunk["sizes"] = [r * rows // 2, 0], [rows // 2, cols]
    for rule in m["plan"]["linear"]:
        if rule["match"] == "transformer_blocks.*.attn.to_out.0":  # the tiny model has blocks 0 and 1
            rule["match"] = "transformer_blocks.1.attn.to_out.0"
    m["plan"]["linear"].append({"match": "transformer_blocks.0.attn.to_out.0", "style": "colwise"})


def _swap_owners(m: dict) -> None:
    chunks = m["tensors"][Q0]["chunks"]
    for key in ("file", "offset"):
        chunks[0][key], chunks[1][key] = chunks[1][key], chunks[0][key]


def _swap_offsets(m: dict) -> None:
    chunks = m["tensors"][Q0]["chunks"]
    chunks[0]["offsets"], chunks[1]["offsets"] = chunks[1]["offsets"], chunks[0]["offsets"]


def _same_size_dtype(m: dict) -> None:
    t = m["tensors"][Q0]
    t["dtype"] = t["source_dtype"] = "float16"


def _relabel_replicated(m: dict) -> None:
    (chunk,) = m["tensors"][REPLICATED]["chunks"]
    chunk["file"] = "__1_0.distcp" if chunk["file"] == "__0_0.distcp" else "__0_0.distcp"


MANIFEST_TAMPERS = {
    "style": (_style_edit, OUT0),
    "style-everywhere": (_style_edit_everywhere, OUT0),
    "rank-ownership": (_swap_owners, Q0),
    "rank-offsets": (_swap_offsets, Q0),
    "same-size-dtype": (_same_size_dtype, Q0),
    "replicated-relabelled": (_relabel_replicated, REPLICATED),
}


def _change_config(checkpoint: Path) -> None:
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = config["rope_theta"] * 2
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tampered(converted, tmp_path_factory) -> dict[str, Path]:
    """Every tamper class, plain and re-sealed, each in its own copy of the mixed tp=2 checkpoint."""
    base = converted("mixed", 2)
    root = tmp_path_factory.mktemp("tampered")
    cases = {}
    for name, (edit, _) in MANIFEST_TAMPERS.items():
        for sealed in (False, True):
            folder = Path(shutil.copytree(base, root / f"{name}-{'sealed' if sealed else 'plain'}"))
            edit_manifest(folder, edit, sealed=sealed)
            cases[folder.name] = folder
    folder = Path(shutil.copytree(base, root / "config"))
    _change_config(folder)
    cases["config"] = folder
    return cases


def _expected_tensor(case: str) -> str:
    return "config.json" if case == "config" else MANIFEST_TAMPERS[case.rsplit("-", 1)[0]][1]


def _try_loads(rank: int, world_size: int, cases: dict[str, str]) -> dict[str, str]:
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    init_gloo()
    outcome = {}
    for name, folder in cases.items():
        try:
            load_sharded(MiniMaxH3Transformer3DModel, folder)
            outcome[name] = "loaded"
        except PreshardError as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"
    return outcome


def test_every_tamper_class_is_refused_by_a_default_load_on_two_ranks(tampered):
    results = run_ranks(_try_loads, 2, {k: str(v) for k, v in tampered.items()}, timeout=240)
    for rank, outcome in enumerate(results):
        for case, what in outcome.items():
            assert what != "loaded", f"rank {rank} loaded the '{case}' checkpoint"
            assert "\n" not in what
            if case.endswith("-plain"):
                assert "does not match its digest" in what, (case, what)
            else:
                assert _expected_tensor(case) in what or "record" in what, (case, what)


CASES = sorted([*(f"{n}-{k}" for n in MANIFEST_TAMPERS for k in ("plain", "sealed")), "config"])


@pytest.mark.parametrize("case", CASES)
def test_every_tamper_class_is_flagged_by_verify(tampered, case):
    result = verify_checkpoint(tampered[case])
    assert not result.ok
    assert any(_expected_tensor(case) in p or "digest" in p for p in result.problems), result.problems


def test_a_deep_style_edit_passes_the_manifest_but_not_the_framing(tampered):
    """The one sealed edit no structural check can see (every derived field consistent): the records on disk
    frame chunks of another shape, which the always-on framing check reads."""
    manifest = read_manifest(tampered["style-everywhere-sealed"])
    assert manifest.tensors[OUT0].layout.style.name == "colwise"
    with pytest.raises(PreshardError, match="does not frame a bfloat16 chunk of shape"):
        with ShardReader(tampered["style-everywhere-sealed"], manifest, 0, verify=False, pin=False) as reader:
            reader.read(OUT0, torch.empty(manifest.tensors[OUT0].layout.local_shape(2), dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# The model's config must be the checkpoint's


def test_a_factory_whose_config_differs_is_refused(converted):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.examples.minimax_h3 import tiny_config
    from preshard.runtime.load import load_sharded

    checkpoint = converted("float32", 1)
    load_sharded(lambda: H3(**tiny_config()), checkpoint)  # the same config: loads
    with pytest.raises(MismatchError, match=r"differs from the checkpoint's in rope_theta .*rope_theta: model 500"):
        load_sharded(lambda: H3(**tiny_config(rope_theta=500.0)), checkpoint)
    with pytest.raises(MismatchError, match="norm_eps"):
        load_sharded(lambda: H3(**tiny_config(norm_eps=1e-3)), checkpoint)


# ---------------------------------------------------------------------------------------------------------
# Fuzz: random edits, re-sealed, are refused or harmless

# Covered by the digest alone: what attention modules divide and how CP splits the sequence cannot be
# re-derived from anything else in the checkpoint, so a re-sealed edit there is a different, valid plan.
DIGEST_ONLY = (("plan", "attention"), ("plan", "cp_plan"))


def _local_tensors(checkpoint: Path, manifest: Manifest) -> dict[tuple[int, str], bytes]:
    """Every TP rank's local tensors as the runtime reads them (no process group needed for the reading)."""
    out = {}
    for tp_rank in range(manifest.tp):
        with ShardReader(checkpoint, manifest, tp_rank, verify=False, pin=False) as reader:
            for name, record in manifest.tensors.items():
                local = torch.empty(record.layout.local_shape(manifest.tp), dtype=record.layout.dtype.torch)
                reader.read(name, local)
                out[(tp_rank, name)] = (str(local.dtype), tuple(local.shape), local.view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def fuzz_base(converted, tmp_path_factory):
    folder = Path(shutil.copytree(converted("mixed", 2), tmp_path_factory.mktemp("fuzz") / "ckpt"))
    base = json.loads((folder / MANIFEST_NAME).read_text())
    paths = [p for p in json_paths(base) if p[:2] not in DIGEST_ONLY]
    return folder, base, paths, _local_tensors(folder, read_manifest(folder))


@pytest.mark.timeout(300)
@settings(max_examples=250, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_resealed_manifest_edits_are_refused_or_leave_every_rank_bit_identical(fuzz_base, data):
    folder, base, paths, expected = fuzz_base
    edited = reseal(data.draw(mutated(base, paths)))
    (folder / MANIFEST_NAME).write_text(json.dumps(edited))
    try:
        manifest = read_manifest(folder)
    except PreshardError:
        event("refused by the manifest checks")
        return
    try:
        got = _local_tensors(folder, manifest)
    except PreshardError:
        event("refused by the framing or file checks")
        return
    event("loaded: must be bit-identical")
    assert got == expected, "an edit that was not refused changed the weights a rank loads"
    result = verify_checkpoint(folder)
    assert result.ok or all("\n" not in p for p in result.problems)


@settings(max_examples=60, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_plain_manifest_edits_are_all_refused_by_the_digest(fuzz_base, data):
    folder, base, _, _ = fuzz_base
    edited = data.draw(mutated(base, list(json_paths(base))))
    if edited == base:
        return
    with pytest.raises(PreshardError):
        Manifest.from_dict(edited)


@pytest.fixture(scope="module")
def load_fuzz_base(converted, tmp_path_factory, tiny_inputs, references):
    folder = Path(shutil.copytree(converted("float32", 1), tmp_path_factory.mktemp("load-fuzz") / "ckpt"))
    base = json.loads((folder / MANIFEST_NAME).read_text())
    paths = [p for p in json_paths(base) if p[:2] not in DIGEST_ONLY]
    return folder, base, paths, references("float32")


@pytest.mark.timeout(300)
@settings(max_examples=80, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_resealed_edits_through_load_sharded_are_refused_or_compute_the_same_function(
    load_fuzz_base, tiny_inputs, data
):
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    folder, base, paths, reference = load_fuzz_base
    edited = reseal(data.draw(mutated(base, paths)))
    (folder / MANIFEST_NAME).write_text(json.dumps(edited))
    try:
        model = load_sharded(MiniMaxH3Transformer3DModel, folder)
    except PreshardError:
        event("refused")
        return
    event("loaded: must compute the same function")
    with torch.no_grad():
        out = model(**tiny_inputs, return_dict=False)
    for got, want in zip(out, reference):
        assert torch.equal(got, want), "an edit that was not refused changed the model's output"


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["plan"].update(attention=5),
        lambda m: m["plan"]["attention"][0].update(divide="heads"),
        lambda m: m["plan"]["attention"][0].update(context_parallel="yes"),
        lambda m: m["plan"].update(cp_plan={"proj_out": {"gather_output": {"dim": "1"}}}),
        lambda m: m["plan"]["linear"][0].update(style=7),
    ],
    ids=["attention-not-a-list", "divide-not-a-list", "cp-not-a-bool", "cp-plan-dim", "style-not-a-name"],
)
def test_a_malformed_plan_inside_a_resealed_manifest_is_refused_before_any_forward(converted, private_copy, edit):
    checkpoint = private_copy(converted("mixed", 2))
    edit_manifest(checkpoint, edit)
    with pytest.raises(PreshardError, match="plan"):
        read_manifest(checkpoint)
    assert not verify_checkpoint(checkpoint).ok
