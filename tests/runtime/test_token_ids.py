"""A token id outside the model's vocabulary is a ConfigError naming the id, where it is, ``model.vocab_size``
and the likely fix, before the step: it was ``IndexError: index out of range in self`` from the first
stage's embedding (or the loss, for a target), deep inside the schedule."""

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


def test_the_id_its_place_and_the_fix_are_named():
    from lightning_hexiscale.runtime.schedule import check_token_ids

    tokens = torch.arange(32).reshape(4, 8)
    check_token_ids(tokens, tokens.roll(1, 1), 64, 0)  # all in range: nothing
    bad = tokens.clone()
    bad[2, 5] = 70
    with pytest.raises(ConfigError) as info:
        check_token_ids(bad, tokens, 64, 1)
    assert str(info.value).startswith("model.vocab_size = 64: the batch's inputs hold token id 70 (row 2 of pipeline "
                                      "1's samples, position 5; ids run 0..70), and ids must be in [0, 64). Fix: "
                                      "tokenize with the model's tokenizer, or give the model the tokenizer's "
                                      "vocabulary (model.vocab_size >= 71)")
    target = tokens.clone()
    target[0, 1] = -100  # an ignore index: the pipeline's loss averages over every token, it would not ignore it
    with pytest.raises(ConfigError, match=r"the batch's targets hold token id -100 \(row 0 .* position 1"):
        check_token_ids(tokens, target, 64, 0)


def _step_with_a_bad_id(rank: int, world: int) -> str:
    from lightning_hexiscale.runtime import PipelineEngine

    engine = PipelineEngine(Plan.from_dict(PLAN), CONFIG, seed=1)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    batch = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch[3, 2] = CONFIG.vocab_size + 6
    try:
        engine.fit_step(batch[:, :-1], batch[:, 1:], optimizer)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_every_stage_of_the_pipeline_refuses_the_batch_before_the_step(run_ranks):
    """Every rank of the pipeline holds its rows, so both stages refuse them, before any communication."""
    got = run_ranks(2, _step_with_a_bad_id)
    assert all(g.startswith("model.vocab_size = 64: the batch's inputs hold token id 70 (row 3 of pipeline 0's")
               for g in got), got
