"""Hub repos end to end: convert, verify, plan and dry-run by repo id (online through a fake Hub, offline from a
hand-made HF cache), and pre-sharded checkpoints loaded from the Hub, each rank fetching only what it reads.

Never the internet: `fake_hub` serves repos on 127.0.0.1 and logs every request; `hf_env` points HF_HOME at the
test's own folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clitools import assert_one_line, cli_runner
from fake_hub import FakeHub, fake_commit, make_hf_cache
from hub_fixtures import HfEnv
from multiproc import init_gloo, run_ranks

from preshard.cli import convert_checkpoint_command, main
from preshard.errors import CorruptCheckpointError, SourceError
from preshard.format.manifest import read_manifest
from preshard.runtime import hub as runtime_hub
from preshard.runtime.hub import fetch_rank_files, rank_files

REPO = "org/h3"
SUB = "transformer"


def folder_files(folder: Path, prefix: str = "") -> dict[str, bytes]:
    return {f"{prefix}{p.relative_to(folder).as_posix()}": p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def repo_files(tiny_sources) -> dict[str, bytes]:
    """A diffusers repo: the sharded tiny transformer (index + 9 files), an fp16 variant, a vae, a model card."""
    files = folder_files(tiny_sources("mixed"), f"{SUB}/")
    single = tiny_sources("bfloat16") / "diffusion_pytorch_model.safetensors"
    files[f"{SUB}/diffusion_pytorch_model.fp16.safetensors"] = single.read_bytes()
    files["vae/diffusion_pytorch_model.safetensors"] = single.read_bytes()
    files["README.md"] = b"# h3\n"
    return files


def transformer_paths(files: dict[str, bytes]) -> list[str]:
    return sorted(p for p in files if p.startswith(f"{SUB}/") and ".fp16." not in p)


def cli(*args: str, command=None):
    result = cli_runner().invoke(command or main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def assert_one_line_error(result, *needles: str) -> None:
    assert_one_line(result.exit_code, result.stderr, 2, *needles, stdout=result.stdout)


def convert(*args: str):
    return cli(*args, "--no-progress", command=convert_checkpoint_command)


# Conversion sources


def test_convert_and_verify_by_repo_id_online(fake_hub: FakeHub, repo_files, converted, tmp_path: Path):
    commit = fake_hub.add_repo(REPO, repo_files)
    out = tmp_path / "out"

    result = convert(REPO, str(out), "--subfolder", SUB, "--tp", "2")

    assert result.exit_code == 0, result.stderr
    assert sorted(fake_hub.downloaded(REPO)) == transformer_paths(repo_files)  # no variant, vae or card
    manifest = read_manifest(out)
    source = manifest.source
    assert (source.kind, source.path, source.repo_id, source.subfolder) == ("hub", REPO, REPO, SUB)
    assert (source.revision, source.commit) == (None, commit)
    local = read_manifest(converted("mixed", 2))  # the same weights converted from the local folder
    assert [(f.name, f.size, f.xxh3_128) for f in source.files] == [
        (f.name, f.size, f.xxh3_128) for f in local.source.files
    ]
    assert [f.xxh3_128 for f in manifest.files] == [f.xxh3_128 for f in local.files]  # the same bytes written
    shown = cli("inspect", str(out))
    assert f"hub {REPO}/{SUB} @ default branch (commit {commit})" in shown.stdout

    fake_hub.clear_log()
    checked = cli("verify", str(out), "--source", REPO, "--subfolder", SUB, "--json", "--no-progress")
    assert checked.exit_code == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    assert report["ok"] and report["source_tensors"] == len(manifest.tensors)
    assert fake_hub.downloaded(REPO) == []  # everything came from the cache


def test_revision_is_resolved_and_recorded(fake_hub: FakeHub, repo_files, tiny_sources, tmp_path: Path):
    old = fake_hub.add_repo(REPO, repo_files)
    newer = {f"{SUB}/{k}": v for k, v in folder_files(tiny_sources("float32")).items()}  # one file, no index
    new = fake_hub.add_commit(REPO, newer)
    fake_hub.set_ref(REPO, "v1", old)

    by_tag = convert(REPO, str(tmp_path / "v1"), "--subfolder", SUB, "--revision", "v1", "--tp", "2")
    by_default = convert(REPO, str(tmp_path / "main"), "--subfolder", SUB, "--tp", "2")
    by_sha = convert(REPO, str(tmp_path / "sha"), "--subfolder", SUB, "--revision", old, "--tp", "1")

    assert by_tag.exit_code == by_default.exit_code == by_sha.exit_code == 0, by_tag.stderr + by_default.stderr
    tag, default, sha = (read_manifest(tmp_path / n).source for n in ("v1", "main", "sha"))
    assert (tag.revision, tag.commit, len(tag.files)) == ("v1", old, 9)
    assert (default.revision, default.commit, [f.name for f in default.files]) == (
        None,
        new,
        ["diffusion_pytorch_model.safetensors"],
    )
    assert (sha.revision, sha.commit) == (old, old)


def test_convert_offline_from_a_hand_made_cache(fake_hub: FakeHub, hf_env: HfEnv, repo_files, tmp_path: Path):
    commit = fake_commit("offline-h3")
    make_hf_cache(hf_env.home, REPO, commit, {p: repo_files[p] for p in transformer_paths(repo_files)})
    hf_env.offline()

    for revision in ("main", commit):
        out = tmp_path / revision[:8]
        result = convert(REPO, str(out), "--subfolder", SUB, "--revision", revision, "--tp", "2")
        assert result.exit_code == 0, result.stderr
        source = read_manifest(out).source
        assert (source.repo_id, source.subfolder, source.revision, source.commit) == (REPO, SUB, revision, commit)
    assert fake_hub.log() == []  # offline: not one request


def test_only_the_downloaded_files_are_opened_not_the_whole_cache_folder(
    fake_hub: FakeHub, hf_env: HfEnv, tiny_sources, tmp_path: Path
):
    # The snapshot folder also holds an fp16 variant (as after diffusers fetched it): a folder with two
    # .safetensors files and no index, which open_local alone would refuse as ambiguous.
    single = folder_files(tiny_sources("float32"), f"{SUB}/")
    variant = {f"{SUB}/diffusion_pytorch_model.fp16.safetensors": b"\0" * 8 + b"{}"}
    commit = fake_commit("with-variant")
    make_hf_cache(hf_env.home, REPO, commit, single | variant)
    hf_env.offline()

    result = convert(REPO, str(tmp_path / "out"), "--subfolder", SUB, "--tp", "2")

    assert result.exit_code == 0, result.stderr
    assert [f.name for f in read_manifest(tmp_path / "out").source.files] == ["diffusion_pytorch_model.safetensors"]


def test_missing_repo_or_revision_is_one_line_exit_2(fake_hub: FakeHub, hf_env: HfEnv, repo_files, tmp_path: Path):
    fake_hub.add_repo(REPO, repo_files)
    out = str(tmp_path / "out")
    assert_one_line_error(convert("org/nope", out, "--tp", "2"), "Hub repo org/nope not found")
    assert_one_line_error(convert(REPO, out, "--subfolder", SUB, "--revision", "v9", "--tp", "2"), "'v9' not found")
    hf_env.offline()
    assert_one_line_error(convert("org/nope", out, "--tp", "2"), "org/nope", "not in the local Hugging Face cache")
    assert_one_line_error(cli("plan", "org/nope"), "org/nope", "HF_HUB_OFFLINE")
    assert not (tmp_path / "out").exists()


def test_a_local_path_wins_over_a_repo_id(fake_hub: FakeHub, repo_files, tiny_sources, tmp_path, monkeypatch):
    fake_hub.add_repo(REPO, repo_files)
    local = tmp_path / "org" / "h3"
    local.mkdir(parents=True)
    for name, data in folder_files(tiny_sources("float32")).items():
        (local / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)

    result = convert(REPO, str(tmp_path / "out"), "--tp", "2")

    assert result.exit_code == 0, result.stderr
    assert read_manifest(tmp_path / "out").source.kind == "folder"
    assert fake_hub.log() == []


def test_plan_and_dry_run_by_repo_id_download_no_weights(
    fake_hub: FakeHub, hf_env: HfEnv, repo_files, tiny_sources, tmp_path
):
    fake_hub.add_repo(REPO, repo_files)

    hub_plan = cli("plan", REPO, "--subfolder", SUB, "--devices", "4", "--json")
    local_plan = cli("plan", str(tiny_sources("mixed")), "--devices", "4", "--json")
    parent = tmp_path / "outputs"
    parent.mkdir()
    dry = cli("convert", REPO, str(parent / "out"), "--subfolder", SUB, "--tp", "2", "--dry-run")

    assert hub_plan.exit_code == local_plan.exit_code == dry.exit_code == 0, hub_plan.stderr + dry.stderr
    hub_figures, local_figures = json.loads(hub_plan.stdout), json.loads(local_plan.stdout)
    assert hub_figures.pop("source").startswith("Hub repo") and local_figures.pop("source")
    assert hub_figures == local_figures  # the same figures from headers alone
    assert "nothing downloaded" in dry.stdout and "the download comes on top" in dry.stdout
    assert list(parent.iterdir()) == []
    # Only config.json and the index came whole; the weight files only as header ranges.
    for request in fake_hub.log():
        if request.method == "GET" and request.path.endswith(".safetensors"):
            assert request.status == 206 and request.range.startswith("bytes=0-"), request
    assert set(fake_hub.downloaded(REPO)) == set(transformer_paths(repo_files))
    cached = {p.name for p in (hf_env.cache / "models--org--h3" / "snapshots").rglob("*") if p.is_file()}
    assert cached == {"config.json", "diffusion_pytorch_model.safetensors.index.json"}  # no weights stored


# Pre-sharded checkpoints on the Hub


@pytest.fixture
def presharded(fake_hub: FakeHub, converted) -> tuple[str, str, Path]:
    """The tiny checkpoint converted for tp=2, uploaded as a repo with a model card: (repo, commit, local copy)."""
    local = converted("mixed", 2)
    commit = fake_hub.add_repo("org/h3-tp2", folder_files(local) | {"README.md": b"# tp2\n"})
    return "org/h3-tp2", commit, local


def full_gets(hub: FakeHub, repo: str, token: str | None = None) -> set[str]:
    prefix = f"/{repo}/resolve/"
    return {
        r.path[len(prefix) :].split("/", 1)[1]
        for r in hub.log()
        if r.path.startswith(prefix) and r.method == "GET" and r.status == 200
        and (token is None or r.authorization == f"Bearer {token}")
    }  # fmt: skip


def ranged_gets(hub: FakeHub, repo: str, token: str | None = None) -> dict[str, int]:
    prefix = f"/{repo}/resolve/"
    sent: dict[str, int] = {}
    for r in hub.log():
        if r.path.startswith(prefix) and r.status == 206 and (token is None or r.authorization == f"Bearer {token}"):
            name = r.path[len(prefix) :].split("/", 1)[1]
            sent[name] = sent.get(name, 0) + r.sent
    return sent


def test_a_rank_fetches_its_own_file_whole_and_only_its_records_of_the_others(
    fake_hub: FakeHub, hf_env: HfEnv, presharded, monkeypatch
):
    repo, commit, local = presharded
    manifest = read_manifest(local)
    monkeypatch.setattr(runtime_hub, "MERGE_GAP", 0)  # one request per record: the bytes sent are exactly them
    _, ranged = rank_files(manifest, 0)
    records = ranged["__1_0.distcp"]

    folder = fetch_rank_files(repo, tp_rank=0, token="rank0")

    assert full_gets(fake_hub, repo) == {"manifest.json", ".metadata", "config.json", "__0_0.distcp"}
    assert ranged_gets(fake_hub, repo) == {"__1_0.distcp": sum(c.framing.length for c in records)}
    assert sum(c.framing.length for c in records) < manifest.file("__1_0.distcp").size / 4
    assert all(r.authorization == "Bearer rank0" for r in fake_hub.log())
    assert not any("README" in r.path for r in fake_hub.log())
    assert folder.name == "tp0-of-2" and commit in str(folder) and str(hf_env.home) in str(folder)
    # The rank folder holds the checkpoint's bytes wherever this rank reads, in a file of the recorded size.
    other = (folder / "__1_0.distcp").read_bytes()
    want = (local / "__1_0.distcp").read_bytes()
    assert len(other) == len(want)
    for c in records:
        assert other[c.offset : c.end] == want[c.offset : c.end]
    assert (folder / "__0_0.distcp").read_bytes() == (local / "__0_0.distcp").read_bytes()

    # Again, by commit and offline: the rank folder is reused, no data is fetched.
    fake_hub.clear_log()
    assert fetch_rank_files(repo, tp_rank=0, revision=commit) == folder
    assert full_gets(fake_hub, repo) == set() and ranged_gets(fake_hub, repo) == {}
    hf_env.offline()
    assert fetch_rank_files(repo, tp_rank=0) == folder
    hf_env.offline(False)

    # TP rank 1 on the same machine: rank 0's file is already whole in the HF cache, so the snapshot serves.
    fake_hub.clear_log()
    snapshot = fetch_rank_files(repo, tp_rank=1)
    assert full_gets(fake_hub, repo) == {"__1_0.distcp"} and ranged_gets(fake_hub, repo) == {}
    assert snapshot == hf_env.cache / "models--org--h3-tp2" / "snapshots" / commit


def test_a_damaged_upload_is_caught_before_it_is_cached(fake_hub: FakeHub, hf_env: HfEnv, presharded):
    repo, _, local = presharded
    files = folder_files(local)
    manifest = read_manifest(local)
    record = rank_files(manifest, 0)[1]["__1_0.distcp"][0]
    damaged = bytearray(files["__1_0.distcp"])
    damaged[record.data_offset] ^= 0xFF
    commit = fake_hub.add_commit(repo, files | {"__1_0.distcp": bytes(damaged)})

    with pytest.raises(CorruptCheckpointError) as exc:
        fetch_rank_files(repo, tp_rank=0)
    assert "does not match its checksum" in str(exc.value) and record.tensor in str(exc.value)
    assets = hf_env.home / "assets" / "preshard" / "org--h3-tp2" / commit
    assert list(assets.iterdir()) == []  # no rank folder, complete or partial, was left


def test_a_fully_cached_repo_loads_from_the_snapshot_offline(fake_hub, hf_env: HfEnv, converted):
    local = converted("mixed", 2)
    commit = fake_commit("tp2-cached")
    snapshot = make_hf_cache(hf_env.home, "org/h3-tp2", commit, folder_files(local))
    hf_env.offline()

    assert fetch_rank_files("org/h3-tp2", tp_rank=1) == snapshot
    with pytest.raises(SourceError) as exc:
        fetch_rank_files("org/other", tp_rank=0)
    assert "not in the local Hugging Face cache" in str(exc.value)
    assert fake_hub.log() == []


def _rank_loads_from_hub(rank: int, world_size: int, repo: str, local: str) -> dict:
    """Load the Hub checkpoint and the local folder with the same mesh; compare every tensor."""
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    init_gloo()
    hub = load_sharded(H3, repo, cp=2, token=f"rank{rank}")
    mine = load_sharded(H3, local, cp=2)
    theirs, ours = hub.state_dict(), mine.state_dict()
    same = set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
    report = hub.preshard_report
    return {"same": same, "tp": report.coords["tp"], "checkpoint": report.checkpoint}


def test_load_sharded_by_repo_id_on_a_tp2_x_ulysses2_mesh(fake_hub: FakeHub, hf_env: HfEnv, presharded):
    repo, commit, local = presharded

    results = run_ranks(_rank_loads_from_hub, 4, repo, str(local), timeout=240)

    # Ranks 0,1 are TP rank 0 and ranks 2,3 TP rank 1 (Ulysses varies fastest): each fetched its TP rank's file.
    assert [r["tp"] for r in results] == [0, 0, 1, 1]
    assert all(r["same"] for r in results)
    for rank, r in enumerate(results):
        tp = r["tp"]
        # The rank folder, or the snapshot when another rank of this machine had already cached the other file.
        assert Path(r["checkpoint"]).name in (f"tp{tp}-of-2", commit), r["checkpoint"]
        got = full_gets(fake_hub, repo, f"rank{rank}")
        assert got <= {"manifest.json", ".metadata", "config.json", f"__{tp}_0.distcp"}
        assert set(ranged_gets(fake_hub, repo, f"rank{rank}")) <= {f"__{1 - tp}_0.distcp"}
    assert full_gets(fake_hub, repo) == {"manifest.json", ".metadata", "config.json", "__0_0.distcp", "__1_0.distcp"}
    assert not any("README" in r.path for r in fake_hub.log())


def test_a_checkpoint_in_a_subfolder_of_a_hub_repo(fake_hub: FakeHub, hf_env: HfEnv, converted, tmp_path: Path):
    """--subfolder/subfolder= wherever a Hub id is accepted: inspect fetches only the subfolder's manifest.json,
    fetch_rank_files (load_sharded) only the subfolder's files of this rank, reshard/unshard the subfolder's files;
    nothing outside the subfolder."""
    local = converted("mixed", 2)
    repo = "org/pipeline"
    fake_hub.add_repo(repo, folder_files(local, "transformer/") | {"vae/config.json": b"{}", "README.md": b"# p\n"})

    run = cli_runner().invoke(main, ["inspect", repo, "--subfolder", "transformer", "--json"])
    assert run.exit_code == 0, run.stderr
    assert json.loads(run.stdout)["digest"] == read_manifest(local).digest
    assert full_gets(fake_hub, repo) == {"transformer/manifest.json"}

    fake_hub.clear_log()
    folder = fetch_rank_files(repo, tp_rank=0, subfolder="transformer")
    # manifest.json came with inspect: the HF cache serves it now
    assert full_gets(fake_hub, repo) == {f"transformer/{n}" for n in (".metadata", "config.json", "__0_0.distcp")}
    assert set(ranged_gets(fake_hub, repo)) == {"transformer/__1_0.distcp"}
    assert folder.name == "transformer--tp0-of-2"
    assert (folder / "__0_0.distcp").read_bytes() == (local / "__0_0.distcp").read_bytes()

    out = tmp_path / "tp1"
    done = cli_runner().invoke(main, ["reshard", repo, str(out), "--subfolder", "transformer", "--tp", "1", "--json"])
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["command"] == "reshard" and read_manifest(out).tp == 1
    back = cli_runner().invoke(main, ["unshard", repo, str(tmp_path / "u"), "--subfolder", "transformer", "-q"])
    assert back.exit_code == 0 and back.stdout == "", back.stderr
    assert not any(r.path.startswith(f"/{repo}/resolve/") and "/vae/" in r.path for r in fake_hub.log())
    missing = cli_runner().invoke(main, ["inspect", repo, "--subfolder", "nope"])
    assert missing.exit_code == 2 and missing.stderr.startswith("error: ") and len(missing.stderr.splitlines()) == 1


def test_load_sharded_subfolder_local_and_hub(fake_hub: FakeHub, hf_env: HfEnv, converted, tmp_path: Path):
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.runtime.load import load_sharded

    local = converted("mixed", 1)
    reference = load_sharded(H3, local, device="cpu").state_dict()
    fake_hub.add_repo("org/pipe1", folder_files(local, "transformer/"))
    parent = tmp_path / "pipeline"
    parent.mkdir()
    (parent / "transformer").symlink_to(local, target_is_directory=True)
    for where in ("org/pipe1", str(parent)):
        loaded = load_sharded(H3, where, subfolder="transformer", device="cpu").state_dict()
        assert set(loaded) == set(reference) and all(torch.equal(loaded[k], reference[k]) for k in reference), where
