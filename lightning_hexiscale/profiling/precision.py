"""The run's precision in the profiler's measurements (``hexiscale profile / calibrate / check-estimate --precision``).

A measurement is only worth its cost-model constant when it runs in the dtype training will run in:
the profile's matmul FLOP/s, the calibration's training steps and check-estimate's plan all take
one Lightning precision string and map it here to

- the parameter dtype (what ``Trainer(precision=...)`` converts the module to, see the strategy),
- the autocast dtype (``bf16-mixed``: forward under ``torch.autocast`` in bfloat16), and
- the compute dtype = autocast dtype if any, else the parameter dtype (the dtype of the matmuls),
- the cost model's workload dtype (:data:`~lightning_hexiscale.config.recipe.PRECISION_DTYPES`).

The default is what training defaults to (:func:`~lightning_hexiscale.config.recipe.effective_precision`):
``32-true`` on CPU ranks (``--local N``, or a launch without CUDA), ``bf16-mixed`` on CUDA ranks.
``16-mixed`` is refused, as by the strategy and the recipe (no fp16 gradient scaler).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lightning_hexiscale.config.recipe import PRECISION_DTYPES, precision_dtype
from lightning_hexiscale.errors import ConfigError

PARAM_DTYPES = {"32-true": torch.float32, "64-true": torch.float64, "bf16-true": torch.bfloat16,
                "16-true": torch.float16, "bf16-mixed": torch.float32}
"""Precision -> parameter dtype (the precisions the runtime trains in)."""
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16}
"""Precision -> autocast dtype (mixed precision only)."""
PRECISIONS = tuple(PARAM_DTYPES)


@dataclass(frozen=True)
class MeasurePrecision:
    """One precision, resolved to torch dtypes (see the module doc)."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in: the autocast dtype, else the parameter dtype."""
        return self.autocast_dtype or self.param_dtype

    @property
    def cost_dtype(self) -> str:
        """The cost model's ``Workload.dtype`` (fp32, bf16, fp64, fp16)."""
        return PRECISION_DTYPES[self.name]

    def autocast(self, device: torch.device):
        """``torch.autocast`` in the autocast dtype on ``device``, or a no-op."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def default_precision(cuda: bool) -> str:
    """``bf16-mixed`` on CUDA ranks, ``32-true`` on CPU ranks (as the recipe chooses)."""
    return "bf16-mixed" if cuda else "32-true"


def check_precision(name: str, key: str = "--precision") -> str:
    """``name`` if the profiler can measure in it, else the ConfigError naming ``key`` that training
    gives for it (:func:`~lightning_hexiscale.config.recipe.precision_dtype`: 16-mixed is refused)."""
    precision_dtype(name, key=key)
    if name not in PARAM_DTYPES:
        raise ConfigError(key, name, f"must be one of {', '.join(PRECISIONS)}",
                          "use the trainer.precision of the run (e.g. 32-true or bf16-mixed)")
    return name


def resolve(name: str | None, device: torch.device) -> MeasurePrecision:
    """``name`` (None: :func:`default_precision` for ``device``) as dtypes."""
    name = check_precision(name if name is not None else default_precision(device.type == "cuda"))
    return MeasurePrecision(name, PARAM_DTYPES[name], AUTOCAST_DTYPES.get(name))
