"""Where Lightning meets the runtime: :class:`HexiScaleStrategy`, plan resolution, the
:class:`PipelineModel` a LightningModule sees, ZeRO optimizer hooks, strategy registration, the
example module, and :mod:`.internals` (the only module that touches Lightning's private attributes).

Importing this package does not import Lightning; the strategy loads on first use.
"""

from lightning_hexiscale._lazy import lazy_exports

__all__ = ["HexiScaleStrategy", "LlamaLitModule", "PipelineModel"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "HexiScaleStrategy": "lightning_hexiscale.lightning.strategy",
    "LlamaLitModule": "lightning_hexiscale.lightning.example",
    "PipelineModel": "lightning_hexiscale.lightning.pipeline_model",
})
