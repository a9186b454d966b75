"""A checkpoint that carries its compiled programs: `load_sharded(..., compile=True)` compiles the loaded model with
`torch.compile` and keeps what torch compiled for it in a cache entry beside the checkpoint, which a later load with
the same key loads before its first compiled call.

What an entry holds. torch's own compile-cache artifacts (`torch.compiler.save_cache_artifacts()`: the inductor FX
graph cache and the AOTAutograd cache entries of the graphs compiled, bytes that `torch.compiler.load_cache_artifacts`
puts back into inductor's cache folder), taken after the first compiled call (the graphs are compiled then, not at
`torch.compile`), and the compiled kernels themselves: on CPU, inductor's C++ kernels are built by the system compiler
into shared objects that the artifacts do not carry (a warm start from the artifacts alone still builds every
kernel, about half the cold CPU time on the tiny H3), so the first call runs with `TORCHINDUCTOR_CACHE_DIR` pointed at
a fresh private folder and every file inductor wrote there besides its two graph caches is kept in the entry as well.

The key. An entry is used only by a call whose key is equal to the one it was written under: preshard's, torch's,
Python's and diffusers' versions, the model's class, the manifest digest, the device type and capability (CPU: the
ISA torch dispatches to and the CPU's flags, as inductor builds with -march=native; CUDA: the device name and
capability), the mesh, the rank and its coordinates (the hooks bake each rank's slice offsets into its graph, so
every rank keeps an entry of its own), the parameters' names, local shapes and dtypes (the dtype cast, quantized
weights and runtime LoRA adapters change them), the hooks, the input check, the compile options, and the first
call's inputs (each tensor's shape and dtype; other arguments by value). Another entry of the same rank is ignored
with one line (a `CompileCacheWarning`) naming the fields that differ.

Trust. The entries are code: pickles and shared objects that torch loads and runs. A checkpoint's weights and
manifest are data preshard checks and never executes; an entry is not. So an entry is loaded only when
(1) every file it lists has the size and SHA-256 its `entry.json` records (a damaged one is ignored, with a line),
and (2) it was written by preshard for this user: `entry.json` carries an HMAC-SHA256 of the key and the file
hashes under a secret kept in the user's cache folder (`$XDG_CACHE_HOME/preshard/compile-cache.key`, mode 0600).
An entry that came with a checkpoint from elsewhere (a download, a copy from another user or host without the same
home folder) fails (2) and is ignored with a line saying so, unless the caller opts in with
`CompileOptions(trust_cache=True)`: then it is trusted as the checkpoint's source is, and (1) still applies.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import json
import os
import platform
import re
import secrets
import shutil
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preshard.errors import UsageError
from preshard.format.folder import open_regular, read_fd
from preshard.format.jsonio import canonical_json
from preshard.format.publish import publish_folder, staged_sibling

ENTRY_FORMAT = "preshard-compile-cache/1"
ENTRY_NAME = "entry.json"
ARTIFACTS_NAME = "artifacts.bin"
KERNELS = "kernels"
CHECKPOINT_FOLDER = "compiled"  # a local checkpoint's entries: <checkpoint>/compiled/<entry id>/
# Inductor's own graph caches inside its cache folder: carried by torch's artifacts, not copied as files.
_TORCH_CACHED = ("fxgraph", "aotautograd", "locks")
_PART = re.compile(r"^[A-Za-z0-9_.+-]{1,200}$")
_ENTRY_LIMIT = 1 << 22  # entry.json: far above what a real one holds (a few hundred files)


class CompileCacheWarning(UserWarning):
    """An entry of the compile cache was not used, or one could not be written; the message says why."""


@dataclass(frozen=True)
class CompileOptions:
    """How `load_sharded(..., compile=...)` compiles the model and where it keeps the compiled programs.

    Args:
        backend, mode, fullgraph, dynamic: passed to `torch.compile` (only inductor writes artifacts to keep).
        cache: the folder that holds the entries (default: `<checkpoint>/compiled` for a local checkpoint, the
            user's cache folder `$XDG_CACHE_HOME/preshard/compiled/<manifest digest>` for a Hub one).
        save: write an entry after a cold first call (default True); False only reads.
        trust_cache: also load entries this user's preshard did not write (shipped with the checkpoint): they are
            code, trusted as the checkpoint's source is. Their file hashes are still checked.

    Example:
        >>> net = load_sharded(H3, "h3-tp2", compile=CompileOptions(cache="/data/compiled"))  # doctest: +SKIP
    """

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    cache: str | Path | None = None
    save: bool = True
    trust_cache: bool = False


def compile_loaded(
    net: nn.Module, compile: bool | CompileOptions, *, folder: Path, remote: bool, digest: str
) -> nn.Module:
    """`net` as load_sharded returns it: itself (compile=False), or `torch.compile(net)` with the cache attached.

    Args:
        net: the loaded model (its `preshard_report` describes rank, mesh and hooks).
        compile: False, True (default options) or `CompileOptions`.
        folder: the checkpoint's local folder; remote: it came from the Hub (entries go to the user's cache).
        digest: the manifest digest, part of the key.

    Returns:
        The model, or its compiled module (attributes reach the model; the first call loads or writes the entry).

    Raises:
        UsageError: `compile` is neither a bool nor `CompileOptions`.
    """
    if compile is False:
        return net
    if compile is True:
        compile = CompileOptions()
    if not isinstance(compile, CompileOptions):
        raise UsageError(f"compile= takes True, False or CompileOptions(...), not {type(compile).__name__}")
    options = compile
    compiled = torch.compile(
        net, backend=options.backend, mode=options.mode, fullgraph=options.fullgraph, dynamic=options.dynamic
    )
    assert isinstance(compiled, nn.Module)  # torch.compile of a module is its OptimizedModule
    if options.cache is not None:
        cache = Path(options.cache)
    elif remote:
        cache = user_cache_root() / "compiled" / digest[:32]
    else:
        cache = folder / CHECKPOINT_FOLDER
    first = _FirstCall(cache, options, static_key(net, options, digest))
    handles: list[Any] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first.before(args, kwargs)

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        failed = output is None  # what torch passes when the call raised: the next call is the first one again
        if not failed:
            for handle in handles:
                handle.remove()
        first.after(failed=failed)

    handles.append(compiled.register_forward_pre_hook(before, with_kwargs=True))
    handles.append(compiled.register_forward_hook(after, with_kwargs=True, always_call=True))
    return compiled


def user_cache_root() -> Path:
    """preshard's folder in the user's cache (`$XDG_CACHE_HOME/preshard`, else `~/.cache/preshard`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "preshard"


def static_key(net: nn.Module, options: CompileOptions, digest: str) -> dict[str, Any]:
    """What the compiled programs depend on, but the first call's inputs."""
    report = getattr(net, "preshard_report", None)
    weights = [[name, list(p.shape), str(p.dtype)] for name, p in [*net.named_parameters(), *net.named_buffers()]]
    versions = {"preshard": _version("preshard"), "torch": torch.__version__, "python": sys.version.split()[0]}
    for library in ("diffusers", "transformers"):
        if library in sys.modules:
            versions[library] = _version(library)
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    return {
        "versions": versions,
        "model": f"{type(net).__module__}.{type(net).__qualname__}",
        "manifest": digest,
        "device": device_key(device),
        "rank": getattr(report, "rank", 0),
        "world_size": getattr(report, "world_size", 1),
        "mesh": getattr(report, "mesh", None),
        "coords": getattr(report, "coords", None),
        "hooks": _digest(getattr(report, "hooks", None)),
        "input_check": getattr(report, "input_check", None),
        "weights": _digest(weights),
        "compile": {k: v for k, v in asdict(options).items() if k in ("backend", "mode", "fullgraph", "dynamic")},
    }


def device_key(device: torch.device) -> dict[str, Any]:
    """The device type and what compiled code for it depends on."""
    key: dict[str, Any] = {"type": device.type, "machine": platform.machine()}
    if device.type == "cpu":
        key["capability"] = torch.backends.cpu.get_cpu_capability()
        key["cpu_flags"] = _digest(_cpu_flags())
    elif device.type == "cuda":
        key["capability"] = list(torch.cuda.get_device_capability(device))
        key["name"] = torch.cuda.get_device_name(device)
    return key


def inputs_key(args: tuple, kwargs: dict) -> Any:
    """The first call's inputs as the graphs depend on them: tensors by shape, dtype and device; the rest by value."""

    def of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ["tensor", list(value.shape), str(value.dtype), value.device.type, value.requires_grad]
        if isinstance(value, (list, tuple)):
            return [type(value).__name__, [of(v) for v in value]]
        if isinstance(value, dict):
            return ["dict", {str(k): of(v) for k, v in value.items()}]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return ["object", f"{type(value).__module__}.{type(value).__qualname__}"]

    return {"args": of(list(args)), "kwargs": of(dict(kwargs))}


def entry_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(key)).hexdigest()[:32]


