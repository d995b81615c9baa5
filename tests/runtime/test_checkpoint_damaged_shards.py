"""A checkpoint whose shard file (``__0_0.distcp``) is missing or cut short, as an interrupted copy
leaves it: reading it was a FileNotFoundError or zipfile.BadZipFile traceback wrapped in DCP's
CheckpointException (consolidate, export, load_llama); now one ConfigError that names the shard and
the bytes its index needs. One process, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.checkpoint_layout import model_fqn
from lightning_hexiscale.runtime.parallelize import param_specs

CONFIG = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=48,
                     vocab_size=64, seq_len=8)


def llama_checkpoint(path: Path) -> Path:
    """The files a one-rank save writes: the model's tensors by global name in one shard, meta.pt, COMPLETE."""
    state = {model_fqn(s.name): torch.randn(s.shape) for s in param_specs(CONFIG)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"global_step": 3, "hexiscale": {"format": ckpt.FORMAT, "model": CONFIG.to_dict()}}, path / ckpt.META)
    (path / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    return path


@pytest.mark.parametrize("damage", ["missing", "empty", "cut"])
def test_a_missing_or_cut_shard_is_named(tmp_path, capsys, damage):
    path = llama_checkpoint(tmp_path / "last.ckpt")
    assert set(ckpt.load_llama_state_dict(path)) == {s.name for s in param_specs(CONFIG)}
    (shard,) = path.glob("*.distcp")
    whole = shard.read_bytes()
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(whole[:len(whole) // 3] if damage == "cut" else b"")
    want = "is missing" if damage == "missing" else f"holds {0 if damage == 'empty' else len(whole) // 3} bytes"
    with pytest.raises(ConfigError, match=rf"ckpt_path = .*the shard {shard.name} {want}.*damaged or cut short"):
        ckpt.load_llama(path)
    out = tmp_path / "llama.pt"
    out.write_bytes(b"kept")
    for argv in (["checkpoint", "consolidate", str(path), str(out), "--force"],
                 ["export", str(path), "--hf", str(tmp_path / "hf")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("error:") == 1 and f"the shard {shard.name} {want}" in err, err
    assert out.read_bytes() == b"kept" and not (tmp_path / "hf").exists()
