"""Where checkpoints come from besides the local disk: the Hugging Face Hub (`preshard.sources.hub`)."""
