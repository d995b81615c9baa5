"""Vocabulary-parallel embedding / LM head / cross-entropy and tied embeddings across stages, against
one process in float64.

- the Megatron-style vocab-parallel cross-entropy and embedding (uneven vocabulary split over 3
  ranks) give F.cross_entropy / F.embedding's values and gradients;
- training 3 steps under plans with a TP-2 last stage (vocab-parallel head) and a 2-stage pipeline
  whose embedding and tied head live on different stages equals the plain tied Llama on one device,
  under ddp, zero2 and zero3, every copy of every parameter element compared;
- the same run with the tied-gradient exchange switched off does NOT match (the check can fail).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_equivalence import SEED, STEPS, assert_matches_reference, check_equivalence, make_batch, plan_of, reference

from lightning_hexiscale.models.config import LlamaConfig, split_even
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime import tensor_parallel as tpl
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.tied_embeddings import TiedPair, needs_tied_sync, tied_pairs
from grad_step import train_step

ATOL = 1e-10  # the vocab-parallel kernels alone, in float64


@pytest.fixture
def tiny_tied() -> LlamaConfig:
    """tiny_gqa with a tied LM head and Llama 3.1's RoPE scaling (so the stages' tables are scaled too)."""
    return LlamaConfig(name="tiny_tied", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=100, vocab_size=250, seq_len=16, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                       tie_word_embeddings=True)


# ---- the kernels ---------------------------------------------------------------------------------
def _kernels_worker(rank: int, world: int):
    torch.manual_seed(0)
    V, H, B, S = 13, 6, 2, 5  # 13 rows over 3 ranks: 5, 4, 4
    logits = torch.randn(B, S, V, dtype=torch.float64)
    targets = torch.randint(0, V, (B, S))
    targets[0, :3] = torch.tensor([0, 6, 12])  # a target in every rank's range
    table = torch.randn(V, H, dtype=torch.float64)
    v0, v1 = split_even(V, world)[rank]  # what LlamaConfig.vocab_split gives
    group = dist.new_group(list(range(world)))
    local = logits[..., v0:v1].clone().requires_grad_(True)
    loss = tpl.vocab_parallel_cross_entropy(local, targets, v0, group)
    (loss * 3.0).backward()
    emb = tpl.VocabParallelEmbedding(v0, v1, H, group, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(table[v0:v1])
    out = emb(targets)
    (out * torch.arange(H, dtype=torch.float64)).sum().backward()
    return {"loss": loss.item(), "grad": local.grad, "range": (v0, v1), "emb": out.detach(), "emb_grad": emb.weight.grad,
            "inputs": (logits, targets, table)}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_vocab_parallel_cross_entropy_and_embedding_equal_one_device(run_ranks):
    results = run_ranks(3, _kernels_worker)
    logits, targets, table = results[0]["inputs"]
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.reshape(-1, full.shape[-1]), targets.reshape(-1))
    (ref * 3.0).backward()
    w = table.clone().requires_grad_(True)
    ref_emb = F.embedding(targets, w)
    (ref_emb * torch.arange(table.shape[1], dtype=torch.float64)).sum().backward()
    for res in results:
        v0, v1 = res["range"]
        assert res["loss"] == pytest.approx(ref.item(), abs=ATOL)
        assert (res["grad"] - full.grad[..., v0:v1]).abs().max() < ATOL
        assert (res["emb"] - ref_emb.detach()).abs().max() < ATOL
        assert (res["emb_grad"] - w.grad[v0:v1]).abs().max() < ATOL
    assert [r["range"] for r in results] == [(0, 5), (5, 9), (9, 13)]


# ---- pairs ---------------------------------------------------------------------------------------
def test_tied_pairs_overlap_first_and_last_stage_rows(tiny_tied):
    plan = plan_of([(2, 1, [([0], (0, 2)), ([1, 2], (2, 4))]), (2, 1, [([3], (0, 4))]),
                    (2, 1, [([4, 5], (0, 1)), ([6], (1, 4))])], 4)
    assert tied_pairs(plan, tiny_tied) == [TiedPair(0, 0, 1, 0, 125), TiedPair(0, 0, 2, 125, 250),
                                           TiedPair(2, 4, 6, 0, 125), TiedPair(2, 5, 6, 125, 250)]
    assert needs_tied_sync(plan, tiny_tied)
    single = plan_of([(2, 1, [([0, 1], (0, 4))])], 4)
    assert tied_pairs(single, tiny_tied) == [] and not needs_tied_sync(single, tiny_tied)
    untied = dataclasses.replace(tiny_tied, tie_word_embeddings=False)
    assert tied_pairs(plan, untied) == [] and not needs_tied_sync(plan, untied)


def test_tied_llama_has_one_embedding_parameter(tiny_tied):
    model = Llama(tiny_tied).init_weights(1)
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and not any(n.startswith("lm_head") for n in names)
    assert "lm_head.weight" not in model.state_dict()
    assert model.lm_head.weight is model.embed.weight
    model.to(torch.float64)
    assert model.lm_head.weight is model.embed.weight  # the tie survives a dtype/device move
    assert sum(p.numel() for p in model.parameters()) == tiny_tied.total_params


# ---- training equivalence --------------------------------------------------------------------------
# Pipeline 0: embedding on a TP-1 first stage, tied head on a TP-2 last stage (vocab-parallel head and
# loss; the tied copy is exchanged as two half-row pairs). Pipeline 1: one stage, one shared matrix.
TIED_PP = plan_of([(4, 2, [([0], (0, 2)), ([1, 2], (2, 4))]), (2, 1, [([3], (0, 4))])], 4)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_tied_embeddings_across_stages_with_tp2_last_stage(run_ranks, tiny_tied, sharding):
    from test_equivalence_zero import check_zero

    if sharding == "ddp":
        check_equivalence(run_ranks, TIED_PP, tiny_tied, optimizer="adamw")
    else:
        check_zero(run_ranks, TIED_PP, tiny_tied, sharding, "adamw")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tied_one_pipeline_tp2_first_stage_gpipe_recompute(run_ranks, tiny_tied):
    """One pipeline (no data-parallel sync): the exchange alone keeps the copies equal; the TP-2
    FIRST stage holds a vocabulary-parallel embedding, the TP-1 last stage the whole tied copy."""
    plan = plan_of([(4, 1, [([0, 1], (0, 1)), ([2], (1, 3)), ([3], (3, 4))])], 4, schedule="gpipe", recompute=True)
    check_equivalence(run_ranks, plan, tiny_tied)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_untied_tp2_last_stage_vocab_parallel_head(run_ranks, tiny_gqa):
    plan = plan_of([(4, 2, [([0], (0, 3)), ([1, 2], (3, 4))]), (2, 2, [([3, 4], (0, 4))])], 4)
    check_equivalence(run_ranks, plan, tiny_gqa, optimizer="adamw")


def _no_tie_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    engine.tied.sum_grads = lambda: None  # the mutation: no first/last exchange
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(config, plan.global_batch, step)
        losses.append(train_step(engine, tokens, targets))
        opt.step()
    return {"losses": losses, "shards": engine.local_shards()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_the_tied_exchange_training_differs(run_ranks, tiny_tied):
    """The equivalence check above can fail: drop the exchange and the parameters drift apart."""
    results = run_ranks(TIED_PP.world_size, _no_tie_worker, TIED_PP.to_dict(), tiny_tied)
    ref_losses, ref_state = reference(tiny_tied, TIED_PP.global_batch, "sgd")
    with pytest.raises(AssertionError, match="embed.weight|losses"):
        assert_matches_reference(results, ref_losses, ref_state)
