"""The precision plugin the strategy clips through (lightning/step_adapter.py): the Trainer's plugin,
subclassed, same state, global-norm clipping while tied to the step adapter, picklable (spawn)."""

from __future__ import annotations

import pickle

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_hexiscale.lightning.step_adapter import GlobalNormClipping, global_norm_precision


class _Adapter:
    """Records the clipping calls the plugin makes (the step's own clipping is tested against one
    device in test_strategy_equivalence.py)."""

    def __init__(self):
        self.calls = []

    def clip(self, max_norm):
        self.calls.append(max_norm)
        return 0.0


@pytest.mark.parametrize("plugin", [Precision(), DoublePrecision(), HalfPrecision("bf16-true"),
                                    MixedPrecision("bf16-mixed", "cpu")], ids=lambda p: type(p).__name__)
def test_the_plugin_keeps_its_class_and_state(plugin):
    new = global_norm_precision(plugin)
    assert isinstance(new, type(plugin)) and isinstance(new, GlobalNormClipping)
    assert type(new).__name__ == f"GlobalNorm{type(plugin).__name__}" and vars(new) == vars(plugin)
    assert global_norm_precision(new) is new
    assert type(global_norm_precision(type(plugin).__new__(type(plugin)))) is type(new)  # one subclass per class
    back = pickle.loads(pickle.dumps(new))
    assert type(back) is type(new) and vars(back) == vars(plugin)


def test_norm_clipping_goes_to_the_step_only_while_tied():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)  # local norm 6
    opt = torch.optim.SGD([p], lr=0.1)
    plugin, engine = global_norm_precision(Precision()), _Adapter()
    plugin.adapter = engine
    plugin.clip_gradients(opt, 1.0, "norm")
    assert engine.calls == [1.0] and torch.equal(p.grad, torch.full((4,), 3.0))  # the engine's, not the local one
    assert "adapter" not in vars(pickle.loads(pickle.dumps(plugin)))
    plugin.adapter = None
    plugin.clip_gradients(opt, 1.0, "norm")  # untied: the base class's local clipping
    assert engine.calls == [1.0] and abs(float(p.grad.norm()) - 1.0) < 1e-5
