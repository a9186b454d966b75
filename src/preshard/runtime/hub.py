"""Pre-sharded checkpoints on the Hugging Face Hub: each rank fetches what it reads, and nothing else.

A rank of a tp=8 checkpoint needs 1/8 of the weights but not 1/8 of the files: every replicated tensor (norms,
biases, embeddings: 184 MiB of MiniMax-H3) is stored once, in whichever rank file was smallest at the time, so a
rank reads a few records out of every other rank's file. Downloading those files whole would make every rank
fetch the whole checkpoint. So a rank:

1. downloads `manifest.json`, then, from the same commit, `.metadata`, `config.json` and the data files holding
   chunks it owns (its own rank file), whole, into the standard HF cache (`preshard.sources.hub.download_files`);
2. reads the records of replicated tensors it needs from the other rank files with ranged requests
   (huggingface_hub's `HfFileSystem`), checks each chunk against the manifest's xxh3_64, and writes them at their
   offsets into sparse files of the recorded size, in a rank folder in huggingface_hub's assets cache
   (`cached_assets_path("preshard", ...)`, under HF_HOME), next to links to the downloaded files.

That folder loads exactly as a local checkpoint folder does (it is a partial copy: only this TP rank's reads are
in it; `preshard verify` it not). It is built in a temporary folder and renamed into place, so a crash leaves none
or a complete one, and a later load of the same commit and TP rank reuses it without fetching any data (also
offline). When every data file the rank reads is already in the HF cache (the whole repo was downloaded, or an
offline cache holds it), the cache's snapshot folder is used as it is.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

from preshard.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SourceNotFoundError,
    SourceUnreachableError,
    UsageError,
)
from preshard.format.folder import read_regular
from preshard.format.layout import ChunkRecord
from preshard.format.manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest, chunk_digest, read_manifest
from preshard.format.publish import publish_folder, staged_sibling

LIBRARY = "preshard"
COMPLETE_NAME = ".preshard-rank-folder.json"  # written last in a rank folder: which manifest, which files
MERGE_GAP = 1 << 20  # ranged reads of records closer than this are merged into one request


def rank_files(manifest: Manifest, tp_rank: int) -> tuple[list[str], dict[str, list[ChunkRecord]]]:
    """What TP rank `tp_rank` reads: (data files to download whole, {other data file: the records it reads there}).

    A file is downloaded whole when it holds a chunk the rank owns (its own rank file); from the others the rank
    reads only replicated tensors' records.
    """
    whole: set[str] = set()
    ranged: dict[str, list[ChunkRecord]] = {}
    for chunks in manifest.chunks_for_tp_rank(tp_rank).values():
        for c in chunks:
            if c.owner == tp_rank:
                whole.add(c.file)
            else:
                ranged.setdefault(c.file, []).append(c)
    order = [f.name for f in manifest.files]
    others = [name for name in order if name in ranged and name not in whole]
    parts = {name: sorted(ranged[name], key=lambda c: c.offset) for name in others}
    return [name for name in order if name in whole], parts


@dataclass(frozen=True)
class RankCheckpoint:
    """What `fetch_rank_checkpoint` fetched: the folder to load from, its manifest (parsed once) and the commit."""

    folder: Path
    manifest: Manifest
    commit: str


def fetch_rank_files(
    repo_id: str,
    *,
    tp_rank: int | Callable[[Manifest], int] = 0,
    revision: str | None = None,
    token: str | bool | None = None,
    subfolder: str | None = None,
) -> Path:
    """The folder of `fetch_rank_checkpoint` (same arguments, same errors)."""
    return fetch_rank_checkpoint(repo_id, tp_rank=tp_rank, revision=revision, token=token, subfolder=subfolder).folder


def fetch_rank_checkpoint(
    repo_id: str,
    *,
    tp_rank: int | Callable[[Manifest], int] = 0,
    revision: str | None = None,
    token: str | bool | None = None,
    subfolder: str | None = None,
) -> RankCheckpoint:
    """Fetch what one TP rank of a pre-sharded Hub checkpoint reads; return a folder that loads like a local one.

    Args:
        repo_id: a Hub repo holding a folder `convert-checkpoint` wrote (uploaded with `upload_folder`).
        tp_rank: this rank's TP coordinate, or a function of the manifest giving it (the run mesh may differ in
            CP from the converted one, so `load_sharded` computes it once the manifest is known).
        revision: branch, tag or commit (default: the default branch). Every file comes from one commit.
        token: Hub token (default: HF_TOKEN or the saved login).
        subfolder: the folder of the repo holding the checkpoint (default: the repo's root).

    Returns:
        The folder to load from (the HF cache's snapshot folder, or this rank's folder in the assets cache), the
        manifest, and the commit `revision` resolved to (every rank of a job must load the same one).

    Raises:
        CorruptCheckpointError: `repo_id` is no repo id (and no local path), or its manifest is damaged.
        SourceError: the repo, revision or a file cannot be fetched (one line, naming it and the fix).
    """
    from preshard.sources.hub import clean_subfolder, download_files, is_repo_id

    if not is_repo_id(repo_id):
        raise CheckpointNotFoundError(
            f"checkpoint {repo_id} does not exist; pass the folder convert-checkpoint wrote or a Hub repo id (org/name)"
        )
    subfolder = clean_subfolder(subfolder)
    head = download_files(repo_id, [MANIFEST_NAME], revision=revision, token=token, subfolder=subfolder)
    manifest = read_manifest(head.folder)
    rank = tp_rank(manifest) if callable(tp_rank) else tp_rank
    if not 0 <= rank < manifest.tp:
        raise UsageError(f"TP rank {rank} is outside the checkpoint's tp={manifest.tp}")
    whole, ranged = rank_files(manifest, rank)
    small = [MANIFEST_NAME, DCP_METADATA_NAME] + ([manifest.config.name] if manifest.config is not None else [])
    snapshot = download_files(repo_id, small + whole, revision=head.commit, token=token, subfolder=subfolder).folder
    if all(_cached(repo_id, _in(subfolder, name), head.commit) for name in ranged):
        return RankCheckpoint(snapshot, manifest, head.commit)
    folder = _rank_folder(repo_id, head.commit, snapshot, manifest, rank, small + whole, ranged, token, subfolder)
    return RankCheckpoint(folder, manifest, head.commit)


def _in(subfolder: str | None, name: str) -> str:
    return f"{subfolder}/{name}" if subfolder else name


def _cached(repo_id: str, name: str, commit: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, name, revision=commit), str)


def _rank_folder(
    repo_id: str,
    commit: str,
    snapshot: Path,
    manifest: Manifest,
    rank: int,
    links: list[str],
    ranged: dict[str, list[ChunkRecord]],
    token: str | bool | None,
    subfolder: str | None = None,
) -> Path:
    """This rank's folder in the assets cache: links to the downloaded files, sparse files with its records."""
    from huggingface_hub import cached_assets_path, constants

    # The assets folder as configured now (cached_assets_path's own default is bound when huggingface_hub is imported).
    assets = constants.HF_ASSETS_CACHE
    root = cached_assets_path(LIBRARY, namespace=repo_id.replace("/", "--"), subfolder=commit, assets_dir=assets)
    final = root / ((f"{subfolder.replace('/', '--')}--" if subfolder else "") + f"tp{rank}-of-{manifest.tp}")
    if _complete(final, manifest):
        return final
    work = staged_sibling(final, "tmp")
    try:
        for name in links:
            _link(snapshot / name, work / name)
        _fetch_records(repo_id, commit, manifest, ranged, work, token, subfolder)
        (work / COMPLETE_NAME).write_text(
            json.dumps({"digest": manifest.digest, "links": links, "records": sorted(ranged)})
        )
        if final.exists() and not _complete(final, manifest):
            shutil.rmtree(final, ignore_errors=True)  # stale: e.g. the HF cache it linked to was cleaned
        if not publish_folder(work, final, replace=False) and not _complete(final, manifest):
            raise OSError(errno.EEXIST, "an incomplete rank folder is in the way", str(final))
        # (False with a complete folder: another rank of this machine finished first; its folder is used)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _complete(folder: Path, manifest: Manifest) -> bool:
    """A finished rank folder for this manifest whose links still resolve."""
    try:
        done = json.loads(read_regular(folder / COMPLETE_NAME, COMPLETE_NAME, CorruptCheckpointError, "remove it"))
    except (OSError, ValueError, CorruptCheckpointError):
        return False
    if not isinstance(done, dict) or done.get("digest") != manifest.digest:
        return False
    names = list(done.get("links", [])) + list(done.get("records", []))
    return all((folder / name).is_file() for name in names)


def _link(target: Path, link: Path) -> None:
    """A symbolic link to a file in the HF cache (a copy where the file system has no links)."""
    try:
        link.symlink_to(target.resolve())
    except OSError:
        shutil.copyfile(target, link)


def _spans(chunks: list[ChunkRecord]) -> list[tuple[int, int, list[ChunkRecord]]]:
    """Byte ranges covering `chunks` (sorted by offset), neighbours closer than MERGE_GAP in one range."""
    spans: list[tuple[int, int, list[ChunkRecord]]] = []
    for c in chunks:
        if spans and c.offset - spans[-1][1] <= MERGE_GAP:
            start, _, members = spans[-1]
            spans[-1] = (start, c.end, [*members, c])
        else:
            spans.append((c.offset, c.end, [c]))
    return spans


def _fetch_records(
    repo_id: str,
    commit: str,
    manifest: Manifest,
    ranged: dict[str, list[ChunkRecord]],
    folder: Path,
    token: str | bool | None,
    subfolder: str | None = None,
) -> None:
    """Read the records of `ranged` with ranged requests into sparse files of the recorded sizes, checked."""
    from huggingface_hub import HfFileSystem, constants
    from huggingface_hub.errors import HfHubHTTPError

    from preshard.sources.hub import TransportError, hub_error, not_cached_message, offline_mode
    from preshard.sources.hub_retry import BodyCutShort, max_retries, retried

    if not ranged:
        return
    if offline_mode():
        name = next(iter(ranged))
        raise SourceUnreachableError(
            not_cached_message(f"{name} of Hub repo {repo_id} (commit {commit})", True)
            + "; or download the whole checkpoint once (hf download)"
        )
    fs = HfFileSystem(token=token, endpoint=constants.ENDPOINT, skip_instance_cache=True)
    for name, chunks in ranged.items():
        size = manifest.file(name).size
        path = folder / name
        remote_path = f"{repo_id}/{_in(subfolder, name)}"
        try:
            with (
                open(path, "wb") as out,
                fs.open(remote_path, "rb", revision=commit, cache_type="none", size=size) as remote,
            ):
                out.truncate(size)  # sparse: only this rank's records take space
                for start, end, members in _spans(chunks):
                    data = retried(f"{name} of Hub repo {repo_id}", partial(_read_span, remote, start, end))
                    _check_records(name, start, data, members)
                    os.pwrite(out.fileno(), data, start)
                out.flush()
                os.fsync(out.fileno())
        except FileNotFoundError:
            raise SourceNotFoundError(
                f"{name} is not in Hub repo {repo_id} at commit {commit}; upload the whole checkpoint folder"
            ) from None
        except BodyCutShort as exc:
            raise SourceUnreachableError(
                f"the ranged read of {name} of Hub repo {repo_id} ended early ({exc.got} of {exc.wanted} bytes, "
                f"retried {max_retries()} times); nothing was kept: run the command again, and if it persists the "
                "upload is incomplete: upload the checkpoint folder again"
            ) from None
        except (HfHubHTTPError, TransportError) as exc:
            raise hub_error(exc, repo_id, commit, offline=False, path=name) from exc


def _read_span(remote: BinaryIO, start: int, end: int) -> bytes:
    """Bytes start..end of a remote file (one ranged request); an answer cut short is `BodyCutShort` (retried)."""
    from preshard.sources.hub_retry import BodyCutShort

    remote.seek(start)
    data = remote.read(end - start)
    if len(data) != end - start:
        raise BodyCutShort(end - start, len(data))
    return data


def _check_records(name: str, start: int, data: bytes, chunks: list[ChunkRecord]) -> None:
    view = memoryview(data)
    for c in chunks:
        first = c.data_offset - start
        if chunk_digest(view[first : first + c.data_length]) != c.xxh3_64:
            raise CorruptCheckpointError(
                f"the record of {c.tensor} in {name} on the Hub does not match its checksum in the manifest; "
                "the upload is damaged or mixed: upload the checkpoint folder again"
            )


def names_repo(text: str | Path) -> bool:
    """Whether `text` is a Hub repo id and names no local path (`sources.hub.is_repo_id`, for the runtime)."""
    from preshard.sources.hub import is_repo_id

    return isinstance(text, str) and is_repo_id(text)