class _FirstCall:
    """The first compiled call: before it, load a usable entry into a private inductor cache folder; after it,
    write one if none was used. Every later call goes straight to the compiled module."""

    def __init__(self, cache: Path, options: CompileOptions, key: dict[str, Any]) -> None:
        self.cache, self.options, self.key = cache, options, key
        self.private: Path | None = None
        self.previous: str | None = None
        self.loaded = False
        self.fresh: contextlib.ExitStack | None = None

    def before(self, args: tuple, kwargs: dict) -> None:
        self.key = {**self.key, "inputs": inputs_key(args, kwargs)}
        self.private = Path(tempfile.mkdtemp(prefix="preshard-inductor-"))
        atexit.register(shutil.rmtree, self.private, True)  # compiled modules keep paths into it until exit
        self.previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.private)
        _point_device_caches(self.cache, self.key)
        entry = find_entry(self.cache, self.key, trust=self.options.trust_cache)
        if entry is not None:
            self.loaded = install_entry(entry, self.private)
        if not self.loaded and self.options.save:
            self.fresh = contextlib.ExitStack()
            self.fresh.enter_context(_fresh_artifacts())

    def after(self, *, failed: bool) -> None:
        try:
            if self.fresh is not None and self.private is not None:
                try:
                    saved = None if failed else torch.compiler.save_cache_artifacts()
                finally:
                    self.fresh.close()
                if saved is not None:
                    write_entry(self.cache, self.key, saved[0], self.private)
        finally:
            if self.previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.previous


