"""A conversion into object storage (`convert-checkpoint SRC s3://bucket/h3-tp8 --tp 8`): converted into a local
staging folder, then uploaded with the manifest last.

Why staged: the converter writes each rank file with positional writes, journals what it finished for a resume and
publishes the folder in one rename (`converter/workdir.py`); an object store has none of those. So the conversion
runs, unchanged, into `PRESHARD_CACHE/outputs/<hash of the URL>/checkpoint` (an interrupted one resumes there),
and only a finished, sealed folder is uploaded:

1. an output that already holds a manifest is refused unless `overwrite` (then its manifest is deleted first, so
   no reader sees it while its files are replaced);
2. every other file is uploaded (an object appears whole when its upload ends) and its size checked;
3. objects of an earlier checkpoint under the prefix that the new one does not have are deleted;
4. `manifest.json` is uploaded last: a reader that sees the manifest sees every file it names.

The staging folder is removed once the upload is done (it needs the output's size on the local disk meanwhile).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from preshard.errors import OutputError, OutputExistsError
from preshard.format.manifest import MANIFEST_NAME, Manifest
from preshard.format.object_store import ObjectStore, cache_root, open_store, url_key

UPLOAD_WORKERS = 4


def staging_folder(url: str) -> Path:
    """The local folder a conversion into `url` is written to before its upload."""
    folder = cache_root() / "outputs" / url_key(url)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "checkpoint"


def convert_to_url(convert: Callable[[Path], Manifest], url: str, *, overwrite: bool) -> Manifest:
    """Run `convert(local_folder)`, then publish that folder at `url` (module docstring).

    Raises:
        OutputExistsError: `url` holds a checkpoint already and `overwrite` is False.
        ObjectStoreError: an upload failed (the output then has no manifest: readers see no checkpoint).
    """
    store = open_store(url)
    if store.exists(MANIFEST_NAME) and not overwrite:
        raise OutputExistsError(
            f"{store.where()} already holds a checkpoint ({MANIFEST_NAME}); pass --overwrite to replace it"
        )
    staging = staging_folder(url)
    manifest = convert(staging)
    publish_to_store(staging, store)
    shutil.rmtree(staging.parent, ignore_errors=True)
    return manifest


def publish_to_store(folder: Path, store: ObjectStore) -> None:
    """Upload the checkpoint folder `folder` to `store`, the manifest last (module docstring)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())  # .metadata included
    names = [p.name for p in files]
    if MANIFEST_NAME not in names:
        raise OutputError(f"{folder} holds no {MANIFEST_NAME}: the conversion did not finish; run it again")
    store.remove(MANIFEST_NAME)  # from here until the end, readers see no checkpoint at the prefix
    data = [p for p in files if p.name != MANIFEST_NAME]

    def upload(path: Path) -> None:
        store.upload(path, path.name)
        size = store.size(path.name)
        if size != path.stat().st_size:
            raise OutputError(
                f"{store.where(path.name)} is {size} bytes after its upload, not {path.stat().st_size}; run again"
            )

    with ThreadPoolExecutor(max_workers=UPLOAD_WORKERS, thread_name_prefix="preshard-upload") as pool:
        for _ in pool.map(upload, data):
            pass
    for stale in set(store.names()) - set(names):
        if "/" not in stale:  # a checkpoint's own files only: never another folder's objects under the prefix
            store.remove(stale)
    store.upload(folder / MANIFEST_NAME, MANIFEST_NAME)


__all__ = ["convert_to_url", "publish_to_store", "staging_folder"]
