"""Weight initialisation does not depend on the default device in force.

Lightning builds a one-device module inside a default-device context (``torch.device("cuda:0")``
under ``Trainer(accelerator="gpu", devices=1)``). ``init_tensor`` used to create its draws without a
device, so they landed on that default device, where the CPU generator cannot draw
("Expected a 'cuda' device type for generator but found 'cpu'"). On CPU the same fault shows under
a ``meta`` default device: the draws became meta tensors and ``copy_`` out of them failed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama, init_tensor


def _tiny() -> LlamaConfig:
    return LlamaConfig.load("llama_tiny")


def test_init_tensor_is_drawn_on_cpu_under_another_default_device():
    ref = init_tensor("layers.0.attn.q_proj.weight", (8, 4), seed=3)
    ones = init_tensor("layers.0.attn_norm.weight", (4,), seed=3)
    with torch.device("meta"):
        got = init_tensor("layers.0.attn.q_proj.weight", (8, 4), seed=3)
        got_ones = init_tensor("layers.0.attn_norm.weight", (4,), seed=3)
    assert got.device.type == "cpu" and got_ones.device.type == "cpu"
    assert torch.equal(got, ref) and torch.equal(got_ones, ones)


def test_init_weights_under_a_non_cpu_default_device_equals_plain_init():
    ref = Llama(_tiny()).init_weights(0)
    model = Llama(_tiny())
    with torch.device("meta"):
        model.init_weights(0)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lit_module_trains_under_lightnings_single_device_strategy_on_gpu():
    torch.manual_seed(0)
    data = torch.randint(0, _tiny().vocab_size, (8, 17))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = LlamaLitModule("llama_tiny")
    trainer.fit(module, loader)
    assert next(module.model.parameters()).device.type == "cuda"
    assert trainer.global_step == 2