@contextlib.contextmanager
def _fresh_artifacts():
    """torch's record of cache artifacts, empty for this call: what is saved is this model's graphs alone."""
    from torch.compiler._cache import CacheArtifactManager

    fresh = getattr(CacheArtifactManager, "with_fresh_cache", None)
    with fresh() if fresh is not None else contextlib.nullcontext():
        yield


@dataclass(frozen=True)
class Entry:
    """An entry whose files were read and checked: the bytes to install, by relative path."""

    path: Path
    artifacts: bytes
    kernels: dict[str, bytes]


def _warn(message: str) -> None:
    warnings.warn(f"compile cache: {message}", CompileCacheWarning, stacklevel=4)


def find_entry(cache: Path, key: dict[str, Any], *, trust: bool) -> Entry | None:
    """The entry for `key` in `cache`, read and checked (hashes; HMAC unless `trust`), or None, with one line for
    an entry of this rank that is there and not used."""
    path = cache / entry_id(key)
    if not path.is_dir():
        _explain_miss(cache, key)
        return None
    try:
        record = json.loads(_read(path / ENTRY_NAME, _ENTRY_LIMIT))
        if record.get("format") != ENTRY_FORMAT or record.get("key") != key:
            _warn(f"not using {path}: its {ENTRY_NAME} is for another key or format; compiling")
            return None
        files = record["files"]
        if not isinstance(files, dict) or ARTIFACTS_NAME not in files:
            raise ValueError("no file list")
        signed = hmac.compare_digest(str(record.get("signature", "")), _sign(key, files, create=False) or "")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _warn(f"not using {path}: its {ENTRY_NAME} cannot be read ({exc}); compiling")
        return None
    if not signed and not trust:
        _warn(
            f"not using {path}: it was not written by preshard for this user (it came with the checkpoint or from "
            "another user or host); its programs are code, so pass compile=CompileOptions(trust_cache=True) if you "
            "trust the checkpoint's source; compiling"
        )
        return None
    blobs: dict[str, bytes] = {}
    for relative, meta in files.items():
        parts = str(relative).split("/")
        if not all(_PART.match(p) and p not in (".", "..") for p in parts):
            _warn(f"not using {path}: it lists an unsafe path {relative!r}; compiling")
            return None
        try:
            data = _read(path.joinpath(*parts), int(meta["size"]) + 1)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _warn(f"not using {path}: {relative} cannot be read ({exc}); compiling")
            return None
        if len(data) != int(meta["size"]) or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            _warn(f"not using {path}: {relative} does not match its recorded SHA-256 (damaged or edited); compiling")
            return None
        blobs[relative] = data
    artifacts = blobs.pop(ARTIFACTS_NAME)
    kernels = {k[len(KERNELS) + 1 :]: v for k, v in blobs.items() if k.startswith(f"{KERNELS}/")}
    return Entry(path, artifacts, kernels)


def _explain_miss(cache: Path, key: dict[str, Any]) -> None:
    """One line for the nearest entry of this rank that is there under another key."""
    nearest: tuple[int, Path, list[str]] | None = None
    with contextlib.suppress(OSError):
        for entry in sorted(cache.iterdir()):
            try:
                other = json.loads(_read(entry / ENTRY_NAME, _ENTRY_LIMIT)).get("key")
            except (OSError, ValueError, AttributeError):
                continue
            if not isinstance(other, dict) or other.get("rank") != key.get("rank"):
                continue  # another rank's entry (or not an entry): not this rank's to explain
            differ = _differences(other, key)
            if nearest is None or len(differ) < nearest[0]:
                nearest = (len(differ), entry, differ)
    if nearest is not None:
        _warn(f"not using {nearest[1]}: it was compiled under another key ({'; '.join(nearest[2][:4])}); compiling")


