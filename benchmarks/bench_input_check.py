"""What the cross-rank input check costs, against a forward of MiniMax-H3 at its real width, in one run.

    python benchmarks/bench_input_check.py [--layers 1] [--tp 2] [--canvas 128x128] [--reps 5] [--dtype float32]
        [--workdir DIR]

MiniMax-H3 at its real width (hidden 5376, 56 heads, ffn 14336) with `--layers` blocks and one refiner block,
weights all zero (a sparse synthetic checkpoint: the matmuls cost the same), converted for `--tp` ranks in a
temp dir that is deleted at the end, loaded as stored (bf16, the fp32 modules in fp32) or cast to `--dtype`
(float32 runs faster on a CPU without bf16 matmul units, so the check weighs more against it, but needs twice
the memory); `--tp` gloo ranks on this machine's CPU, one thread each. The inputs are the packed sequence of a
5 s (124 frame) t2va request on the `--canvas` (video, audio and text rows as the pipeline builds them).
Alternating repetitions of the forward with the check on and off (in ABBA order: the first forward of a pair runs
slower on a loaded machine), and of the check alone (the model's forward pre-hook: fingerprints, one all-gather,
the comparison); medians, and the minimum of each forward. The check alone is also timed on the inputs of
the released canvas (768x1344), whose forward is far beyond a CPU.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

FRAMES = 124  # 5 s at 24 fps: 37 latent frames, 207 audio latents per channel
LATENT_FRAMES, AUDIO_LATENTS = 37, 207
TEXT_ROWS = 128


def _inputs(canvas: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The transformer's inputs for a t2va request, laid out by the pipeline's own blocks: [text | audio | video]
    rows (16x spatial compression, 2x2 patches, stereo audio), float64 positions as on the CPU."""
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as blocks

    height, width = canvas
    text_tags = torch.full((TEXT_ROWS,), 1, dtype=torch.long)
    position_ids, token_tags, video, audio, text, _, _ = blocks.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, LATENT_FRAMES, height // 16, width // 16, AUDIO_LATENTS, (1, 2, 2), 2, 2, 0
    )
    timestep, timestep_indices = blocks.MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, 0, 0, TEXT_ROWS, 0.5, 0.5, 0.999, 1.0
    )
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, video.numel(), 96, generator=g),
        "audio_hidden_states": torch.randn(1, audio.numel(), 32, generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT_ROWS, 5120, generator=g).to(torch.bfloat16),  # as Qwen3-VL emits
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": video,
        "audio_indices": audio,
        "text_indices": text,
    }


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def _rank(rank: int, world: int, port: int, checkpoint: str, args: argparse.Namespace, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    net = load_sharded(MiniMaxH3Transformer3DModel, checkpoint, device="cpu", dtype=args.dtype)
    check = net.preshard_input_check
    inputs = _inputs(args.canvas)
    real = _inputs((768, 1344))
    times: dict[str, list[float]] = {"on": [], "off": [], "check": [], "check_real": []}

    def forward() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            net(**inputs, return_dict=False)
        return time.perf_counter() - start

    def check_alone(kwargs: dict, n: int = 20) -> float:
        start = time.perf_counter()
        for _ in range(n):
            check(net, (), kwargs)
        return (time.perf_counter() - start) / n

    check.mode = "check"
    forward()  # warm up
    for i in range(args.reps):
        for mode in ("check", "off") if i % 2 == 0 else ("off", "check"):  # ABBA: no order effect
            check.mode = mode
            times["on" if mode == "check" else "off"].append(forward())
        check.mode = "check"
        times["check"].append(check_alone(inputs))
        times["check_real"].append(check_alone(real))
    if rank == 0:
        nbytes = {
            name: sum(t.numel() * t.element_size() for t in d.values())
            for name, d in (("small", inputs), ("real", real))
        }
        torch.save({"times": times, "nbytes": nbytes}, out)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--canvas", default="128x128", help="HEIGHTxWIDTH in pixels, multiples of 32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="cast the weights at load (default: as stored, bf16 + fp32)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.canvas = tuple(int(v) for v in args.canvas.split("x"))
    print("command: python benchmarks/bench_input_check.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")

    import torch.multiprocessing as mp

    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint

    with tempfile.TemporaryDirectory(prefix="preshard-bench-check-", dir=args.workdir) as tmp:
        root = Path(tmp)
        tensors, config = minimax_h3_tensors(num_layers=args.layers, num_refiner_layers=1)
        write_safetensors_checkpoint(root / "src", tensors, config, data="hole")
        convert_checkpoint(root / "src", root / "ckpt", tp=args.tp, progress=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = root / "times.pt"
        mp.start_processes(
            _rank, args=(args.tp, port, str(root / "ckpt"), args, str(out)), nprocs=args.tp,
            start_method="spawn",
        )  # fmt: skip
        result = torch.load(out)
    times, nbytes = result["times"], result["nbytes"]
    rows = _inputs(args.canvas)["token_tags"].numel()
    on, off, check = (_median_ms(times[k]) for k in ("on", "off", "check"))
    print(
        f"MiniMax-H3 real width, {args.layers} block(s) + 1 refiner block, {args.dtype or 'stored'} weights, "
        f"tp={args.tp} gloo "
        "ranks, 1 thread each"
    )
    print(f"inputs: {args.canvas[0]}x{args.canvas[1]} canvas, {FRAMES} frames: {rows} rows "
          f"({nbytes['small'] / 2**20:.2f} MiB of tensors)")  # fmt: skip
    print(f"{'forward, check on':<34}{on:>12.1f} ms")
    print(f"{'forward, check off':<34}{off:>12.1f} ms")
    print(f"{'the check alone':<34}{check:>12.3f} ms   {100 * check / off:.3f} % of the forward")
    print(f"{'on / off (medians)':<34}{on / off:>12.4f}")
    print(f"{'on / off (minimums)':<34}{min(times['on']) / min(times['off']):>12.4f}   ({args.reps} of each)")
    real = _median_ms(times["check_real"])
    print(f"{'the check alone, 768x1344 inputs':<34}{real:>12.3f} ms   ({nbytes['real'] / 2**20:.2f} MiB of tensors)")
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
