"""A small pipeline folder and a snapshot of a tree, for the tests and the hostile soak of untrusted pipeline folders
(`tests/test_pipeline_untrusted.py`, `scripts/hostile_soak_pipelines.py`)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

INDEX = {
    "_class_name": "WanPipeline",
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}


def safetensors_bytes(n: int = 4) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(4 * n)


def write_pipeline(folder: Path, index: dict | None = None, extra: dict[str, dict[str, bytes]] | None = None) -> Path:
    """A pipeline folder: the index, a scheduler and a VAE (copied whole), README.md; `extra` adds components."""
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps(index or INDEX))
    (folder / "README.md").write_text("a pipeline\n")
    files = {
        "scheduler": {"scheduler_config.json": b'{"_class_name": "FlowMatchEulerDiscreteScheduler"}'},
        "vae": {"config.json": b'{"_class_name": "AutoencoderKLWan"}',
                "diffusion_pytorch_model.safetensors": safetensors_bytes()},
        **(extra or {}),
    }  # fmt: skip
    for component, names in files.items():
        for name, data in names.items():
            (folder / component / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / component / name).write_bytes(data)
    return folder


def tree(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under `root` (links as links, never followed): what must not change outside the output."""
    out: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", path.read_bytes())
    return out