def _differences(theirs: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name), ours.get(name)
        if isinstance(a, dict) and isinstance(b, dict) and name != "inputs":
            found += _differences(a, b, f"{prefix}{name}.")
        elif a != b:
            found.append(f"{prefix}{name}: {_short(a)} there, {_short(b)} here" if name != "inputs" else "inputs")
    return found


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def install_entry(entry: Entry, inductor_folder: Path) -> bool:
    """Put a checked entry's kernels into `inductor_folder` and load its artifacts into torch's caches."""
    for relative, data in entry.kernels.items():
        target = inductor_folder.joinpath(*relative.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)  # the bytes hashed, not the file re-read
        if target.suffix == ".so":
            target.chmod(0o700)
    info = torch.compiler.load_cache_artifacts(entry.artifacts)
    if info is None:
        _warn(f"not using {entry.path}: torch could not read its artifacts; compiling")
        return False
    return True


def write_entry(cache: Path, key: dict[str, Any], artifacts: bytes, inductor_folder: Path) -> Path | None:
    """Publish an entry for `key` in `cache` (in one step; an entry already there is kept); None with one line when
    the folder cannot be written."""
    target = cache / entry_id(key)
    staged: Path | None = None
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        staged = staged_sibling(target, "writing")
        files = {ARTIFACTS_NAME: _write(staged / ARTIFACTS_NAME, artifacts)}
        for source in sorted(inductor_folder.rglob("*")):
            relative = source.relative_to(inductor_folder)
            if relative.parts[0] in _TORCH_CACHED or source.is_symlink() or not source.is_file():
                continue
            name = "/".join((KERNELS, *relative.parts))
            destination = staged / KERNELS / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            files[name] = _write(destination, source.read_bytes())
        record = {"format": ENTRY_FORMAT, "key": key, "files": files, "signature": _sign(key, files, create=True)}
        _write(staged / ENTRY_NAME, json.dumps(record, indent=1, sort_keys=True).encode())
        if publish_folder(staged, target, replace=False):
            return target
        shutil.rmtree(staged, ignore_errors=True)  # another process wrote the same key first: its entry stays
        return target
    except OSError as exc:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        _warn(f"could not write {target} ({exc.strerror or exc}); pass compile=CompileOptions(cache=FOLDER)")
        return None


def _write(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _read(path: Path, limit: int) -> bytes:
    fd = open_regular(path, str(path), UsageError, "remove the entry", follow_symlinks=False)
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def _sign(key: dict[str, Any], files: dict[str, Any], *, create: bool) -> str | None:
    """HMAC-SHA256 of an entry's key and file hashes under this user's secret (made on first write)."""
    secret = _user_secret(create)
    if secret is None:
        return None
    return hmac.new(secret, canonical_json({"key": key, "files": files}), hashlib.sha256).hexdigest()


def _user_secret(create: bool) -> bytes | None:
    path = user_cache_root() / "compile-cache.key"
    try:
        with open(path, "rb") as f:
            secret = f.read(64)
        return secret if len(secret) == 32 else None
    except FileNotFoundError:
        if not create:
            return None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return _user_secret(create=False)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
        f.flush()
        os.fsync(f.fileno())
    return _user_secret(create=False)


def _point_device_caches(cache: Path, key: dict[str, Any]) -> None:
    """XLA's and Neuron's own persistent compile caches, pointed into `cache` (untested without the devices).

    Neither carries preshard's hashes or HMAC: they are the device stacks' own caches, in a folder the caller chose.
    """
    kind = key["device"]["type"]
    folder = cache / f"{kind}-rank{key['rank']}"
    if kind == "xla":
        try:
            import torch_xla.runtime as xr

            if not xr.is_persistent_cache_initialized():
                folder.mkdir(parents=True, exist_ok=True)
                xr.initialize_cache(str(folder), readonly=False)
        except Exception as exc:  # it must run before the first XLA computation: say how instead
            _warn(
                f"XLA's persistent cache was not pointed at {folder} ({exc}); call "
                f"torch_xla.runtime.initialize_cache({str(folder)!r}) before load_sharded"
            )
    elif kind == "neuron" and "NEURON_COMPILE_CACHE_URL" not in os.environ:
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["NEURON_COMPILE_CACHE_URL"] = str(folder)


def _version(library: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return "unknown"


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()[:32]


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.processor()
