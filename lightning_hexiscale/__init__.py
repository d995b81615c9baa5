"""lightning-hexiscale: asymmetric parallel LLM training over heterogeneous GPU clusters.

The system of the HexiScale paper (MLSys 2025) as a PyTorch Lightning strategy.
"""

__version__ = "0.1.0"
