"""lightning-hexiscale: asymmetric parallel LLM training over heterogeneous GPU clusters.

The system of the HexiScale paper (MLSys 2025) as a PyTorch Lightning strategy. The package is
layered; each folder imports only the ones above it in this list:

- :mod:`.config`    units, GPU catalog, Hydra schemas, :class:`Cluster`
- :mod:`.models`    :class:`LlamaConfig` (pure data) and the plain single-device :class:`Llama`
- :mod:`.planner`   plans, the Appendix B cost model, the §4 search, baselines
- :mod:`.runtime`   a Plan + a rank -> process groups, this rank's stage, the schedule, gradient sync
- :mod:`.data`      per-pipeline samplers, token datasets and tokenisation, Hugging Face weights in and out
- :mod:`.profiling` measure a cluster, calibrate and check the cost model
- :mod:`.lightning` ``HexiScaleStrategy`` and the rest of the Lightning integration
- :mod:`.cli`       the ``hexiscale`` command

Importing the package registers ``Trainer(strategy="hexiscale")`` without importing Lightning
itself (:mod:`.lightning.registration`); the names below that need torch or Lightning load on first use.
"""

from lightning_hexiscale._lazy import lazy_exports
from lightning_hexiscale.lightning.registration import install as _install_strategy

__version__ = "0.1.0"

__all__ = ["Cluster", "ConfigError", "HexiScaleError", "HexiScaleStrategy", "Llama", "LlamaConfig", "LlamaLitModule",
           "Plan", "attach_weights", "estimate", "load_hf", "load_llama", "load_llama_state_dict", "search"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Cluster": "lightning_hexiscale.config.cluster",
    "ConfigError": "lightning_hexiscale.errors",
    "HexiScaleError": "lightning_hexiscale.errors",
    "HexiScaleStrategy": "lightning_hexiscale.lightning.strategy",
    "Llama": "lightning_hexiscale.models.llama",
    "LlamaConfig": "lightning_hexiscale.models.config",
    "LlamaLitModule": "lightning_hexiscale.lightning.example",
    "Plan": "lightning_hexiscale.planner.plan",
    "attach_weights": "lightning_hexiscale.data.weights",
    "estimate": "lightning_hexiscale.planner.cost.estimate",
    "load_hf": "lightning_hexiscale.data.weights",
    "load_llama": "lightning_hexiscale.runtime.checkpoint",
    "load_llama_state_dict": "lightning_hexiscale.runtime.checkpoint",
    "search": "lightning_hexiscale.planner.search.entry",
})

_install_strategy()
