"""Benchmark: one rank's read of a preshard checkpoint against a raw read of the same bytes and shard-on-read.

For one rank of a tp=T conversion (default T=8, rank 0) of a synthetic MiniMax-H3 checkpoint at the real
width (`preshard.examples.synthetic`: hidden 5376, 56 heads, ffn 14336, --layers transformer blocks plus
both refiner blocks; bf16 with the real checkpoint's float32 modules; random bytes), five variants each
run in a fresh child process:

  raw       the baseline: a plain sequential read (os.preadv, 16 MiB blocks, in file and offset order) of
            exactly the bytes preshard reads for this rank (its slices in its rank file plus every
            replicated chunk), into one preallocated buffer
  preshard  the runtime's ShardReader over every tensor of the manifest into preallocated CPU tensors
            (what load_sharded(verify=False) does on the CPU, without building a model or a process group)
  verified  preshard with every chunk's xxh3_64 checked, hashed beside the read (load_sharded's default)
  prefault  preshard, with a second thread mapping the destination pages from the end (MADV_POPULATE_WRITE)
            while the reader fills them from the start: the first-touch faults shared by two cores
  hugepages preshard, with madvise(MADV_HUGEPAGE) on every destination tensor first: 2 MiB faults where
            transparent huge pages are given on request
  slice     shard-on-read: the same rank's slices cut from the original safetensors with
            safetensors.safe_open(...).get_slice(name)[...] and copied into preallocated tensors. The
            copy matters: since safetensors 0.8 get_slice returns views backed by the mmapped file, so
            without it nothing is read and the variant looks free.

Fairness: repetitions alternate (each --runs repetition runs every variant, in an order that rotates,
warm and cold interleaved). Warm: the files the variant reads are read with cat first. Cold: `sync;
echo 3 > /proc/sys/vm/drop_caches` before the child starts, only where that file is writable; elsewhere
the output says "cold not possible here" and only warm runs are made. Timed: the read only (imports,
manifest parsing and preallocation come before the clock). Reported per run: read time, rchar and
read_bytes deltas from /proc/self/io, the source bytes the variant has to bring in (slice reads through
mmap, which rchar does not count: the file pages its slices cover, from the file layout), the child's
peak RSS during the read (VmHWM reset before it) and its growth, and ratios against raw of the same run.

--ranks N runs the whole job instead: N ranks under torchrun (gloo, free port) each call load_sharded
on one tp=N conversion and report the time from torchrun's start to the model loaded, split into torchrun's
launch of the rank, interpreter start, the imports of torch, diffusers and preshard, the process group's
start, building the model (on meta, checks, hooks) and the read of the rank's shard.

    python benchmarks/bench_load.py                           # tp=8, rank 0, 1 layer (2.8 GiB), 3 runs
    python benchmarks/bench_load.py --layers 2 --tp 4 --rank 1 --runs 5
    python benchmarks/bench_load.py --ranks 8                 # 8 torchrun ranks, time to a loaded model
    python benchmarks/bench_load.py --plan my-plan.json --source path/to/transformer  # your own checkpoint
    python benchmarks/bench_load.py --converted DIR --variants raw,preshard,verified   # an existing conversion
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _harness import REPO_SRC, bench_env, cold_possible, drop_caches, loadavg

VARIANTS = ("raw", "preshard", "verified", "prefault", "hugepages", "slice")
MIB = 1024 * 1024
BLOCK = 16 * MIB


# --------------------------------------------------------------------------------------------------
# Environment, page cache


def read_through(paths: list[Path]) -> None:
    """Bring files into the page cache (cat, as a user would)."""
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def _prepare_cache(mode: str, paths: list[Path]) -> None:
    os.sync()
    if mode == "cold":
        drop_caches()
    else:
        read_through(paths)


# --------------------------------------------------------------------------------------------------
# Building the synthetic source checkpoint and its conversion (parent process)


def write_source(directory: Path, layers: int, shard_mib: int) -> Path:
    """A real-width MiniMax-H3 in diffusers' layout, random bytes streamed from one repeated buffer."""
    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint

    tensors, config = minimax_h3_tensors(num_layers=layers)
    write_safetensors_checkpoint(directory, tensors, config, data="random", max_shard_bytes=shard_mib * MIB)
    return directory


