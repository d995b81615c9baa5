"""A model's sizes computed with numpy (a sweep's ``np.arange``, ``np.int64(128)``) are whole numbers:
taken as plain ints. They were refused as "must be a positive integer" although they are one; kept as
numpy's, a plan's ``meta.model_shape`` would not dump (yaml.safe_dump refuses numpy scalars)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig


def test_numpy_integers_are_taken_as_ints():
    base = LlamaConfig.load("llama_tiny")
    config = replace(base, hidden_size=np.int64(base.hidden_size), num_layers=np.int32(base.num_layers),
                     seq_len=np.uint16(base.seq_len))
    assert config == base
    assert all(type(getattr(config, k)) is int for k in ("hidden_size", "num_layers", "seq_len"))
    assert yaml.safe_load(yaml.safe_dump({"h": config.hidden_size})) == {"h": base.hidden_size}


@pytest.mark.parametrize("value", [np.float64(128.0), np.int64(0), np.bool_(True), True, 128.0])
def test_what_is_no_positive_integer_is_still_refused(value):
    with pytest.raises(ConfigError, match=r"model\.hidden_size = .*must be a positive integer"):
        replace(LlamaConfig.load("llama_tiny"), hidden_size=value)

