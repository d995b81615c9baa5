"""A plan made for another model than the module's is refused before any process starts, in the
words of the Python call (``HexiScaleStrategy(plan)``, a fix that names the module class and
``HexiScaleStrategy()``), not by every rank after the launch with a command-line fix. A module the
strategy cannot see the model of before ``configure_model`` is left to the ranks, as before."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from strategy_helpers import plan_of

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan.model_check import model_shape


def _strategy():
    """A strategy with a plan made for llama_demo (its shape recorded, as ``hexiscale plan --out``
    writes it), attached to a Trainer so its settings are resolved as in ``fit``."""
    demo = LlamaConfig.load("llama_demo")
    plan = plan_of([(4, 2, [([0], (0, demo.num_layers))]), (2, 1, [([1], (0, demo.num_layers))])],
                   num_layers=demo.num_layers, model="llama_demo", model_shape=model_shape(demo))
    strategy = HexiScaleStrategy(plan=plan)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=plan.world_size, max_steps=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return strategy


def _check(strategy, module):
    strategy.check_before_launch(True, {"model": module, "train_dataloaders": None, "ckpt_path": None})


def test_a_plan_for_another_model_is_refused_before_the_launch():
    with pytest.raises(PlanError) as caught:
        _check(_strategy(), LlamaLitModule("llama_tiny"))
    text = str(caught.value)
    assert text.startswith("HexiScaleStrategy(plan)"), text
    assert "LlamaLitModule('llama_demo')" in text and "HexiScaleStrategy()" in text, text


def test_a_module_that_built_its_model_is_checked_too():
    module = LlamaLitModule("llama_tiny")
    module.configure_model()
    with pytest.raises(PlanError, match=r"^HexiScaleStrategy\(plan\)"):
        _check(_strategy(), module)


def test_the_model_the_plan_was_made_for_passes():
    _check(_strategy(), LlamaLitModule("llama_demo"))


def test_a_module_whose_model_is_unknown_before_setup_is_left_to_the_ranks():
    """No model to compare with: nothing is refused here (each rank checks once it has built one).
    (A module with no Llama and no hook that could build one is refused: test_module_without_llama.)"""
    class BuildsLater(pl.LightningModule):
        def configure_model(self):  # builds its Llama on each rank, from a shape unknown here
            raise AssertionError("not called before the launch")

    _check(_strategy(), BuildsLater())


def test_a_tp_degree_the_model_cannot_take_is_refused_before_the_launch():
    """TP 3 over llama_tiny's 2 KV heads: each rank refused it after the launch (PlanError after the
    processes started), though the module's model and the plan are both known before it."""
    tiny = LlamaConfig.load("llama_tiny")
    plan = plan_of([(4, 2, [([0, 1, 2], (0, tiny.num_layers))])], num_layers=tiny.num_layers)
    strategy = HexiScaleStrategy(plan=plan)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=3, max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(PlanError, match=r"^plan\.pipelines\[0\]\.stages\[0\]\.devices .*Fix:"):
        _check(strategy, LlamaLitModule("llama_tiny"))
    ok = plan_of([(4, 2, [([0, 1], (0, tiny.num_layers))])], num_layers=tiny.num_layers)
    strategy = HexiScaleStrategy(plan=ok)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False)
    _check(strategy, LlamaLitModule("llama_tiny"))
