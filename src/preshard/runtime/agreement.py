"""One checkpoint per job: the ranks of a load agree that they opened the same checkpoint before anything is
read into a parameter, and at the end that it did not change and every rank succeeded.

Why: the ranks of a job reach `load_sharded` at different moments. One that comes late can open a checkpoint
that `convert-checkpoint --overwrite` has just replaced, or resolve a Hub branch that has just moved to a new
commit, and would then load other weights than the ranks before it: no error, torn weights. So each rank
first opens (and holds, `preshard.runtime.held`) everything it will read, then the ranks exchange what they
opened: the manifest digest and the Hub commit, or the error that stopped the rank. Every rank decides from
the same records in the same way, so either all go on or all raise, with the same one line: none is left
waiting in a collective for a rank that gave up. A second exchange at the end of the load carries each
rank's outcome (an error while reading, or the checkpoint replaced under the load), again refused on every
rank alike.

The exchange is one fixed-size all-gather (`collectives.all_gather_bytes`) over the default group, on the
rank's device, so it runs on every backend the model's collectives run on.
"""

from __future__ import annotations

import json

from preshard import errors
from preshard.errors import CorruptCheckpointError, JobTimeoutError, MismatchError, PreshardError
from preshard.runtime import collectives
from preshard.runtime.devices import RankDevice

RECORD_BYTES = 4096  # each rank's record: two digests and at most one error message
MESSAGE_CHARS = 1500
SHOWN_GROUPS = 4


def _exchange(rank_device: RankDevice, record: dict, doing: str = "loading") -> list[dict]:
    """Every rank's `record`. A rank that is gone (killed or crashed: gloo's "Connection closed by peer", a broken
    pipe, the group's timeout) is one line, not the backend's error."""
    if rank_device.world_size == 1:
        return [record]
    data = json.dumps(record).encode()
    if len(data) > RECORD_BYTES:  # only a message can be that long
        record = {**record, "error": [record["error"][0], record["error"][1][:200]]}
        data = json.dumps(record).encode()[:RECORD_BYTES]
    try:
        gathered = collectives.all_gather_bytes(data, RECORD_BYTES, rank_device.device)
    except RuntimeError as exc:  # torch.distributed's DistError kinds are RuntimeErrors
        raise JobTimeoutError(
            f"another rank of this job left while {doing} (killed, crashed or stopped: "
            f"{' '.join(str(exc).split())[:200]}); nothing was returned on this rank: check the other ranks' logs"
        ) from None
    out = []
    for raw in gathered:
        try:
            out.append(json.loads(raw))
        except ValueError:
            out.append({"error": ["PreshardError", "its record did not arrive whole"]})
    return out


def _describe(error: BaseException | None) -> list[str] | None:
    if error is None:
        return None
    name = type(error).__name__ if isinstance(error, PreshardError) else "PreshardError"
    text = str(error) if isinstance(error, PreshardError) else f"{type(error).__name__}: {error}"
    return [name, " ".join(text.split())[:MESSAGE_CHARS]]


def raise_failures(records: list[dict], error: BaseException | None, doing: str) -> None:
    """This rank's own error, else the first other rank's (rebuilt as its class), if any rank failed."""
    if error is not None:
        raise error
    for rank, record in enumerate(records):
        if record.get("error"):
            name, message = record["error"]
            cls = getattr(errors, name, None)
            text = f"rank {rank} of the job failed {doing}: {message}"
            try:
                failure = cls(text) if isinstance(cls, type) and issubclass(cls, PreshardError) else None
            except TypeError:  # a class with another signature (Interrupted)
                failure = None
            raise failure or PreshardError(text)


