"""A LightningModule that holds no Llama and has no hook that could build one is refused before any
process starts, in the words of the contract (it was each rank's error after the launch and, with
``cluster=auto``, after the discovery). Modules that may build it later (configure_model, the older
configure_sharded_model, setup, a ``llama()`` method) or hold one are left to the ranks."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.plan_resolution import check_module_before_launch, find_llama
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.llama import Llama


class NoLlama(pl.LightningModule):
    """An ordinary one-device module: a linear layer, no Llama anywhere."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float()[:, :4]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OtherModel(NoLlama):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(4, 4)


@pytest.mark.parametrize("cluster", ["cpu2", "auto"])
@pytest.mark.parametrize("kind, shown", [(NoLlama, "NoneType"), (OtherModel, "Linear")])
def test_a_module_without_a_llama_is_refused_before_launch(kind, shown, cluster, monkeypatch):
    trainer = pl.Trainer(strategy=HexiScaleStrategy(cluster=cluster, start_method="fork", timeout=PG_TIMEOUT),
                         accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    def no_fork():
        raise AssertionError("a rank was started: the module was not checked before the launch")

    monkeypatch.setattr(os, "fork", no_fork)
    with pytest.raises(ConfigError, match=rf"{kind.__name__}.model = '{shown}': the hexiscale strategy turns the "
                                          r"module's Llama into .*Fix: build it in configure_model: self.model = Llama"):
        trainer.fit(kind(), loader(8, 4))


def _with_hook(name):
    def hook(self, *args):
        self.model = Llama(TINY)
    return type(f"Builds{name}", (NoLlama,), {name: hook})


@pytest.mark.parametrize("module", [
    _with_hook("configure_model")(), _with_hook("configure_sharded_model")(), _with_hook("setup")(),
    type("HandsOut", (NoLlama,), {"llama": lambda self: Llama(TINY)})(),
])
def test_a_module_that_may_build_its_llama_later_is_left_to_the_ranks(module):
    check_module_before_launch(None, module)


def test_a_module_holding_a_llama_passes():
    module = NoLlama()
    module.model = Llama(TINY)
    check_module_before_launch(None, module)


class HoldsItElsewhere(NoLlama):
    def __init__(self):
        super().__init__()
        self.net = Llama(TINY)


def test_a_llama_under_another_name_is_pointed_at():
    # the fix said "build it in configure_model" to a module that had built it, as self.net
    with pytest.raises(ConfigError, match=r"HoldsItElsewhere.model = 'NoneType': .*Fix: the module holds its Llama "
                                          r"as self.net: name it self.model, or return it from a llama\(\) method"):
        check_module_before_launch(None, HoldsItElsewhere())


def _hf_llama(directory=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    if directory is not None:
        model.save_pretrained(directory)
        model = transformers.LlamaForCausalLM.from_pretrained(directory)
    return model


def test_a_hugging_face_llama_is_pointed_at_the_same_weights_as_a_llama(tmp_path):
    # the fix said "build it in configure_model: self.model = Llama(config)" to a module that had one
    module = NoLlama()
    module.model = _hf_llama(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"NoLlama.model = 'LlamaForCausalLM': .*Fix: self.model is transformers' "
                                          r"LlamaForCausalLM; the strategy trains lightning_hexiscale's Llama: start "
                                          rf"from the same weights with LlamaLitModule\('hf:{tmp_path / 'hf'}'\)"):
        check_module_before_launch(None, module)


def test_a_hugging_face_model_built_in_configure_model_is_named_by_the_ranks_too():
    # the ranks' check (after configure_model): an HF Llama held as self.net, not loaded from a folder
    module = NoLlama()
    module.net = _hf_llama()
    with pytest.raises(ConfigError, match=r"NoLlama.model = 'NoneType': .*Fix: self.net is transformers' "
                                          r"LlamaForCausalLM; .*LlamaLitModule\('hf:DIR'\)"
                                          r".*attach_weights\(module, 'DIR'\)"):
        find_llama(module)


def test_a_hugging_face_model_of_another_architecture_is_said_to_be_one():
    transformers = pytest.importorskip("transformers")
    module = NoLlama()
    module.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2,
                                                                        n_positions=16))
    with pytest.raises(ConfigError, match=r"Fix: self.model is transformers' GPT2LMHeadModel \('gpt2'\); the "
                                          r"strategy trains Llama-shaped models as lightning_hexiscale's Llama"):
        check_module_before_launch(None, module)
