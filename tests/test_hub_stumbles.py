"""A Hub that stumbles, as huggingface_hub users know it: transient errors retried with huggingface_hub's backoff,
one line per retry, then one line; bodies cut short or dropped mid-way one line naming the file; an X-Repo-Commit
that is no commit one line; an answer slower than huggingface_hub's read timeout given up on and retried, then one
line; nothing placed in the cache or the rank folder. Retries are counted by the requests the fake Hub received,
never timed; waits are kept at huggingface_hub's 1 s minimum and few."""

from __future__ import annotations

import hashlib
import logging

import pytest
from fake_hub import FakeHub
from hub_fixtures import HfEnv
from huggingface_hub import constants
from test_hub_convert import folder_files
from test_hub_sources import REPO, SHARDS, SUB, h3_repo

from preshard.errors import SourceError, SourceUnreachableError, UsageError
from preshard.format.manifest import read_manifest
from preshard.runtime.hub import fetch_rank_files, rank_files
from preshard.sources.hub import download_source
from preshard.sources.hub_retry import HF_LOGGERS, RETRIES_VAR

pytestmark = pytest.mark.quick

SHARD = f"{SUB}/{SHARDS[1]}"


def gets(hub: FakeHub, suffix: str, method: str = "GET") -> int:
    return sum(1 for r in hub.log() if r.method == method and r.path.endswith(suffix))


def retry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all("\n" not in line for line in lines), lines
    return [line for line in lines if "retrying" in line or "resuming" in line]


def assert_nothing_placed(hf_env: HfEnv, data: bytes, path: str = SHARD) -> None:
    repo = hf_env.cache / "models--org--h3"
    assert not (repo / "blobs" / hashlib.sha256(data).hexdigest()).exists()
    assert not any(p.is_file() for p in (repo / "snapshots").glob(f"*/{path}"))
    snapshots = [p.name for p in (repo / "snapshots").iterdir()] if (repo / "snapshots").exists() else []
    assert all(len(name) == 40 for name in snapshots), snapshots  # no folder named by a bad commit id


@pytest.fixture(autouse=True)
def _no_filter_outlives_the_call():
    yield
    assert all(logging.getLogger(name).filters == [] for name in HF_LOGGERS)


def test_one_503_on_the_repo_info_is_retried(fake_hub: FakeHub, tmp_path, caplog):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("status", path=f"/api/models/{REPO}/revision/main", status=503)
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]
    assert gets(fake_hub, "/revision/main") == 2  # the 503, then the retry
    assert len(retry_lines(caplog)) == 1


def test_one_503_on_a_download_is_retried(fake_hub: FakeHub, tmp_path, caplog):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("status", path=SHARD, method="GET", status=503)
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]
    assert gets(fake_hub, SHARD) == 2
    (line,) = retry_lines(caplog)
    assert "HTTP 503" in line and SHARDS[1] in line


def test_two_429s_with_retry_after_are_waited_out(fake_hub: FakeHub, tmp_path, caplog):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("status", path=f"/api/models/{REPO}/revision/main", status=429, retry_after=0, times=2)
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]
    assert gets(fake_hub, "/revision/main") == 3
    lines = retry_lines(caplog)
    assert len(lines) == 2 and all("HTTP 429" in line and "retrying in 1s" in line for line in lines), lines


def test_a_hub_that_keeps_answering_503_is_one_line(fake_hub: FakeHub, hf_env: HfEnv, tmp_path, monkeypatch):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    monkeypatch.setenv(RETRIES_VAR, "1")
    fake_hub.fail("status", path=SHARD, method="GET", status=503, times=None)
    with pytest.raises(SourceUnreachableError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and SHARDS[1] in message and "HTTP 503" in message and RETRIES_VAR in message
    assert gets(fake_hub, SHARD) == 2  # the first try and one retry
    assert_nothing_placed(hf_env, files[SHARD])


def test_a_connection_dropped_mid_body_every_time_is_one_line(
    fake_hub: FakeHub, hf_env: HfEnv, tmp_path, monkeypatch, caplog
):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    monkeypatch.setenv(RETRIES_VAR, "1")
    fake_hub.fail("close", path=SHARD, method="GET", times=None)
    with pytest.raises(SourceUnreachableError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and SHARDS[1] in message and "RemoteProtocolError" in message
    resumed = retry_lines(caplog)
    # huggingface_hub resumed the download itself (one line each); those count as retries: preshard added none.
    assert resumed and all("resuming" in line and SHARDS[1] in line for line in resumed)
    assert len(fake_hub.faulted(SHARD)) == 1 + len(resumed)
    assert_nothing_placed(hf_env, files[SHARD])


def test_a_body_cut_short_once_is_resumed(fake_hub: FakeHub, tmp_path):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("short", path=SHARD, method="GET")
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]  # and its sha256 checked
    assert gets(fake_hub, SHARD) == 2


def test_a_body_always_cut_short_is_one_line_and_a_rerun_completes(
    fake_hub: FakeHub, hf_env: HfEnv, tmp_path, monkeypatch
):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    monkeypatch.setenv(RETRIES_VAR, "1")
    fault = fake_hub.fail("short", path=SHARD, method="GET", times=None)
    with pytest.raises(SourceUnreachableError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and SHARDS[1] in message and "ended early" in message and "again" in message
    assert gets(fake_hub, SHARD) == 2
    assert_nothing_placed(hf_env, files[SHARD])
    fault.times = 0  # the Hub answers in full again
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]


SLOW_S = 8  # the slow answer's wait: far past the read timeout the tests set (1 s)


@pytest.fixture
def short_read_timeout(monkeypatch):
    """huggingface_hub's read timeout for downloads at 1 s, through its documented HF_HUB_DOWNLOAD_TIMEOUT (read
    at import into `constants`, which a download reads at call time: both set, for this test only)."""
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)


