"""Test helpers shared by several test modules (a fake Hugging Face Hub, hand-made HF caches)."""
