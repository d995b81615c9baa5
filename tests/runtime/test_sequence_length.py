"""Input sequences longer than the model's ``seq_len`` are refused before the step, on every rank
(``PipelineEngine.check_tokens``): the stage was built and the plan priced for ``seq_len`` positions,
and rows of 4 x seq_len trained silently (on a GPU, past the memory the plan said fits). Shorter
sequences cost less than priced and train."""

from __future__ import annotations

import pytest
import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan

CONFIG = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=48,
                     vocab_size=64, seq_len=8)
PLAN = {"num_layers": 2, "schedule": "1f1b", "recompute": False, "pipelines": [
    {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [1, 2]}]}]}


def _calls(rank: int, world: int) -> dict[str, str]:
    from lightning_hexiscale.runtime import PipelineEngine

    engine = PipelineEngine(Plan.from_dict(PLAN), CONFIG, seed=1)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, length in (("long", 4 * CONFIG.seq_len), ("one_more", CONFIG.seq_len + 1), ("short", CONFIG.seq_len - 3),
                         ("exact", CONFIG.seq_len)):
        batch = torch.randint(0, CONFIG.vocab_size, (4, length + 1), generator=gen)
        for call in ("fit", "eval", "predict"):
            try:
                if call == "fit":
                    got = engine.fit_step(batch[:, :-1], batch[:, 1:], optimizer).loss
                elif call == "eval":
                    got = engine.eval_loss(batch[:, :-1], batch[:, 1:])
                else:
                    logits = engine.predict_logits(batch[:, :-1])
                    got = None if logits is None else tuple(logits.shape)
                out[f"{name} {call}"] = f"ok {got}"
            except ConfigError as e:
                out[f"{name} {call}"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_longer_rows_are_refused_on_every_rank_and_shorter_ones_train(run_ranks):
    got = run_ranks(2, _calls)
    for rank, calls in enumerate(got):
        for call in ("fit", "eval", "predict"):
            for name, n in (("long", 32), ("one_more", 9)):
                assert calls[f"{name} {call}"].startswith(
                    f"model.seq_len = 8: the batch holds sequences of {n} input tokens (rows of {n + 1} with the "
                    "shifted targets), longer than the model and its plan were built for"), (rank, call, calls)
                assert f"model.seq_len={n} in the recipe" in calls[f"{name} {call}"]
            for name in ("short", "exact"):
                assert calls[f"{name} {call}"].startswith("ok"), (rank, name, call, calls)
    assert got[0]["short predict"] == "ok (4, 5, 64)" and got[1]["short predict"] == "ok None"
