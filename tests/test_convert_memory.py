"""Converting holds bands, not tensors: peak RSS stays below a bound set by the band budget and the writers'
staging buffers, which is less than the largest tensor, however large the tensors and the checkpoint are.

The design promises: memory = `BANDS_IN_FLIGHT` bands of `slicing.BAND_BYTES` (read ahead, being cut, being
written) + one staging buffer per data file (`writer.stage_bytes`) + a little bookkeeping. The test
converts a synthetic checkpoint (several files + index, written one file at a time) whose largest tensor
is 96 MiB, well above glibc's 32 MiB mmap threshold (so a tensor-sized buffer would be its own mapping,
counted in full while alive), with 8 MiB bands: the bound is then 4 x 8 + 4 x 8 + 24 = 88 MiB, under
one 96 MiB tensor (measured: 63 MiB). Every path runs: colwise, rowwise (column split, the largest), packed_colwise,
replicated, bf16 and fp32. Each conversion runs in a fresh child process that reports its own high-water
mark (VmHWM); a child that only imports what the converter imports (torch, preshard, torch's DCP for
.metadata) gives the baseline.

Negative control: the same conversion with bands larger than any tensor (so a band is a whole tensor)
must exceed the bound (measured: 263 MiB); if it did not, the measurement could not tell bands from
tensors. About 20 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from preshard.converter.pipeline import BANDS_IN_FLIGHT
from preshard.converter.writer import stage_bytes

MiB = 1024 * 1024
TP = 4
SMALL_BANDS = 8 * MiB
WHOLE_TENSOR_BANDS = 128 * MiB  # more than the largest tensor: one band per tensor
BOOKKEEPING = 24 * MiB  # Python objects, the manifest and records, thread stacks, page tables (measured: ~0)
BOUND = BANDS_IN_FLIGHT * SMALL_BANDS + TP * stage_bytes(TP) + BOOKKEEPING
LARGEST_BYTES = 96 * MiB
TIMEOUT_S = 120

F32, BF16 = torch.float32, torch.bfloat16
# name -> (shape, dtype, fill); 424 MiB in all, the largest (96 MiB) first in its file and rowwise.
FILES: list[dict[str, tuple[tuple[int, ...], torch.dtype, str]]] = [
    {"blocks.0.down.weight": ((6144, 4096), F32, "randn"), "blocks.0.norm.weight": ((4096,), F32, "randn")},
    {"blocks.0.up.weight": ((12288, 4096), BF16, "randn")},  # colwise, 96 MiB
    {"blocks.0.gateup.weight": ((8192, 4096), BF16, "zeros")},  # packed [gate; up], 64 MiB
    {"embed.weight": ((3072, 4096), F32, "randn")},  # replicated, 48 MiB
    {"blocks.1.down.weight": ((6144, 4096), F32, "empty"), "head.weight": ((1024, 4096), BF16, "randn")},
]
PLAN = {
    "name": "memory-test",
    "linear": [
        {"match": "blocks.*.up", "style": "colwise"},
        {"match": "blocks.*.down", "style": "rowwise"},
        {"match": "blocks.*.gateup", "style": "packed_colwise", "blocks": 2},
    ],
}

# The child reports VmHWM, its own address space's high-water mark. Not ru_maxrss: Linux carries the
# RSS high-water mark of the pre-exec address space into ru_maxrss across exec, so a child started
# from this (large) pytest process would report at least this process's peak.
_PEAK = textwrap.dedent(
    """
    import json
    def _report(**extra):
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        print("PEAK " + json.dumps({"peak": peak, **extra}))
    """
)
BASELINE = _PEAK + "import torch, preshard.converter.convert, preshard.format.dcp_metadata\n_report()\n"
CONVERT = _PEAK + textwrap.dedent(
    """
    import sys, torch
    from preshard.format import slicing
    from preshard.converter.convert import convert_checkpoint
    slicing.BAND_BYTES = int(sys.argv[5])
    manifest = convert_checkpoint(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), plan=sys.argv[4], progress=False)
    _report(tensors=len(manifest.tensors))
    """
)


def _fill(shape: tuple[int, ...], dtype: torch.dtype, fill: str, gen: torch.Generator) -> torch.Tensor:
    if fill == "randn":
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.zeros(shape, dtype=dtype) if fill == "zeros" else torch.empty(shape, dtype=dtype)


def _write_checkpoint(folder: Path) -> tuple[int, int]:
    """Write FILES one file at a time; return (total bytes, largest tensor bytes)."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0
    for i, spec in enumerate(FILES):
        name = f"model-{i + 1:05d}-of-{len(FILES):05d}.safetensors"
        tensors = {key: _fill(shape, dtype, fill, gen) for key, (shape, dtype, fill) in spec.items()}
        save_file(tensors, str(folder / name))
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
            largest = max(largest, t.numel() * t.element_size())
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total, largest


def _run_child(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PEAK "))
    return json.loads(line[len("PEAK ") :])


def test_peak_rss_is_bounded_by_the_bands_not_the_largest_tensor(tmp_path):
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc/self/status (VmHWM) to measure a child's own peak RSS")
    total, largest = _write_checkpoint(tmp_path / "src")
    assert largest == LARGEST_BYTES > 32 * MiB  # above glibc's largest mmap threshold
    assert BOUND < largest, "the bound must be below one tensor, or the test cannot tell bands from tensors"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    baseline = _run_child(BASELINE)["peak"]

    extra = {}
    for band in (SMALL_BANDS, WHOLE_TENSOR_BANDS):
        out = tmp_path / f"out-{band}"
        report = _run_child(CONVERT, str(tmp_path / "src"), str(out), str(TP), str(plan), str(band))
        assert report["tensors"] == sum(len(spec) for spec in FILES)
        assert sum(f.stat().st_size for f in out.glob("*.distcp")) >= total  # it did convert everything
        extra[band] = report["peak"] - baseline

    detail = (
        f"peak over the import baseline ({baseline / MiB:.0f} MiB): {extra[SMALL_BANDS] / MiB:.0f} MiB with "
        f"{SMALL_BANDS // MiB} MiB bands, {extra[WHOLE_TENSOR_BANDS] / MiB:.0f} MiB with whole-tensor bands; bound "
        f"{BOUND / MiB:.0f} MiB; largest tensor {largest / MiB:.0f} MiB, checkpoint {total / MiB:.0f} MiB"
    )
    print(detail)
    assert extra[SMALL_BANDS] < BOUND, detail
    assert extra[WHOLE_TENSOR_BANDS] > BOUND, "negative control: " + detail
