"""Loading a checkpoint runs no code it carries (runtime/checkpoint_safety.py): ``meta.pt`` and DCP's
``.metadata`` are read weights_only by default; a planted pickled callable is refused with a clear
error before it runs, and the caller can opt out explicitly (``weights_only=False``, which the
strategy's ``load_checkpoint`` honours, as Lightning passes it from ``trainer.fit``)."""

from __future__ import annotations

import pickle
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy_checkpoints import CheckpointMethods
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.runtime import checkpoint as ckpt


class Planted:
    """Unpickling this runs ``exec`` of a statement that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def real_checkpoint(path: Path) -> Path:
    """A complete checkpoint directory: DCP's real ``.metadata`` and a plain ``meta.pt``."""
    dcp.save({"model.w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"global_step": 3, "loops": {"fit_loop": {"epoch": 0}},
                "hexiscale": {"format": ckpt.FORMAT, "model": LlamaConfig.load("llama_tiny").to_dict()}}, path / ckpt.META)
    (path / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    return path


def test_a_real_checkpoint_loads_weights_only(tmp_path):
    path = real_checkpoint(tmp_path / "ok.ckpt")
    assert ckpt.read_meta(path)["global_step"] == 3
    md = ckpt.RangeReader(str(path)).read_metadata()  # DCP's classes, torch.Size, dtypes: allowed
    assert tuple(md.state_dict_metadata["model.w"].size) == (6,)


def test_a_pickled_callable_in_meta_pt_is_refused_unless_trusted(tmp_path):
    path = real_checkpoint(tmp_path / "planted.ckpt")
    marker = tmp_path / "code-ran"
    torch.save({"global_step": 3, "hexiscale": {"format": ckpt.FORMAT}, "evil": Planted(marker)}, path / ckpt.META)
    with pytest.raises(ConfigError) as e:
        ckpt.read_meta(path)
    msg = str(e.value)
    assert "ckpt_path" in msg and "pickled global exec" in msg and "weights_only=False" in msg and "Fix:" in msg
    assert not marker.exists(), "the planted code ran"
    # the strategy's load_checkpoint: Lightning's weights_only (None from trainer.fit by default)
    strategy = types.SimpleNamespace(checkpointer=types.SimpleNamespace(wait=lambda: None))
    for given in (None, True):
        with pytest.raises(ConfigError, match="pickled global exec"):
            CheckpointMethods.load_checkpoint(strategy, path, weights_only=given)
    assert not marker.exists()
    meta = CheckpointMethods.load_checkpoint(strategy, path, weights_only=False)  # the caller trusts it
    assert marker.exists() and meta["global_step"] == 3 and meta["hexiscale"]["weights_only"] is False


def test_a_pickled_callable_in_dcp_metadata_is_refused_unless_trusted(tmp_path):
    path = real_checkpoint(tmp_path / "planted.ckpt")
    marker = tmp_path / "code-ran"
    md = pickle.loads((path / ".metadata").read_bytes())
    md.planner_data = Planted(marker)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ConfigError, match=r"global builtins.exec.*weights_only=False"):
        ckpt.RangeReader(str(path)).read_metadata()
    with pytest.raises(ConfigError, match="builtins.exec"):
        ckpt.load_llama_state_dict(path)
    assert not marker.exists(), "the planted code ran"
    ckpt.RangeReader(str(path), weights_only=False).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("name", [".metadata", ckpt.META])
@pytest.mark.parametrize("content", [b"", b"hello\n", bytes(range(256)), "half"])
def test_a_damaged_index_or_meta_is_said_to_be_damaged(tmp_path, capsys, name, content):
    """An empty, cut or overwritten ``.metadata`` / ``meta.pt`` (an interrupted copy): was an EOFError or
    KeyError traceback, or "it holds a pickled Memo value ..., which loading would have to execute" with
    the advice to trust the file; now one message that the file is damaged, before anything is printed."""
    from lightning_hexiscale.cli.main import main

    path = real_checkpoint(tmp_path / "cut.ckpt")
    whole = (path / name).read_bytes()
    (path / name).write_bytes(whole[:len(whole) // 2] if content == "half" else content)
    for weights_only in (None, False):
        with pytest.raises(ConfigError, match=rf"ckpt_path = .*{name}'.*damaged or cut short.*Fix: copy the"):
            ckpt.load_llama_state_dict(path, weights_only=weights_only)
    assert main(["checkpoint", "info", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and "weights_only=False" not in err, err
    assert err.count("error:") == 1 and "damaged or cut short" in err, err
