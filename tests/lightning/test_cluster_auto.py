"""``HexiScaleStrategy()`` with no cluster (``cluster="auto"``, the default): the job's ranks discover
their cluster at setup (collectively), plan on it and train; a second fit reuses the cached file.
``cluster=None`` keeps its meaning (a nominal description of the local devices, nothing measured), and a
given plan needs no discovery."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import yaml
from torch.utils.data import DataLoader

import lightning_hexiscale  # noqa: F401  (registers "hexiscale")
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.plan_resolution import AUTO
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from strategy_helpers import PG_TIMEOUT


def test_auto_is_the_default_and_none_keeps_its_meaning():
    assert HexiScaleStrategy().settings.cluster == AUTO
    assert HexiScaleStrategy(cluster="auto").settings.cluster == AUTO and HexiScaleStrategy().cluster is None
    assert HexiScaleStrategy(cluster=None).settings.cluster is None
    assert HexiScaleStrategy(cluster="cpu_demo").settings.cluster.name == "cpu_demo"


class _Steps(pl.Callback):
    """Rank 0 writes the global step it ended at (the forked ranks' trainers are not the caller's)."""

    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.path.write_text(str(trainer.global_step))


def _fit(capfd, tmp_path) -> str:
    """Fit 2 steps on 4 forked CPU ranks; what the ranks printed, and the steps rank 0 ended at."""
    strategy = HexiScaleStrategy(global_batch=8, planner_iterations=2, start_method="fork", timeout=PG_TIMEOUT)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[_Steps(tmp_path / "steps")])
    trainer.fit(LlamaLitModule("llama_tiny", lr=1e-3), DataLoader(generated_corpus(8 * 2, 128), batch_size=8))
    return capfd.readouterr().out + f"\nSTEPS {(tmp_path / 'steps').read_text()}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fit_without_cluster_discovers_plans_trains_and_reuses(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HEXISCALE_CACHE_DIR", str(tmp_path / "cache"))
    out = _fit(capfd, tmp_path)
    assert "STEPS 2" in out, out[-3000:]
    assert "discovering 4 rank(s) on 1 machine(s)" in out and "discovered in" in out, out[-3000:]
    files = [p for p in (tmp_path / "cache").glob("*.yaml") if not p.name.endswith(".matrix.yaml")]
    assert len(files) == 1
    doc = yaml.safe_load(files[0].read_text())
    assert doc["machines"][0]["count"] == 4 and doc["layer_times"][0]["model"]["name"] == "llama_tiny"
    assert {r["micro_batch"] for r in doc["layer_times"][0]["rows"]} == {1, 2, 4}  # 1, 2, 4 up to the batch of 8
    out = _fit(capfd, tmp_path)
    assert "STEPS 2" in out and "reusing the cluster discovered earlier" in out, out[-3000:]
