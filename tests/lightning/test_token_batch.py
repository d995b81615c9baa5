"""What LlamaLitModule reads from a batch (:func:`token_batch`): a (B, S + 1) integer tensor, the one
tensor of a list (TensorDataset's rows), or a Hugging Face style mapping's ``input_ids``. Anything it
would not read as given is a ConfigError naming the step and the key: a mapping was ``TypeError:
unhashable type: 'slice'``, labels and padding would have been dropped without a word."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.example import LlamaLitModule, token_batch

KEY = "M.training_step(batch)"
IDS = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
PADDED = torch.ones_like(IDS)
PADDED[0, -2:] = 0


@pytest.mark.parametrize("batch", [IDS, [IDS], (IDS,), {"input_ids": IDS}, {"input_ids": IDS, "labels": IDS.clone()},
                                   {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}])
def test_the_token_tensor_is_found(batch):
    assert token_batch(batch, KEY) is IDS


@pytest.mark.parametrize("batch, key, value", [
    ({"input_ids": IDS, "labels": torch.where(IDS > 100, IDS, -100)}, r"\['labels'\]", "'not input_ids'"),
    ({"input_ids": IDS, "attention_mask": PADDED}, r"\['attention_mask'\]", "'not all ones'"),
    ({"input_ids": IDS, "position_ids": IDS}, "", r"\"a mapping with \['position_ids'\]\""),
    ({"text": ["a"]}, "", "'a dict'"),
    (IDS[0], "", "'a 1-D int64 tensor of shape \\[9\\]'"),
    (IDS.float(), "", "'a 2-D float32 tensor of shape \\[4, 9\\]'"),
    (IDS[:, :1], "", "'a 2-D int64 tensor of shape \\[4, 1\\]'"),
    ([IDS, IDS], "", "'a list'"),
])
def test_what_it_would_not_read_is_named(batch, key, value):
    with pytest.raises(ConfigError, match=rf"^M\.training_step\(batch\){key} = {value}: .*Fix: "):
        token_batch(batch, KEY)


class _Rows(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.arange(i, i + 17) % 256}


def test_mapping_rows_train_as_their_tensor_on_one_device():
    # the same steps and losses from {"input_ids": rows} and from the rows themselves
    losses = []
    for data in (_Rows(), TensorDataset(torch.stack([_Rows()[i]["input_ids"] for i in range(8)]))):
        torch.manual_seed(0)
        module = LlamaLitModule("llama_tiny", lr=1e-2)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(data, batch_size=4))
        losses.append(float(trainer.callback_metrics["train_loss"]))
    assert losses[0] == losses[1]
