"""`load_sharded(torch_dtype=...)` and `load_pipeline(torch_dtype=...)` load as diffusers' `from_pretrained` does,
with `dtype=` kept as an alias: on the README's "mixed" source (bf16 weights, the class's fp32 modules in float32),
`torch_dtype=torch.float32` at tp=2 equals `from_pretrained(source)` (no torch_dtype: float32) within fp32 tolerance,
while the default (each tensor as stored) does not (the negative control: 1e-2 away) and holds the parameter dtypes
`from_pretrained(source, torch_dtype=torch.bfloat16)` holds; `torch_dtype=torch.bfloat16` on a bf16 source casts
the class's `_keep_in_fp32_modules` to float32, as diffusers does. Both names given and different: one line."""

from __future__ import annotations

import pytest
import torch
from multiproc import init_gloo, run_ranks

from preshard.errors import UsageError
from preshard.examples.minimax_h3 import make_inputs, tiny_config
from preshard.format.dtypes import parse_load_dtype
from preshard.runtime.load import load_sharded

FP32_TOL = 1e-5


def _dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def _rank(rank: int, world: int, source: str, mixed: str, bfloat16: str) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    init_gloo()
    inputs = make_inputs(tiny_config(), 37, seed=1)
    out: dict = {}
    with torch.no_grad():
        want = H3.from_pretrained(source).eval()(**inputs, return_dict=False)
        for key, options in {
            "torch_dtype": {"torch_dtype": torch.float32},
            "dtype_alias": {"dtype": "fp32"},
            "both_same": {"torch_dtype": torch.float32, "dtype": "float32"},
            "default": {},
            "auto": {"torch_dtype": "auto"},
        }.items():
            got = load_sharded(H3, mixed, **options)(**inputs, return_dict=False)
            out[key] = max((g.float() - w).abs().max().item() for g, w in zip(got, want))
        out["stored_dtypes"] = _dtypes(load_sharded(H3, mixed))
        out["from_pretrained_bf16_dtypes"] = _dtypes(H3.from_pretrained(source, torch_dtype=torch.bfloat16))
        out["cast_bf16_dtypes"] = _dtypes(load_sharded(H3, bfloat16, torch_dtype=torch.bfloat16))
    return out


@pytest.fixture(scope="module")
def ranks(tiny_sources, converted) -> list[dict]:
    args = (str(tiny_sources("mixed")), str(converted("mixed", 2)), str(converted("bfloat16", 2)))
    return run_ranks(_rank, 2, *args, timeout=300)


def test_torch_dtype_float32_equals_from_pretrained_of_the_mixed_source(ranks):
    for r in ranks:
        for key in ("torch_dtype", "dtype_alias", "both_same"):
            assert r[key] <= FP32_TOL, (key, r)
        # the default keeps the stored bf16: not from_pretrained's float32 numbers (so the match above is the cast's)
        assert r["default"] > 1e-3 and r["auto"] == r["default"], r


def test_the_default_holds_the_dtypes_of_from_pretrained_in_the_stored_dtype(ranks):
    for r in ranks:
        stored = r["stored_dtypes"]
        assert stored == r["from_pretrained_bf16_dtypes"]
        assert {torch.float32, torch.bfloat16} <= set(stored.values())


def test_a_cast_keeps_the_classes_fp32_modules_in_float32_as_diffusers_does(ranks):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    keep = H3._keep_in_fp32_modules
    assert keep
    for r in ranks:
        dtypes = r["cast_bf16_dtypes"]  # stored bf16 everywhere: the kept modules cast up
        kept = {n for n in dtypes if any(m in n.split(".") for m in keep)}
        assert kept and all(dtypes[n] == torch.float32 for n in kept), dtypes
        assert all(dtypes[n] == torch.bfloat16 for n in dtypes if n not in kept)
        assert dtypes == r["from_pretrained_bf16_dtypes"]


@pytest.mark.quick
def test_torch_dtype_and_its_alias_parse_and_disagree_in_one_line():
    assert parse_load_dtype(torch.bfloat16, None).name == "bfloat16"
    assert parse_load_dtype(None, "fp16").name == "float16"
    assert parse_load_dtype("auto", None) is None and parse_load_dtype(None, None) is None
    assert parse_load_dtype(torch.float32, "fp32").name == "float32"
    with pytest.raises(UsageError, match=r"^torch_dtype=float32 and dtype=bfloat16 differ .* pass one$"):
        parse_load_dtype(torch.float32, torch.bfloat16)
    with pytest.raises(UsageError, match="torch_dtype=auto and dtype=float16 differ"):
        parse_load_dtype("auto", "fp16")
    with pytest.raises(UsageError, match="torch_dtype= torch.int8 is not supported"):
        parse_load_dtype(torch.int8, None)


@pytest.mark.quick
def test_load_sharded_refuses_two_different_dtypes_in_one_line(converted):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    with pytest.raises(UsageError, match="differ") as caught:
        load_sharded(H3, converted("float32", 1), torch_dtype=torch.float16, dtype="bf16")
    assert "\n" not in str(caught.value)
