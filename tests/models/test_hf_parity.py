"""Hugging Face parity: a tiny random ``transformers`` Llama (float64) and ours after ``load_hf`` compute
the same logits (to 1e-6) for plain RoPE, rope_theta 500000, llama3 RoPE scaling, tied embeddings and
grouped-query attention; ``hexiscale export`` writes a directory ``from_pretrained`` loads with the same
logits. The only test module that imports transformers (importorskip: it is a test/dev extra)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_hexiscale import load_hf  # noqa: E402  (the package-root export)
from lightning_hexiscale.errors import ConfigError  # noqa: E402
from lightning_hexiscale.models.config import LlamaConfig  # noqa: E402
from lightning_hexiscale.models.llama import Llama  # noqa: E402

ATOL = 1e-6
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.05)
CASES = {
    "default_rope": {},
    "rope_theta_500000": {"rope_theta": 500000.0},
    "llama3_rope_scaling": {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "tied_embeddings": {"tie_word_embeddings": True},
    "gqa": {"num_key_value_heads": 2},
}


def hf_model(tmp_path, seed: int = 0, **overrides):
    """A random transformers LlamaForCausalLM in float64, saved to tmp_path (safetensors)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**BASE, **overrides})
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    model.save_pretrained(tmp_path)
    return model


def ours_from(directory) -> Llama:
    config, weights = load_hf(directory)
    model = Llama(config).to(torch.float64)
    model.load_state_dict({k: weights[k] for k in model.state_dict()})
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path, case):
    ref = hf_model(tmp_path, **CASES[case])
    ours = ours_from(tmp_path)
    x = tokens(BASE["vocab_size"])
    with torch.no_grad():
        want, got = ref(x).logits, ours(x)
    assert want.abs().max() > 0.1  # logits of some size, not a vacuous comparison
    assert (got - want).abs().max().item() < ATOL
    if case == "llama3_rope_scaling":  # the check can fail: ignoring the scaling is visible
        assert ours.config.rope_scaling is not None
        plain = Llama(LlamaConfig(**{**ours.config.to_dict(), "rope_scaling": None})).to(torch.float64)
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (plain(x) - want).abs().max().item() > 1e-4
    if case == "tied_embeddings":
        assert ours.config.tie_word_embeddings and "lm_head.weight" not in ours.state_dict()


def test_load_hf_config_and_slices(tmp_path):
    hf_model(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3, num_key_value_heads=2)
    config, weights = load_hf(tmp_path)
    assert (config.num_kv_heads, config.rope_theta, config.rope_scaling.factor) == (2, 500000.0, 8.0)
    assert config.seq_len == 8  # the pre-training context (original_max_position_embeddings)
    assert config.max_position_embeddings == 64
    full = weights["layers.1.mlp.down_proj.weight"]
    assert torch.equal(weights.read_slice("layers.1.mlp.down_proj.weight", 1, 10, 40), full[:, 10:40])
    assert torch.equal(weights.read_slice("lm_head.weight", 0, 100, 200), weights["lm_head.weight"][100:200])
    assert weights.shape_of("embed.weight") == (300, 64)


@pytest.mark.parametrize("case", ["llama3_rope_scaling", "tied_embeddings", "gqa"])
def test_from_hf_takes_a_transformers_config_as_its_config_json(tmp_path, case):
    """``LlamaConfig.from_hf(AutoConfig.from_pretrained(d))``, what a Hugging Face user holds: it was an
    AttributeError (no ``.get``); it reads as the directory's config.json does."""
    hf_model(tmp_path, **CASES[case])
    from_file = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()), "m")
    assert LlamaConfig.from_hf(transformers.AutoConfig.from_pretrained(tmp_path), "m") == from_file
    from lightning_hexiscale.lightning.example import LlamaLitModule

    module = LlamaLitModule(transformers.AutoConfig.from_pretrained(tmp_path))  # its shape, not its weights
    assert module.config == dataclasses.replace(from_file, name="hf") and getattr(module, "init_state_dict", None) is None
    with pytest.raises(ConfigError, match=r"^LlamaConfig\.from_hf\(hf\) = '.*config\.json': is of type str; it must "
                                          r"be the mapping of a config\.json or a transformers PretrainedConfig"):
        LlamaConfig.from_hf(str(tmp_path / "config.json"))


def test_preset_mismatch_is_a_config_error(tmp_path):
    from lightning_hexiscale.data.weights import attach_weights

    hf_model(tmp_path, tie_word_embeddings=True)
    config, _ = load_hf(tmp_path)

    class M:  # a module whose config is a preset that differs in one field
        pass

    for field, value in (("tie_word_embeddings", False), ("rope_theta", 500000.0), ("num_kv_heads", 2),
                         ("rms_norm_eps", 1e-6)):
        m = M()
        m.config = LlamaConfig(**{**config.to_dict(), field: value})
        with pytest.raises(ConfigError, match=f"model.{field}"):
            attach_weights(m, tmp_path)
    m = M()
    m.config = LlamaConfig(**{**config.to_dict(), "seq_len": 128, "max_position_embeddings": None})
    with pytest.raises(ConfigError, match="model.seq_len.*at most 64"):
        attach_weights(m, tmp_path)


def test_other_rope_types_are_refused(tmp_path):
    hf_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_type = 'yarn'"):
        load_hf(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_export_from_pretrained_equal_logits(tmp_path):
    """A checkpoint trained under a 2-stage plan (tied embeddings across the stages, TP-2 last stage)
    -> ``hexiscale export`` -> ``LlamaForCausalLM.from_pretrained`` -> the checkpoint's logits."""
    from hf_helpers import train_and_save

    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.runtime.checkpoint import load_llama

    src = tmp_path / "src"
    hf_model(src, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3, num_key_value_heads=2)
    (src / "tokenizer.json").write_text("{}")  # copied as is
    ckpt = train_and_save(tmp_path, f"hf:{src}")
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), "--hf", str(out), "--tokenizer", str(src), "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert "lm_head.weight" not in index["weight_map"]  # the tied matrix once
    assert (out / "tokenizer.json").is_file()
    ours = load_llama(ckpt).to(torch.float64).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    x = tokens(BASE["vocab_size"])[:, :8]
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() < ATOL
    # training moved the weights away from the source directory's
    start = ours_from(src)
    assert (start.embed.weight - ours.embed.weight).abs().max() > 1e-4


def test_a_path_that_is_no_hf_directory_says_what_it_is(tmp_path):
    """model=hf:<file model.safetensors> said "no such local directory" (it exists), and
    model=hf:<a checkpoint of this strategy> "the directory has no config.json" with no way forward."""
    hf_model(tmp_path / "hf")
    with pytest.raises(ConfigError, match="is a file.*model=hf:.*/hf"):
        LlamaConfig.load(f"hf:{tmp_path / 'hf' / 'model.safetensors'}")
    ckpt = tmp_path / "last.ckpt"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text("hexiscale-checkpoint/2")
    (ckpt / "meta.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="checkpoint of the hexiscale strategy.*trainer.resume=.*hexiscale export"):
        LlamaConfig.load(f"hf:{ckpt}")
