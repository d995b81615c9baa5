"""HF Llama safetensors from a local directory initialise the model, on one device and under the
strategy (each rank reading only its rows through ``safe_open(...).get_slice``); ``trainer.validate``
through the pipeline (forward only, vocabulary-parallel loss on a TP-2 last stage) gives the
one-device loss. The directory is written by ``save_hf`` (the export path), in several shards."""

from __future__ import annotations

import dataclasses
import json

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader, module, plan_of

from lightning_hexiscale.data.hf_export import save_hf
from lightning_hexiscale.data.weights import HFWeights, attach_weights, load_hf
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.llama import Llama


def hf_directory(tmp_path, config=TINY, seed: int = 3):
    """A tiny HF Llama directory of ``config``'s shape; returns (dir, {our name: tensor})."""
    ours = {k: v.detach().clone() for k, v in Llama(config).to(torch.float64).init_weights(seed).state_dict().items()}
    out = save_hf(ours, config, tmp_path / "hf", max_shard_bytes=60_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    return out, ours


def _trainer(**kw):
    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", **kw)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hf_weights_one_device_and_pipelined_validate(tmp_path):
    d, ours = hf_directory(tmp_path)
    config, weights = load_hf(d)
    assert TINY.check_matches(config, str(d)) is None
    assert set(weights) == set(ours) and torch.equal(weights["layers.2.mlp.down_proj.weight"],
                                                     ours["layers.2.mlp.down_proj.weight"])
    val = loader(12, 6)
    one = module()
    attach_weights(one, d)
    ref = _trainer(devices=1).validate(one, val, verbose=False)[0]["val_loss"]
    assert torch.equal(one.model.state_dict()["lm_head.weight"], ours["lm_head.weight"])

    plan = plan_of([(4, 2, [([0], (0, 3)), ([1, 2], (3, 4))]), (2, 1, [([3], (0, 4))])])
    many = module()
    attach_weights(many, d)
    strategy = HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT)
    got = _trainer(devices=plan.world_size, strategy=strategy).validate(many, val, verbose=False)[0]["val_loss"]
    assert got == pytest.approx(ref, abs=1e-9)


def test_weights_shape_mismatch_and_missing_dir(tmp_path):
    d, _ = hf_directory(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 7}))
    m = module()
    with pytest.raises(ConfigError, match="model.num_layers = 4.*num_layers=7"):
        attach_weights(m, d)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        HFWeights(tmp_path / "nothing", TINY)
    for f in d.glob("*.safetensors"):  # a shard missing: a named tensor is missing
        f.unlink()
        break
    with pytest.raises(ConfigError, match="lack .* tensor"):
        HFWeights(d, TINY)


def test_a_tp_rank_reads_only_its_rows(tmp_path):
    """load_full_state_dict reads every sharded matrix with read_slice (its rows or columns only) and
    only the replicated norms whole; the pieces equal the full tensors' slices."""
    from lightning_hexiscale.runtime.parallelize import build_stage, load_full_state_dict

    d, ours = hf_directory(tmp_path)
    weights = HFWeights(d, TINY)
    whole, sliced = [], []
    read_slice, getitem = weights.read_slice, HFWeights.__getitem__

    class Spy(HFWeights):
        def __getitem__(self, name):
            whole.append(name)
            return getitem(self, name)

    weights.__class__ = Spy
    weights.read_slice = lambda name, dim, a, b: sliced.append((name, dim, a, b)) or read_slice(name, dim, a, b)
    with torch.device("meta"):
        meta = Llama(TINY)
    stage = build_stage(meta, (2, 4), False, True, 2, 1, tp_group=object(), dtype=torch.float64, seed=None)
    load_full_state_dict(stage, weights)
    assert all(n.endswith("norm.weight") for n in whole) and "norm.weight" in whole
    assert ("lm_head.weight", 0, 128, 256) in sliced  # vocabulary rows of TP rank 1 of 2
    assert ("layers.3.mlp.down_proj.weight", 1, 50, 100) in sliced  # row-parallel: its columns
    for name, p in stage.named_parameters():
        s = stage.shards()[name]
        assert torch.equal(p, s.slice_of(ours[name])), name


