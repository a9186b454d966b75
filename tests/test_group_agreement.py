"""A process group the caller made, with a long timeout (600 s, tests/support/group_rank.py): a rank that fails
before the checkpoint exchange, or disagrees, or is killed before load_sharded, must make every other rank fail
promptly with one line naming the problem, not wait for the group's timeout (issue 31).

Each rank is its own process (as under torchrun, TORCHELASTIC_RUN_ID set, so an uncaught PreshardError prints as
`error: rank R: ...` and the process exits 1). The group's timeout is far past this module's pytest timeout, so a
rank left waiting in a collective fails the test by the timeout; the evidence is the timeout and the count of ranks
that reported their line, never a measured time. Without the store-based agreement (`rendezvous.agree_in_group`)
the rank with the refused device raised alone while the other sat in the checkpoint all-gather for the group's
600 s, and a killed rank's peers met gloo's raw "Connection closed by peer" error.
"""

from __future__ import annotations

import pytest
from group_rank import caught, error_lines, run_job

pytestmark = pytest.mark.timeout(240)  # the caller's group waits 600 s: a rank left waiting fails here


def test_ranks_that_fail_or_disagree_before_the_exchange_fail_every_rank(converted, tmp_path):
    folder = converted("float32", 2)
    relative = {"checkpoint": f"./{folder.name}"}
    steps = [
        [{"catch": {}}, {"catch": {}}, {"catch": relative, "cwd": str(folder.parent)}, {"catch": {}}, {"load": {}}],
        [
            {"catch": {"device": "cuda"}},  # refused on this CPU-only torch, before any exchange
            {"catch": {"dtype": "float7"}},  # refused as it is parsed
            {"catch": relative, "cwd": str(tmp_path)},  # the checkpoint is missing on this rank only
            {"catch": {"device": "cpu"}},  # the negative control: the same request loads, the ranks still in step
            {"load": {"dtype": "bf16"}},  # another dtype, uncaught: both processes end
        ],
    ]
    (status0, out0, err0), (status1, out1, err1) = run_job(steps, folder)
    mine, theirs = caught(out1), caught(out0)
    assert len(mine) == len(theirs) == 4, (out0, err0[-5:], out1, err1[-5:])
    assert mine[0].startswith("DeviceError: device 'cuda' was requested"), mine
    assert theirs[0].startswith("DeviceError: rank 1 of the job failed before joining the job: device 'cuda'"), theirs
    assert mine[1].startswith("UsageError: dtype= 'float7'"), mine
    assert theirs[1].startswith("UsageError: rank 1 of the job failed before joining the job: dtype= 'float7'"), theirs
    assert theirs[2].startswith("CheckpointNotFoundError: rank 1 of the job failed to open the checkpoint"), theirs
    assert mine[2].startswith("CheckpointNotFoundError:") and "rank 1" not in mine[2], mine
    assert mine[3] is None and theirs[3] is None  # loaded on both: the failed calls left no rank a call behind
    mismatch = 'the ranks of this job called load_sharded with different dtype: rank 0 null; rank 1 "bfloat16"'
    for rank, status, stderr in ((0, status0, err0), (1, status1, err1)):
        assert status == 1, (rank, status, stderr[-5:])
        lines = error_lines(rank, stderr)
        assert len(lines) == 1 and mismatch in lines[0], (rank, stderr[-5:])
        assert "Traceback" not in "\n".join(stderr) and "gloo" not in "\n".join(stderr), stderr[-20:]


def test_a_rank_killed_before_load_sharded_fails_every_other_rank(converted):
    steps = [[{"load": {"timeout": 10}}], [{"kill": True}], [{"load": {"timeout": 10}}]]
    results = run_job(steps, converted("float32", 2))
    assert results[1][0] == 3 and "joined" in results[1][1]  # it had joined the group, then was killed
    reported = []
    for rank in (0, 2):
        status, _, stderr = results[rank]
        lines = error_lines(rank, stderr)
        assert status == 1 and len(lines) == 1, (rank, status, stderr[-5:])
        assert lines[0].endswith("rank 1 of 3 did not reach load_sharded within 10 s (killed, crashed or still "
                                 "starting); nothing was loaded: check that rank's log, or pass a larger timeout= "
                                 "if it starts slowly"), lines  # fmt: skip
        reported.append(rank)
    assert reported == [0, 2]


def test_rank_0_killed_with_the_store_it_serves_fails_the_others(converted):
    results = run_job([[{"kill": True}], [{"load": {"timeout": 30}}]], converted("float32", 2))
    assert results[0][0] == 3 and "joined" in results[0][1]
    status, _, stderr = results[1]
    lines = error_lines(1, stderr)
    assert status == 1 and len(lines) == 1, (status, stderr[-5:])
    assert "this rank lost the process group's store while waiting for the other ranks" in lines[0], lines
    assert "Traceback" not in "\n".join(stderr), stderr[-20:]  # torch logs its own warning of the lost socket
