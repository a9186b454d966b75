"""Benchmark: one rank's read of a preshard checkpoint against a raw read and against shard-on-read.

For one rank of a tp=T conversion (default T=8, rank 0) of a synthetic MiniMax-H3-like checkpoint
(real diffusers parameter names and structure at "medium" dimensions, scaled by the number of blocks to
about --size-gib; bf16 with the real checkpoint's float32 modules; colwise, rowwise, packed_colwise,
replicated_input_rowwise and replicated tensors), three variants each run in a fresh child process:

  raw       sequential read of exactly this rank's data file (__<rank>_0.distcp): the baseline
  preshard  the runtime's ShardReader over every tensor of the manifest into preallocated CPU tensors
            (what load_sharded does on the CPU, without building a model or a process group)
  slice     shard-on-read: the same rank's slices taken from the original safetensors with
            safetensors.safe_open(...).get_slice(name)[...]

Each variant runs twice in a row, each time in a new child: run 1 is "cold-ish" (nothing is dropped from
the page cache: the files were just written or read by the previous variant, so read_bytes shows how much
really came from the disk) and run 2 is warm. Reported per run: read time (only the reading, not imports,
manifest parsing or preallocation), rchar and read_bytes deltas from /proc/self/io, the source bytes the
read has to bring in (safetensors reads through mmap, which rchar does not count, so for `slice` these are
the file pages its slices cover, computed from the file layout), the child's peak RSS during the read
(VmHWM reset before it: ru_maxrss would carry the parent's peak across exec) and its growth, and the
ratios against `raw` of the same run.

    python benchmarks/bench_load.py                           # tp=8, ~1 GiB, rank 0
    python benchmarks/bench_load.py --size-gib 0.25 --tp 4 --rank 1
    python benchmarks/bench_load.py --plan my-plan.json --source path/to/transformer  # your own checkpoint
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("raw", "preshard", "slice")
MIB = 1024 * 1024
# Medium MiniMax-H3 dimensions: every TP-sharded dim divides by 8 (16 heads, inner 1024, ffn 2816, time
# embedding 512). One block is ~42.5 MiB in bf16; the rest of the model ~30 MiB.
MEDIUM = {
    "num_attention_heads": 16,
    "attention_head_dim": 64,
    "hidden_size": 1024,
    "num_refiner_layers": 1,
    "ffn_dim": 2816,
    "in_channels": 16,
    "audio_in_channels": 64,
    "text_dim": 1024,
    "freq_dim": 256,
    "time_embed_hidden_dim": 1024,
    "time_embed_dim": 512,
}
ST_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


# --------------------------------------------------------------------------------------------------
# Building the synthetic source checkpoint and its conversion (parent process)


def _medium_shapes(num_layers: int) -> tuple[dict, dict[str, tuple[list[int], str]]]:
    """Config and {name: (shape, dtype)} of a medium MiniMax-H3 built on meta (nothing is allocated)."""
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.examples.minimax_h3 import tiny_config

    config = tiny_config(**MEDIUM, num_layers=num_layers)
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    keep = list(getattr(MiniMaxH3Transformer3DModel, "_keep_in_fp32_modules", None) or [])
    shapes = {
        name: (list(t.shape), "float32" if any(k in name.split(".") for k in keep) else "bfloat16")
        for name, t in model.state_dict().items()
    }
    config = {"_class_name": "MiniMaxH3Transformer3DModel", **config}
    return config, shapes


def _nbytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * (4 if dtype == "float32" else 2)


def _layers_for(size_bytes: int) -> int:
    one = sum(_nbytes(*v) for v in _medium_shapes(1)[1].values())
    two = sum(_nbytes(*v) for v in _medium_shapes(2)[1].values())
    return max(1, round((size_bytes - (one - (two - one))) / (two - one)))


def write_source(directory: Path, size_bytes: int, seed: int = 0) -> Path:
    """A diffusers-layout folder: config.json + one safetensors file of random values, written streaming."""
    import torch

    config, shapes = _medium_shapes(_layers_for(size_bytes))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    path = directory / "diffusion_pytorch_model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for shape, dtype in shapes.values():
            values = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
            f.write(values.contiguous().view(torch.uint8).numpy().tobytes())
    return directory


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


def _local_shape(tensor, tp: int) -> list[int]:
    shape = list(tensor.shape)
    if tensor.shard_dim is not None:
        shape[tensor.shard_dim] //= tp
    return shape


def _prepare_raw(checkpoint: Path, rank: int):
    import torch

    from preshard.manifests.schema import data_file_name

    path = checkpoint / data_file_name(rank)
    size = path.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    block = 16 * MIB

    def read() -> tuple[int, int | None]:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                n = f.readinto(view[done : done + block])
                if not n:
                    raise RuntimeError(f"{path} ended at byte {done}")
                done += n
        return size, None

    read.outs = {"file": buf}
    return read


def _prepare_preshard(checkpoint: Path, rank: int):
    import torch

    from preshard.manifests.io import read_manifest
    from preshard.runtime.reader import ShardReader

    manifest = read_manifest(checkpoint)
    outs = {
        name: torch.empty(_local_shape(t, manifest.tp), dtype=getattr(torch, t.dtype))
        for name, t in manifest.tensors.items()
    }

    def read() -> tuple[int, int | None]:
        with ShardReader(checkpoint, manifest, rank, verify=False, pin=False) as reader:
            for name, out in outs.items():
                reader.read(name, out)
        return reader.stats.bytes_read, None

    read.outs = outs
    return read


def _slice_of(handle, tensor, tp: int, rank: int):
    """This rank's part of `tensor`, taken by get_slice from the original file as a shard-on-read loader does."""
    import torch

    sl = handle.get_slice(tensor.name)
    if tensor.shard_dim is None:
        return sl[:]
    size = tensor.shape[tensor.shard_dim]
    if tensor.shard_dim == 1:
        width = size // tp
        return sl[:, rank * width : (rank + 1) * width]
    # colwise: one block; packed_colwise: the manifest's block sizes, this rank's rows of each, concatenated
    parts, base = [], 0
    for block in tensor.blocks or [size]:
        width = block // tp
        parts.append(sl[base + rank * width : base + (rank + 1) * width])
        base += block
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pages_touched(entry, tensor, tp: int, rank: int, page: int) -> list[tuple[int, int]]:
    """Page intervals [first, last] of the source file that hold bytes of this rank's slice of `tensor`."""
    spans: list[tuple[int, int]] = []  # absolute byte ranges [a, b)
    if tensor.shard_dim is None:
        spans.append((entry.start, entry.end))
    elif tensor.shard_dim == 0:
        base = 0
        for block in tensor.blocks or [tensor.shape[0]]:
            width = block // tp
            first = base + rank * width
            spans.append((entry.start + first * entry.row_bytes, entry.start + (first + width) * entry.row_bytes))
            base += block
    else:
        item = entry.row_bytes // tensor.shape[1]
        width = tensor.shape[1] // tp
        for row in range(tensor.shape[0]):
            a = entry.start + row * entry.row_bytes + rank * width * item
            spans.append((a, a + width * item))
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

    from preshard.converter.sources import open_source
    from preshard.manifests.io import read_manifest

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
            intervals += _pages_touched(source.tensors[n], manifest.tensors[n], manifest.tp, rank, page)
        touched += _merged_pages(intervals) * page
    outs = {}

    def read() -> tuple[int, int | None]:
        nbytes = 0
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in by_file[path]:
                    outs[name] = _slice_of(handle, manifest.tensors[name], manifest.tp, rank)
                    nbytes += outs[name].numel() * outs[name].element_size()
        return nbytes, touched

    read.outs = outs
    return read


