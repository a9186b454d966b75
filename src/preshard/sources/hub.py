"""Checkpoints on the Hugging Face Hub: conversion sources, their headers, and a rank's files of a pre-sharded repo.

Why: a diffusers repo holds much more than one model's weights (VAE, text encoders, other precisions), and a rank of
a pre-sharded checkpoint needs only its own TP rank's data file. So only what is read is downloaded: for a
conversion, the subfolder's `config.json`, its safetensors index and the files that index names (or its single
`.safetensors` file); for `preshard plan`, the config, the index and the safetensors *headers* (ranged reads, no
weights); for a rank, the exact files it names. Everything goes through huggingface_hub's public API (no
hand-written HTTP) into its standard cache, the one diffusers and transformers use: what they downloaded is not
fetched again, and what is downloaded here they reuse. huggingface_hub's own settings apply: HF_HOME / HF_HUB_CACHE
(where the cache is), HF_ENDPOINT (which Hub), HF_TOKEN or a stored login (authentication), HF_HUB_OFFLINE=1 (the
cache only, no network; also honoured when set after huggingface_hub was imported). When the Hub cannot be reached,
files already in the cache are used, as huggingface_hub itself does.

Every failure is a one-line `SourceError` naming the repo, revision or file, and what to do about it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import (
    HfApi,
    constants,
    get_cached_repo_tree,
    parse_local_safetensors_file_metadata,
    snapshot_download,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)
from huggingface_hub.utils import validate_repo_id

from preshard.errors import (
    PipelineRepoError,
    PreshardError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
)
from preshard.format.hub_names import check_hub_arguments, check_subfolder, path_problem
from preshard.format.jsonio import read_json
from preshard.format.pipeline_record import INDEX_NAMES as PIPELINE_INDEXES
from preshard.format.pipeline_record import parse_pipeline_index
from preshard.sources.hub_integrity import check_downloaded
from preshard.sources.hub_retry import (
    CUT_SHORT,
    RETRIES_VAR,
    describe,
    max_retries,
    request_url,
    retried,
    transient,
    url_path,
)

try:  # the HTTP client huggingface_hub 2.x is built on: its connection and timeout errors
    from httpx2 import TransportError
except ImportError:  # pragma: no cover - other huggingface_hub releases
    TransportError = ConnectionError  # type: ignore[assignment,misc]

PREFERRED_INDEXES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
PREFERRED_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
INDEX_SUFFIX = ".safetensors.index.json"
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
# What huggingface_hub raises for a repo that cannot be resolved: mapped to one-line SourceErrors by hub_error.
RESOLVE_FAILURES = (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    HFValidationError,
    LocalTokenNotFoundError,
    TransportError,
)


@dataclass(frozen=True)
class HubSnapshot:
    """Files of one Hub repo commit, in the local HF cache."""

    repo_id: str
    subfolder: str | None
    revision: str | None  # as the user asked (None = the default branch)
    commit: str  # the resolved 40-hex commit sha
    folder: Path  # the snapshot folder joined with the subfolder: the files are here
    files: tuple[str, ...] = ()  # the files this call made sure are present, relative to `folder`


def is_repo_id(text: str) -> bool:
    """Whether `text` is a Hub repo id, 'org/name', and names no local path.

    Callers check the local path first: a local path always wins over a repo id of the same spelling. What is not
    'org/name' is a local path, so a mistyped folder is reported as a missing folder, not as a Hub repo that could
    not be reached: a bare name (`h3-tp8-typo`: the Hub's old namespace-less ids name no checkpoint preshard reads),
    a path that starts with `.`, `/` or `~`, and file names (`*.safetensors`, `*.json`).
    """
    if not isinstance(text, str) or not text or os.path.lexists(text):
        return False
    if text.endswith((".safetensors", ".json")) or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def download_source(
    repo_id: str, *, subfolder: str | None = None, revision: str | None = None, token: str | bool | None = None
) -> HubSnapshot:
    """Download what converting `repo_id`'s `subfolder` reads, and nothing else; return where it is.

    That is `<subfolder>/config.json` (when the repo has one), the subfolder's safetensors index and the files it
    names, or without an index the subfolder's single `.safetensors` file (diffusers' own file name wins over
    variants such as `*.fp16.safetensors`). With HF_HUB_OFFLINE=1, or when the Hub cannot be reached, the files
    come from the cache.
    """
    subfolder = check_hub_arguments(repo_id, revision=revision, subfolder=subfolder)  # before any Hub call
    res, index, small = _open(repo_id, subfolder, revision, token)
    weights = _index_files(res, subfolder, index) if index is not None else _single_file(res, subfolder)
    snapshot = _fetch(res, [join_path(subfolder, name) for name in weights], token)
    files = tuple(_strip(subfolder, p) for p in small) + tuple(weights)
    return HubSnapshot(repo_id, subfolder, revision, res.commit, _within(snapshot, subfolder), files)


# A component folder's weights in another format than safetensors: not fetched where the folder has safetensors.
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".onnx", ".pb", ".gguf")


def download_pipeline(
    repo_id: str, *, revision: str | None = None, token: str | bool | None = None, skip: frozenset[str] = frozenset()
) -> HubSnapshot | None:
    """Download what converting the diffusers pipeline `repo_id` reads, or return None when it is no pipeline.

    That is the pipeline index, the top-level files (README, LICENSE) and the folder of every component the index
    names (its files as listed at one commit; where a folder holds safetensors, no weights in other formats and no
    `*.safetensors` variants beside diffusers' own file), except the components in `skip`. The index's component names
    are checked before any path is made from them (`format/pipeline_record.parse_pipeline_index`), and every listed
    path is checked as a plain relative path. Each file is fetched once into the HF cache (the sharded components'
    weights are then read from there by the converter, the others copied); the snapshot folder it returns links into
    the cache's blobs.

    Raises:
        UsageError: a hostile repo id or revision (`format/hub_names.py`). SourceError: as `download_source`.
    """
    check_hub_arguments(repo_id, revision=revision)  # before any Hub call
    res = _resolve(repo_id, revision, token, list(PIPELINE_INDEXES))
    present = [name for name in reversed(PIPELINE_INDEXES) if name in res.names]
    if not present:
        return None
    index_path = res.snapshot / present[0]
    index = parse_pipeline_index(index_path.read_bytes(), present[0])
    wanted = {c.name for c in index.components if c.library and c.class_name and c.name not in skip}
    paths = [n for n in res.names if "/" not in n and path_problem(n) is None]
    for name in sorted(wanted):
        files = [n for n in res.names if n.startswith(name + "/") and path_problem(n) is None]
        if any(f.endswith(".safetensors") for f in files):
            files = [f for f in files if not f.endswith(OTHER_WEIGHTS)]
            own = [f for f in files if f.rsplit("/", 1)[-1] in PREFERRED_FILES or f.endswith(INDEX_SUFFIX)]
            if own:  # diffusers' own weights (or an index naming shards): no fp16/variant copies beside them
                index_named = {f for f in own if f.endswith(INDEX_SUFFIX)}
                shards = set()
                for idx in index_named:
                    _fetch(res, [idx], token)
                    data = _read_json(res.snapshot / idx, f"{idx} of {_where(res)}")
                    shards |= {f"{name}/{v}" for v in (data.get("weight_map") or {}).values() if isinstance(v, str)}
                files = [f for f in files if not f.endswith(".safetensors") or f in own or f in shards]
        paths += files
    snapshot = _fetch(res, sorted(set(paths)), token)
    return HubSnapshot(repo_id, None, revision, res.commit, snapshot, tuple(sorted(set(paths))))


def source_headers(
    repo_id: str, *, subfolder: str | None = None, revision: str | None = None, token: str | bool | None = None
) -> tuple[dict[str, dict], dict | None, str]:
    """The safetensors headers of `repo_id`'s `subfolder`, its config and the resolved commit, without the weights.

    Returns ({file name: {tensor: {"dtype", "shape", "data_offsets"}, ..., "__metadata__": {...}}}, the parsed
    `config.json` or None, the commit sha). Files are in the order the index names them. Only `config.json` and the
    index are downloaded (small JSON); each header is read with ranged requests
    (`huggingface_hub.HfApi.parse_safetensors_file_metadata`: the first 100 kB, then the rest of a larger header),
    or from the cache when the file is already there. Works offline from the cache.
    """
    subfolder = check_hub_arguments(repo_id, revision=revision, subfolder=subfolder)  # before any Hub call
    res, index, small = _open(repo_id, subfolder, revision, token)
    weights = _index_files(res, subfolder, index) if index is not None else _single_file(res, subfolder)
    _require(res, [join_path(subfolder, name) for name in weights])
    headers = {name: _header(res, join_path(subfolder, name), token) for name in weights}
    config_path = join_path(subfolder, "config.json")
    config = None
    if config_path in small:
        config = _read_json(res.snapshot / config_path, f"{config_path} of {_where(res)}")
    return headers, config, res.commit


def download_files(
    repo_id: str,
    files: list[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    subfolder: str | None = None,
) -> HubSnapshot:
    """Download exactly `files` (paths relative to `subfolder`) of `repo_id`, nothing else; return where they are.

    For a rank of a pre-sharded checkpoint: `manifest.json`, `.metadata`, `config.json` and the data files it
    reads. For follow-up calls, pass the returned `commit` as `revision`: every file then comes from the same commit,
    and files already in the cache need no request at all.
    """
    subfolder = check_hub_arguments(repo_id, revision=revision, subfolder=subfolder)  # before any Hub call
    names = list(dict.fromkeys(files))
    if not names:
        raise SourceError(f"no file of Hub repo {repo_id} was asked for; name the files to download")
    for name in names:
        if not isinstance(name, str) or not _is_relative(name):
            raise SourceError(f"{name!r} is not a file path inside Hub repo {repo_id}; use a relative path like 'a/b'")
    paths = [join_path(subfolder, name) for name in names]
    if revision is not None and COMMIT_SHA.fullmatch(revision):  # immutable: files already cached need no Hub
        cached = [try_to_load_from_cache(repo_id, path, revision=revision) for path in paths]
        if all(isinstance(c, str) for c in cached):
            snapshot = Path(cached[0]).parents[paths[0].count("/")]
            return HubSnapshot(repo_id, subfolder, revision, revision, _within(snapshot, subfolder), tuple(names))
    res = _resolve(repo_id, revision, token, paths)
    snapshot = _fetch(res, paths, token)
    return HubSnapshot(repo_id, subfolder, revision, res.commit, _within(snapshot, subfolder), tuple(names))


# Resolution: which commit, which files


@dataclass
class _Resolved:
    repo_id: str
    revision: str | None
    commit: str
    snapshot: Path  # the commit's snapshot folder in the cache
    names: frozenset[str]  # repo paths: the Hub's listing of the commit when `complete`, else the cached files
    complete: bool
    offline: bool


def _resolve(repo_id: str, revision: str | None, token: str | bool | None, paths: list[str]) -> _Resolved:
    """Resolve `revision` to a commit and download `paths` (exact repo paths; those the repo lacks are skipped).

    snapshot_download does the resolving as diffusers does: it asks the Hub (and records the branch or tag in the
    cache's refs/, so that a later offline run finds it), falls back to the cache when the Hub cannot be reached,
    and with local_files_only (offline) uses the cache alone.
    """
    if not isinstance(repo_id, str) or not repo_id:
        raise SourceError(f"{repo_id!r} is not a Hub repo id; use 'org/name'")
    offline = offline_mode()
    where = _where_of(repo_id, revision)
    before = _snapshot_names(repo_id)
    try:
        with _no_match_is_fine():
            folder = retried(
                where,
                lambda: snapshot_download(
                    repo_id,
                    revision=revision,
                    token=token,
                    local_files_only=offline,
                    allow_patterns=[_literal(p) for p in paths],
                ),
            )
    except RESOLVE_FAILURES as exc:
        raise hub_error(exc, repo_id, revision, offline=offline, path=paths[0] if len(paths) == 1 else None) from exc
    except PreshardError:
        raise
    except (OSError, ValueError) as exc:  # a body cut short, or a commit id that is no folder name
        raise _download_error(exc, repo_id, revision, paths, before) from None
    snapshot = Path(folder)
    if not COMMIT_SHA.fullmatch(snapshot.name):
        _remove_new_snapshots(repo_id, before)
        raise SourceError(_bad_commit_message(where, snapshot.name))
    try:  # the listing snapshot_download fetched (and cached) for this commit: no request
        names = frozenset(f.path for f in get_cached_repo_tree(repo_id, revision=snapshot.name))
        complete = True
    except CachedRepoTreeNotFoundError:  # never listed online (offline from a cache filled otherwise)
        names = frozenset(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
        complete = False
    return _Resolved(repo_id, revision, snapshot.name, snapshot, names, complete, offline)


def _open(
    repo_id: str, subfolder: str | None, revision: str | None, token: str | bool | None
) -> tuple[_Resolved, str | None, list[str]]:
    """Resolve, and fetch the subfolder's config.json and index: (resolved, index name or None, repo paths fetched)."""
    guesses = [join_path(subfolder, "config.json")] + [join_path(subfolder, name) for name in PREFERRED_INDEXES]
    res = _resolve(repo_id, revision, token, guesses)
    index = _pick_index(res, subfolder)
    small = [
        p for p in (join_path(subfolder, "config.json"), index and join_path(subfolder, index)) if p and p in res.names
    ]
    _fetch(res, small, token)
    return res, index, small


def _children(res: _Resolved, subfolder: str | None) -> list[str]:
    prefix = f"{subfolder}/" if subfolder else ""
    return sorted(n[len(prefix) :] for n in res.names if n.startswith(prefix) and "/" not in n[len(prefix) :])


def _pick_index(res: _Resolved, subfolder: str | None) -> str | None:
    """The subfolder's safetensors index, chosen as open_source chooses in a local folder, or None."""
    indexes = [c for c in _children(res, subfolder) if c.endswith(INDEX_SUFFIX)]
    preferred = [name for name in PREFERRED_INDEXES if name in indexes]
    if preferred:
        return preferred[0]
    if len(indexes) > 1:
        raise SourceError(
            f"{_where(res, subfolder)} holds several safetensors indexes ({', '.join(indexes)}) and none is "
            f"diffusers' {PREFERRED_INDEXES[0]}; download the folder and pass the index to convert as a local path"
        )
    return indexes[0] if indexes else None


def _single_file(res: _Resolved, subfolder: str | None) -> list[str]:
    """The subfolder's one .safetensors file, when it has no index (diffusers' own name wins over variants)."""
    where = _where(res, subfolder)
    files = [c for c in _children(res, subfolder) if c.endswith(".safetensors")]
    preferred = [name for name in PREFERRED_FILES if name in files]
    if preferred:
        return [preferred[0]]
    if len(files) == 1:
        return files
    if len(files) > 1:
        raise SourceError(
            f"{where} holds {len(files)} .safetensors files but no *{INDEX_SUFFIX}; download the folder and pass "
            "one file as a local path, or add the index that names them"
        )
    if not res.complete:
        raise SourceError(not_cached_message(f"the .safetensors files of {where}", res.offline))
    pipeline_index = next((name for name in PIPELINE_INDEXES if name in res.names), None)
    if subfolder is None and pipeline_index is not None:
        raise PipelineRepoError(
            f"Hub repo {res.repo_id} is a diffusers pipeline ({pipeline_index}), not one model; convert it whole with "
            f"convert-checkpoint {res.repo_id} OUT --tp N, or one component with --subfolder NAME"
        )
    folders = sorted({n.rsplit("/", 1)[0] if "/" in n else "." for n in res.names if n.endswith(".safetensors")})
    hint = f"; folders with weights: {', '.join(folders)} (pass one as --subfolder)" if folders else ""
    raise SourceError(f"{where} holds no .safetensors file{hint}")


def _index_files(res: _Resolved, subfolder: str | None, index: str) -> list[str]:
    """The files `index` names, in its order (already downloaded: it is small)."""
    path = join_path(subfolder, index)
    data = _read_json(res.snapshot / path, f"{path} of {_where(res)}")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(
            f"{path} of {_where(res)} is not a valid safetensors index (needs a 'weight_map' of tensor -> file)"
        )
    files = list(dict.fromkeys(weight_map.values()))
    for name in files:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise SourceError(f"{path} of {_where(res)} names {name!r}, which is not a file next to it")
    if not files:
        raise SourceError(f"{path} of {_where(res)} names no file; the repo's index is empty")
    return files


# Fetching


def _fetch(res: _Resolved, paths: list[str], token: str | bool | None) -> Path:
    """Make sure `paths` (repo paths of the resolved commit) are in the cache; returns the snapshot folder."""
    missing = [p for p in paths if not (res.snapshot / p).is_file()]
    if not missing:
        return res.snapshot
    _require(res, missing)
    what = f"{missing[0]} of {_where(res)}" if len(missing) == 1 else f"{len(missing)} files of {_where(res)}"
    before = _snapshot_names(res.repo_id)
    try:
        retried(
            what,
            lambda: snapshot_download(
                res.repo_id, revision=res.commit, allow_patterns=[_literal(p) for p in missing], token=token
            ),
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, TransportError) as exc:
        path = _failed_path(exc, missing)
        raise hub_error(exc, res.repo_id, res.revision, offline=res.offline, path=path) from exc
    except PreshardError:
        raise
    except (OSError, ValueError) as exc:  # a body cut short, or a commit id that is no folder name
        raise _download_error(exc, res.repo_id, res.revision, missing, before) from None
    stray = _remove_new_snapshots(res.repo_id, before)
    for path in missing:
        if not (res.snapshot / path).is_file():
            if stray:
                raise SourceError(_bad_commit_message(f"{path} of {_where(res)}", stray[0]))
            raise SourceError(f"downloading {path} of {_where(res)} did not complete; retry")
    check_downloaded(res.snapshot, missing, _where(res))  # the bytes the Hub described, before anything reads them
    return res.snapshot


def _require(res: _Resolved, paths: list[str]) -> None:
    """Raise for the first of `paths` the repo lacks, or that is not cached when only the cache can be used."""
    for path in paths:
        if res.complete and path not in res.names:
            raise SourceNotFoundError(f"{path} is not in {_where(res)} (commit {res.commit[:12]})")
        # Offline, or the Hub could not be reached when resolving (the listing is the cache's): the cache or nothing.
        if (res.offline or not res.complete) and not (res.snapshot / path).is_file():
            raise SourceUnreachableError(not_cached_message(f"{path} of {_where(res)}", res.offline))


def _header(res: _Resolved, path: str, token: str | bool | None) -> dict[str, Any]:
    """One safetensors header, from the cache if the file is there, else by ranged reads from the Hub."""
    cached = res.snapshot / path
    try:
        if cached.is_file():
            meta = parse_local_safetensors_file_metadata(cached)
        else:
            meta = retried(
                f"{path} of {_where(res)}",
                lambda: HfApi().parse_safetensors_file_metadata(res.repo_id, path, revision=res.commit, token=token),
            )
    except SafetensorsParsingError as exc:
        raise SourceError(f"{path} of {_where(res)} is not a valid safetensors file: {_first_line(exc)}") from exc
    except (HfHubHTTPError, OfflineModeIsEnabled, TransportError) as exc:
        raise hub_error(exc, res.repo_id, res.revision, offline=res.offline, path=path) from exc
    header: dict[str, Any] = {
        name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
        for name, info in meta.tensors.items()
    }
    header["__metadata__"] = dict(meta.metadata or {})
    return header


# Errors


def hub_error(
    exc: BaseException, repo_id: str, revision: str | None, *, offline: bool, path: str | None = None
) -> SourceError:
    """One line for a huggingface_hub failure: what failed and what to do."""
    where = _where_of(repo_id, revision)
    endpoint = constants.ENDPOINT
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        if status == 403:
            return SourceAccessError(
                f"{where} is gated and the token used has no access to it: accept its conditions at "
                f"{endpoint}/{repo_id} with that token's account, then retry"
            )
        return SourceAccessError(
            f"{where} is gated and no token was sent: accept its conditions at {endpoint}/{repo_id}, then pass "
            "--token or set HF_TOKEN (or run `hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        local = "" if os.path.lexists(repo_id) else " (and there is no local path of that name)"
        token_hint = (
            "if it is private, pass --token or set HF_TOKEN"
            if status == 401
            else "if it is private, check that the token used can read it"
        )
        return SourceNotFoundError(
            f"Hub repo {repo_id} not found at {endpoint}{local}: check the spelling; {token_hint}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return SourceNotFoundError(
            f"revision {revision!r} not found in Hub repo {repo_id}: pass an existing branch, tag or commit sha "
            "as --revision"
        )
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return SourceNotFoundError(f"{path or 'a file'} is not in {where}")
    if isinstance(exc, HFValidationError):
        return SourceError(f"{repo_id!r} is not a valid Hub repo id ('org/name') and not an existing local path")
    if isinstance(exc, LocalTokenNotFoundError):
        return SourceAccessError(
            f"a token is required for {where} but none is set: pass --token, set HF_TOKEN or run `hf auth login`"
        )
    stumble = transient(exc)
    # The file the failing request asked for, where the call fetched several (a rank's manifest, config and data).
    path = path or (url_path(request_url(stumble)) if stumble is not None else None)
    what = f"{path} of {where}" if path else where
    if stumble is not None and not offline:
        return SourceUnreachableError(
            f"the Hub at {endpoint} kept failing for {what} ({describe(stumble)}, retried {max_retries()} times as "
            f"huggingface_hub's backoff does): retry later, raise {RETRIES_VAR}, or check HF_ENDPOINT and any proxy"
        )
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled, TransportError)):
        offline = offline or isinstance(exc, OfflineModeIsEnabled) or offline_mode()
        return SourceUnreachableError(not_cached_message(what, offline, exc))
    if isinstance(exc, HfHubHTTPError):
        return SourceError(
            f"the Hub at {endpoint} answered HTTP {status} for {what}: {_first_line(exc)}; retry later, or check "
            "HF_ENDPOINT and the token"
        )
    return SourceError(f"{what}: {type(exc).__name__}: {_first_line(exc)}")


def not_cached_message(what: str, offline: bool, error: BaseException | None = None) -> str:
    cache = constants.HF_HUB_CACHE
    if offline:
        return (
            f"{what} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: run once online "
            "to download it, or unset HF_HUB_OFFLINE"
        )
    cause = error
    while isinstance(cause, LocalEntryNotFoundError) and cause.__cause__ is not None:
        cause = cause.__cause__  # huggingface_hub wraps the connection error it met
    known = cause is not None and not isinstance(cause, LocalEntryNotFoundError)
    reason = f" ({type(cause).__name__})" if known else ""
    return (
        f"could not reach the Hub at {constants.ENDPOINT}{reason} and {what} is not in the local Hugging Face cache "
        f"({cache}): check the network connection, proxy and HF_ENDPOINT, then retry"
    )


def _failed_path(exc: BaseException, paths: list[str]) -> str | None:
    """Which of `paths` the failed request asked for (from its URL), else the only one, else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        asked = url_path(request_url(cause))
        for path in paths:
            if asked is not None and asked.endswith(path):
                return path
        cause = cause.__cause__ or cause.__context__
    return paths[0] if len(paths) == 1 else None


def _download_error(
    exc: OSError | ValueError, repo_id: str, revision: str | None, paths: list[str], before: set[str]
) -> SourceError:
    """One line for a download that ended early (retried already) or that the Hub named no commit for."""
    where = _where_of(repo_id, revision)
    short = CUT_SHORT.search(str(exc))
    if short:
        shown = re.search(r"\(\(…\)([^)]*)\)\.?$|\(([^()]*)\)\.?$", str(exc).split("\n", 1)[0])
        tail = next((g for g in (shown.groups() if shown else ()) if g), "")
        named = [p for p in paths if tail and p.endswith(tail)] or paths
        return SourceUnreachableError(
            f"the download of {named[0]} of {where} ended early ({short.group(2)} of {short.group(1)} bytes, "
            f"retried {max_retries()} times): run the command again to resume it, and check the network, any proxy "
            "and HF_ENDPOINT"
        )
    stray = _remove_new_snapshots(repo_id, before)
    if isinstance(exc, ValueError) and ("pointer path" in str(exc) or stray):
        return SourceError(_bad_commit_message(where, stray[0] if stray else "outside the cache"))
    return SourceError(f"downloading from {where} failed: {type(exc).__name__}: {_first_line(exc)}; retry")


def _bad_commit_message(what: str, commit: str) -> str:
    return (
        f"the Hub at {constants.ENDPOINT} named commit {commit!r} for {what}, which is not a commit hash (40 hex "
        "digits); nothing was kept: check HF_ENDPOINT and any proxy in between, then retry"
    )


def _repo_cache(repo_id: str) -> Path:
    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def _snapshot_names(repo_id: str) -> set[str]:
    try:
        return {p.name for p in (_repo_cache(repo_id) / "snapshots").iterdir()}
    except OSError:
        return set()


def _remove_new_snapshots(repo_id: str, before: set[str]) -> list[str]:
    """Remove snapshot folders a download made since `before` whose names are no commit hash; returns the names.

    A Hub (or proxy) answering an `X-Repo-Commit` that is no commit makes huggingface_hub link the file under a
    folder of that name: never a snapshot anything reads, so it is not left behind, nor the blobs it links to.
    """
    snapshots = _repo_cache(repo_id) / "snapshots"
    stray = sorted(_snapshot_names(repo_id) - before - {n for n in _snapshot_names(repo_id) if COMMIT_SHA.fullmatch(n)})
    for name in stray:
        folder = snapshots / name
        for link in [p for p in folder.rglob("*") if p.is_symlink()]:
            blob = link.resolve()
            if blob.parent.name == "blobs" and blob.parent.parent == _repo_cache(repo_id).resolve():
                blob.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    return stray


# Small helpers


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as set in the environment since."""
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES


def clean_subfolder(subfolder: str | None) -> str | None:
    """The subfolder checked (`format/hub_names.check_subfolder`: a relative path of plain names; a trailing `/`
    dropped), None for the repo's top. Raises UsageError otherwise."""
    return check_subfolder(subfolder)


def _is_relative(path: str) -> bool:
    return path_problem(path) is None


def join_path(subfolder: str | None, name: str) -> str:
    return f"{subfolder}/{name}" if subfolder else name


def _strip(subfolder: str | None, path: str) -> str:
    return path[len(subfolder) + 1 :] if subfolder else path


def _within(snapshot: Path, subfolder: str | None) -> Path:
    return snapshot / subfolder if subfolder else snapshot


class _DropNoMatch(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files matched")


@contextmanager
def _no_match_is_fine() -> Iterator[None]:
    """Silence snapshot_download's warning that no file matched: resolving asks for files that may not exist."""
    log = logging.getLogger("huggingface_hub._snapshot_download")
    drop = _DropNoMatch()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _literal(path: str) -> str:
    """An fnmatch pattern matching exactly `path` (allow_patterns are fnmatch patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _where(res: _Resolved, subfolder: str | None = None) -> str:
    where = _where_of(res.repo_id, res.revision)
    return f"{subfolder}/ of {where}" if subfolder else where


def _where_of(repo_id: str, revision: str | None) -> str:
    return f"Hub repo {repo_id}" + (f" at revision {revision}" if revision else "")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A small JSON object from the repo (config.json, an index); anything else is a one-line SourceError."""
    return read_json(path, what, SourceError, "fix the file in the repo")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
