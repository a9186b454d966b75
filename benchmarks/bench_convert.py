"""Benchmark: convert-checkpoint against copying and plainly reading the same checkpoint, in one run.

A synthetic bf16 checkpoint with MiniMax-H3's structure (56 heads, SwiGLU FFN, AdaLN projection of 18 x
hidden rows; widths divided by a power of two to fit --size-mib) is written as several safetensors files
plus an index and config.json. Then, each in a fresh child process:

  cp       `cp -r` of the source folder (the baseline: every byte read once and written once)
  read     a raw sequential read of every source byte in Python, 8 MiB blocks
  convert  preshard's convert_checkpoint at each --tp (built-in minimax-h3 plan, no progress bar)

For each: the time of the work, bytes written, peak RSS of the child, and convert's time over cp's and
over read's. The source was just written, so all three read it from the page cache alike. Times of the
Python steps are taken inside the child around the work (interpreter start and `import torch` excluded);
cp's time is its whole process. convert also hashes the source files for the manifest and fsyncs what it
writes; cp does neither.

    python benchmarks/bench_convert.py                       # ~1 GiB, tp 8 and 2
    python benchmarks/bench_convert.py --size-mib 256 --tp 8 2 --workdir /some/fast/disk

This process imports neither torch nor preshard, so that the peak RSS a child reports is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MiB = 1024 * 1024

# Writes the synthetic checkpoint: argv = folder, target bytes, width divisor, number of blocks.
GENERATE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file

    folder, target, div, n_blocks = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    heads, head_dim = 56, 96 // div
    hidden, ffn, temb = heads * head_dim, 14336 // div, 2688 // div
    def block(prefix, adaln):
        t = {
            f"{prefix}.norm1.weight": (hidden,),
            f"{prefix}.attn.to_q.weight": (hidden, hidden),
            f"{prefix}.attn.to_k.weight": (hidden, hidden),
            f"{prefix}.attn.to_v.weight": (hidden, hidden),
            f"{prefix}.attn.norm_q.weight": (head_dim,),
            f"{prefix}.attn.norm_k.weight": (head_dim,),
            f"{prefix}.attn.to_out.0.weight": (hidden, hidden),
            f"{prefix}.norm2.weight": (hidden,),
            f"{prefix}.ff.net.0.proj.weight": (2 * ffn, hidden),
            f"{prefix}.ff.net.2.weight": (hidden, ffn),
        }
        if adaln:
            t[f"{prefix}.adaln_proj.linear.weight"] = (18 * hidden, temb)
            t[f"{prefix}.adaln_proj.linear.bias"] = (18 * hidden,)
        return t
    shapes = {
        "proj_in.weight": (hidden, 64), "proj_in.bias": (hidden,),
        "context_embedder.weight": (hidden, 4096 // div), "context_embedder.bias": (hidden,),
        "time_embedder.linear_1.weight": (hidden, 256), "time_embedder.linear_1.bias": (hidden,),
        "time_embedder.linear_2.weight": (temb, hidden), "time_embedder.linear_2.bias": (temb,),
    }
    shapes.update(block("token_refiner.refiner_blocks.0", adaln=False))
    for i in range(n_blocks):
        shapes.update(block(f"transformer_blocks.{i}", adaln=True))
    shapes.update({"norm_out.linear.weight": (2 * hidden, temb), "proj_out.weight": (64, hidden)})
    per_file = max(target // 6, 1)
    files, current, size = [], {}, 0
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        if current and size + 2 * n > per_file:
            files.append(current)
            current, size = {}, 0
        current[name] = shape
        size += 2 * n
    files.append(current)
    folder.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, spec in enumerate(files, start=1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{len(files):05d}.safetensors"
        # random bits: every byte matters, and no float conversion is needed (bf16 NaNs are fine here)
        tensors = {k: torch.empty(s, dtype=torch.int16).random_().view(torch.bfloat16) for k, s in spec.items()}
        save_file(tensors, str(folder / name))
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(spec, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"_class_name": "MiniMaxH3Transformer3DModel", "num_attention_heads": heads,
              "attention_head_dim": head_dim, "num_layers": n_blocks, "ffn_dim": ffn, "time_embed_dim": temb}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    print(json.dumps({"files": len(files), "tensors": len(shapes), "bytes": total, "hidden": hidden}))
    """
)

_PEAK = textwrap.dedent(
    """
    def _peak():
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    """
)

