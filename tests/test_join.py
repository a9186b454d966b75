"""Joining a load: real gloo ranks on a free port (tests/support/multiproc.py). A rank that never joins (killed
before load_sharded) makes the others fail with one JobTimeoutError naming it after `timeout=`, not torch's 30
minutes; a rank that raises before the process group exists (device="cuda" on this CPU-only torch) makes every
rank raise that error; ranks given another dtype= or mesh raise one MismatchError on every rank instead of
meeting in mismatched gloo collectives (which abort the process). Each case would hang to run_ranks' timeout, or
abort, without the rendezvous."""

from __future__ import annotations

import pytest
from multiproc import error_of, free_port, run_ranks

from preshard.errors import UsageError
from preshard.runtime.rendezvous import DEFAULT_TIMEOUT_S, check_timeout


def _h3():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel


SCENARIOS = {  # name: (keyword arguments per rank, the rank that never calls load_sharded)
    "rank 1 absent": ({"all": {"timeout": 1}}, 1),
    "rank 0 absent": ({"all": {"timeout": 1}}, 0),
    "device": ({1: {"device": "cuda"}}, None),
    "dtype": ({1: {"dtype": "bf16"}}, None),
    "mesh": ({0: {"cp": 1}, 1: {"ring": 1}}, None),
    "same": ({1: {"device": "cpu"}}, None),  # the negative control: device=None picks cpu here; last, it loads
}


def _rank(rank: int, world: int, checkpoint: str, ports: dict[str, int]) -> dict[str, str | None]:
    """Every scenario in turn, each on a port of its own (one process group of ranks for all: they cost seconds)."""
    import os

    from preshard.runtime.load import load_sharded

    model_class = _h3()
    out: dict[str, str | None] = {}
    for name, (per_rank, absent) in SCENARIOS.items():
        os.environ["MASTER_PORT"] = str(ports[name])
        if rank == absent:
            out[name] = "absent"  # this rank never reaches load_sharded, as if killed before it
            continue
        kwargs = {**per_rank.get(rank, {}), **per_rank.get("all", {})}
        out[name] = error_of(lambda kwargs=kwargs: load_sharded(model_class, checkpoint, **kwargs))
    return out


@pytest.fixture(scope="module")
def results(converted):
    ports = {name: free_port() for name in SCENARIOS}
    return run_ranks(_rank, 2, str(converted("float32", 2)), ports, timeout=180)


def test_the_default_timeout_is_a_minute_and_bounded():
    assert DEFAULT_TIMEOUT_S == 60
    for bad in (0, -1, float("inf"), float("nan"), "60", True, 10**9):
        with pytest.raises(UsageError, match="timeout="):
            check_timeout(bad)
    assert check_timeout(5) == 5.0


def test_a_rank_that_never_joins_is_a_timeout_naming_it(results):
    assert results[1]["rank 1 absent"] == "absent"
    message = results[0]["rank 1 absent"]
    assert message.startswith("JobTimeoutError: rank 1 of 2 did not reach load_sharded within 1 s"), message


def test_rank_0_never_starting_the_store_is_a_timeout(results):
    message = results[1]["rank 0 absent"]
    assert message.startswith("JobTimeoutError: this rank could not reach the job's store"), message


def test_a_rank_refused_its_device_before_joining_fails_every_rank(results):
    assert results[1]["device"].startswith("DeviceError: device 'cuda' was requested"), results[1]
    message = results[0]["device"]
    assert message.startswith("DeviceError: rank 1 of the job failed before joining the job: device 'cuda'"), message


@pytest.mark.parametrize("field", ["dtype", "mesh"])
def test_ranks_asked_for_different_things_raise_one_mismatch(results, field):
    assert results[0][field] == results[1][field], results
    prefix = f"MismatchError: the ranks of this job called load_sharded with different {field}"
    assert results[0][field].startswith(prefix), results[0][field]


def test_the_same_request_loads(results):
    assert results[0]["same"] is None and results[1]["same"] is None, results
