"""The compile cache (preshard.runtime.compile_cache): `load_sharded(..., compile=...)` loads a checkpoint's saved
compile artifacts before its first compiled call only under the same key, only when every file matches its hash,
and only when this user's preshard wrote them (or the caller trusts them); otherwise it compiles and says why in one
line. The quick tests load the tiny H3 at tp=1 with the `eager` backend (nothing to compile) and count the calls of
torch's `load_cache_artifacts`; the one inductor test compiles the tiny H3 at tp=2 on gloo twice, in fresh processes
and fresh inductor folders, and reads inductor's and AOTAutograd's cache-hit counters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from multiproc import init_gloo, run_ranks

from preshard.examples.minimax_h3 import make_inputs, tiny_config
from preshard.runtime import compile_cache as cc
from preshard.runtime.compile_cache import CompileCacheWarning, CompileOptions

SEQ_LEN = 21


@pytest.fixture()
def user_cache(tmp_path, monkeypatch) -> Path:
    """This test's own HMAC secret (the user's cache folder)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache"


@pytest.fixture()
def loads(monkeypatch) -> list[dict]:
    """Every call of torch.compiler.load_cache_artifacts: its bytes and the inductor folder's files then."""
    calls: list[dict] = []

    def load(data: bytes):
        folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        calls.append({"bytes": data, "files": files})
        return torch.compiler._cache.CacheInfo()

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return calls


def _load(checkpoint: Path, **options):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    return load_sharded(H3, checkpoint, compile=CompileOptions(backend="eager", **options))


def _key_of(net, options: CompileOptions, inputs: dict) -> dict:
    """The key the first call of `net` with `inputs` looks up (as the hooks compute it)."""
    from preshard.format.manifest import read_manifest

    digest = read_manifest(net.preshard_report.checkpoint).digest
    call = {**inputs, "return_dict": False}
    return {**cc.static_key(net._orig_mod, options, digest), "inputs": cc.inputs_key((), call)}


def _write(cache: Path, key: dict, tmp_path: Path) -> Path:
    kernels = tmp_path / "kernels-src"
    (kernels / "ab").mkdir(parents=True, exist_ok=True)
    (kernels / "ab" / "cabc.so").write_bytes(b"\x7fELF not really")
    entry = cc.write_entry(cache, key, b"torch artifacts", kernels)
    assert entry is not None
    return entry


@pytest.fixture(scope="module")
def checkpoint(converted) -> Path:
    return converted("float32", 1)


def _forward(net) -> None:
    with torch.no_grad():
        net(**make_inputs(tiny_config(), SEQ_LEN), return_dict=False)


@pytest.mark.quick
def test_an_entry_of_the_same_key_is_loaded_before_the_first_call_and_a_mismatched_one_is_not(
    checkpoint, tmp_path, user_cache, loads
):
    cache = tmp_path / "cache"
    net = _load(checkpoint, cache=cache)
    key = _key_of(net, CompileOptions(backend="eager"), make_inputs(tiny_config(), SEQ_LEN))
    other = {**key, "versions": {**key["versions"], "torch": "2.0.0"}}
    _write(cache, other, tmp_path)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with pytest.warns(CompileCacheWarning, match=r"under another key \(versions\.torch: \"2\.0\.0\" there, \"2\.13"):
        _forward(net)
    assert loads == []  # the mismatched entry's artifacts were never handed to torch
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # inductor's folder is the caller's again

    _write(cache, key, tmp_path)  # now one for this key: the next load uses it, with its kernels in place
    _forward(_load(checkpoint, cache=cache))
    assert len(loads) == 1 and loads[0]["bytes"] == b"torch artifacts"
    assert loads[0]["files"] == {"ab/cabc.so": b"\x7fELF not really"}


