"""A conversion source in object storage (s3://bucket/H3/transformer, any fsspec URL): what the conversion reads,
fetched once into a local folder, then opened as a local source.

Why a local copy rather than ranged reads during the conversion: the converter reads each source file once, front
to back, in bands through the page cache and `O_DIRECT` (`sources/reader.py`); streaming those bands from a bucket
would need a second reader of its own. So, as for a Hub source, only the files the conversion reads are fetched
(config.json, the safetensors index and the files it names, or the one `.safetensors` file), each streamed to disk by
the client in bounded memory, into `PRESHARD_CACHE/sources/<hash of the URL>/`. Each file is fetched to a temporary
name and renamed into place, with its size and ETag beside it; a later conversion of the same URL reuses a file whose
object still has that size and ETag (nothing is read again) and fetches it again otherwise. The conversion then
hashes every source file it reads, as for any local source, and the manifest records the URL as the source's path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from preshard.errors import ObjectNotFoundError, SourceError, SourceNotFoundError
from preshard.format.object_store import ObjectStore, cache_root, open_store, url_key

CONFIG_NAME = "config.json"
INDEX_SUFFIX = ".safetensors.index.json"
PREFERRED_INDEXES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")


def fetch_source(url: str, subfolder: str | None = None) -> Path:
    """Fetch what a conversion of the source at `url` reads; return the local folder (or file) to open.

    Args:
        url: a weights prefix ("s3://bucket/H3/transformer") or one object ending in .safetensors.
        subfolder: a prefix below `url` (e.g. "transformer" of a pipeline's prefix).

    Returns:
        The local folder holding config.json, the index and the weights (or the local `.safetensors` file).

    Raises:
        SourceNotFoundError: nothing to convert under the URL. ObjectStoreError: an object that cannot be read.

    Example:
        >>> open_local(fetch_source("s3://bucket/H3/transformer"))   # doctest: +SKIP
    """
    store = open_store(url).child(subfolder)
    if store.root.endswith(".safetensors"):
        parent_url, _, name = store.url.rpartition("/")
        parent = open_store(parent_url)
        folder = _folder(parent)
        if not parent.exists(name):
            raise SourceNotFoundError(f"source {store.where()} does not exist; check the URL")
        _fetch(parent, [name] + [CONFIG_NAME] * parent.exists(CONFIG_NAME), folder)
        return folder / name
    names = set(store.names())
    weights = sorted(n for n in names if "/" not in n and n.endswith(".safetensors"))
    indexes = [n for n in PREFERRED_INDEXES if n in names] or sorted(
        n for n in names if "/" not in n and n.endswith(INDEX_SUFFIX)
    )
    if not weights and not indexes:
        raise SourceNotFoundError(
            f"source {store.where()} holds no .safetensors object; point at the model's weights prefix (with "
            "config.json), or add --subfolder NAME for a pipeline's component"
        )
    folder = _folder(store)
    wanted = [n for n in (CONFIG_NAME,) if n in names]
    if indexes:
        if len(indexes) > 1 and indexes[0] not in PREFERRED_INDEXES:
            raise SourceError(f"source {store.where()} holds several index files ({', '.join(indexes)})")
        _fetch(store, wanted + [indexes[0]], folder)
        wanted = _indexed(folder / indexes[0], indexes[0], store)
    else:
        wanted += weights
    _fetch(store, wanted, folder)
    return folder


def _folder(store: ObjectStore) -> Path:
    folder = cache_root() / "sources" / url_key(store.where())
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _indexed(index: Path, name: str, store: ObjectStore) -> list[str]:
    """The files a safetensors index names (checked to be plain names: the index is untrusted)."""
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{store.where(name)} is not a valid safetensors index; it needs a 'weight_map'")
    files = list(dict.fromkeys(weight_map.values()))
    for file_name in files:
        if Path(file_name).name != file_name or file_name in ("", ".", ".."):
            raise SourceError(f"{store.where(name)} names {file_name!r}, which is not a file name beside it")
    return files


def _fetch(store: ObjectStore, names: list[str], folder: Path) -> None:
    """Each object of `names` into `folder`, unless a copy of the same size and ETag is there already."""
    for name in dict.fromkeys(names):
        info = _info(store, name)
        stamp = folder / f".{name}.object.json"
        target = folder / name
        try:
            same = json.loads(stamp.read_text()) == info and target.stat().st_size == info["size"]
        except (OSError, ValueError):
            same = False
        if same:
            continue
        partial = folder / f".{name}.part-{os.getpid()}"
        try:
            store.download(name, partial)
            if partial.stat().st_size != info["size"]:
                raise SourceError(
                    f"{store.where(name)} changed while it was being fetched; run the command again once it is "
                    "no longer being written"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        stamp.write_text(json.dumps(info))


def _info(store: ObjectStore, name: str) -> dict[str, object]:
    try:
        info = store.call(name, "look up", lambda: store.fs.info(store.path(name)))
    except ObjectNotFoundError:
        raise SourceNotFoundError(f"{store.where(name)} is missing; the source's index or folder names it") from None
    return {"size": int(info.get("size", -1)), "etag": str(info.get("ETag") or info.get("etag") or "")}


__all__ = ["fetch_source"]
