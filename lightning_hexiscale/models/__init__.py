"""LLaMA model descriptions (pure data) and the plain single-device LLaMA (no parallelism inside).

:class:`Llama` needs torch and loads on first use, so that the planner can read model shapes cheaply.
"""

from lightning_hexiscale._lazy import lazy_exports
from lightning_hexiscale.models.config import LlamaConfig, RopeScaling, split_even

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "split_even"]

__getattr__, __dir__ = lazy_exports(__name__, {"Llama": "lightning_hexiscale.models.llama"})
