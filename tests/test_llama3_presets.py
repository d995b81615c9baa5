"""Llama 3.x model family: the presets' shapes and parameter counts against the published totals,
the llama3 RoPE scaling formula and its errors, tied heads, RoPE table caching and the flash-attn
gate (decided once, compute capability >= 8.0, SDPA otherwise; CUDA mocked)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hexiscale.config.hf_model import model_fields_from_hf
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models import llama as llama_mod
from lightning_hexiscale.models.config import LlamaConfig, RopeScaling

# Published totals (model cards / safetensors index metadata of meta-llama/*), exact parameter counts.
PUBLISHED = {
    "llama3_8b": (8_030_261_248, dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                      ffn_hidden_size=14336), None, False),
    "llama3_70b": (70_553_706_496, dict(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                        ffn_hidden_size=28672), None, False),
    "llama3_1_405b": (405_853_388_800, dict(hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                                            ffn_hidden_size=53248), 8.0, False),
    "llama3_2_1b": (1_235_814_400, dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                        ffn_hidden_size=8192), 32.0, True),
    "llama3_2_3b": (3_212_749_824, dict(hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                                        ffn_hidden_size=8192), 32.0, True),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_llama3_presets_match_published_shapes_and_counts(name):
    total, shape, factor, tied = PUBLISHED[name]
    c = LlamaConfig.load(name)
    assert {k: getattr(c, k) for k in shape} == shape
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps) == (128256, 500000.0, 1e-5)
    assert c.head_dim == (64 if name == "llama3_2_1b" else 128)
    assert c.tie_word_embeddings is tied
    assert (c.rope_scaling.factor if c.rope_scaling else None) == factor
    if factor:
        assert (c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
                c.rope_scaling.original_max_position_embeddings) == (1.0, 4.0, 8192)
    assert c.total_params == total


def test_llama3_rope_scaling_regimes():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    # wavelength 2*pi/x: < 8192/4 kept, > 8192/1 divided by 8, in between smoothed
    high, low = 2 * math.pi / 100.0, 2 * math.pi / 10000.0
    mid = 2 * math.pi / 4096.0
    out = s.scale([high, mid, low])
    smooth = (8192 / 4096 - 1.0) / (4.0 - 1.0)
    assert out[0] == high and out[2] == pytest.approx(low / 8)
    assert out[1] == pytest.approx((1 - smooth) * mid / 8 + smooth * mid)
    c = LlamaConfig.load("llama3_2_1b")
    inv = c.rope_inv_freq()
    assert len(inv) == 32 and inv[0] == 1.0 and inv[-1] == pytest.approx(500000.0 ** (-62 / 64) / 32)


def test_rope_scaling_errors_name_the_key():
    base = dict(name="x", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, ffn_hidden_size=64,
                vocab_size=100, seq_len=16)
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type = 'yarn'"):
        LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type = 'linear'"):
        LlamaConfig(**base, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="model.rope_scaling.low_freq_factor"):
        LlamaConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    with pytest.raises(ConfigError, match="model.rope_scaling.beta"):
        LlamaConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "beta": 1})
    with pytest.raises(ConfigError, match="model.seq_len = 16.*max_position_embeddings=8"):
        LlamaConfig(**base, max_position_embeddings=8)
    with pytest.raises(ConfigError, match="rope_type = 'dynamic'"):
        model_fields_from_hf({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                              "intermediate_size": 64, "vocab_size": 100,
                              "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "x")
    with pytest.raises(ConfigError, match="model_type='mistral'"):
        model_fields_from_hf({"model_type": "mistral"}, "x")


def test_hf_config_both_generations_read_alike():
    common = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 4096, "tie_word_embeddings": True}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}
    v4 = model_fields_from_hf({**common, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}, "m")
    v5 = model_fields_from_hf({**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                             **scaling}}, "m")
    assert v4 == v5 and v4["seq_len"] == 2048 and v4["rope_scaling"]["rope_type"] == "llama3"
    c = LlamaConfig(**v4)
    assert LlamaConfig.from_hf(c.to_hf(), "m") == c  # config.json round trip


def test_rope_tables_are_cached_per_device_and_dtype():
    c = LlamaConfig.load("llama_tiny")
    cache = llama_mod.RopeCache(c)
    a = cache(16, torch.device("cpu"), torch.float32)
    assert cache(16, torch.device("cpu"), torch.float32)[0] is a[0]  # not rebuilt
    b = cache(16, torch.device("cpu"), torch.float64)
    assert b[0].dtype == torch.float64 and b[0] is not a[0]
    ref = llama_mod.rope_tables(16, c.head_dim, c.rope_theta, dtype=torch.float64)
    assert torch.equal(b[0], ref[0]) and torch.equal(b[1], ref[1])


def test_rope_tables_built_in_inference_mode_serve_a_later_training_step():
    """A model evaluated under torch.inference_mode first (Lightning's trainer.validate / predict,
    then trainer.fit with the same module) cached inference tensors, and the first training forward
    failed with 'Inference tensors cannot be saved for backward'."""
    c = LlamaConfig(name="t", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden_size=48,
                    vocab_size=64, seq_len=8)
    model = llama_mod.Llama(c).init_weights(0)
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        evaluated = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    fresh = llama_mod.Llama(c).init_weights(0)
    fresh.loss(fresh(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert float(loss) == float(evaluated)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.grad, q.grad), name