def child(variant: str, checkpoint: Path, rank: int) -> dict:
    import torch

    torch.set_num_threads(1)
    read = {"raw": _prepare_raw, "preshard": _prepare_preshard, "slice": _prepare_slice}[variant](checkpoint, rank)
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


def check(checkpoint: Path, rank: int) -> dict:
    """Both loaders deliver the same tensors, bit for bit (else the comparison would mean nothing)."""
    import torch

    preshard, sliced = _prepare_preshard(checkpoint, rank), _prepare_slice(checkpoint, rank)
    preshard()
    sliced()
    wrong = [n for n, t in preshard.outs.items() if not torch.equal(t, sliced.outs[n])]
    return {"tensors": len(preshard.outs), "wrong": wrong}


def _run_child(variant: str, checkpoint: Path, rank: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--checkpoint", str(checkpoint)]
    cmd += ["--rank", str(rank)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# Report


def _mib(n: int) -> str:
    return f"{n / MIB:9.1f}"


def report(results: list[dict], header: str) -> str:
    lines = [header, ""]
    cols = (
        f"{'variant':<9} {'run':>3} {'read s':>7} {'GiB/s':>6} {'data MiB':>9} {'rchar MiB':>9} {'disk MiB':>9} "
        f"{'src MiB':>9} {'peak RSS':>9} {'RSS +MiB':>9} {'t/raw':>6} {'src/raw':>7}"
    )
    lines += [cols, "-" * len(cols)]
    raw = {r["run"]: r for r in results if r["variant"] == "raw"}
    for r in results:
        base = raw[r["run"]]
        lines.append(
            f"{r['variant']:<9} {r['run']:>3} {r['seconds']:7.3f} {r['bytes'] / r['seconds'] / 2**30:6.2f} "
            f"{_mib(r['bytes'])} {_mib(r['rchar'])} {_mib(r['read_bytes'])} {_mib(r['touched'])} "
            f"{_mib(r['peak_rss'])} {_mib(r['rss_growth'])} {r['seconds'] / base['seconds']:6.2f} "
            f"{r['touched'] / base['touched']:7.2f}"
        )
    lines += [
        "",
        "data: bytes the variant delivers (raw: the rank file; preshard: own slices + every replicated chunk;",
        "slice: the same tensors cut from the source). rchar / disk: /proc/self/io rchar / read_bytes deltas of",
        "the read (disk: not served by the page cache). src: bytes of files the read has to bring in: rchar for",
        "read()-based variants; for slice (safetensors mmap, invisible to rchar) the 4 KiB pages of the source",
        "that hold any byte of the slices (a column slice touches every page of its tensor). peak RSS: VmHWM",
        "during the read (reset just before it; includes mapped file pages); RSS +: growth over the start of",
        "the read. Run 1 is cold-ish (nothing dropped from the page cache), later runs warm. Every time includes",
        "the first-touch page faults of the destination memory, as a fresh loading process pays them.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0, help="the TP rank whose shard is read")
    parser.add_argument("--size-gib", type=float, default=1.0, help="approximate size of the synthetic checkpoint")
    parser.add_argument("--plan", help="plan JSON file or built-in plan name (default: the model's built-in plan)")
    parser.add_argument("--source", help="use this safetensors file/folder instead of the synthetic checkpoint")
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary folder, removed)")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant (run 1 cold-ish, the rest warm)")
    parser.add_argument("--child", choices=(*VARIANTS, "check"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        run = check if args.child == "check" else lambda c, r: child(args.child, c, r)
        print(json.dumps(run(Path(args.checkpoint), args.rank)))
        return
    if not 0 <= args.rank < args.tp:
        parser.error(f"--rank must be in 0..{args.tp - 1}")

    from preshard.converter.convert import convert_checkpoint

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        source = Path(args.source) if args.source else write_source(work / "source", int(args.size_gib * 2**30))
        t1 = time.perf_counter()
        out = work / f"tp{args.tp}"
        manifest = convert_checkpoint(source, out, tp=args.tp, plan=args.plan, overwrite=True, progress=False)
        t2 = time.perf_counter()
        styles: dict[str, int] = {}
        for t in manifest.tensors.values():
            styles[t.style] = styles.get(t.style, 0) + 1
        total = sum(f.size for f in manifest.files)
        results = []
        for variant in VARIANTS:
            for run in range(1, args.runs + 1):
                results.append({**_run_child(variant, out, args.rank), "run": run})
        counts = ", ".join(f"{k} {v}" for k, v in sorted(styles.items()))
        header = (
            f"checkpoint: {len(manifest.tensors)} tensors ({counts}), "
            f"{total / 2**30:.3f} GiB in {len(manifest.files)} rank files; source written in {t1 - t0:.1f}s, "
            f"converted in {t2 - t1:.1f}s\nrank {args.rank} of tp={args.tp}; platform {sys.platform}, "
            f"{os.cpu_count()} CPUs"
        )
        verdict = _run_child("check", out, args.rank)
        if verdict["wrong"]:
            raise SystemExit(f"preshard and slice disagree on {verdict['wrong']}")
        header += f"\ncheck: preshard and slice deliver the same {verdict['tensors']} tensors, bit for bit"
        print(report(results, header))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
