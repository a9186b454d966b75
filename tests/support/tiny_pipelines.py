"""Tiny diffusers pipelines built offline for the pipeline tests: one `Case` per pipeline, so that adding a
pipeline is one more entry in CASES.

A case builds its seeded transformer and the pipeline's other components (tokenizers from small in-memory
vocabularies, random text encoders from transformers configs, the pipeline's own schedulers), and runs a
generation of two denoising steps from a given generator, returning the latents (every output a mesh can
change). `variants` are further calls of the same pipeline that exercise what it does to its transformer:
batches, classifier-free guidance, callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# (tp, ring, ulysses) meshes each case runs, by world size: TP, CP (both kinds) and TP x CP.
MESHES = {2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2), (2, 2, 1)]}


@dataclass(frozen=True)
class Case:
    name: str
    transformer: Callable[[], nn.Module]  # seeded random weights, float32, eval mode
    components: Callable[[], dict[str, Any]]  # everything but the transformer, seeded
    pipeline: Callable[[nn.Module, dict[str, Any]], Any]  # (transformer, components) -> pipeline
    run: Callable[..., dict[str, torch.Tensor]]  # (pipe, generator, **variant) -> latents by name
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> extra run() keywords

    def save_transformer(self, folder: Path) -> Path:
        """The transformer in the diffusers layout (config.json + one safetensors file), to convert."""
        from tiny_diffusers import save

        return save(self.transformer(), folder)


# ---------------------------------------------------------------- MiniMax-H3 (modular, t2va)


def _h3_run(pipe, generator: torch.Generator, **variant) -> dict[str, torch.Tensor]:
    from preshard.examples.minimax_h3_pipeline import generate

    return generate(pipe, generator=generator, **variant)


def _h3_case() -> Case:
    from preshard.examples import minimax_h3_pipeline as h3

    return Case(
        name="minimax-h3",
        transformer=h3.build_transformer,
        components=h3.build_text_components,
        pipeline=lambda transformer, components: h3.build_pipeline(transformer, components),
        run=_h3_run,
        variants={"prompt": {"prompt": "an owl hoots, softly!"}},
    )


# ---------------------------------------------------------------- Flux


_CHARS = "abcdefghijklmnopqrstuvwxyz"
FLUX_TEXT_LEN = 8  # text tokens (T5 max_sequence_length, CLIP model_max_length): divides every CP size here
FLUX_SIZE = 8  # pixels; the tiny VAE has no downsampling, so 8 x 8 latents pack into 16 image tokens


def _flux_components() -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast, T5Config, T5EncoderModel, T5TokenizerFast

    clip_vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        clip_vocab[c] = len(clip_vocab)
        clip_vocab[c + "</w>"] = len(clip_vocab)
    tokenizer = CLIPTokenizerFast(vocab=clip_vocab, merges=[], model_max_length=FLUX_TEXT_LEN)
    t5_vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)] + [(c, -2.0) for c in _CHARS]
    tokenizer_2 = T5TokenizerFast(vocab=t5_vocab, extra_ids=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_vocab), hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=FLUX_TEXT_LEN, bos_token_id=0, eos_token_id=1,
                pad_token_id=1, projection_dim=24,
            )
        ).eval()  # fmt: skip
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                relative_attention_num_buckets=8, decoder_start_token_id=0,
            )
        ).eval()  # fmt: skip
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D"],
            block_out_channels=[4], layers_per_block=1, latent_channels=1, norm_num_groups=2, shift_factor=0.0,
            scaling_factor=1.0,
        ).eval()  # fmt: skip
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": vae,
        "text_encoder": clip,
        "tokenizer": tokenizer,
        "text_encoder_2": t5,
        "tokenizer_2": tokenizer_2,
    }


def _flux_transformer() -> nn.Module:
    from tiny_diffusers import build

    return build("flux")[0]  # 4 input channels = 1 latent channel packed 2 x 2, pooled 24, joint 32


def _flux_pipeline(transformer: nn.Module, components: dict[str, Any]):
    from diffusers import FluxPipeline

    return FluxPipeline(transformer=transformer, **components)


def _halve_latents_at_first_step(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    """A callback that changes the latents the next step sees (so a sharded run must follow it)."""
    return {"latents": callback_kwargs["latents"] * 0.5} if step == 0 else {}


def _flux_run(pipe, generator: torch.Generator, *, output_type: str = "latent", **variant) -> dict[str, torch.Tensor]:
    out = pipe(
        prompt=variant.pop("prompt", "a cat"), height=FLUX_SIZE, width=FLUX_SIZE, num_inference_steps=2,
        max_sequence_length=FLUX_TEXT_LEN, generator=generator, output_type=output_type, **variant,
    )  # fmt: skip
    return {"latents" if output_type == "latent" else "images": out.images}


def _flux_case() -> Case:
    return Case(
        name="flux",
        transformer=_flux_transformer,
        components=_flux_components,
        pipeline=_flux_pipeline,
        run=_flux_run,
        variants={
            "batch": {"prompt": ["a cat", "a dog"], "num_images_per_prompt": 2},  # batch 4
            "cfg": {"negative_prompt": "a dog", "true_cfg_scale": 2.0},  # two transformer calls per step
            "callback": {"callback_on_step_end": _halve_latents_at_first_step},
            "images": {"output_type": "pt"},  # decoded by the (unsharded) VAE
        },
    )


# ---------------------------------------------------------------- Wan (text to video)


WAN_TEXT_LEN = 8  # UMT5 max_sequence_length: the cross-attention's keys (not split under CP)
WAN_SIZE, WAN_FRAMES = 32, 5  # 8x spatial, 4x temporal compression: 2 latent frames of 4 x 4, 8 video tokens


def _wan_components() -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)] + [(c, -2.0) for c in _CHARS]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                relative_attention_num_buckets=8, decoder_start_token_id=0,
            )
        ).eval()  # fmt: skip
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        ).eval()  # fmt: skip
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
    }


def _wan_transformer() -> nn.Module:
    from tiny_diffusers import build

    return build("wan")[0]  # 4 latent channels, text_dim 16 (the UMT5 width), 4 heads of 8


def _wan_pipeline(transformer: nn.Module, components: dict[str, Any]):
    from diffusers import WanPipeline

    return WanPipeline(transformer=transformer, **components)


def _wan_run(pipe, generator: torch.Generator, *, output_type: str = "latent", **variant) -> dict[str, torch.Tensor]:
    options = {"prompt": "a cat", "guidance_scale": 1.0, **variant}  # CFG only in its variant: 2 calls per run
    out = pipe(
        height=WAN_SIZE, width=WAN_SIZE, num_frames=WAN_FRAMES, num_inference_steps=2,
        max_sequence_length=WAN_TEXT_LEN, generator=generator, output_type=output_type, **options,
    )  # fmt: skip
    return {"latents" if output_type == "latent" else "videos": out.frames}


def _wan_case() -> Case:
    return Case(
        name="wan",
        transformer=_wan_transformer,
        components=_wan_components,
        pipeline=_wan_pipeline,
        run=_wan_run,
        variants={
            "batch": {"prompt": ["a cat", "a dog"], "num_videos_per_prompt": 2},  # batch 4
            "cfg": {"negative_prompt": "a dog", "guidance_scale": 5.0},  # two transformer calls per step
            "callback": {"callback_on_step_end": _halve_latents_at_first_step},
        },  # decoding (the unsharded VAE on equal latents) is Flux's variant: Wan's 3D VAE would only add seconds
    )


CASES: dict[str, Callable[[], Case]] = {"minimax-h3": _h3_case, "flux": _flux_case, "wan": _wan_case}
