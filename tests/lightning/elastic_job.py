"""The worker of test_elastic.py and benchmarks/bench_elastic.py: elastic CPU training of a tiny Llama.

    torchrun ... elastic_job.py OUT CLUSTER_YAML MAX_STEPS EVERY [SLEEP_S]       # elastic (torchrun)
    python elastic_job.py OUT CLUSTER_YAML MAX_STEPS EVERY SLEEP_S --reference CKPT PLAN MACHINE [--mutate]

Elastic mode: ``HexiScaleStrategy(cluster=CLUSTER_YAML, elastic=ElasticSettings(OUT/ckpt, EVERY))``
under torchrun; each node's ``$HEXISCALE_MACHINE`` names its machine. Global rank 0 appends
``{"restart", "step", "loss", "time", "world"}`` per optimizer step to ``OUT/losses.jsonl`` and writes
its plan to ``OUT/plan-<restart>.yaml``; every worker writes its pid to
``OUT/pid-<machine>-<restart>``. ``SLEEP_S`` slows every step so that a kill lands mid-run.

Reference mode: one process, no torchrun, no elastic: the plan file PLAN on the devices of MACHINE
(the survivor's cluster), resumed with ``fit(ckpt_path=CKPT)``; losses to ``OUT/reference.jsonl``
(``--mutate``: another corpus, to ``OUT/mutant.jsonl``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.launch.elastic import ElasticSettings, ElasticStop
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan

TINY = LlamaConfig(name="tiny_elastic", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   ffn_hidden_size=128, vocab_size=256, seq_len=16)
HOLD_S = 2.0  # seconds a lone first worker waits per step while bench_elastic's hold file exists
G = 8  # global batch: the same on every plan, so the data position carries over


class Losses(pl.Callback):
    def __init__(self, path: Path, sleep_s: float):
        self.path, self.sleep_s = path, sleep_s

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            row = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1)), "step": trainer.global_step,
                   "loss": float(outputs["loss"]), "time": time.time(), "world": trainer.world_size}
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        # bench_elastic.HOLD_FILE (its path in HEXISCALE_HOLD_FILE): alone and not yet restarted, wait
        # for the second agent (bounded, so a SIGTERM of its join is acted on at the step boundary within HOLD_S)
        hold, until = os.environ.get("HEXISCALE_HOLD_FILE"), time.time() + HOLD_S
        if hold and trainer.world_size == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            while Path(hold).exists() and time.time() < until:
                time.sleep(0.05)


def data(seed: int | None = None) -> DataLoader:
    """Shuffled (the position inside the epoch matters on resume); ``seed``: another corpus (the
    test's mutation: a run that does not see the survivor's batches)."""
    return DataLoader(generated_corpus(G * 6, TINY.seq_len, seed=3 if seed is None else seed), batch_size=G,
                      shuffle=True)


def main() -> None:
    out, cluster_file, max_steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sleep_s = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    out_dir = Path(out)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = LlamaLitModule(TINY, lr=1e-2, dtype=torch.float64, init_seed=5, warmup_steps=2)
    common = dict(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if "--reference" in sys.argv:
        ckpt, plan_file, machine = sys.argv[sys.argv.index("--reference") + 1:][:3]
        full = Cluster.load(cluster_file)
        m = next(i for i, x in enumerate(full.machines) if x.name == machine)
        cluster = full.subset(list(full.machines[m].devices))
        plan = Plan.load(plan_file)
        strategy = HexiScaleStrategy(cluster=cluster, plan=plan, start_method="popen", timeout=60.0, num_threads=1)
        trainer = pl.Trainer(strategy=strategy, devices=plan.world_size,
                             callbacks=[Losses(out_dir / ("mutant.jsonl" if "--mutate" in sys.argv else
                                                          "reference.jsonl"), 0.0)], **common)
        trainer.fit(module, data(seed=4 if "--mutate" in sys.argv else None), ckpt_path=ckpt)
        return
    machine = os.environ.get("HEXISCALE_MACHINE", "?")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out_dir / f"pid-{machine}-{restart}").write_text(str(os.getpid()))
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    strategy = HexiScaleStrategy(cluster=cluster_file, timeout=30.0, watchdog_grace_s=2.0, planner_iterations=5,
                                 num_threads=1,
                                 elastic=ElasticSettings(out_dir / "ckpt", every_n_steps=every, keep=100))
    trainer = pl.Trainer(strategy=strategy, devices=local, num_nodes=world // local,
                         callbacks=[Losses(out_dir / "losses.jsonl", sleep_s)], **common)

    class SavePlan(pl.Callback):
        def on_train_start(self, trainer, module):
            if trainer.global_rank == 0:
                strategy.plan.save(out_dir / f"plan-{restart}.yaml")

    trainer.callbacks.append(SavePlan())
    try:
        trainer.fit(module, data())
    except ElasticStop:  # planned (a machine joins or leaves): rank 0 said so; torchrun restarts the workers
        sys.exit(5)
    if trainer.global_rank == 0:
        (out_dir / f"done-{restart}").write_text(json.dumps({"step": trainer.global_step, "world": world}))


if __name__ == "__main__":
    main()
