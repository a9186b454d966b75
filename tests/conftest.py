"""Shared fixtures: the tiny seeded MiniMax-H3 models, their diffusers checkpoints and conversions, built once
per session; `tests/support` (the gloo launcher, the hand-written slicing oracle, manifest edits) on the path."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from hub_fixtures import fake_hub, hf_env  # noqa: E402, F401  (pytest fixtures for every test module)

SEQ_LEN = 37  # odd, so no split of the packed sequence comes out even by accident


@pytest.fixture(scope="session")
def tiny_models() -> Callable[[str], object]:
    """tiny_models(dtype) -> the seeded model in "float32", "bfloat16" or "mixed" (built once each)."""
    from preshard.examples.minimax_h3 import build_model

    cache: dict[str, object] = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = build_model(dtype=dtype, seed=0)
        return cache[dtype]

    return get


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory, tiny_models) -> Callable[[str], Path]:
    """tiny_sources(kind) -> a diffusers weights folder: "mixed" is sharded over >= 3 files with an index;
    "float32" and "bfloat16" are single files."""
    from preshard.examples.minimax_h3 import save_checkpoint

    root = tmp_path_factory.mktemp("sources")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            shard = 60_000 if kind == "mixed" else None
            cache[kind] = save_checkpoint(tiny_models(kind), root / kind / "transformer", max_shard_bytes=shard)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, tiny_sources) -> Callable[..., Path]:
    """converted(kind, tp, **mesh_and_options) -> a conversion of tiny_sources(kind), done once per session.

    The folders are shared: a test that damages one must copy it first (see `private_copy`).
    """
    from preshard.converter.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple, Path] = {}

    def get(kind: str, tp: int, **kwargs) -> Path:
        key = (kind, tp, *sorted(kwargs.items()))
        if key not in cache:
            out = root / "-".join([kind, f"tp{tp}", *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
            convert_checkpoint(tiny_sources(kind), out, tp=tp, progress=False, **kwargs)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture()
def private_copy(tmp_path) -> Callable[[Path], Path]:
    """private_copy(checkpoint) -> a copy in this test's tmp_path that the test may damage."""
    import shutil

    def copy(folder: Path) -> Path:
        return Path(shutil.copytree(folder, tmp_path / f"copy-{folder.name}"))

    return copy


@pytest.fixture(scope="session")
def tiny_inputs():
    from preshard.examples.minimax_h3 import make_inputs, tiny_config

    return make_inputs(tiny_config(), SEQ_LEN)


@pytest.fixture(scope="session")
def references(tiny_models, tiny_inputs) -> Callable[[str], tuple]:
    """references(dtype) -> the unsharded model's (video, audio) output on `tiny_inputs`."""
    from preshard.examples.minimax_h3 import reference_forward

    cache: dict[str, tuple] = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = reference_forward(tiny_models(dtype), tiny_inputs)
        return cache[dtype]

    return get
