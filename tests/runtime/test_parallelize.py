"""Cutting the plain model into stages: parameter layout, uneven shard ranges, state-dict mapping,
and single-process (TP 1) stage chains that reproduce the full model exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.runtime.parallelize import (assemble_full_state_dict, build_stage, load_full_state_dict,
                                                     local_shards, param_specs, stage_shards)


def meta_model(config) -> Llama:
    with torch.device("meta"):
        return Llama(config)


def test_param_specs_match_the_model(tiny_gqa):
    specs = param_specs(tiny_gqa)
    ref = dict(Llama(tiny_gqa).named_parameters())
    assert [s.name for s in specs] == list(ref)
    assert all(tuple(ref[s.name].shape) == s.shape for s in specs)


def test_uneven_shard_ranges_tp3(tiny_mha):
    # 4 KV heads over TP 3 -> 2,1,1 heads; head_dim 16; FFN 100 -> 34,33,33
    q = {r: stage_shards(tiny_mha, (0, 4), True, True, 3, r)["layers.0.attn.q_proj.weight"] for r in range(3)}
    assert [(q[r].start, q[r].end) for r in range(3)] == [(0, 32), (32, 48), (48, 64)]
    down = stage_shards(tiny_mha, (0, 4), True, True, 3, 2)["layers.3.mlp.down_proj.weight"]
    assert (down.spec.shard_dim, down.start, down.end) == (1, 67, 100)
    # vocabulary-parallel embedding and head: 256 rows -> 86, 85, 85
    emb = stage_shards(tiny_mha, (0, 4), True, True, 3, 2)["embed.weight"]
    assert (emb.spec.shard_dim, emb.start, emb.end) == (0, 171, 256)
    head = stage_shards(tiny_mha, (0, 4), True, True, 3, 0)["lm_head.weight"]
    assert (head.spec.shard_dim, head.start, head.end) == (0, 0, 86)
    assert stage_shards(tiny_mha, (0, 4), True, True, 3, 0)["norm.weight"].spec.shard_dim is None


def test_stage_holds_only_its_layers(tiny_gqa):
    names = set(stage_shards(tiny_gqa, (1, 3), False, False, 1, 0))
    assert "embed.weight" not in names and "lm_head.weight" not in names
    assert {n.split(".")[1] for n in names} == {"1", "2"}


def test_build_stage_materialises_only_local_params(tiny_gqa):
    stage = build_stage(meta_model(tiny_gqa), (0, 2), True, False, 1, 0, None, dtype=torch.float64)
    assert not any(p.is_meta for p in stage.parameters())
    assert set(dict(stage.named_parameters())) == set(stage_shards(tiny_gqa, (0, 2), True, False, 1, 0))
    assert all(p.dtype == torch.float64 for p in stage.parameters())


def test_build_stage_needs_meta_model_and_tp_group(tiny_gqa):
    with pytest.raises(ValueError, match="meta"):
        build_stage(Llama(tiny_gqa), (0, 4), True, True, 1, 0, None)
    with pytest.raises(ValueError, match="TP process group"):
        build_stage(meta_model(tiny_gqa), (0, 4), True, True, 2, 0, None)


@pytest.mark.parametrize("recompute", [False, True])
def test_chain_of_tp1_stages_equals_full_model(tiny_gqa, recompute):
    """Stages (0-1), (1-3), (3-4) chained in one process: same logits and gradients as the full model."""
    ref = Llama(tiny_gqa).to(torch.float64).init_weights(5)
    cuts = [(0, 1), (1, 3), (3, 4)]
    stages = [build_stage(meta_model(tiny_gqa), c, i == 0, i == 2, 1, 0, None, dtype=torch.float64,
                          recompute=recompute, seed=5) for i, c in enumerate(cuts)]
    tok = torch.randint(0, tiny_gqa.vocab_size, (2, tiny_gqa.seq_len), generator=torch.Generator().manual_seed(0))
    h = tok
    for s in stages:
        h = s(h)
    want = ref(tok)
    assert torch.equal(h, want)
    Llama.loss(h, tok).backward()
    Llama.loss(want, tok).backward()
    ref_params = dict(ref.named_parameters())
    for s in stages:
        for name, p in s.named_parameters():
            assert torch.allclose(p.grad, ref_params[name].grad, atol=1e-14), name


def test_state_dict_round_trip(tiny_mha):
    full = Llama(tiny_mha).to(torch.float64).init_weights(9).state_dict()
    full = {k: v + torch.randn_like(v) for k, v in full.items()}  # not the init values
    pieces = []
    for layers, first, last in [((0, 3), True, False), ((3, 4), False, True)]:
        stage = build_stage(meta_model(tiny_mha), layers, first, last, 1, 0, None, dtype=torch.float64, seed=None)
        load_full_state_dict(stage, full)
        pieces.append(local_shards(stage))
    back = assemble_full_state_dict(pieces, tiny_mha)
    assert all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="missing"):
        assemble_full_state_dict(pieces[:1], tiny_mha)


def test_slices_of_uneven_shards_reassemble(tiny_mha):
    """TP-3 shard ranges of every parameter, cut from a full state dict, reassemble to it."""
    full = Llama(tiny_mha).to(torch.float64).init_weights(2).state_dict()
    pieces = []
    for r in range(3):
        piece = {}
        for name, sh in stage_shards(tiny_mha, (0, 4), True, True, 3, r).items():
            piece[name] = (sh.slice_of(full[name]).clone(), sh.spec.shard_dim, sh.start, sh.end)
        pieces.append(piece)
    assert sum(t.numel() for p in pieces for n, (t, d, *_) in p.items() if d is not None) == sum(
        full[s.name].numel() for s in param_specs(tiny_mha) if s.shard_dim is not None)
    back = assemble_full_state_dict(pieces, tiny_mha)
    assert all(torch.equal(back[k], full[k]) for k in full)
