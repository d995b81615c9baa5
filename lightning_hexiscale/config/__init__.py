"""Configuration: explicit units, the GPU catalog, the Hydra schemas and the :class:`Cluster`.

The lowest layer after :mod:`lightning_hexiscale.errors`: nothing here imports torch.
"""

from lightning_hexiscale.config.cluster import Calibration, Cluster, Device, Machine
from lightning_hexiscale.config.schema import compose, conf_dir, load_preset, preset_names

__all__ = ["Calibration", "Cluster", "Device", "Machine", "compose", "conf_dir", "load_preset", "preset_names"]
