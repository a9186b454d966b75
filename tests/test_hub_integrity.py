"""Downloaded weights are the bytes the Hub described: a weights file served with other bytes of the same length
(its headers, X-Linked-Etag included, the true file's) is one SourceError naming the file, removed from the cache
(blob and link), so a re-run downloads it again and converts; the negative control downloads the true bytes."""

from __future__ import annotations

import hashlib

import pytest
from fake_hub import FakeHub
from hub_fixtures import HfEnv
from test_hub_sources import REPO, SHARDS, SUB, h3_repo

from preshard.errors import SourceError
from preshard.sources.hub import download_source

pytestmark = pytest.mark.quick


def _same_length_other_bytes(data: bytes) -> bytes:
    return data[:-16] + bytes(b ^ 0xFF for b in data[-16:])  # the header intact: only the sha256 can tell


def test_a_download_of_other_bytes_is_refused_and_not_kept(fake_hub: FakeHub, hf_env: HfEnv, tmp_path):
    files = h3_repo(tmp_path)
    commit = fake_hub.add_repo(REPO, files)
    damaged = f"{SUB}/{SHARDS[1]}"
    fake_hub.repos[REPO].served[damaged] = _same_length_other_bytes(files[damaged])
    with pytest.raises(SourceError) as info:
        download_source(REPO, subfolder=SUB)
    message = str(info.value)
    assert "\n" not in message and SHARDS[1] in message and "sha256" in message and "again" in message, message
    repo_dir = hf_env.cache / "models--org--h3"
    blob = repo_dir / "blobs" / hashlib.sha256(files[damaged]).hexdigest()
    assert not blob.exists() and not (repo_dir / "snapshots" / commit / damaged).exists()  # nothing half-placed
    # The Hub serves the true bytes again: the re-run downloads the file once more and it is kept.
    del fake_hub.repos[REPO].served[damaged]
    fake_hub.clear_log()
    snapshot = download_source(REPO, subfolder=SUB)
    assert (snapshot.folder / SHARDS[1]).read_bytes() == files[damaged]
    assert any(r.path.endswith(SHARDS[1]) and r.method == "GET" for r in fake_hub.log())


def test_a_true_download_passes(fake_hub: FakeHub, hf_env: HfEnv, tmp_path):
    files = h3_repo(tmp_path)
    fake_hub.add_repo(REPO, files)
    snapshot = download_source(REPO, subfolder=SUB)
    for name in SHARDS:
        assert (snapshot.folder / name).read_bytes() == files[f"{SUB}/{name}"]
