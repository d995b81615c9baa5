"""A Hugging Face config.json with a value of the wrong type is a ConfigError naming the model key:
rope_scaling.factor null / text was float()'s TypeError / ValueError, original_max_position_embeddings
null int()'s; tie_word_embeddings "abc" or -1 ran as true (bool()), num_key_value_heads 0 as
multi-head attention (read as absent), max_position_embeddings 1.5 was truncated to 1, and
rope_scaling 0 / "" / [] ran as plain RoPE."""

import pytest

from lightning_hexiscale.config.hf_model import model_fields_from_hf
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 128}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _shape(hf):
    return LlamaConfig.from_config(model_fields_from_hf(hf, "m"))


@pytest.mark.parametrize("changes, key", [
    ({"rope_scaling": {**LLAMA3, "factor": None}}, "model.rope_scaling.factor"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": "abc"}}, "model.rope_scaling.low_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": [1]}}, "model.rope_scaling.high_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": None}},
     "model.rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64.5}},
     "model.rope_scaling.original_max_position_embeddings"),
    ({"tie_word_embeddings": "abc"}, "model.tie_word_embeddings"),
    ({"tie_word_embeddings": -1}, "model.tie_word_embeddings"),
    ({"num_key_value_heads": 0}, "model.num_kv_heads"),
    ({"num_key_value_heads": ""}, "model.num_kv_heads"),
    ({"max_position_embeddings": 1.5}, "model.max_position_embeddings"),
    ({"rope_scaling": 0}, "model.rope_scaling"),
    ({"rope_scaling": []}, "model.rope_scaling"),
])
def test_a_config_json_value_of_the_wrong_type_is_named(changes, key):
    with pytest.raises(ConfigError) as e:
        _shape({**BASE, **changes})
    assert e.value.key == key and e.value.fix, e.value


def test_null_and_absent_keep_transformers_defaults():
    m = _shape({**BASE, "num_key_value_heads": None, "tie_word_embeddings": None, "rope_scaling": None})
    assert m.num_kv_heads == 4 and m.tie_word_embeddings is False and m.rope_scaling is None
    assert _shape({**BASE, "rope_scaling": LLAMA3}).rope_scaling.factor == 8.0