@pytest.mark.quick
def test_a_damaged_or_foreign_entry_is_not_loaded_unless_trusted(checkpoint, tmp_path, user_cache, loads, monkeypatch):
    cache = tmp_path / "cache"
    net = _load(checkpoint, cache=cache)
    key = _key_of(net, CompileOptions(backend="eager"), make_inputs(tiny_config(), SEQ_LEN))
    entry = _write(cache, key, tmp_path)
    kernel = entry / "kernels" / "ab" / "cabc.so"
    kernel.write_bytes(b"\x7fELF not really, edited")
    with pytest.warns(CompileCacheWarning, match="does not match its recorded SHA-256"):
        _forward(net)
    assert loads == []

    kernel.write_bytes(b"\x7fELF not really")  # intact again, but signed under another user's secret:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-user"))
    with pytest.warns(CompileCacheWarning, match="not written by preshard for this user"):
        _forward(_load(checkpoint, cache=cache))
    assert loads == []
    _forward(_load(checkpoint, cache=cache, trust_cache=True))  # the caller's explicit opt-in
    assert len(loads) == 1

    record = json.loads((entry / "entry.json").read_text())  # an entry naming a path outside itself: refused
    record["files"]["kernels/../../escape.so"] = record["files"].pop("kernels/ab/cabc.so")
    (entry / "entry.json").write_text(json.dumps(record))
    with pytest.warns(CompileCacheWarning, match="unsafe path"):
        _forward(_load(checkpoint, cache=cache, trust_cache=True))
    assert len(loads) == 1


@pytest.mark.quick
def test_a_cold_first_call_writes_its_entry_and_a_failed_one_writes_none(checkpoint, tmp_path, user_cache, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"saved", torch.compiler._cache.CacheInfo()))
    cache = tmp_path / "cache"
    net = _load(checkpoint, cache=cache)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with pytest.raises(Exception, match="missing|required|argument"):
        net()  # the first call raises: nothing is saved, inductor's folder is the caller's again
    assert not cache.exists() or list(cache.iterdir()) == []
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    _forward(net)  # the next call is the first that runs: its entry is written, signed, under its key
    (entry,) = cache.iterdir()
    assert (entry / "artifacts.bin").read_bytes() == b"saved"
    key = _key_of(net, CompileOptions(backend="eager"), make_inputs(tiny_config(), SEQ_LEN))
    assert entry.name == cc.entry_id(key) and json.loads((entry / "entry.json").read_text())["key"] == key
    _forward(net)  # later calls: nothing more
    assert len(list(cache.iterdir())) == 1


@pytest.mark.quick
def test_compile_takes_only_a_bool_or_options(checkpoint):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.errors import UsageError
    from preshard.runtime.load import load_sharded

    with pytest.raises(UsageError, match="compile= takes True, False or CompileOptions"):
        load_sharded(H3, checkpoint, compile="inductor")


def _cold_then_warm(rank: int, world: int, checkpoint: str, cache: str, inductor: str) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{inductor}-rank{rank}"  # a fresh inductor folder in every process
    init_gloo()
    torch._dynamo.utils.counters.clear()
    net = load_sharded(H3, checkpoint, compile=CompileOptions(cache=cache, fullgraph=True))
    with torch.no_grad():
        out = net(**make_inputs(tiny_config(), SEQ_LEN), return_dict=False)[0]
    counters = torch._dynamo.utils.counters
    return {"out": out, "inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}


@pytest.mark.timeout(2400)
def test_a_second_process_hits_the_saved_graphs_at_tp2(converted, tmp_path, user_cache):
    checkpoint, cache = str(converted("float32", 2)), str(tmp_path / "cache")
    cold = run_ranks(_cold_then_warm, 2, checkpoint, cache, str(tmp_path / "inductor-cold"), timeout=2000)
    entries = sorted(p.name for p in Path(cache).iterdir())
    assert len(entries) == 2, entries  # one per rank: each rank's graph bakes in its own slices
    warm = run_ranks(_cold_then_warm, 2, checkpoint, cache, str(tmp_path / "inductor-warm"), timeout=2000)
    for rank in range(2):
        assert cold[rank]["inductor"].get("fxgraph_cache_hit", 0) == 0, cold[rank]["inductor"]
        assert cold[rank]["inductor"].get("fxgraph_cache_miss", 0) >= 1
        assert warm[rank]["inductor"].get("fxgraph_cache_hit", 0) >= 1, warm[rank]["inductor"]
        assert warm[rank]["inductor"].get("fxgraph_cache_miss", 0) == 0, warm[rank]["inductor"]
        assert warm[rank]["aot"].get("autograd_cache_hit", 0) >= 1, warm[rank]["aot"]
        assert torch.equal(warm[rank]["out"], cold[rank]["out"])
    assert sorted(p.name for p in Path(cache).iterdir()) == entries  # the warm run wrote nothing new
