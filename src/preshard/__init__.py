"""preshard: pre-shard a diffusion-transformer checkpoint for a TP x CP mesh, load each rank's shard."""

from preshard.errors import PreshardError

__all__ = ["PreshardError"]
__version__ = "0.1.0"
