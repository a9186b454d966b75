"""A tiny MiniMax-H3 generation pipeline, built offline: diffusers' `MiniMaxH3ModularPipeline` (the `t2va`
workflow; diffusers 0.42.1 has no other MiniMax-H3 pipeline) with seeded random components.

The real conditioner is Qwen3-VL read at hidden state 50, so the tiny one is a Qwen3-VL of 51 decoder layers
40 wide; the tokenizer is a byte-level BPE over a few dozen characters (no download); the two schedulers are
the pipeline's own (`shift` 12 for video, 3 for audio). Without a VAE the pipeline falls back to the released
model's latent geometry (24 video and 32 audio channels, 16x spatial compression), so the transformer is the
tiny MiniMax-H3 of `preshard.examples.minimax_h3` with those channel counts. The decode step is left out:
what sharding can change is the denoised latents, and the tiny random VAEs would only decode them to noise.

Used by the pipeline tests and by `examples/minimax_h3_generate.py --tiny`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from preshard.examples.minimax_h3 import build_model, tiny_config

if TYPE_CHECKING:
    from diffusers.modular_pipelines import ModularPipeline

TEXT_DIM = 40  # the tiny conditioner's width, the transformer's text_dim
TEXT_LAYERS = 51  # MiniMax-H3 reads hidden_states[50]
HEIGHT = WIDTH = 32  # the smallest canvas (a multiple of 32): 2 x 2 latents, one row per latent frame
NUM_FRAMES = 124  # the shortest request (5 s at 24 fps, as 17 * 7 + 5): 37 latent frames, 414 audio rows
_CHARS = "abcdefghijklmnopqrstuvwxyzĠ.,!?'"
_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def transformer_config() -> dict[str, Any]:
    """The tiny MiniMax-H3 config with the channel counts the pipeline uses without a VAE."""
    return tiny_config(in_channels=24, audio_in_channels=32, text_dim=TEXT_DIM)


def build_transformer(seed: int = 0, dtype: str = "float32") -> torch.nn.Module:
    """The tiny MiniMax-H3 transformer for the pipeline, with seeded random weights."""
    return build_model(transformer_config(), seed=seed, dtype=dtype)


def _processor_class():
    from transformers import Qwen3VLProcessor

    class TinyQwen3VLProcessor(Qwen3VLProcessor):
        """Qwen3-VL's processor without a video processor (which needs torchvision): `t2va` never uses one."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return TinyQwen3VLProcessor


def build_text_components(seed: int = 0, layers: int = TEXT_LAYERS) -> dict[str, Any]:
    """Tokenizer, processor and a seeded random Qwen3-VL conditioner of `layers` decoder layers, built in memory."""
    from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    vocab = {c: i for i, c in enumerate(dict.fromkeys(_CHARS))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[], additional_special_tokens=_SPECIAL)
    processor = _processor_class()(image_processor=ImageProcessor(), tokenizer=tokenizer, video_processor=None)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in _SPECIAL}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, head_dim=20,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM, patch_size=4,
            spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    return {"text_encoder": text_encoder, "tokenizer": tokenizer, "processor": processor}


def build_pipeline(transformer: torch.nn.Module, components: dict[str, Any] | None = None) -> ModularPipeline:
    """`MiniMaxH3ModularPipeline` (t2va, no decode step) around `transformer`, with the tiny text components.

    Args:
        transformer: a MiniMax-H3 transformer (sharded or not) with `transformer_config()`'s channels.
        components: tokenizer, processor and text encoder (default: `build_text_components()`).

    Returns:
        The pipeline; call it through `generate`.
    """
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks

    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    pipe = blocks.init_pipeline()
    pipe.update_components(
        **(components if components is not None else build_text_components()),
        transformer=transformer,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    return pipe


def generate(
    pipe: ModularPipeline,
    *,
    prompt: str = "a cat sings.",
    steps: int = 2,
    seed: int = 0,
    generator: torch.Generator | None = None,
    height: int = HEIGHT,
    width: int = WIDTH,
    num_frames: int = NUM_FRAMES,
    outputs: tuple[str, ...] = ("latents", "audio_latents"),
) -> dict[str, Any]:
    """Run `steps` denoising steps (MiniMax-H3's scheduler evaluates the model `num_inference_steps - 1` times).

    Returns:
        The requested outputs of the pipeline state (by default the video and audio latents).
    """
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    return pipe(
        prompt=prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=steps + 1,
        generator=generator, output=list(outputs),
    )  # fmt: skip


def pipeline_blocks():
    """MiniMax-H3's modular blocks without the decode step (the tiny pipeline has no VAE)."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks

    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    return blocks


def save_pipeline_folder(folder: str | Path, transformer: torch.nn.Module, components: dict[str, Any]) -> Path:
    """The tiny pipeline as a modular pipeline folder (`modular_model_index.json` and a folder per component), as
    MiniMax-H3 ships. The processor is left out (saving it needs a video processor, which needs torchvision): pass
    it in memory when loading.

    Returns:
        The folder.
    """
    pipe = build_pipeline(transformer, {k: v for k, v in components.items() if k != "processor"})
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    return Path(folder)


# MiniMax-H3's conditioner as Qwen3-VL-32B's shapes (64 decoder layers 5120 wide, 64 query and 8 key/value heads of
# 128, ffn 25600, a 27-block vision tower 1152 wide): 33.4 B parameters, as the issue counts them. Shapes only, for
# `preshard plan` over headers: written from Qwen3-VL-32B's published config, untested against H3's own files.
FULL_CONDITIONER = dict(
    text_config=dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[8, 16, 24],
    ),
)  # fmt: skip


def write_full_size_pipeline(folder: str | Path) -> Path:
    """MiniMax-H3's pipeline folder at full size as safetensors headers over holes (no data, no disk): the
    transformer (the class defaults) and the conditioner (`FULL_CONDITIONER`), bf16, with the modular index naming
    them and the two schedulers. For `preshard plan PIPELINE` and the memory table.

    Returns:
        The folder.
    """
    import json

    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from preshard.examples.synthetic import minimax_h3_tensors, write_safetensors_checkpoint

    folder = Path(folder)
    tensors, config = minimax_h3_tensors()
    write_safetensors_checkpoint(folder / "transformer", tensors, config, data="hole")
    conditioner = Qwen3VLConfig(**FULL_CONDITIONER)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(conditioner)
    specs = {name: ("BF16", tuple(t.shape)) for name, t in model.state_dict().items()}
    write_safetensors_checkpoint(folder / "text_encoder", specs, {}, data="hole")
    conditioner.architectures = ["Qwen3VLForConditionalGeneration"]  # as the real config.json names it
    conditioner.save_pretrained(folder / "text_encoder")  # transformers' config.json over the placeholder
    for name, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        (folder / name).mkdir(exist_ok=True)
        scheduler = {"_class_name": "MiniMaxH3Scheduler", "shift": shift}
        (folder / name / "scheduler_config.json").write_text(json.dumps(scheduler))
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_blocks_class_name": "MiniMaxH3Blocks",
        "transformer": ["diffusers", "MiniMaxH3Transformer3DModel", {"subfolder": "transformer"}],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration", {"subfolder": "text_encoder"}],
        "scheduler": ["diffusers", "MiniMaxH3Scheduler", {"subfolder": "scheduler"}],
        "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler", {"subfolder": "audio_scheduler"}],
    }
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2))
    return folder
