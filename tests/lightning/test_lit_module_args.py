"""LlamaLitModule's arguments are checked at construction: a ConfigError naming the argument, before
any Trainer or process. AdamW refused lr=-1 only in configure_optimizers, inside every rank after the
search and the launch (torch's ValueError), and took lr=nan, a negative warm-up or betas of 1.5
silently (the loss turned nan, or the schedule ran backwards)."""

import pytest
import torch

from lightning_hexiscale import LlamaLitModule
from lightning_hexiscale.errors import ConfigError


@pytest.mark.parametrize("kwargs, key", [
    ({"lr": -1.0}, "LlamaLitModule(lr)"),
    ({"lr": 0}, "LlamaLitModule(lr)"),
    ({"lr": float("nan")}, "LlamaLitModule(lr)"),
    ({"lr": float("inf")}, "LlamaLitModule(lr)"),
    ({"lr": "3e-3"}, "LlamaLitModule(lr)"),
    ({"lr": True}, "LlamaLitModule(lr)"),
    ({"eps": 0.0}, "LlamaLitModule(eps)"),
    ({"eps": float("nan")}, "LlamaLitModule(eps)"),
    ({"weight_decay": -0.1}, "LlamaLitModule(weight_decay)"),
    ({"weight_decay": float("inf")}, "LlamaLitModule(weight_decay)"),
    ({"betas": (0.9, 1.5)}, "LlamaLitModule(betas)"),
    ({"betas": (0.9,)}, "LlamaLitModule(betas)"),
    ({"betas": 0.9}, "LlamaLitModule(betas)"),
    ({"betas": (float("nan"), 0.95)}, "LlamaLitModule(betas)"),
    ({"warmup_steps": -5}, "LlamaLitModule(warmup_steps)"),
    ({"warmup_steps": 2.5}, "LlamaLitModule(warmup_steps)"),
    ({"warmup_steps": True}, "LlamaLitModule(warmup_steps)"),
    ({"init_seed": -1}, "LlamaLitModule(init_seed)"),
    ({"init_seed": 2**70}, "LlamaLitModule(init_seed)"),
    ({"dtype": torch.int64}, "LlamaLitModule(dtype)"),
    ({"dtype": "float32"}, "LlamaLitModule(dtype)"),
    ({"config": 7}, "LlamaLitModule(config)"),
    ({"config": None}, "LlamaLitModule(config)"),
])
def test_a_bad_argument_is_a_config_error_at_construction(kwargs, key):
    with pytest.raises(ConfigError) as e:
        LlamaLitModule(**kwargs)
    assert e.value.key == key and e.value.fix, e.value


def test_good_arguments_still_construct():
    import numpy as np

    m = LlamaLitModule("llama_tiny", lr=np.float64(1e-3), weight_decay=0, betas=[0.9, 0.99], warmup_steps=np.int64(3),
                       init_seed=2**63 - 1, dtype=torch.float64, eps=1e-6)
    assert m.betas == (0.9, 0.99) and m.lr == 1e-3
