"""MiniMax-H3 text-to-video-and-audio generation with a pre-sharded transformer, in every rank of a torchrun job.

With the whole pipeline converted in one command (the transformer and the conditioner sharded, the conditioner
without the decoder layers MiniMax-H3 never reads, the rest copied) and loaded in one call (`preshard.load_pipeline`;
the conditioner runs TP over the transformer's TP ranks, replicated over the Ulysses groups):

    convert-checkpoint ./MiniMax-H3 ./h3-tp4 --tp 4
    torchrun --nproc-per-node 8 examples/minimax_h3_generate.py --converted ./h3-tp4 --ulysses 2 \
        --prompt "A cat sings on a rooftop at dusk." --steps 30 --output out/

With only the transformer converted (the rest of the pipeline comes from the diffusers repo):

    convert-checkpoint MiniMaxAI/MiniMax-H3 ./h3-tp4 --subfolder transformer --tp 4
    torchrun --nproc-per-node 8 examples/minimax_h3_generate.py --checkpoint ./h3-tp4 --ulysses 2 \
        --pipeline MiniMaxAI/MiniMax-H3 --prompt "A cat sings on a rooftop at dusk." --steps 30 --output out/

Offline, on tiny random components (rank 0 writes the tiny pipeline folder and converts it, in a moment, and every
rank loads that one converted pipeline, as load_sharded requires), checked against the unsharded pipeline:

    torchrun --nproc-per-node 4 examples/minimax_h3_generate.py --tiny --tp 2 --ulysses 2 --output out/

Every rank runs the whole pipeline (text encoder, scheduler loop, VAE) with the same prompt and the same seed:
the transformer checks on every forward that the ranks agree (a per-rank seed is refused in one line). Rank 0
writes the outputs: video.mp4 (or video-frames/*.png without imageio), audio.wav, latents.pt.
"""

from __future__ import annotations

import argparse
import os
import sys
import wave
from pathlib import Path

