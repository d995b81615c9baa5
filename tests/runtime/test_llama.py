"""The plain single-device LLaMA: shapes, causality, GQA, RoPE, deterministic per-parameter init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama, apply_rope, init_tensor, rope_tables


@pytest.fixture
def model(tiny_gqa) -> Llama:
    return Llama(tiny_gqa).to(torch.float64).init_weights(0)


def tokens_of(config: LlamaConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_parameter_count(model, tiny_gqa):
    c = tiny_gqa
    assert model(tokens_of(c)).shape == (2, c.seq_len, c.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == c.total_params
    attn = model.layers[0].attn
    assert attn.q_proj.weight.shape == (c.num_heads * c.head_dim, c.hidden_size)
    assert attn.k_proj.weight.shape == (c.kv_dim, c.hidden_size)
    assert all(getattr(m, "bias", None) is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()  # untied


def test_causal_future_tokens_do_not_change_past_logits(model, tiny_gqa):
    tok = tokens_of(tiny_gqa)
    changed = tok.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % tiny_gqa.vocab_size
    a, b = model(tok), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gqa_equals_mha_with_repeated_kv_heads(model, tiny_gqa):
    """Query head j uses KV head j // heads_per_kv: compare with an explicit repeat_interleave."""
    attn = model.layers[0].attn
    x = torch.randn(2, tiny_gqa.seq_len, tiny_gqa.hidden_size, dtype=torch.float64)
    cos, sin = rope_tables(tiny_gqa.seq_len, tiny_gqa.head_dim, tiny_gqa.rope_theta, dtype=torch.float64)
    b, s, d, g = 2, tiny_gqa.seq_len, tiny_gqa.head_dim, tiny_gqa.heads_per_kv
    q = apply_rope(attn.q_proj(x).view(b, s, -1, d).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, s, -1, d).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(b, s, -1, d).transpose(1, 2)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    manual = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
    assert torch.allclose(attn(x, cos, sin), manual, atol=1e-12)


def test_rope_rotates_pairs_and_keeps_norm():
    cos, sin = rope_tables(8, 6, 10000.0, dtype=torch.float64)
    x = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0: angle 0


def test_loss_is_mean_token_cross_entropy(model, tiny_gqa):
    tok = tokens_of(tiny_gqa)
    logits = model(tok)
    want = F.cross_entropy(logits.reshape(-1, tiny_gqa.vocab_size), tok.reshape(-1))
    assert torch.allclose(model.loss(logits, tok), want)


def test_init_is_per_parameter_and_independent_of_model_size(tiny_gqa):
    """A 2-layer model gets the same layer-0/1 values as the 4-layer one: init depends only on
    (seed, global name)."""
    big = Llama(tiny_gqa).init_weights(7).state_dict()
    small_cfg = LlamaConfig(**{**tiny_gqa.to_dict(), "num_layers": 2})
    small = Llama(small_cfg).init_weights(7).state_dict()
    for name, t in small.items():
        assert torch.equal(t, big[name]), name
    assert not torch.equal(big["layers.0.attn.q_proj.weight"], big["layers.1.attn.q_proj.weight"])
    other = Llama(tiny_gqa).init_weights(8).state_dict()
    assert not torch.equal(big["embed.weight"], other["embed.weight"])
    assert torch.equal(big["layers.3.mlp_norm.weight"], torch.ones(tiny_gqa.hidden_size))
    assert torch.equal(init_tensor("layers.1.mlp.up_proj.weight", (100, 64), 7), big["layers.1.mlp.up_proj.weight"])


def test_meta_construction_then_materialise(tiny_gqa):
    with torch.device("meta"):
        m = Llama(tiny_gqa)
    assert all(p.is_meta for p in m.parameters())
    m.init_weights(3)
    assert not any(p.is_meta for p in m.parameters())
    ref = Llama(tiny_gqa).init_weights(3)
    tok = tokens_of(tiny_gqa)
    assert torch.equal(m(tok), ref(tok))


def test_bf16_autocast_runs_on_cpu(tiny_gqa):
    m = Llama(tiny_gqa).init_weights(0)
    tok = tokens_of(tiny_gqa)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m.loss(m(tok), tok)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert m.layers[0].attn.q_proj.weight.grad is not None