def _files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def _variant_files(checkpoint: Path, source: Path, rank: int) -> dict[str, list[Path]]:
    """What each variant reads (warm runs read these first)."""
    from preshard.format.manifest import read_manifest

    manifest = read_manifest(checkpoint)
    mine = [checkpoint / f for f in manifest.files_for_tp_rank(rank)] + [checkpoint / "manifest.json"]
    src = (_files_of(source) if source.is_dir() else [source]) if source.exists() else []
    return {"raw": mine, "preshard": mine, "verified": mine, "prefault": mine, "hugepages": mine, "slice": src}


# --------------------------------------------------------------------------------------------------
# First-touch cost of fresh destination memory: two remedies measured as variants (neither is in the loader:
# on the shared 2-core VM both made the load slower, see the README)

HUGE_PAGE, PAGE = 2 << 20, 4096
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # linux/mman.h
PREFAULT_STEP = 16 << 20


def _madvise():
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor) -> None:
    """madvise(MADV_HUGEPAGE) on the whole huge pages inside a CPU tensor's memory, before it is first written:
    its faults are then 2 MiB ones where transparent huge pages are given on request (`madvise` mode)."""
    madvise = _madvise()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end - end % HUGE_PAGE
    if madvise is not None and last > first:
        madvise(first, last - first, MADV_HUGEPAGE)


class Prefault:
    """While the block runs, a thread maps the pages of `tensors` (in read order) last tensor first
    (MADV_POPULATE_WRITE: the data is not touched), so that the reader filling them from the first meets it in
    the middle and the fault work is shared by two cores."""

    def __init__(self, tensors) -> None:
        self.regions = []
        for t in tensors:
            if t.numel():
                start = t.data_ptr() - t.data_ptr() % PAGE
                end = t.data_ptr() + t.numel() * t.element_size()
                self.regions.append((start, end + (-end % PAGE) - start))
        self.madvise = _madvise()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self.madvise is not None:
            self.thread.start()
        return self

    def _run(self) -> None:
        for start, length in reversed(self.regions):
            for offset in range(0, length, PREFAULT_STEP):
                if self.stop.is_set() or self.madvise(start + offset, min(PREFAULT_STEP, length - offset), 23):
                    return

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


# --------------------------------------------------------------------------------------------------
# The variants (each in its own child process)


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _preallocate(manifest) -> dict:
    """Each tensor's local (this rank's) tensor, allocated before the clock starts."""
    import torch

    return {
        name: torch.empty(t.layout.local_shape(manifest.tp), dtype=t.layout.dtype.torch)
        for name, t in manifest.tensors.items()
    }


def rank_ranges(manifest, rank: int) -> list[tuple[str, int, int]]:
    """(file, start, end) byte ranges preshard reads for `rank`, merged where adjacent, in file order."""
    spans = sorted(
        (c.file, c.data_offset, c.data_offset + c.data_length)
        for chunks in manifest.chunks_for_tp_rank(rank).values()
        for c in chunks
    )
    merged: list[tuple[str, int, int]] = []
    for f, a, b in spans:
        if merged and merged[-1][0] == f and merged[-1][2] == a:
            merged[-1] = (f, merged[-1][1], b)
        else:
            merged.append((f, a, b))
    return merged


def _prepare_raw(checkpoint: Path, rank: int):
    import torch

    from preshard.format.manifest import read_manifest

    ranges = rank_ranges(read_manifest(checkpoint), rank)
    size = sum(b - a for _, a, b in ranges)
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")

    def read() -> tuple[int, int | None]:
        done = 0
        fds: dict[str, int] = {}
        try:
            for name, a, b in ranges:
                fd = fds.get(name)
                if fd is None:
                    fd = fds[name] = os.open(checkpoint / name, os.O_RDONLY)
                pos = a
                while pos < b:
                    n = os.preadv(fd, [view[done : done + min(BLOCK, b - pos)]], pos)
                    if not n:
                        raise RuntimeError(f"{name} ended at byte {pos}")
                    pos += n
                    done += n
        finally:
            for fd in fds.values():
                os.close(fd)
        return size, None

    read.outs = {"bytes": buf}
    return read