import torch


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--converted", help="the converted pipeline folder (convert-checkpoint PIPELINE OUT)")
    parser.add_argument("--checkpoint", help="the converted transformer (convert-checkpoint's output or a Hub repo)")
    parser.add_argument("--pipeline", help="the diffusers MiniMax-H3 repo or folder (modular_model_index.json)")
    parser.add_argument("--prompt", default="A cat sings on a rooftop at dusk.")
    parser.add_argument("--steps", type=int, default=30, help="denoising steps (model evaluations)")
    parser.add_argument("--seed", type=int, default=0, help="the same on every rank")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--num-frames", type=int)
    parser.add_argument("--ring", type=int, default=None, help="CP layout at load (default: as converted)")
    parser.add_argument("--ulysses", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu, cuda, xla, neuron (default: detected)")
    parser.add_argument("--dtype", default="bfloat16", help="the pipeline's dtype (the tiny mode runs float32)")
    parser.add_argument("--output", type=Path, default=Path("out"))
    parser.add_argument("--tiny", action="store_true", help="tiny random components, offline, checked")
    parser.add_argument("--tp", type=int, default=2, help="--tiny: the TP degree to convert for")
    parser.add_argument("--workdir", type=Path, default=None, help="--tiny: where rank 0 converts (every rank sees it)")
    args = parser.parse_args(argv)
    if not args.tiny and not args.converted and not (args.checkpoint and args.pipeline):
        parser.error("give --converted OUT, or --checkpoint and --pipeline, or --tiny")
    return args


def _tiny_pipeline_folder(args: argparse.Namespace, rank: int) -> Path:
    """Rank 0 writes the tiny pipeline folder and converts it in one command's call; every rank loads that one
    converted pipeline (the ranks of a load must agree on it: per-rank conversions differ in their manifests). A
    failure on rank 0 is raised on every rank."""
    import tempfile

    import torch.distributed as dist

    from preshard import convert_pipeline, init_rank_device
    from preshard.examples import minimax_h3_pipeline as tiny

    init_rank_device(args.device)  # the process group load_pipeline will use (torchrun's environment)
    message: list = [None, None]  # [converted folder, error]
    if rank == 0:
        try:
            root = args.workdir or Path(tempfile.mkdtemp(prefix="h3-tiny-"))
            source = tiny.save_pipeline_folder(root / "H3", tiny.build_transformer(), tiny.build_text_components())
            out = root / f"h3-tp{args.tp}"
            mesh = {"tp": args.tp, "ring": args.ring or 1, "ulysses": args.ulysses or 1}
            convert_pipeline(source, out, **mesh, overwrite=True, progress=False)  # a re-run into --workdir
            message[0] = str(out)
        except Exception as exc:  # noqa: BLE001 - told to every rank, so that none waits
            message[1] = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized():
        dist.broadcast_object_list(message, src=0)
    if message[1] is not None:
        raise SystemExit(f"rank 0 could not convert the tiny pipeline: {message[1]}")
    return Path(message[0])


def _real_pipeline(args: argparse.Namespace, transformer: torch.nn.Module):
    """The diffusers repo's t2va pipeline around the sharded transformer (every other component loaded whole)."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(args.pipeline, workflow="t2va")
    pipe.update_components(transformer=transformer)
    pipe.load_components(dtype=getattr(torch, args.dtype))  # all but the transformer, already there
    return pipe.to(transformer.device)


def _write_outputs(args: argparse.Namespace, out: dict) -> list[Path]:
    args.output.mkdir(parents=True, exist_ok=True)
    written = [args.output / "latents.pt"]
    torch.save({k: out[k].cpu() for k in ("latents", "audio_latents") if k in out}, written[0])
    if out.get("videos") is not None:
        frames = out["videos"][0]
        try:
            from diffusers.utils import export_to_video

            written.append(Path(export_to_video(frames, str(args.output / "video.mp4"), fps=24)))
        except (ImportError, AttributeError):  # neither imageio nor opencv: the frames as PNG files
            folder = args.output / "video-frames"
            folder.mkdir(exist_ok=True)
            for i, frame in enumerate(frames):
                frame.save(folder / f"{i:04d}.png")
            written.append(folder)
    if out.get("audio") is not None:
        audio = out["audio"][0].float().clamp(-1, 1).T.contiguous()  # (samples, channels)
        path = args.output / "audio.wav"
        with wave.open(str(path), "wb") as f:
            f.setnchannels(audio.shape[1])
            f.setsampwidth(2)
            f.setframerate(int(out["sampling_rate"]))
            f.writeframes((audio * 32767).round().to(torch.int16).numpy().tobytes())
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard import load_pipeline, load_sharded
    from preshard.examples import minimax_h3_pipeline as tiny

    rank = int(os.environ.get("RANK", "0"))
    mesh = {"ring": args.ring, "ulysses": args.ulysses, "device": args.device}
    if args.tiny:  # the processor is not in the tiny folder (saving one needs torchvision); no VAE: no decode
        processor = tiny.build_text_components()["processor"]
        folder = _tiny_pipeline_folder(args, rank)
        pipe = load_pipeline(folder, **mesh, components={"processor": processor}, blocks=tiny.pipeline_blocks())
        report = pipe.preshard_sharded_components["transformer"]
    elif args.converted:
        pipe = load_pipeline(args.converted, **mesh, dtype=args.dtype)
        report = pipe.preshard_sharded_components["transformer"]
    else:
        transformer = load_sharded(MiniMaxH3Transformer3DModel, args.checkpoint, **mesh, dtype=args.dtype)
        report = transformer.preshard_report
        pipe = _real_pipeline(args, transformer)
    print(f"[rank {rank}] {report.summary()}", flush=True)

    outputs = ("latents", "audio_latents") if args.tiny else ("latents", "audio_latents", "videos", "audio")
    size = {k: v for k, v in (("height", args.height), ("width", args.width), ("num_frames", args.num_frames)) if v}
    generator = torch.Generator().manual_seed(args.seed)  # the same seed on every rank
    out = tiny.generate(pipe, prompt=args.prompt, steps=args.steps, generator=generator, outputs=outputs, **size)
    if not args.tiny:
        out["sampling_rate"] = pipe.audio_sampling_rate

    status = 0
    if args.tiny:
        # The unsharded tiny pipeline, same components, same seed: every rank's latents must equal it.
        reference = tiny.generate(
            tiny.build_pipeline(tiny.build_transformer()), prompt=args.prompt, steps=args.steps,
            generator=torch.Generator().manual_seed(args.seed), outputs=outputs, **size,
        )  # fmt: skip
        diff = max((out[k] - reference[k]).abs().max().item() for k in outputs)
        print(f"[rank {rank}] max abs diff to the unsharded pipeline: {diff:.3g}", flush=True)
        status = 0 if diff <= 1e-5 else 1
    if rank == 0:
        for path in _write_outputs(args, out):
            print(f"wrote {path}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