def test_a_slow_answer_once_is_given_up_on_and_retried(fake_hub: FakeHub, tmp_path, short_read_timeout, caplog):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("slow", path=SHARD, method="GET", delay=SLOW_S)
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[SHARD]
    # The slow answer was not waited for: the bytes came from a second request, made after the read timed out.
    assert len(fake_hub.faulted(SHARD, kind="slow")) == 1 and gets(fake_hub, SHARD) == 2
    (line,) = retry_lines(caplog)
    assert "resuming" in line and SHARDS[1] in line, line


def test_a_hub_that_always_answers_slowly_is_one_line(
    fake_hub: FakeHub, hf_env: HfEnv, tmp_path, short_read_timeout, monkeypatch, caplog
):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    monkeypatch.setenv(RETRIES_VAR, "1")
    fake_hub.fail("slow", path=SHARD, method="GET", delay=SLOW_S, times=None)
    with pytest.raises(SourceUnreachableError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and SHARDS[1] in message and "ReadTimeout" in message, message
    resumed = retry_lines(caplog)
    # Each slow answer was given up on at the read timeout, then resumed by huggingface_hub (one line each), and
    # preshard retried none past the budget: every request for the file was a slow one, and one ended the call.
    assert resumed and all("resuming" in line and SHARDS[1] in line for line in resumed)
    assert gets(fake_hub, SHARD) == len(fake_hub.faulted(SHARD, kind="slow")) == 1 + len(resumed)
    assert_nothing_placed(hf_env, files[SHARD])


@pytest.mark.parametrize("commit", ["not-a-commit", "../../../escape"])
def test_an_x_repo_commit_that_is_no_commit_is_one_line(fake_hub: FakeHub, hf_env: HfEnv, tmp_path, commit):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    fake_hub.fail("commit", path=SHARD, method="HEAD", commit=commit, times=None)
    with pytest.raises(SourceError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and "not a commit hash" in message and "HF_ENDPOINT" in message
    assert_nothing_placed(hf_env, files[SHARD])
    assert not (hf_env.home / "escape").exists()


def test_a_bad_retry_count_is_one_line(fake_hub: FakeHub, tmp_path, monkeypatch):
    fake_hub.add_repo(REPO, h3_repo(tmp_path))
    monkeypatch.setenv(RETRIES_VAR, "lots")
    with pytest.raises(UsageError, match=RETRIES_VAR):
        download_source(REPO, subfolder=SUB)


@pytest.fixture
def presharded(fake_hub: FakeHub, converted):
    local = converted("mixed", 2)
    commit = fake_hub.add_repo("org/h3-tp2", folder_files(local))
    return "org/h3-tp2", commit, local


def test_a_rank_s_ranged_read_cut_short_is_retried_then_one_line(
    fake_hub: FakeHub, hf_env: HfEnv, presharded, monkeypatch, caplog
):
    repo, commit, local = presharded
    other = next(iter(rank_files(read_manifest(local), 0)[1]))
    fake_hub.fail("short", path=other, method="GET")
    folder = fetch_rank_files(repo, tp_rank=0)  # cut short once: retried
    assert (folder / other).stat().st_size == (local / other).stat().st_size
    assert any(other in line and "cut short" in line for line in retry_lines(caplog))

    # Always cut short (a new commit, so nothing is reused): one line, no rank folder left, complete or partial.
    commit = fake_hub.add_commit(repo, folder_files(local) | {"README.md": b"new"})
    monkeypatch.setenv(RETRIES_VAR, "1")
    fake_hub.fail("short", path=other, method="GET", times=None)
    fake_hub.clear_log()
    with pytest.raises(SourceUnreachableError) as info:
        fetch_rank_files(repo, tp_rank=0)
    message = str(info.value)
    assert "\n" not in message and other in message and "ended early" in message
    assert len(fake_hub.faulted(other)) == 2
    assert list((hf_env.home / "assets" / "preshard" / "org--h3-tp2" / commit).iterdir()) == []


def test_a_rank_s_whole_file_dropped_mid_body_every_time_is_one_line_naming_it(
    fake_hub: FakeHub, hf_env: HfEnv, presharded, monkeypatch
):
    repo, _, local = presharded
    whole = rank_files(read_manifest(local), 0)[0]
    data = next(name for name in whole if name.endswith(".distcp"))
    monkeypatch.setenv(RETRIES_VAR, "1")
    fake_hub.fail("close", path=data, method="GET", times=None)
    with pytest.raises(SourceUnreachableError) as info:
        fetch_rank_files(repo, tp_rank=0)  # with the manifest, .metadata and config.json in one call
    message = str(info.value)
    assert "\n" not in message and f"{data} of Hub repo {repo}" in message and "RemoteProtocolError" in message
    assert fake_hub.faulted(data)
