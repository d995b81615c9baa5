"""The fine-tuning path of docs/guide/models.md, end to end on CPU: a Hugging Face directory (written here, with
a tokenizer built here: no downloads) -> ``hexiscale prepare-data`` -> ``recipes/train.py model=hf:DIR``
(plans, trains from the directory's weights, logs the plan as hyper-parameters, checkpoints) ->
``hexiscale export`` -> a directory that ``load_hf`` reads back with the trained weights. Plus the
recipe's ``model=hf:`` composition, preset checks and ``trainer.logger`` choices."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_hexiscale.cli import train_fit, train_run
from lightning_hexiscale.cli.main import main as hexiscale
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.data import load_hf
from lightning_hexiscale.data.hf_export import save_hf
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"
WORDS = "the cluster trains a small model over slow links while every pipeline sends its activations".split()
MODEL = LlamaConfig(name="src", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                    vocab_size=32, seq_len=64, rope_theta=500000.0, tie_word_embeddings=True,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    max_position_embeddings=256)


def hf_dir(tmp_path: Path) -> Path:
    """An HF Llama directory (tied, llama3 RoPE) with a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    d = save_hf(Llama(MODEL).init_weights(5).state_dict(), MODEL, tmp_path / "Tiny-Llama")
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_model_hf_composes_and_checks_presets(tmp_path):
    d = hf_dir(tmp_path)
    cfg = compose([f"model=hf:{d}", "model.seq_len=16", "dry_run=true", "cluster=cpu2", "train.global_batch=4",
                   "planner.iterations=2", f"trainer.output_dir={tmp_path / 'out'}"])
    assert cfg.model.name == f"hf:{d.resolve()}" and cfg.model.seq_len == 16 and cfg.model.tie_word_embeddings
    assert cfg.model.rope_scaling.factor == 8.0 and Path(cfg.trainer.weights) == d.resolve()
    assert train_run.run(cfg) == 0
    # the plan names the model so that it composes again, e.g. for `hexiscale estimate --plan`
    assert hexiscale(["estimate", "--plan", str(tmp_path / "out" / "plan.yaml"), "model.seq_len=16"]) == 0
    # a preset that does not match the directory: refused before planning, naming the field
    bad = compose(["model=llama_tiny", f"trainer.weights={d}", "dry_run=true", "cluster=cpu2"])
    with pytest.raises(ConfigError, match="model.hidden_size = 128.*hidden_size=32"):
        train_run.run(bad)
    with pytest.raises(ConfigError, match="trainer.weights"):
        compose([f"model=hf:{d}", f"trainer.weights={tmp_path}"])
    with pytest.raises(ConfigError, match="no such local directory"):
        compose([f"model=hf:{tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="^model = 'hf:': hf: needs the directory"):  # read the working directory
        compose(["model=hf:"])


def test_a_sweep_over_hf_models(tmp_path):
    """`-m model=hf:A,hf:B`: `hexiscale plan -m` composed each job with Hydra's escaped value
    (model=hf\\:A), which was taken for a model file ("no such file"); `recipes/train.py -m` made it
    trainer.weights=A,hf:B (the second job's directory was 'hf:B', "no such local directory")."""
    from lightning_hexiscale.config.overrides import hf_model_overrides

    import shutil

    a = save_hf(Llama(MODEL).state_dict(), MODEL, tmp_path / "a")
    b = Path(shutil.copytree(a, tmp_path / "b"))
    assert hf_model_overrides([f"model=hf:{a},hf:{b}", "cluster=cpu2"]) == [
        "model=_hf", "cluster=cpu2", f"trainer.weights={a.resolve()},{b.resolve()}"]
    cfg = compose([f"model=hf\\:{a}", "cluster=cpu2"])  # one job of a plan sweep, as Hydra writes it
    assert cfg.model.name == f"hf:{a.resolve()}" and Path(cfg.trainer.weights) == a.resolve()
    with pytest.raises(ConfigError, match="model = .*a sweep over both hf: directories and model presets"):
        hf_model_overrides([f"model=llama_tiny,hf:{a}"])


def test_logger_choices(tmp_path, monkeypatch):
    cfg = compose(["trainer.logger=csv", "cluster=cpu2"])
    logger = train_fit.make_logger(cfg, tmp_path)
    logger.log_hyperparams({"plan_table": "pipeline  batch/mb ...", "estimate": {"pflops": 0.1}})
    logger.save()
    saved = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert saved["plan_table"].startswith("pipeline") and saved["estimate"]["pflops"] == 0.1
    with pytest.raises(ConfigError, match="trainer.logger = 'mlflow'"):
        train_fit.check_logger(compose(["trainer.logger=mlflow"]))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the wandb package.*lightning-hexiscale\[wandb\]"):
        train_fit.check_logger(compose(["trainer.logger=wandb"]))
    if real("tensorboard") or real("tensorboardX"):
        tb = train_fit.make_logger(compose(["trainer.logger=tensorboard"]), tmp_path)
        assert type(tb).__name__ == "TensorBoardLogger"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_finetune_path_end_to_end(tmp_path):
    d = hf_dir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    docs = ["the cluster trains a small model", "every pipeline sends its activations over slow links"] * 20
    corpus.write_text("".join('{"text": "%s"}\n' % t for t in docs))
    data = tmp_path / "data" / "train.bin"
    assert hexiscale(["prepare-data", str(corpus), "--tokenizer", str(d), "--out", str(data), "--no-progress"]) == 0

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    out = subprocess.run([sys.executable, str(TRAIN), f"model=hf:{d}", "model.seq_len=16", "cluster=cpu2",
                          "train.global_batch=4", "trainer.max_steps=3", "trainer.val_every=0", "trainer.lr=1e-2",
                          "trainer.precision=64-true", "trainer.progress_bar=false", "data.kind=bin",
                          f"data.path={data}", "planner.iterations=2", f"hydra.run.dir={run}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"training loss: first [\d.]+ -> last [\d.]+ after 3 steps", out.stdout), out.stdout[-2000:]
    hparams = yaml.safe_load(next(run.glob("logs/*/hparams.yaml")).read_text())
    assert "pipeline" in hparams["plan_table"] and hparams["estimate"]["iteration_time_s"] > 0
    assert hparams["model"]["tie_word_embeddings"] and hparams["model"]["name"] == f"hf:{d.resolve()}"

    ckpt = run / "checkpoints" / "last.ckpt"
    exported = tmp_path / "exported"
    assert hexiscale(["export", str(ckpt), "--hf", str(exported), "--tokenizer", str(d)]) == 0
    assert (exported / "tokenizer.json").is_file() and (exported / "model.safetensors").is_file()
    config, weights = load_hf(exported)
    assert MODEL.check_matches(config, str(exported)) is None and config.max_position_embeddings == 256
    from lightning_hexiscale.runtime.checkpoint import load_llama

    trained = load_llama(ckpt)
    start = load_hf(d)[1]
    for name, value in trained.state_dict().items():
        assert torch.equal(weights[name], value), name
    # trained from d's weights: 3 AdamW steps of lr 1e-2 move each element by about 0.03 at most, while
    # the recipe's own initialisation (seed 0) is ~0.09 away from them
    moved = max((weights[n] - start[n]).abs().max().item() for n in weights)
    assert 1e-4 < moved < 0.05
    seed0 = Llama(MODEL).init_weights(0).state_dict()
    assert max((seed0[n] - start[n]).abs().max().item() for n in start) > 0.05