def _ranks(ranks: list[int], limit: int = 4) -> str:
    shown = ", ".join(map(str, ranks[:limit])) + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def compare_requests(records: list[dict], call: str = "load_sharded") -> None:
    """Every rank asked for the same things, or one MismatchError naming the first that differs (`call`: what the
    ranks called, for the message)."""
    fields: list[str] = []
    for record in records:
        fields += [k for k in record.get("requests", {}) if k not in fields]
    for field in fields:
        seen: dict[str, list[int]] = {}
        for rank, record in enumerate(records):
            seen.setdefault(json.dumps(record.get("requests", {}).get(field)), []).append(rank)
        if len(seen) > 1:
            parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:4]))} {v}" for v, r in seen.items()]
            raise MismatchError(
                f"the ranks of this job called {call} with different {field}: {'; '.join(parts[:4])}; every "
                "rank must pass the same arguments (nothing was loaded)"
            )


def agree_on_checkpoint(
    rank_device: RankDevice,
    digest: str | None,
    commit: str | None,
    error: BaseException | None,
    checkpoint: str,
    requests: dict | None = None,
    *,
    what: str = "manifest",
    call: str = "load_sharded",
) -> None:
    """Every rank opened the same checkpoint (manifest digest and Hub commit), or every rank raises.

    Args:
        digest, commit: what this rank opened (None when it failed to, or when the checkpoint is not from the Hub).
        error: what stopped this rank from opening it, if anything (it is raised here, after the exchange).
        checkpoint: the checkpoint as the caller named it (for the message).
        requests: what this rank was asked for (`compare_requests`: dtype, mesh, ...), the same on every rank.
        what, call: what the digest is of ("pipeline record"), and what the ranks called, for the messages.

    Raises:
        MismatchError: the ranks opened different checkpoints (the same line on every rank).
        The error of this rank, or of the first rank that failed (its class, naming the rank).
    """
    record = {"digest": digest, "commit": commit, "error": _describe(error), "requests": requests or {}}
    records = _exchange(rank_device, record, "opening the checkpoint")
    raise_failures(records, error, "to open the checkpoint")
    compare_requests(records, call)
    groups: dict[tuple, list[int]] = {}
    for rank, record in enumerate(records):
        groups.setdefault((record.get("digest"), record.get("commit")), []).append(rank)
    if len(groups) == 1:
        return
    parts = []
    for (seen_digest, seen_commit), ranks in list(groups.items())[:SHOWN_GROUPS]:
        seen = f"{what} {str(seen_digest)[:12]}" + (f" (commit {seen_commit[:12]})" if seen_commit else "")
        parts.append(f"{_ranks(ranks)} {seen}")
    more = f" and {len(groups) - SHOWN_GROUPS} more" if len(groups) > SHOWN_GROUPS else ""
    hub = any(c for _, c in groups)
    raise MismatchError(
        f"the ranks of this job opened different checkpoints at {checkpoint}: {'; '.join(parts)}{more}; it changed "
        "while the job started (" + ("its Hub branch moved" if hub else "a conversion replaced it") + "): nothing "
        "was loaded; load again once it is stable" + (", or pin revision= to one commit" if hub else "")
    )


def agree_on_outcome(
    rank_device: RankDevice, error: BaseException | None, replaced: str | None, doing: str = "while loading"
) -> None:
    """Every rank read its shard of the checkpoint it agreed on, and the checkpoint is still that one, or every rank
    raises (`doing`: what the ranks did, for the message).

    Raises:
        CorruptCheckpointError: a rank saw the checkpoint replaced or modified during the load (the same line on
            every rank). The error of this rank, or of the first rank that failed while loading.
    """
    records = _exchange(rank_device, {"error": _describe(error), "replaced": replaced}, doing.removeprefix("while "))
    raise_failures(records, error, doing)
    for rank, record in enumerate(records):
        if record.get("replaced"):
            raise CorruptCheckpointError(
                f"{record['replaced']} (seen by rank {rank}); the model was not returned on any rank: load again "
                "once the checkpoint is no longer being written"
            )


__all__ = ["agree_on_checkpoint", "agree_on_outcome", "compare_requests", "raise_failures"]
