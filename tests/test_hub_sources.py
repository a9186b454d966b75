"""Hub sources (`preshard.sources.hub`) against a local fake Hub and hand-made HF caches; never the internet.

- online: only the subfolder's config, index and the files the index names are downloaded (request log), the commit
  is recorded, revisions resolve by branch, tag and sha, the token reaches the server;
- failures: a missing repo, a missing revision, a gated or private repo without a (good) token, offline with nothing
  cached, an unreachable Hub: one line each, naming the repo and the fix;
- offline (HF_HUB_OFFLINE=1) from a hand-made cache by branch and by sha, with no request at all;
- headers: `source_headers` reads safetensors headers with ranged GETs only, far fewer bytes than the files;
- a rank's files: `download_files` fetches exactly the files named;
- a fresh process reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE from its environment at import.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, fake_commit, make_hf_cache
from hub_fixtures import HfEnv
from safetensors.torch import save_file

from preshard.errors import SourceError
from preshard.sources.hub import HubSnapshot, download_files, download_source, is_repo_id, source_headers

# a dependency API at its lower bound (the XLA tier runs it); no ranks, a fake Hub: in the quick tier too
pytestmark = [pytest.mark.xla_api, pytest.mark.quick]

REPO = "org/h3"
SUB = "transformer"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
SHARDS = ("diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors")
CONFIG = {"_class_name": "MiniMaxH3Transformer3DModel", "num_layers": 2}
SRC = Path(__file__).resolve().parents[1] / "src"


def safetensors_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "t.safetensors") -> bytes:
    path = tmp_path / name
    save_file(tensors, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    path.unlink()
    return data


def header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def h3_repo(tmp_path: Path, seed: int = 0) -> dict[str, bytes]:
    """A diffusers-style repo: a sharded transformer (+ an fp16 variant), a vae, a text encoder, a model card."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    # Each shard is ~512 KiB of weights: far more than the 100 kB a header read asks for.
    shard1 = {"blocks.0.attn.to_q.weight": rand(256, 256), "blocks.0.attn.to_k.weight": rand(256, 256)}
    shard2 = {"blocks.1.attn.to_q.weight": rand(256, 256), "proj_out.weight": rand(256, 256, dtype=torch.bfloat16)}
    shard2["proj_out.bias"] = rand(256)
    weight_map = {name: SHARDS[0] for name in shard1} | {name: SHARDS[1] for name in shard2}
    return {
        "model_index.json": json.dumps({"_class_name": "MiniMaxH3Pipeline"}).encode(),
        "README.md": b"# h3\n",
        f"{SUB}/config.json": json.dumps(CONFIG).encode(),
        f"{SUB}/{INDEX}": json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode(),
        f"{SUB}/{SHARDS[0]}": safetensors_bytes(tmp_path, shard1),
        f"{SUB}/{SHARDS[1]}": safetensors_bytes(tmp_path, shard2),
        f"{SUB}/diffusion_pytorch_model.fp16.safetensors": safetensors_bytes(tmp_path, {"x": rand(64, 64)}),
        "vae/config.json": b"{}",
        "vae/diffusion_pytorch_model.safetensors": safetensors_bytes(tmp_path, {"v": rand(128, 128)}),
        "text_encoder/model.safetensors": safetensors_bytes(tmp_path, {"e": rand(128, 128)}),
    }


TRANSFORMER_FILES = {f"{SUB}/config.json", f"{SUB}/{INDEX}", f"{SUB}/{SHARDS[0]}", f"{SUB}/{SHARDS[1]}"}


def assert_one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


def assert_has(snapshot: HubSnapshot, files: dict[str, bytes], paths: set[str]) -> None:
    root = snapshot.folder.parent if snapshot.subfolder else snapshot.folder
    for path in paths:
        assert (root / path).read_bytes() == files[path], path


# Online, through the fake Hub


