"""lightning-hexiscale: asymmetric parallel LLM training over heterogeneous GPU clusters.

The system of the HexiScale paper (MLSys 2025) as a PyTorch Lightning strategy.
Importing the package registers ``Trainer(strategy="hexiscale")`` (see :mod:`.registration`)
without importing Lightning itself.
"""

from lightning_hexiscale.registration import install as _install_strategy

__version__ = "0.1.0"

_install_strategy()