def _prepare_preshard(checkpoint: Path, rank: int, memory: str = "fresh", verify: bool = False):
    """The runtime's reader into preallocated tensors; `memory`: "prefault" maps their pages on a second thread
    while reading (`Prefault`), "hugepages" asks for transparent huge pages first (`advise_huge_pages`)."""
    import contextlib

    from preshard.format.manifest import read_manifest
    from preshard.runtime.reader import ShardReader

    manifest = read_manifest(checkpoint)
    outs = _preallocate(manifest)
    if memory == "hugepages":
        for out in outs.values():
            advise_huge_pages(out)
    chunks = manifest.chunks_for_tp_rank(rank)
    order = sorted(outs, key=lambda n: min((c.file, c.offset) for c in chunks[n]))

    def read() -> tuple[int, int | None]:
        prefault = Prefault([outs[n] for n in order]) if memory == "prefault" else contextlib.nullcontext()
        with prefault, ShardReader(checkpoint, manifest, rank, verify=verify, pin=False) as reader:
            reader.read_all(outs)
        return reader.stats.bytes_read, None

    read.outs = outs
    return read


def _copy_slice(handle, layout, tp: int, rank: int, out) -> None:
    """Copy this rank's part of a tensor from the original file into `out`, as a shard-on-read loader must.

    get_slice(...)[...] may be a view of the mmapped file (safetensors >= 0.8): copy_ is what reads it.
    `layout` is the manifest's TensorLayout: the split dimension and its blocks (packed styles: the rank's
    slice of each block, in order).
    """
    sl = handle.get_slice(layout.name)
    if layout.shard_dim is None:
        out.copy_(sl[:])
        return
    base = at = 0
    for block in layout.blocks:
        width = block // tp
        lo, hi = base + rank * width, base + (rank + 1) * width
        if layout.shard_dim == 0:
            out[at : at + width].copy_(sl[lo:hi])
        else:
            out[:, at : at + width].copy_(sl[:, lo:hi])
        base += block
        at += width