def test_download_source_fetches_only_what_conversion_reads(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    files = h3_repo(tmp_path)
    commit = fake_hub.add_repo(REPO, files)

    snap = download_source(REPO, subfolder=SUB)

    assert snap == HubSnapshot(
        REPO, SUB, None, commit, hf_env.cache / "models--org--h3" / "snapshots" / commit / SUB, snap.files
    )
    assert sorted(snap.files) == sorted(["config.json", INDEX, *SHARDS])
    assert_has(snap, files, TRANSFORMER_FILES)
    assert sorted(fake_hub.downloaded(REPO)) == sorted(TRANSFORMER_FILES)
    touched = {r.path for r in fake_hub.log()}
    for other in ("vae/", "text_encoder/", "fp16", "README.md", "model_index.json"):
        assert not any(other in path for path in touched), other
    assert fake_hub.calls()[0] == ("GET", f"/api/models/{REPO}/revision/main")  # the default branch, once
    # Everything landed in the standard cache layout diffusers and transformers read.
    assert (hf_env.cache / "models--org--h3" / "refs" / "main").read_text() == commit


def test_single_file_source_prefers_the_diffusers_file_over_variants(fake_hub: FakeHub, tmp_path: Path):
    main = safetensors_bytes(tmp_path, {"w": torch.ones(4, 4)})
    files = {
        "transformer/config.json": b"{}",
        "transformer/diffusion_pytorch_model.safetensors": main,
        "transformer/diffusion_pytorch_model.fp16.safetensors": safetensors_bytes(tmp_path, {"w": torch.ones(2)}),
    }
    fake_hub.add_repo("org/single", files)

    snap = download_source("org/single", subfolder="transformer")

    assert snap.files == ("config.json", "diffusion_pytorch_model.safetensors")
    assert sorted(fake_hub.downloaded("org/single")) == [
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
    ]


def test_revision_by_branch_tag_and_sha(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    old_files, new_files = h3_repo(tmp_path, seed=1), h3_repo(tmp_path, seed=2)
    old = fake_hub.add_repo(REPO, old_files)
    new = fake_hub.add_commit(REPO, new_files)  # main moves on; the old commit stays reachable by sha
    fake_hub.set_ref(REPO, "v1", old)
    assert old != new

    by_branch = download_source(REPO, subfolder=SUB, revision="main")
    by_tag = download_source(REPO, subfolder=SUB, revision="v1")
    by_sha = download_source(REPO, subfolder=SUB, revision=old)

    assert (by_branch.revision, by_branch.commit) == ("main", new)
    assert (by_tag.revision, by_tag.commit) == ("v1", old)
    assert (by_sha.revision, by_sha.commit) == (old, old)
    assert by_sha.folder == by_tag.folder == hf_env.cache / "models--org--h3" / "snapshots" / old / SUB
    assert_has(by_branch, new_files, TRANSFORMER_FILES)
    assert_has(by_sha, old_files, TRANSFORMER_FILES)

    fake_hub.clear_log()
    again = download_source(REPO, subfolder=SUB, revision=old)  # all cached: the Hub sends no file again
    assert again == by_sha
    assert fake_hub.downloaded(REPO) == []


def test_missing_repo_is_one_line(fake_hub: FakeHub):
    with pytest.raises(SourceError) as exc:
        download_source("org/nope", subfolder=SUB)
    assert_one_line(exc, "Hub repo org/nope not found", fake_hub.endpoint, "no local path", "--token", "HF_TOKEN")


def test_missing_revision_is_one_line(fake_hub: FakeHub, tmp_path: Path):
    fake_hub.add_repo(REPO, h3_repo(tmp_path))
    with pytest.raises(SourceError) as exc:
        download_source(REPO, subfolder=SUB, revision="v9")
    assert_one_line(exc, "revision 'v9' not found", REPO, "--revision")


def test_missing_subfolder_names_the_folders_with_weights(fake_hub: FakeHub, tmp_path: Path):
    fake_hub.add_repo(REPO, h3_repo(tmp_path))
    with pytest.raises(SourceError) as exc:
        download_source(REPO, subfolder="transfomer")
    assert_one_line(exc, "transfomer/", REPO, "no .safetensors", "transformer", "vae", "--subfolder")
    assert fake_hub.downloaded(REPO) == []


def test_gated_repo_needs_a_token_with_access(fake_hub: FakeHub, tmp_path: Path):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files, gated=True, tokens={"hf_granted"})

    with pytest.raises(SourceError) as exc:
        download_source(REPO, subfolder=SUB)
    assert_one_line(exc, REPO, "gated", "no token", "--token", "HF_TOKEN", f"{fake_hub.endpoint}/{REPO}")

    with pytest.raises(SourceError) as exc:
        download_source(REPO, subfolder=SUB, token="hf_other")
    assert_one_line(exc, REPO, "gated", "no access", "accept its conditions")

    snap = download_source(REPO, subfolder=SUB, token="hf_granted")
    assert_has(snap, files, TRANSFORMER_FILES)


def test_private_repo_token_reaches_the_hub(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files, private=True, tokens={"hf_secret"})

    with pytest.raises(SourceError) as exc:  # a private repo looks missing without a token, as on the Hub
        download_source(REPO, subfolder=SUB)
    assert_one_line(exc, "not found", "private", "--token")

    fake_hub.clear_log()
    snap = download_source(REPO, subfolder=SUB, token="hf_secret")
    assert_has(snap, files, TRANSFORMER_FILES)
    assert fake_hub.log() and all(r.authorization == "Bearer hf_secret" for r in fake_hub.log())

    # HF_TOKEN is read by huggingface_hub at call time.
    fake_hub.clear_log()
    hf_env.monkeypatch.setenv("HF_TOKEN", "hf_secret")
    download_files(REPO, ["config.json"], subfolder=SUB)
    assert fake_hub.log() and all(r.authorization == "Bearer hf_secret" for r in fake_hub.log())


def test_source_headers_reads_headers_only(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    files = h3_repo(tmp_path)
    commit = fake_hub.add_repo(REPO, files)

    headers, config, resolved = source_headers(REPO, subfolder=SUB)

    assert resolved == commit
    assert config == CONFIG
    assert list(headers) == list(SHARDS)  # in the index's order
    for name in SHARDS:
        expected = header_of(files[f"{SUB}/{name}"])
        assert headers[name] == expected
        assert headers[name]["__metadata__"] == {"format": "pt"}
    # Weights were not downloaded: only ranged GETs of the safetensors files, each well under the file's size.
    for name in SHARDS:
        requests = [r for r in fake_hub.log() if r.path.endswith(name)]
        assert requests and all(r.method == "GET" and (r.range or "").startswith("bytes=") for r in requests)
        assert fake_hub.bytes_sent(REPO, name) <= 100_001 < len(files[f"{SUB}/{name}"]) // 3
    assert sorted(fake_hub.downloaded(REPO)) == sorted(
        [f"{SUB}/config.json", f"{SUB}/{INDEX}", f"{SUB}/{SHARDS[0]}", f"{SUB}/{SHARDS[1]}"]
    )  # the two shards only as the ranged reads above
    blobs = {p.stat().st_size for p in (hf_env.cache / "models--org--h3" / "blobs").iterdir()}
    assert max(blobs) < 1000  # config and index only


def test_source_headers_large_header_takes_a_second_ranged_read(fake_hub: FakeHub, tmp_path: Path):
    tensors = {
        f"blocks.{i}.a_rather_long_module_name_to_make_the_header_big.weight": torch.zeros(1) for i in range(1500)
    }
    tensors["big"] = torch.zeros(512, 512)  # 1 MiB of weights
    data = safetensors_bytes(tmp_path, tensors)
    assert struct.unpack("<Q", data[:8])[0] > 100_000
    fake_hub.add_repo("org/wide", {"diffusion_pytorch_model.safetensors": data})

    headers, config, _ = source_headers("org/wide")

    assert headers == {"diffusion_pytorch_model.safetensors": header_of(data)}
    assert config is None
    ranges = [r.range for r in fake_hub.file_requests("org/wide")]
    assert len(ranges) == 2 and all(r.startswith("bytes=") for r in ranges)
    assert fake_hub.bytes_sent("org/wide") < len(data) // 2


def test_download_files_fetches_exactly_the_named_files(fake_hub: FakeHub, tmp_path: Path):
    files = {
        "manifest.json": b'{"format": "preshard-manifest"}',
        ".metadata": b"dcp-metadata",
        "config.json": b"{}",
        "__0_0.distcp": b"rank0" * 1000,
        "__1_0.distcp": b"rank1" * 1000,
        "README.md": b"# pre-sharded\n",
    }
    commit = fake_hub.add_repo("org/h3-tp2", files)
    rank1 = ["manifest.json", ".metadata", "config.json", "__1_0.distcp"]

    snap = download_files("org/h3-tp2", rank1, revision="main")

    assert (snap.commit, snap.revision, snap.files) == (commit, "main", tuple(rank1))
    assert sorted(fake_hub.downloaded("org/h3-tp2")) == sorted(rank1)
    assert not any("__0_0" in r.path or "README" in r.path for r in fake_hub.log())
    for name in rank1:
        assert (snap.folder / name).read_bytes() == files[name]

    # A follow-up by commit: only the new file is fetched; files already cached need no request at all.
    fake_hub.clear_log()
    more = download_files("org/h3-tp2", ["__0_0.distcp"], revision=snap.commit)
    assert fake_hub.downloaded("org/h3-tp2") == ["__0_0.distcp"] and more.folder == snap.folder
    fake_hub.clear_log()
    assert download_files("org/h3-tp2", rank1, revision=snap.commit).folder == snap.folder
    assert fake_hub.log() == []

    with pytest.raises(SourceError) as exc:
        download_files("org/h3-tp2", ["manifest.json", "__7_0.distcp"])
    assert_one_line(exc, "__7_0.distcp", "org/h3-tp2", "is not in")


def test_file_names_are_matched_literally_not_as_patterns(fake_hub: FakeHub):
    # allow_patterns are fnmatch patterns: unescaped, "w[1].distcp" would match "w1.distcp" and not itself.
    fake_hub.add_repo("org/odd", {"w[1].distcp": b"bracketed", "w1.distcp": b"plain", "w*.distcp": b"star"})

    snap = download_files("org/odd", ["w[1].distcp"])

    assert fake_hub.downloaded("org/odd") == ["w[1].distcp"]
    assert (snap.folder / "w[1].distcp").read_bytes() == b"bracketed"


# Offline and unreachable, from hand-made caches


def h3_cache(hf_env: HfEnv, tmp_path: Path, commit: str, refs: dict[str, str] | None = None) -> dict[str, bytes]:
    files = {p: d for p, d in h3_repo(tmp_path).items() if p.startswith(f"{SUB}/")}
    make_hf_cache(hf_env.home, REPO, commit, files, refs)
    return files


def test_offline_from_a_hand_made_cache_by_branch_and_sha(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    commit = fake_commit("offline")
    files = h3_cache(hf_env, tmp_path, commit)
    hf_env.offline()

    for revision in ("main", commit, None):
        snap = download_source(REPO, subfolder=SUB, revision=revision)
        assert (snap.commit, snap.revision) == (commit, revision)
        assert snap.folder == hf_env.cache / "models--org--h3" / "snapshots" / commit / SUB
        assert sorted(snap.files) == sorted(["config.json", INDEX, *SHARDS])
        assert_has(snap, files, TRANSFORMER_FILES)
    headers, config, resolved = source_headers(REPO, subfolder=SUB, revision=commit)
    assert (config, resolved, list(headers)) == (CONFIG, commit, list(SHARDS))
    assert fake_hub.log() == []  # offline: not one request


def test_offline_rank_files_from_a_hand_made_cache(fake_hub: FakeHub, hf_env: HfEnv):
    files = {"manifest.json": b"{}", ".metadata": b"meta", "config.json": b"{}", "__0_0.distcp": b"r0"}
    commit = fake_commit("tp1")
    make_hf_cache(hf_env.home, "org/h3-tp1", commit, files, refs={"main": commit, "v1": commit})
    hf_env.offline()

    for revision in ("main", "v1", commit):
        snap = download_files("org/h3-tp1", list(files), revision=revision)
        assert snap.commit == commit and all((snap.folder / n).read_bytes() == d for n, d in files.items())
    with pytest.raises(SourceError) as exc:
        download_files("org/h3-tp1", ["manifest.json", "__1_0.distcp"])
    assert_one_line(exc, "__1_0.distcp", "org/h3-tp1", "HF_HUB_OFFLINE")
    assert fake_hub.log() == []


def test_offline_set_in_the_environment_after_import_is_honoured(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    commit = fake_commit("env-offline")
    h3_cache(hf_env, tmp_path, commit)
    hf_env.monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # huggingface_hub.constants still says online

    assert download_source(REPO, subfolder=SUB).commit == commit
    assert fake_hub.log() == []


def test_offline_with_nothing_cached_is_one_line(hf_env: HfEnv, tmp_path: Path):
    hf_env.offline()
    with pytest.raises(SourceError) as exc:
        download_source("org/nope", subfolder=SUB)
    assert_one_line(exc, "org/nope", "not in the local Hugging Face cache", "HF_HUB_OFFLINE", "run once online")

    commit = fake_commit("partial")
    files = h3_cache(hf_env, tmp_path, commit)
    with pytest.raises(SourceError) as exc:  # the repo is cached, that revision is not
        download_source(REPO, subfolder=SUB, revision="v2")
    assert_one_line(exc, REPO, "v2", "HF_HUB_OFFLINE")

    (hf_env.cache / "models--org--h3" / "snapshots" / commit / SUB / SHARDS[1]).unlink()
    with pytest.raises(SourceError) as exc:  # a shard the index names was never downloaded
        download_source(REPO, subfolder=SUB)
    assert_one_line(exc, SHARDS[1], "not in the local Hugging Face cache", "run once online")
    assert files


def test_unreachable_hub_falls_back_to_the_cache_or_says_so(hf_env: HfEnv, tmp_path: Path):
    # hf_env's endpoint is a closed local port: every connection is refused at once.
    with pytest.raises(SourceError) as exc:
        download_source(REPO, subfolder=SUB)
    assert_one_line(exc, "could not reach the Hub", hf_env.endpoint, REPO, "HF_ENDPOINT")

    commit = fake_commit("cached")
    h3_cache(hf_env, tmp_path, commit)
    assert download_source(REPO, subfolder=SUB).commit == commit  # as huggingface_hub does: use the cache


def test_is_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("org/h3") and is_repo_id("MiniMax/H3-tp8_cp4.v1")
    assert not is_repo_id("gpt2") and not is_repo_id("h3-tp1-typo")  # a bare name: a mistyped local folder
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "h3").mkdir()
    assert not is_repo_id("org/h3")  # a local path of that spelling wins
    for text in ("", "./h3", "/abs/h3", "a/b/c", "org/", "model.safetensors", "x/index.json", "a--b/c", "~/h3"):
        assert not is_repo_id(text), text


# A fresh process: huggingface_hub reads these variables at import


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variables_in_a_fresh_process(fake_hub: FakeHub, hf_env: HfEnv, tmp_path: Path):
    commit = fake_hub.add_repo(REPO, h3_repo(tmp_path))
    code = (
        "from preshard.sources.hub import download_source\n"
        "try:\n"
        "    s = download_source('org/h3', subfolder='transformer')\n"
        "except Exception as e:\n"
        "    print('error:', e); raise SystemExit(2)\n"
        "print(s.commit, s.folder)\n"
    )
    env = hf_env.subprocess_env()  # HF_ENDPOINT = the fake Hub, HF_HOME = the test's, XET and telemetry off
    online = run_python(code, env)
    assert online.returncode == 0, online.stderr
    assert online.stdout.split()[0] == commit
    assert Path(online.stdout.split()[1]).is_relative_to(hf_env.home)
    assert sorted(fake_hub.downloaded(REPO)) == sorted(TRANSFORMER_FILES)

    fake_hub.clear_log()
    offline = run_python(code, {**env, "HF_HUB_OFFLINE": "1"})  # the same cache, no network
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.split()[0] == commit and fake_hub.log() == []

    other_home = run_python(code, {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty")})
    assert other_home.returncode == 2
    assert other_home.stdout.startswith("error:") and "HF_HUB_OFFLINE" in other_home.stdout
    assert str(tmp_path / "empty") in other_home.stdout  # the cache named is the one HF_HOME points at
