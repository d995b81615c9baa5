"""LLaMA model descriptions (pure data) and the plain single-device LLaMA (no parallelism inside)."""

from lightning_hexiscale.models.config import LlamaConfig, split_even

__all__ = ["LlamaConfig", "split_even"]
