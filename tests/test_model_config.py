import re

import pytest

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig, split_even


def test_presets_have_published_parameter_counts():
    # Published totals: Llama-2 7B 6.74B, 13B 13.0B, LLaMA 30B 32.5B, Llama-2 70B 69.0B.
    expect = {"llama2_7b": 6.74e9, "llama2_13b": 13.0e9, "llama_30b": 32.5e9, "llama2_70b": 69.0e9}
    for name, n in expect.items():
        assert LlamaConfig.load(name).total_params == pytest.approx(n, rel=0.005), name


def test_gqa_shapes():
    m = LlamaConfig.load("llama2_70b")
    assert m.num_kv_heads == 8 and m.head_dim == 128 and m.kv_dim == 1024 and m.heads_per_kv == 8


def test_flops_reduce_to_paper_formula_for_12h2_layer():
    # kv_dim = H and F = 8H/3 give exactly 12 H^2 matmul weights.
    h, s, b = 96, 512, 3
    m = LlamaConfig("classic", h, 2, 4, 4, 8 * h // 3, 100, s)
    assert m.layer_matmul_params == 12 * h * h
    assert m.layer_forward_flops(b) == pytest.approx(24 * b * s * h * h * (1 + s / (6 * h)))


def test_model_flops_per_iteration_is_three_forwards():
    m = LlamaConfig.load("llama_tiny")
    fwd = m.num_layers * m.layer_forward_flops(8) + m.head_forward_flops(8)
    assert m.model_flops_per_iteration(8) == pytest.approx(3 * fwd)


def test_split_even():
    assert split_even(52, 8) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 34), (34, 40), (40, 46), (46, 52)]
    assert split_even(4, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        split_even(2, 3)


def test_uneven_tp_split_of_llama30b():
    m = LlamaConfig.load("llama_30b")
    sizes = [e - s for s, e in m.kv_head_split(8)]
    assert sizes == [7, 7, 7, 7, 6, 6, 6, 6]
    assert 1 / 8 < m.max_shard_fraction(8) < 7 / 52 + 1e-9
    assert m.max_shard_fraction(4) == pytest.approx(1 / 4)


def test_tp_larger_than_kv_heads_is_rejected_with_fix():
    m = LlamaConfig.load("llama2_70b")
    with pytest.raises(ConfigError, match="at most 8 devices"):
        m.check_tp(16)
    with pytest.raises(ConfigError, match=r"tp_degrees = 16: .* e\.g\. tp_degrees=\[1, 2, 4, 8\]"):
        m.check_measured_tp([1, 16], "tp_degrees")  # discover_process_group's argument: a Python list


@pytest.mark.parametrize("field,value,fragment", [
    ("num_heads", 3, "must divide hidden_size"),
    ("num_kv_heads", 3, "must divide num_heads"),
    ("num_layers", 0, "positive integer"),
])
def test_bad_model_shapes(field, value, fragment):
    kw = dict(name="m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=10, seq_len=8)
    kw[field] = value
    with pytest.raises(ConfigError, match=fragment):
        LlamaConfig(**kw)


def test_unknown_model_key():
    with pytest.raises(ConfigError, match="unknown key"):
        LlamaConfig.from_config(dict(name="m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                     ffn_hidden_size=128, vocab_size=10, seq_len=8, n_embd=3))


@pytest.mark.parametrize("changes, key, fix", [
    ({"num_layers": 0}, "model.num_layers", "write a whole number >= 1 in the model file (or override model.num_layers=N)"),
    ({"tie_word_embeddings": "yes"}, "model.tie_word_embeddings", "write true (the LM head reuses the token embedding"),
    ({"rope_scaling": {"factor": 0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "model.rope_scaling.factor", "copy it from the model's config.json"),
])
def test_a_bad_model_field_gets_a_real_fix(changes, key, fix):
    """The fix was "fix the model YAML", which says nothing the rule does not."""
    import dataclasses

    with pytest.raises(ConfigError) as e:
        dataclasses.replace(LlamaConfig.load("llama_tiny"), **changes)
    assert e.value.key == key and e.value.fix.startswith(fix), e.value


def test_a_config_json_without_a_field_says_what_to_add():
    from lightning_hexiscale.config.hf_model import model_fields_from_hf

    with pytest.raises(ConfigError, match=r"model.hidden_size = None: config.json has no hidden_size\. "
                                          r"Fix: add hidden_size to config.json"):
        model_fields_from_hf({"model_type": "llama"}, "m")


@pytest.mark.parametrize("key, value, expect", [
    ("max_position_embeddings", None, "model.max_position_embeddings = None: config.json: max_position_embeddings "
                                      "must be a number"),
    ("rms_norm_eps", None, "model.rms_norm_eps = None: config.json: rms_norm_eps must be a number"),
    ("rope_theta", "fast", "model.rope_theta = 'fast': config.json: rope_theta must be a number"),
    ("rope_scaling", "llama3", "model.rope_scaling = 'llama3': config.json: rope_scaling must be a mapping or null"),
])
def test_a_config_json_with_a_null_or_text_number_names_it(key, value, expect):
    """null (or text) in these keys of a hand-edited config.json raised TypeError / ValueError /
    AttributeError from inside float(), int() or dict.get, naming nothing."""
    from lightning_hexiscale.config.hf_model import model_fields_from_hf

    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
          "vocab_size": 300, key: value}
    with pytest.raises(ConfigError, match=re.escape(expect)):
        model_fields_from_hf(hf, "m")


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("changes, key", [
    ({"num_layers": 2**70}, "model.num_layers"),
    ({"num_layers": 65_537}, "model.num_layers"),
    ({"hidden_size": 2**70}, "model.hidden_size"),
    ({"ffn_hidden_size": 2**40}, "model.ffn_hidden_size"),
    ({"vocab_size": 2**70}, "model.vocab_size"),
    ({"seq_len": 2**70}, "model.seq_len"),
    ({"max_position_embeddings": 2**70}, "model.max_position_embeddings"),
    ({"rope_scaling": {**_LLAMA3, "factor": float("inf")}}, "model.rope_scaling.factor"),
    ({"rope_scaling": {**_LLAMA3, "high_freq_factor": float("inf")}}, "model.rope_scaling.high_freq_factor"),
    ({"rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 2**70}},
     "model.rope_scaling.original_max_position_embeddings"),
])
def test_a_huge_or_infinite_model_field_is_refused(changes, key):
    """A model file with num_layers: 2**70 was accepted and the search died of an OverflowError
    (``Python int too large to convert to C long``); the other widths, contexts and an infinite
    RoPE scaling factor were accepted and priced as nonsense."""
    import dataclasses

    with pytest.raises(ConfigError) as e:
        dataclasses.replace(LlamaConfig.load("llama_tiny"), **changes)
    assert e.value.key == key and e.value.fix, e.value


def test_a_huge_num_layers_in_a_model_file_is_a_config_error_from_the_cli(tmp_path, capsys):
    from lightning_hexiscale.cli.main import main

    text = (__import__("pathlib").Path(__file__).parent.parent / "conf/model/llama_tiny.yaml").read_text()
    f = tmp_path / "deep.yaml"
    f.write_text(text.replace("num_layers: 4", "num_layers: 1180591620717411303424"))
    assert main(["plan", "cluster=cpu_hetero4", f"model={f}", "planner.iterations=1"]) == 2
    err = capsys.readouterr().err
    assert "model.num_layers = 1180591620717411303424: must be at most 65,536" in err and "Traceback" not in err


@pytest.mark.parametrize("eps", [1.5, 1e308, 2**70, 1])
def test_an_rms_norm_eps_of_one_or_more_is_refused(eps):
    """rms_norm_eps: 1e308 was accepted ("a small positive number" checked only > 0 and finite-ish):
    RMSNorm's output is then x / sqrt(mean(x^2) + eps), the activations shrunk to nothing."""
    import dataclasses

    with pytest.raises(ConfigError) as e:
        dataclasses.replace(LlamaConfig.load("llama_tiny"), rms_norm_eps=eps)
    assert e.value.key == "model.rms_norm_eps" and e.value.fix