READ = _PEAK + textwrap.dedent(
    """
    import json, os, sys, time
    folder = sys.argv[1]
    buf = bytearray(8 * 1024 * 1024)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    print(json.dumps({"seconds": time.perf_counter() - t0, "read": total, "peak": _peak()}))
    """
)

CONVERT = _PEAK + textwrap.dedent(
    """
    import json, sys, time
    from preshard.converter.convert import convert_checkpoint
    before = _peak()
    t0 = time.perf_counter()
    convert_checkpoint(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), progress=False)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak": _peak(), "import_peak": before}))
    """
)


def _child_json(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _block_bytes(div: int, adaln: bool = True) -> int:
    hidden, ffn, temb = 56 * (96 // div), 14336 // div, 2688 // div
    return 2 * (4 * hidden * hidden + 3 * ffn * hidden + (18 * hidden * temb if adaln else 0))


def _layout(size_mib: int) -> tuple[int, int]:
    """(width divisor, number of transformer blocks) for a checkpoint of about size_mib."""
    target = size_mib * MiB
    div = 4
    while _block_bytes(div) + _block_bytes(div, adaln=False) > target and div < 32:
        div *= 2
    rest = target - _block_bytes(div, adaln=False)  # the token refiner block
    return div, max(1, round(rest / _block_bytes(div)))


def run_cp(src: Path, dst: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(["cp", "-r", str(src), str(dst)])
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"cp -r failed with status {proc.returncode}")
    # ru_maxrss (KiB on Linux) also counts the pre-exec image, i.e. this small process's own peak.
    return {"seconds": seconds, "peak": usage.ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="approximate checkpoint size (default 1024)")
    parser.add_argument("--tp", type=int, nargs="+", default=[8, 2], help="TP degrees to convert to (default 8 2)")
    parser.add_argument("--workdir", default=None, help="where to put the temporary files (default: system temp)")
    args = parser.parse_args(argv)
    if args.size_mib < 1:
        parser.error("--size-mib must be >= 1")
    if any(t not in (1, 2, 4, 8) for t in args.tp):
        parser.error("--tp values must be among 1, 2, 4, 8 (the synthetic model's divisible degrees)")

    root = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir))
    try:
        src = root / "transformer"
        div, n_blocks = _layout(args.size_mib)
        info = _child_json([GENERATE, str(src), str(args.size_mib * MiB), str(div), str(n_blocks)])
        total = info["bytes"]
        print(
            f"source: {total / MiB:.0f} MiB bf16 in {info['files']} files, {info['tensors']} tensors, "
            f"{n_blocks} blocks of hidden {info['hidden']} (MiniMax-H3 widths / {div})"
        )
        rows = []
        read = _child_json([READ, str(src)])
        if read["read"] < total:
            raise SystemExit("the raw read saw fewer bytes than the checkpoint holds")
        rows.append(("read (8 MiB blocks)", read["seconds"], 0, read["peak"], None))
        dst = root / "copy"
        cp = run_cp(src, dst)
        rows.append(("cp -r", cp["seconds"], _tree_bytes(dst), cp["peak"], None))
        shutil.rmtree(dst)
        for tp in args.tp:
            out = root / f"tp{tp}"
            conv = _child_json([CONVERT, str(src), str(out), str(tp)])
            note = f"+{(conv['peak'] - conv['import_peak']) / MiB:.0f} MiB over import"
            rows.append((f"convert --tp {tp}", conv["seconds"], _tree_bytes(out), conv["peak"], note))
            shutil.rmtree(out)

        header = (
            f"{'step':<20} {'time s':>8} {'MiB/s':>8} {'written MiB':>12} {'peak RSS MiB':>13} "
            f"{'/ cp':>6} {'/ read':>7}  notes"
        )
        print(header)
        print("-" * len(header))
        for name, seconds, written, peak, note in rows:
            ratio_cp = f"{seconds / cp['seconds']:.2f}" if name.startswith("convert") else ""
            ratio_read = f"{seconds / read['seconds']:.2f}" if name.startswith("convert") else ""
            line = (
                f"{name:<20} {seconds:>8.3f} {total / MiB / seconds:>8.0f} {written / MiB:>12.1f} "
                f"{peak / MiB:>13.0f} {ratio_cp:>6} {ratio_read:>7}  {note or ''}"
            )
            print(line.rstrip())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
