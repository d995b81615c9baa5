"""HF LLaMA safetensors from a local directory initialise the model, on one device and under the
strategy; ``trainer.validate`` through the pipeline (forward only) gives the one-device loss.

The test writes its own tiny safetensors files (the format: 8-byte header length, JSON header,
raw bytes), in two shards, with tied embeddings (no lm_head) and a config.json."""

from __future__ import annotations

import json
import struct

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader, module, plan_of

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.data.weights import HFLlamaWeights, attach_weights

_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64"}


def write_safetensors(path, tensors: dict[str, torch.Tensor]) -> None:
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def hf_directory(tmp_path, seed: int = 3):
    """A tiny HF-style LLaMA checkpoint of TINY's shape; returns (dir, {our name: tensor})."""
    gen = torch.Generator().manual_seed(seed)
    c = TINY
    ours, hf = {}, {}
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.05
    hf["model.embed_tokens.weight"] = ours["embed.weight"] = ours["lm_head.weight"] = rnd(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        for hf_name, our, shape in [("self_attn.q_proj", "attn.q_proj", (c.hidden_size, c.hidden_size)),
                                    ("self_attn.k_proj", "attn.k_proj", (c.kv_dim, c.hidden_size)),
                                    ("self_attn.v_proj", "attn.v_proj", (c.kv_dim, c.hidden_size)),
                                    ("self_attn.o_proj", "attn.o_proj", (c.hidden_size, c.hidden_size)),
                                    ("mlp.gate_proj", "mlp.gate_proj", (c.ffn_hidden_size, c.hidden_size)),
                                    ("mlp.up_proj", "mlp.up_proj", (c.ffn_hidden_size, c.hidden_size)),
                                    ("mlp.down_proj", "mlp.down_proj", (c.hidden_size, c.ffn_hidden_size)),
                                    ("input_layernorm", "attn_norm", (c.hidden_size,)),
                                    ("post_attention_layernorm", "mlp_norm", (c.hidden_size,))]:
            hf[f"model.layers.{i}.{hf_name}.weight"] = ours[f"layers.{i}.{our}.weight"] = rnd(*shape) + (
                1.0 if len(shape) == 1 else 0.0)
    hf["model.norm.weight"] = ours["norm.weight"] = rnd(c.hidden_size) + 1.0
    names = list(hf)
    half = len(names) // 2
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: hf[k] for k in names[:half]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: hf[k] for k in names[half:]})
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "intermediate_size": c.ffn_hidden_size, "vocab_size": c.vocab_size}))
    return tmp_path, ours


def _trainer(**kw):
    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", **kw)


@pytest.mark.timeout(60)
def test_hf_weights_one_device_and_pipelined_validate(tmp_path):
    d, ours = hf_directory(tmp_path)
    weights = HFLlamaWeights(d, TINY)
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
    with pytest.raises(ConfigError, match="num_hidden_layers=7"):
        HFLlamaWeights(d, TINY)
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        HFLlamaWeights(tmp_path / "nothing", TINY)