def _pages_touched(entry, layout, tp: int, rank: int, page: int) -> list[tuple[int, int]]:
    """Page intervals [first, last] of the source file that hold bytes of this rank's slice of a tensor."""
    spans: list[tuple[int, int]] = []  # absolute byte ranges [a, b)
    if layout.shard_dim is None:
        spans.append((entry.start, entry.end))
    elif layout.shard_dim == 0:
        base = 0
        for block in layout.blocks:
            width = block // tp
            first = base + rank * width
            spans.append((entry.start + first * entry.row_bytes, entry.start + (first + width) * entry.row_bytes))
            base += block
    else:
        item = entry.row_bytes // layout.shape[1]
        for row in range(layout.shape[0]):
            base = 0
            for block in layout.blocks:
                width = block // tp
                a = entry.start + row * entry.row_bytes + (base + rank * width) * item
                spans.append((a, a + width * item))
                base += block
    return [(a // page, (b - 1) // page) for a, b in spans if b > a]


def _merged_pages(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for first, last in sorted(intervals):
        if last > end:
            total += last - max(first, end + 1) + 1
            end = last
    return total


def _prepare_slice(checkpoint: Path, rank: int):
    from safetensors import safe_open

    from preshard.format.manifest import read_manifest
    from preshard.sources import open_source

    # Which slice each tensor needs comes from the manifest (the resolved plan), read before the clock starts.
    manifest = read_manifest(checkpoint)
    source = open_source(manifest.source.path)
    files = sorted({entry.path for entry in source.tensors.values()})
    by_file = {f: [n for n, e in source.tensors.items() if e.path == f] for f in files}
    page = os.sysconf("SC_PAGE_SIZE")
    touched = 0
    for path in files:
        intervals = []
        for n in by_file[path]:
            intervals += _pages_touched(source.tensors[n], manifest.tensors[n].layout, manifest.tp, rank, page)
        touched += _merged_pages(intervals) * page
    outs = _preallocate(manifest)

    def read() -> tuple[int, int | None]:
        nbytes = 0
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in by_file[path]:
                    out = outs[name]
                    _copy_slice(handle, manifest.tensors[name].layout, manifest.tp, rank, out)
                    nbytes += out.numel() * out.element_size()
        return nbytes, touched

    read.outs = outs
    return read


def child(variant: str, checkpoint: Path, rank: int) -> dict:
    import torch

    torch.set_num_threads(1)
    prepare = {
        "raw": _prepare_raw,
        "preshard": _prepare_preshard,
        "verified": lambda c, r: _prepare_preshard(c, r, verify=True),
        "prefault": lambda c, r: _prepare_preshard(c, r, "prefault"),
        "hugepages": lambda c, r: _prepare_preshard(c, r, "hugepages"),
        "slice": _prepare_slice,
    }
    read = prepare[variant](checkpoint, rank)
    # The peak RSS of the read alone: reset the high-water mark (ru_maxrss cannot be used: Linux carries the
    # forking parent's peak over exec, so it reports at least the benchmark driver's own RSS).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_rss = _status_kib("VmRSS") * 1024
    io0 = _proc_io()
    start = time.perf_counter()
    nbytes, touched = read()
    seconds = time.perf_counter() - start
    io1 = _proc_io()
    rchar = io1["rchar"] - io0["rchar"]
    peak = _status_kib("VmHWM") * 1024
    return {
        "variant": variant,
        "seconds": seconds,
        "bytes": nbytes,
        "rchar": rchar,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "touched": rchar if touched is None else touched,
        "peak_rss": peak,
        "rss_growth": peak - base_rss,
    }


def _raw_bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def check(checkpoint: Path, rank: int) -> dict:
    """preshard and slice deliver the same tensors bit for bit, and raw the same bytes (else nothing compares).
    Without the source (an existing conversion whose source is gone) preshard is compared with nothing but raw."""
    import torch

    from preshard.format.manifest import read_manifest

    manifest = read_manifest(checkpoint)
    preshard = _prepare_preshard(checkpoint, rank)
    preshard()
    wrong: list[str] = []
    if Path(manifest.source.path).exists():
        sliced = _prepare_slice(checkpoint, rank)
        sliced()
        # compared as bytes: random bit patterns include NaNs, which torch.equal never finds equal
        wrong = [n for n, t in preshard.outs.items() if not torch.equal(_raw_bytes(t), _raw_bytes(sliced.outs[n]))]
    raw = _prepare_raw(checkpoint, rank)
    raw_bytes, _ = raw()
    return {
        "tensors": len(preshard.outs),
        "sliced": Path(manifest.source.path).exists(),
        "wrong": wrong,
        "raw_bytes": raw_bytes,
        "preshard_bytes": sum(c.data_length for cs in manifest.chunks_for_tp_rank(rank).values() for c in cs),
    }


def _run_child(variant: str, checkpoint: Path, rank: int, env: dict[str, str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--checkpoint", str(checkpoint)]
    cmd += ["--rank", str(rank)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(f"{variant} child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# --ranks: the whole job under torchrun


def _boot_seconds() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _process_start_boot_seconds() -> float:
    """This process's start (exec of the interpreter), in seconds since boot, from /proc/self/stat."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks


def rank_main(checkpoint: str, out_dir: str) -> None:
    """Runs in each torchrun rank: time from torchrun's launch to a loaded model, in parts."""
    t_main = _boot_seconds()
    t_start = _process_start_boot_seconds()
    launched = float(os.environ.get("BENCH_LAUNCH_BOOT_S", "nan"))
    import torch

    t_torch = _boot_seconds()
    from diffusers import MiniMaxH3Transformer3DModel

    t_diffusers = _boot_seconds()
    import torch.distributed as dist

    from preshard.runtime.load import load_sharded

    t_imported = _boot_seconds()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # what load_sharded would do first; timed on its own
    t_group = _boot_seconds()
    model = load_sharded(MiniMaxH3Transformer3DModel, checkpoint, device="cpu")
    t_loaded = _boot_seconds()
    report = model.preshard_report
    mine = {
        "rank": report.rank,
        "launch_s": t_start - launched,
        "interpreter_s": t_main - t_start,
        "torch_s": t_torch - t_main,
        "diffusers_s": t_diffusers - t_torch,
        "preshard_s": t_imported - t_diffusers,
        "imports_s": t_imported - t_main,
        "process_group_s": t_group - t_imported,
        "build_s": t_loaded - t_group - report.read_seconds,
        "load_sharded_s": t_loaded - t_group,
        "read_s": report.read_seconds,
        "total_s": t_loaded - launched,
        "bytes_read": report.bytes_read,
        "peak_rss": _status_kib("VmHWM") * 1024,
    }
    Path(out_dir, f"rank{report.rank}.json").write_text(json.dumps(mine))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(checkpoint: Path, ranks: int, work: Path, env: dict[str, str], timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        os.path.abspath(__file__), "--rank-child", str(checkpoint), "--out", str(out),
    ]  # fmt: skip
    t0 = time.perf_counter()
    env = {**env, "BENCH_LAUNCH_BOOT_S": repr(_boot_seconds())}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    per_rank = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    shutil.rmtree(out, ignore_errors=True)
    if len(per_rank) != ranks:
        raise SystemExit(f"{len(per_rank)} of {ranks} ranks reported")
    return {"torchrun_wall_s": wall, "ranks": per_rank}


RANK_PARTS = (
    "launch_s", "interpreter_s", "torch_s", "diffusers_s", "preshard_s", "process_group_s", "build_s", "read_s",
    "total_s",
)  # fmt: skip


def ranks_report(jobs: list[dict], ranks: int) -> str:
    keys = RANK_PARTS
    lines = [
        f"\n{'mode':<5} {'job':>3} {'torchrun s':>10}  "
        + "  ".join(f"{k.removesuffix('_s').replace('_', ' ') + ' med/max':>17}" for k in keys)
        + f"  {'MiB read/rank':>13} {'peak RSS MiB max':>16}"
    ]
    lines.append("-" * len(lines[-1].strip("\n")))
    for job in jobs:
        cells = []
        for k in keys:
            values = [r[k] for r in job["ranks"]]
            cells.append(f"{f'{statistics.median(values):.2f} / {max(values):.2f}':>17}")
        mib = statistics.median(r["bytes_read"] for r in job["ranks"]) / MIB
        rss = max(r["peak_rss"] for r in job["ranks"]) / MIB
        lines.append(
            f"{job['mode']:<5} {job['run']:>3} {job['torchrun_wall_s']:>10.2f}  "
            + "  ".join(cells)
            + f"  {mib:>13.1f} {rss:>16.0f}"
        )
    lines += [
        "",
        f"per job: median / max over the {ranks} ranks. launch: torchrun started to this rank's process start;",
        "interpreter: process start (exec) to the benchmark's main; torch, diffusers, preshard: their imports;",
        "process group: init_process_group (gloo, every rank joining); build: load_sharded minus its read (model on",
        "meta, checks, buffers, hooks); read: reading this rank's shard; total: torchrun started to loaded model.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Report


def _mib(n: int) -> str:
    return f"{n / MIB:9.1f}"


def report(results: list[dict], header: str, modes: list[str]) -> str:
    lines = [header, ""]
    cols = (
        f"{'mode':<5} {'run':>3} {'variant':<9} {'read s':>7} {'GiB/s':>6} {'data MiB':>9} {'rchar MiB':>9} "
        f"{'disk MiB':>9} {'src MiB':>9} {'peak RSS':>9} {'RSS +MiB':>9} {'t/raw':>6} {'src/raw':>7}"
    )
    lines += [cols, "-" * len(cols)]
    raw = {(r["mode"], r["run"]): r for r in results if r["variant"] == "raw"}
    for r in results:
        base = raw[(r["mode"], r["run"])]
        lines.append(
            f"{r['mode']:<5} {r['run']:>3} {r['variant']:<9} {r['seconds']:7.3f} "
            f"{r['bytes'] / r['seconds'] / 2**30:6.2f} {_mib(r['bytes'])} {_mib(r['rchar'])} {_mib(r['read_bytes'])} "
            f"{_mib(r['touched'])} {_mib(r['peak_rss'])} {_mib(r['rss_growth'])} {r['seconds'] / base['seconds']:6.2f} "
            f"{r['touched'] / base['touched']:7.2f}"
        )
    lines += [
        "",
        f"{'mode':<5} {'variant':<9} {'read s median [min-max]':>24} {'/ raw (medians)':>16} {'/ raw (paired)':>15}",
    ]
    for mode in modes:
        sel = [r for r in results if r["mode"] == mode]
        if not sel:
            continue
        med_raw = statistics.median(r["seconds"] for r in sel if r["variant"] == "raw")
        for variant in [v for v in VARIANTS if any(r["variant"] == v for r in sel)]:
            times = [r["seconds"] for r in sel if r["variant"] == variant]
            paired = [r["seconds"] / raw[(mode, r["run"])]["seconds"] for r in sel if r["variant"] == variant]
            med = statistics.median(times)
            lines.append(
                f"{mode:<5} {variant:<9} {f'{med:.3f} [{min(times):.3f}-{max(times):.3f}]':>24} "
                f"{med / med_raw:>16.2f} {statistics.median(paired):>15.2f}"
            )
    lines += [
        "",
        "data: bytes the variant delivers (raw and preshard: this rank's slices + every replicated chunk;",
        "slice: the same tensors cut from the source and copied). rchar / disk: /proc/self/io rchar / read_bytes",
        "deltas of the read (disk: not served by the page cache). src: bytes of files the read has to bring in:",
        "rchar for read()-based variants; for slice (safetensors mmap, invisible to rchar) the 4 KiB pages of the",
        "source that hold any byte of the slices (a column slice touches every page of its tensor). peak RSS:",
        "VmHWM during the read (reset just before it; includes mapped file pages); RSS +: growth over the start",
        "of the read. warm: the variant's files read with cat first; cold: page cache dropped before the child.",
        "Every time includes the first-touch page faults of the destination memory, as a loading process pays.",
        "/ raw (paired): median over runs of the ratio to the raw read of the same run and mode.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0, help="the TP rank whose shard is read")
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks at real width (default 1: 2.8 GiB)")
    parser.add_argument("--shard-mib", type=int, default=2048, help="max safetensors file size of the source")
    parser.add_argument("--plan", help="plan JSON file or built-in plan name (default: the model's built-in plan)")
    parser.add_argument("--source", help="use this safetensors file/folder instead of the synthetic checkpoint")
    parser.add_argument(
        "--converted",
        help="read this existing conversion (nothing written or converted; slice needs its source to exist)",
    )
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary folder, removed)")
    parser.add_argument("--runs", type=int, default=3, help="alternating repetitions of every variant (default 3)")
    parser.add_argument("--no-cold", action="store_true", help="warm runs only")
    parser.add_argument("--ranks", type=int, default=0, help="run N torchrun ranks loading a tp=N conversion instead")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for one torchrun job")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (raw always runs)",
    )
    parser.add_argument("--json", dest="json_path", help="write every raw number to this JSON file")
    parser.add_argument("--child", choices=(*VARIANTS, "check"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--rank-child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.rank_child:
        rank_main(args.rank_child, args.out)
        return
    if args.child:
        run = check if args.child == "check" else lambda c, r: child(args.child, c, r)
        print(json.dumps(run(Path(args.checkpoint), args.rank)))
        return
    if args.ranks:
        args.tp = args.ranks
    if not 0 <= args.rank < args.tp:
        parser.error(f"--rank must be in 0..{args.tp - 1}")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(chosen) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(set(chosen) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    variants = tuple(v for v in VARIANTS if v in chosen or v == "raw")

    command = shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])])
    print(f"command: {command}")
    load_start = loadavg()
    print(f"{os.cpu_count()} CPUs; loadavg at start: {load_start}")
    modes = ["warm"]
    can_cold, why = cold_possible()
    if args.no_cold:
        print("cold runs: skipped (--no-cold)")
    elif can_cold:
        modes.append("cold")
        print(f"cold runs: possible ({why})")
    else:
        print(f"cold not possible here ({why}): warm runs only")
    env = bench_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if (REPO_SRC / "preshard").is_dir():
        sys.path.insert(0, str(REPO_SRC))

    from preshard.converter.convert import convert_checkpoint

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        if args.converted:
            from preshard.format.manifest import read_manifest

            out = Path(args.converted)
            manifest = read_manifest(out)
            args.tp, source = manifest.tp, Path(manifest.source.path)
            if "slice" in variants and not source.exists():
                parser.error(f"--variants slice needs the source of {out}, {source}, which does not exist")
            t1 = t2 = t0
        else:
            source = Path(args.source) if args.source else write_source(work / "source", args.layers, args.shard_mib)
            t1 = time.perf_counter()
            out = work / f"tp{args.tp}"
            manifest = convert_checkpoint(source, out, tp=args.tp, plan=args.plan, overwrite=True, progress=False)
            t2 = time.perf_counter()
        styles: dict[str, int] = {}
        for t in manifest.tensors.values():
            styles[t.layout.style.name] = styles.get(t.layout.style.name, 0) + 1
        total = sum(f.size for f in manifest.files)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(styles.items()))
        src_bytes = sum(p.stat().st_size for p in _variant_files(out, source, args.rank)["slice"])
        header = (
            f"source: {src_bytes / 2**30:.3f} GiB"
            + (
                ""
                if args.source or args.converted
                else f" (MiniMax-H3 real width, {args.layers} transformer + 2 refiner blocks)"
            )
            + f", written in {t1 - t0:.1f} s\ncheckpoint: {len(manifest.tensors)} tensors ({counts}), "
            f"{total / 2**30:.3f} GiB in {len(manifest.files)} rank files, converted in {t2 - t1:.1f} s"
            + (f" (--converted: the existing {out})" if args.converted else "")
        )
        record: dict = {"command": command, "cpus": os.cpu_count(), "loadavg_start": load_start, "modes": modes}
        if args.ranks:
            print(header, flush=True)
            jobs = []
            for run in range(1, args.runs + 1):
                for mode in modes if run % 2 else modes[::-1]:
                    _prepare_cache(mode, _files_of(out))
                    if mode == "warm":  # the interpreter's and libraries' files, as a warm start has them
                        subprocess.run([sys.executable, "-c", "import torch, diffusers, preshard"], env=env, check=True)
                    load = loadavg()
                    job = {"mode": mode, "run": run, "loadavg_before": load}
                    job.update(run_ranks(out, args.ranks, work, env, args.timeout))
                    jobs.append(job)
                    totals = [r["total_s"] for r in job["ranks"]]
                    print(
                        f"run {run} {mode}: torchrun {job['torchrun_wall_s']:.1f} s, rank total median "
                        f"{statistics.median(totals):.1f} s max {max(totals):.1f} s (load {load.split()[0]})",
                        flush=True,
                    )
            print(ranks_report(jobs, args.ranks))
            record["jobs"] = jobs
        else:
            files = _variant_files(out, source, args.rank)
            header += f"\nrank {args.rank} of tp={args.tp}; platform {sys.platform}, {os.cpu_count()} CPUs"
            verdict = _run_child("check", out, args.rank, env)
            if verdict["wrong"]:
                raise SystemExit(f"preshard and slice disagree on {verdict['wrong']}")
            if verdict["raw_bytes"] != verdict["preshard_bytes"]:
                raise SystemExit(f"raw reads {verdict['raw_bytes']} bytes, preshard {verdict['preshard_bytes']}")
            header += (
                f"\ncheck: preshard and {'slice' if verdict['sliced'] else 'nothing (no source)'} deliver the same "
                f"{verdict['tensors']} tensors, bit for bit; raw reads "
                f"the same {verdict['raw_bytes'] / MIB:.1f} MiB as preshard "
                f"({verdict['raw_bytes'] / manifest.file(f'__{args.rank}_0.distcp').size:.3f}x the rank file)"
            )
            print(header, flush=True)
            results = []
            for run in range(1, args.runs + 1):
                for mode in modes if run % 2 else modes[::-1]:
                    k = (run - 1) % len(variants)
                    for variant in variants[k:] + variants[:k]:
                        _prepare_cache(mode, files[variant])
                        load = loadavg()
                        r = {**_run_child(variant, out, args.rank, env), "run": run, "mode": mode}
                        r["loadavg_before"] = load
                        results.append(r)
                        print(
                            f"run {run} {mode} {variant:<8} {r['seconds']:.3f} s (load {load.split()[0]})", flush=True
                        )
            print("\n" + report(results, f"rank {args.rank} of tp={args.tp}, every run:", modes))
            record["results"] = results
            for mode in modes:
                sel = {(r["variant"], r["run"]): r["seconds"] for r in results if r["mode"] == mode}
                for variant, base in (("preshard", "raw"), ("verified", "raw"), ("verified", "preshard")):
                    if variant not in variants or base not in variants:
                        continue
                    p = statistics.median(v for (name, _), v in sel.items() if name == variant)
                    q = statistics.median(v for (name, _), v in sel.items() if name == base)
                    paired = statistics.median(sel[(variant, n)] / sel[(base, n)] for n in range(1, args.runs + 1))
                    print(
                        f"{mode}: {variant} rank {args.rank} / {base} = {p / q:.2f}x (medians), "
                        f"{paired:.2f}x (median of per-run ratios); target <= 1.1x"
                    )
        load_end = loadavg()
        print(f"loadavg at start: {load_start}\nloadavg at end:   {load_end}")
        if args.json_path:
            record["loadavg_end"] = load_end
            Path(args.json_path).write_text(json.dumps(record, indent=1) + "\n")
            print(f"raw numbers: {args.json_path}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