def test_the_index_decides_which_files_hold_the_weights(tmp_path):
    """A directory with stale shards beside the current ones (a newer revision copied over an older
    one saved with another shard size): transformers reads the files model.safetensors.index.json
    names, and so must we; the stale files sorted last and silently won before."""
    import shutil

    d, old = hf_directory(tmp_path, seed=3)  # many shards (60 kB each)
    newer_state = Llama(TINY).to(torch.float64).init_weights(4).state_dict()
    newer = save_hf({k: v.detach().clone() for k, v in newer_state.items()}, TINY, tmp_path / "newer",
                    max_shard_bytes=200_000)
    assert 1 < len(list(newer.glob("*.safetensors"))) < len(list(d.glob("*.safetensors")))
    for f in newer.iterdir():
        shutil.copy(f, d / f.name)
    weights = HFWeights(d, TINY)
    for name in ("embed.weight", "layers.3.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(weights[name], HFWeights(newer, TINY)[name]), name
        assert not torch.equal(weights[name], old[name]), name

    # a single model.safetensors wins over an index, as in transformers' from_pretrained
    single = save_hf(old, TINY, tmp_path / "single")
    shutil.copy(single / "model.safetensors", d / "model.safetensors")
    assert torch.equal(HFWeights(d, TINY)["embed.weight"], old["embed.weight"])

    # no index and no model.safetensors: a tensor in two files is ambiguous, not "the last file sorted"
    two = tmp_path / "two"
    shutil.copytree(newer, two)
    (two / "model.safetensors.index.json").unlink()
    shutil.copy(next(iter(sorted(d.glob("model-0*-of-*.safetensors")))), two / "extra.safetensors")
    with pytest.raises(ConfigError, match="trainer.weights.*in two files.*extra.safetensors"):
        HFWeights(two, TINY)


def test_a_preset_without_a_context_takes_the_weights_context(tmp_path):
    """model=llama2_7b trainer.weights=/models/Llama-2-7b-hf model.seq_len=512: the preset leaves
    max_position_embeddings open, so the checkpoint and `hexiscale export` recorded the training
    seq_len as the model's context (config.json said 512 where the weights support 4096, and a
    server reading it would refuse longer prompts). The directory's value is recorded instead."""
    d, _ = hf_directory(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    m = module()
    assert m.config.max_position_embeddings is None and m.config.seq_len == 16
    attach_weights(m, d)
    assert m.config.max_position_embeddings == 64 and m.config.seq_len == 16
    assert m.config.to_hf()["max_position_embeddings"] == 64


def test_resuming_is_not_refused_over_a_context_one_side_leaves_open():
    """After the above, a run started with trainer.weights records the weights' context; resuming it
    with the bare preset (or a checkpoint of an older run with the weights) must still work: the
    context is metadata (RoPE tables follow the sequence), not a shape."""
    from lightning_hexiscale.runtime.checkpoint import _check_model

    with_context = dataclasses.replace(TINY, max_position_embeddings=64)
    for saved, now in ((with_context, TINY), (TINY, with_context), (with_context, with_context)):
        _check_model({"hexiscale": {"model": saved.to_dict()}}, now, "x.ckpt")
    with pytest.raises(ConfigError, match="model.max_position_embeddings = 128"):
        _check_model({"hexiscale": {"model": with_context.to_dict()}},
                     dataclasses.replace(TINY, max_position_embeddings=128), "x.ckpt")


def test_a_directory_of_pytorch_bin_weights_says_how_to_convert(tmp_path):
    """Older Hugging Face repositories hold pytorch_model*.bin only; "no *.safetensors files. Fix:
    point to a downloaded HF Llama directory" sent the user to a directory they already had."""
    d = tmp_path / "old"
    d.mkdir()
    (d / "pytorch_model-00001-of-00002.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="pytorch_model.*bin.*save_pretrained"):
        HFWeights(d, TINY)


def test_missing_tensors_say_why(tmp_path):
    """Every case below said only "the safetensors files lack N tensor(s) ... use the complete
    checkpoint directory", and the sequence classifier was told to set tie_word_embeddings (a model
    whose LM head would then be its embedding, silently)."""
    from safetensors.torch import load_file, save_file

    d, _ = hf_directory(tmp_path)  # a shard of the index deleted: named, with the way to fetch it
    state = {}
    for f in d.glob("*.safetensors"):
        state.update(load_file(f))
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.2.mlp.up_proj.weight"]
    (d / shard).unlink()
    with pytest.raises(ConfigError, match=f"index.json puts them in 1 file.*not in the directory: {shard}.*download"):
        HFWeights(d, TINY)

    base = tmp_path / "base"  # a transformers LlamaModel: the decoder without "model." and lm_head.weight
    base.mkdir()
    save_file({k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"},
              str(base / "model.safetensors"))
    with pytest.raises(ConfigError, match="embed_tokens.weight \\(no 'model.' prefix\\).*LlamaModel.*LlamaForCausalLM"):
        HFWeights(base, TINY)

    cls = tmp_path / "cls"  # LlamaForSequenceClassification: score.weight where lm_head.weight would be
    cls.mkdir()
    full = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({**full, "score.weight": torch.zeros(2, TINY.hidden_size, dtype=torch.float64)},
              str(cls / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (cls / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="architectures is LlamaForSequenceClassification") as e:
        HFWeights(cls, TINY)
    assert "tie_word_embeddings" not in str(e.value)
    (cls / "config.json").write_text(json.dumps(cfg))  # a causal LM's config.json: the tie hint stays
    with pytest.raises(ConfigError, match="set tie_word_embeddings"):
        HFWeights(cls, TINY)


def test_a_quantized_checkpoint_is_refused(tmp_path):
    """An FP8 Llama (float8 matrices with a weight_scale beside each, quantization_config in
    config.json) loaded without a word: the codes were read as weights, about 1000x too large."""
    from safetensors.torch import load_file, save_file

    d, _ = hf_directory(tmp_path)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    state = {}
    for f in d.glob("*.safetensors"):
        state.update(load_file(f))
    quantized = {}
    for k, v in state.items():
        if k.endswith("proj.weight"):  # what an FP8 (compressed-tensors) export stores
            scale = v.abs().max().float() / 448
            quantized[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            quantized[k.removesuffix("weight") + "weight_scale"] = scale.reshape(1)
        else:
            quantized[k] = v
    save_file(quantized, str(fp8 / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "compressed-tensors"}}))
    with pytest.raises(ConfigError, match="model.quantization_config = 'compressed-tensors'.*unquantized"):
        load_hf(fp8)
    (fp8 / "config.json").write_text(json.dumps(cfg))  # the files alone give it away too
    with pytest.raises(ConfigError, match="q_proj.weight \\(F8_E4M3\\).*quantized.*unquantized"):
        load_hf(fp8)


def test_tensors_the_model_would_drop_are_refused(tmp_path):
    """q/k/v biases in the files (a Qwen2-style checkpoint labelled llama, attention_bias unset) were
    dropped without a word: a different model. RoPE's inv_freq buffers (older conversions) and the
    layers beyond a config.json's num_hidden_layers (a checkpoint cut short) are still read past."""
    from safetensors.torch import load_file, save_file

    d, ours = hf_directory(tmp_path)
    state = {}
    for f in d.glob("*.safetensors"):
        state.update(load_file(f))
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text((d / "config.json").read_text())
    extra = {"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(TINY.head_dim // 2),
             f"model.layers.{TINY.num_layers}.mlp.up_proj.weight": state["model.layers.0.mlp.up_proj.weight"].clone()}
    save_file({**state, **extra}, str(one / "model.safetensors"))
    assert torch.equal(HFWeights(one, TINY)["layers.1.attn.q_proj.weight"], ours["layers.1.attn.q_proj.weight"])
    bias = {"model.layers.1.self_attn.q_proj.bias": torch.ones(TINY.hidden_size, dtype=torch.float64)}
    save_file({**state, **extra, **bias}, str(one / "model.safetensors"))
    with pytest.raises(ConfigError, match="q_proj.bias \\(and 0 more\\).*no such parameter.*silently differ"):
        HFWeights(one, TINY)


def test_an_override_of_an_hf_model_is_told_to_go(tmp_path):
    """recipes/train.py model=hf:DIR model.rope_theta=1e6 was told "Fix: choose the model preset that
    matches the weights, or use model=hf:<dir>": what it already did. A preset keeps that advice."""
    from lightning_hexiscale.data.weights import check_hf_config
    from lightning_hexiscale.models.config import LlamaConfig

    d, _ = hf_directory(tmp_path)
    from_dir = LlamaConfig.load(f"hf:{d}")
    with pytest.raises(ConfigError, match=f"model.rope_theta = 1000000.0: .*rope_theta=10000.0. Fix: drop the "
                                          f"model.rope_theta override: with model=hf:{d}"):
        check_hf_config(d, dataclasses.replace(from_dir, rope_theta=1e6))
    with pytest.raises(ConfigError, match="Fix: choose the model preset that matches the weights"):
        check_hf_config(d, dataclasses.replace(TINY, rope_theta=1e6))


def test_a_lora_adapter_directory_says_what_it_is(tmp_path):
    """model=hf:<a PEFT adapter directory> (adapter_config.json + adapter_model.safetensors) said only
    "the directory has no config.json. Fix: point to a Hugging Face model directory"."""
    from lightning_hexiscale.models.config import LlamaConfig

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "lora" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="a PEFT \\(LoRA\\) adapter, not a model.*merge_and_unload"):
        LlamaConfig.load(f"hf:{tmp_path / 'lora'}")
    with pytest.raises(ConfigError, match="trainer.weights = .*a PEFT"):
        load_hf(tmp_path / "lora")


def test_layers_beyond_config_json_are_named_as_unused(tmp_path):
    """A config.json cut to fewer layers than its files hold loaded the first layers without a word
    (transformers warns of unused weights): now an UnusedWeightsWarning names them and the fix."""
    import warnings

    from lightning_hexiscale.data.weights import UnusedWeightsWarning

    d, ours = hf_directory(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedWeightsWarning)
        load_hf(d)  # every layer used: nothing said
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.warns(UnusedWeightsWarning) as caught:
        config, weights = load_hf(d)
    assert len(caught) == 1 and str(caught[0].message) == (
        f"trainer.weights = {str(d)!r}: the weight files hold 4 layers and config.json's num_hidden_layers is 1, "
        "so layer(s) 1, 2, 3 (model.layers.N.*) are not used: the model takes only the first 1 layer(s). If that is not "
        f"meant, set num_hidden_layers to 4 in {d / 'config.json'}")
    assert config.num_layers == 1 and set(weights) == {n for n in ours if not n.startswith(("layers.1", "layers.2",
                                                                                              "layers.3"))}
