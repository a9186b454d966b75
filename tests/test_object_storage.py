"""Checkpoints in object storage, against a real S3-compatible HTTP server on the loopback (moto's server mode behind a
counting, fault-injecting proxy: tests/support/s3_server.py), through the platform's standard configuration
(AWS_ENDPOINT_URL and AWS_* credentials), never the internet:

- a conversion from a local folder and from s3:// into s3://: every object complete, the manifest uploaded last,
  the data files byte-identical to a local conversion; an existing checkpoint refused without --overwrite;
- a load on 2 and 4 gloo ranks from s3://: the model equals the local load, and each rank's GET bytes (counted by
  the proxy per rank) are exactly its share (`Manifest.read_bytes`) plus the manifest and config.json; a second
  load reads no data;
- throttling (503 SlowDown) and an answer cut short are retried; an object with other bytes of the same size is
  refused naming it; a missing object, a missing manifest, an unknown scheme: one line each, without credentials.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from multiproc import init_gloo, run_ranks  # noqa: E402
from s3_server import S3Server  # noqa: E402

from preshard.converter.convert import convert_checkpoint  # noqa: E402
from preshard.errors import (  # noqa: E402
    CheckpointNotFoundError,
    ChecksumMismatch,
    ObjectNotFoundError,
    OutputExistsError,
    UsageError,
)
from preshard.format.locate import is_url, local_path  # noqa: E402
from preshard.format.manifest import MANIFEST_NAME, read_manifest  # noqa: E402
from preshard.format.object_store import open_store, shown  # noqa: E402

BUCKET = "ckpts"
SEQ_LEN = 37


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.bucket(BUCKET)
        yield server


@pytest.fixture()
def aws(s3, monkeypatch, tmp_path):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PRESHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_SDK_UA_APP_ID", "test")
    s3.clear_log()
    s3.faults.clear()
    return s3


def _upload(s3: S3Server, folder: Path, prefix: str) -> None:
    for path in sorted(folder.iterdir()):
        if path.is_file():
            s3.put(BUCKET, f"{prefix}/{path.name}", path.read_bytes())


def _data_files(folder: Path) -> dict[str, bytes]:
    return {f.name: (folder / f.name).read_bytes() for f in read_manifest(folder).files}


# -- the resolver and its errors (no server needed)


@pytest.mark.quick
def test_a_url_is_never_a_local_path_and_credentials_are_never_shown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:").mkdir()  # a folder that "s3://b/x" would name as a relative path
    (tmp_path / "s3:" / "b").mkdir()
    assert is_url("s3://b") and is_url("gs://b/x") and not is_url("file:///x") and not is_url("org/name")
    assert local_path("s3://b") is None
    assert shown("s3://KEY:SECRET@bucket/x") == "s3://bucket/x"
    with pytest.raises(UsageError, match=r"^nosuchproto:// is not a storage protocol") as info:
        open_store("nosuchproto://KEY:SECRET@b/x")
    assert "SECRET" not in str(info.value)


# -- conversion into and from object storage


@pytest.fixture(scope="module")
def uploaded(s3, tiny_sources, tmp_path_factory):
    """The tiny mixed source (index + 3 files) at s3://ckpts/src/transformer, and its tp=2 conversion there."""
    _upload(s3, tiny_sources("mixed"), "src/transformer")
    env = {**s3.env(), "PRESHARD_CACHE": str(tmp_path_factory.mktemp("cache"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        convert_checkpoint(f"s3://{BUCKET}/src/transformer", f"s3://{BUCKET}/tp2", tp=2, progress=False)
        convert_checkpoint(f"s3://{BUCKET}/src/transformer", f"s3://{BUCKET}/tp4", tp=4, progress=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {2: f"s3://{BUCKET}/tp2", 4: f"s3://{BUCKET}/tp4"}


def test_s3_to_s3_conversion_is_the_local_one_and_publishes_the_manifest_last(aws, uploaded, converted, tmp_path):
    local = converted("mixed", 2)
    keys = aws.keys(BUCKET, "tp2/")
    assert sorted(k.removeprefix("tp2/") for k in keys) == sorted(p.name for p in local.iterdir() if p.is_file())
    assert ".metadata" in {k.removeprefix("tp2/") for k in keys}  # torch DCP's own metadata, beside the data
    for name, data in _data_files(local).items():
        assert aws.get(BUCKET, f"tp2/{name}") == data, name  # byte-identical to the local conversion
    manifest = read_manifest(local)
    remote = aws.get(BUCKET, f"tp2/{MANIFEST_NAME}")
    (tmp_path / MANIFEST_NAME).write_bytes(remote)
    theirs = read_manifest(tmp_path)
    assert theirs.source.path == f"s3://{BUCKET}/src/transformer"
    assert theirs.files == manifest.files and theirs.tensors == manifest.tensors

    # Into a new prefix from a local folder, with the proxy's log: the manifest's PUT comes after every other one.
    convert_checkpoint(converted_source(converted), f"s3://{BUCKET}/fromlocal", tp=2, progress=False)
    puts = [r.key for r in aws.log if r.method in ("PUT", "POST") and r.key.startswith("fromlocal/")]
    assert puts and puts[-1] == f"fromlocal/{MANIFEST_NAME}"
    assert puts.count(f"fromlocal/{MANIFEST_NAME}") == 1
    for name, data in _data_files(local).items():
        assert aws.get(BUCKET, f"fromlocal/{name}") == data, name

    with pytest.raises(OutputExistsError, match=rf"^s3://{BUCKET}/fromlocal already holds a checkpoint"):
        convert_checkpoint(converted_source(converted), f"s3://{BUCKET}/fromlocal", tp=2, progress=False)


def converted_source(converted) -> str:
    """The local tiny mixed source (the folder `converted("mixed", ...)` converts)."""
    return str(Path(read_manifest(converted("mixed", 2)).source.path))


def test_a_missing_source_object_is_one_line_naming_it(aws, tmp_path):
    with pytest.raises(Exception, match=rf"^source s3://{BUCKET}/nothing-here holds no .safetensors object"):
        convert_checkpoint(f"s3://{BUCKET}/nothing-here", tmp_path / "out", tp=2, progress=False)


# -- loads


def _rank_load(rank: int, world_size: int, url: str, local: str, cache: str) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel as H3

    from preshard.examples.minimax_h3 import make_inputs, tiny_config
    from preshard.runtime.load import load_sharded

    os.environ["PRESHARD_CACHE"] = cache
    os.environ["AWS_SDK_UA_APP_ID"] = f"rank{rank}"
    os.environ["PRESHARD_OBJECT_BACKOFF_S"] = "0.01"
    init_gloo()
    inputs = make_inputs(tiny_config(), SEQ_LEN)
    remote = load_sharded(H3, url)
    again = load_sharded(H3, url)  # its rank folder is reused: no data read
    there = load_sharded(H3, local)
    with torch.no_grad():
        outs = [m(**inputs, return_dict=False) for m in (remote, again, there)]
    return {
        "same": all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out)),
        "tp_rank": remote.preshard_report.coords["tp"],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_exactly_its_share_from_s3(aws, uploaded, converted, tmp_path, world):
    local = converted("mixed", world)
    manifest = read_manifest(local)
    results = run_ranks(
        _rank_load, world, uploaded[world], str(local), str(tmp_path / "cache"), env=aws.env(), timeout=600
    )
    assert all(r["same"] for r in results)
    config = manifest.config.size if manifest.config is not None else 0
    for rank, result in enumerate(results):
        tp_rank = result["tp_rank"]
        data = sum(aws.bytes_sent(f"rank{rank}", f"tp{world}/{f.name}") for f in manifest.files)
        assert data == manifest.read_bytes(tp_rank), rank  # its share, to the byte, read once over two loads
        shares = {f.name: aws.bytes_sent(f"rank{rank}", f"tp{world}/{f.name}") for f in manifest.files}
        assert sum(shares.values()) < sum(f.size for f in manifest.files) / world * 1.5
        small = aws.bytes_sent(f"rank{rank}", f"tp{world}/{MANIFEST_NAME}") + aws.bytes_sent(
            f"rank{rank}", f"tp{world}/config.json"
        )
        manifest_size = len(aws.get(BUCKET, f"tp{world}/{MANIFEST_NAME}"))
        assert small == 2 * manifest_size + config  # the manifest on each load, config.json once


# -- faults


def _fetch(url: str, tp_rank: int = 1):
    from preshard.runtime.object_rank import fetch_rank_checkpoint

    return fetch_rank_checkpoint(url, tp_rank=tp_rank)


def test_throttling_and_an_answer_cut_short_are_retried(aws, uploaded):
    aws.fail("slowdown", "tp2/__1_0.distcp", times=2)
    aws.fail("cut", "tp2/__1_0.distcp", times=1)
    fetched = _fetch(uploaded[2])
    manifest = fetched.manifest
    assert fetched.stats.bytes_read == manifest.read_bytes(1)
    statuses = [r.status for r in aws.gets(suffix="tp2/__1_0.distcp")]
    assert statuses.count(503) == 2 and statuses.count(-1) == 1  # each fault was met, and then retried
    # what landed is what the manifest says: the local reader verifies it again
    from preshard.runtime.reader import ShardReader

    targets = {n: torch.empty(r.layout.local_shape(2), dtype=r.layout.dtype.torch) for n, r in manifest.tensors.items()}
    with ShardReader(fetched.folder, manifest, 1, verify=True, pin=False) as reader:
        reader.read_all(targets)


def test_throttling_past_the_budget_is_one_line_naming_the_object(aws, uploaded, monkeypatch):
    monkeypatch.setenv("PRESHARD_OBJECT_RETRIES", "2")
    aws.fail("slowdown", "tp2/__1_0.distcp", times=10**6)
    with pytest.raises(ConnectionError, match=rf"s3://{BUCKET}/tp2/__1_0.distcp after 2 tries") as info:
        _fetch(uploaded[2])
    assert "\n" not in str(info.value) and "testing-secret" not in str(info.value)
    # bounded: each ranged read was tried 2 times, each with the client's few attempts (here 3), and no more
    per_range: dict[str | None, int] = {}
    for r in aws.gets(suffix="tp2/__1_0.distcp"):
        assert r.status == 503
        per_range[r.range] = per_range.get(r.range, 0) + 1
    assert per_range and 2 <= min(per_range.values()) and max(per_range.values()) <= 2 * 3


def test_an_object_with_other_bytes_is_refused_naming_it(aws, uploaded, converted):
    original = aws.get(BUCKET, "tp2/__1_0.distcp")
    manifest = read_manifest(converted("mixed", 2))
    chunk = next(c for cs in manifest.chunks_for_tp_rank(1).values() for c in cs if c.owner == 1 and c.data_length)
    damaged = bytearray(original)
    damaged[chunk.data_offset] ^= 0xFF  # same size, one byte of one record different
    aws.put(BUCKET, "tp2/__1_0.distcp", bytes(damaged))
    try:
        with pytest.raises(ChecksumMismatch, match=rf"^checksum mismatch in s3://{BUCKET}/tp2/__1_0.distcp for "):
            _fetch(uploaded[2])
        aws.put(BUCKET, "tp2/__1_0.distcp", original[:-1])  # one byte short: the size says so first
        with pytest.raises(ValueError, match=rf"^s3://{BUCKET}/tp2/__1_0.distcp is {len(original) - 1} bytes"):
            _fetch(uploaded[2])
    finally:
        aws.put(BUCKET, "tp2/__1_0.distcp", original)
    assert _fetch(uploaded[2]).stats.bytes_read == manifest.read_bytes(1)  # nothing damaged was kept


def test_missing_objects_are_one_line_naming_them(aws, uploaded):
    with pytest.raises(CheckpointNotFoundError, match=rf"^checkpoint s3://{BUCKET}/nothing has no manifest.json"):
        _fetch(f"s3://{BUCKET}/nothing")
    original = aws.get(BUCKET, "tp2/__0_0.distcp")
    aws.client().delete_object(Bucket=BUCKET, Key="tp2/__0_0.distcp")
    try:
        with pytest.raises(ObjectNotFoundError, match=rf"^s3://{BUCKET}/tp2/__0_0.distcp does not exist"):
            _fetch(uploaded[2], tp_rank=0)
    finally:
        aws.put(BUCKET, "tp2/__0_0.distcp", original)
    with pytest.raises(CheckpointNotFoundError, match=r"^checkpoint s3://no-such-bucket/x has no manifest.json"):
        _fetch("s3://no-such-bucket/x")


def test_the_cli_converts_into_s3_and_names_a_missing_source(aws, converted, tmp_path):
    import subprocess

    from clitools import console_script

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [console_script("convert-checkpoint")]
    missing = [*cmd, f"s3://{BUCKET}/absent", str(tmp_path / "o"), "--tp", "2"]
    result = subprocess.run(missing, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: source s3://{BUCKET}/absent holds no .safetensors object; point at the model's weights prefix "
        "(with config.json), or add --subfolder NAME for a pipeline's component"
    ]
    into = [*cmd, converted_source(converted), f"s3://{BUCKET}/cli", "--tp", "2", "--quiet"]
    result = subprocess.run(into, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    local = converted("mixed", 2)
    for name, data in _data_files(local).items():
        assert aws.get(BUCKET, f"cli/{name}") == data, name
    assert MANIFEST_NAME in [k.removeprefix("cli/") for k in aws.keys(BUCKET, "cli/")]
