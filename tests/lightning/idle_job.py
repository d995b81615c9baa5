"""One rank of a CPU training job whose plan leaves launch rank 0's device idle, started by torchrun
or, torchrun-style, by the test itself (RANK, WORLD_SIZE, ... in the environment): the worker of
test_idle_ranks.py.

    python idle_job.py OUT {static,elastic} PLAN_FILE MAX_STEPS [FAIL_STEP]

``static``: ``HexiScaleStrategy(plan=PLAN_FILE)``; ``OUT/ckpt/last.ckpt`` every 2 steps (ModelCheckpoint),
and ``trainer.save_checkpoint(OUT/after_fit)`` after ``fit`` (a no-op on the idle ranks).
``elastic``: ``HexiScaleStrategy(cluster=<3 CPU devices>, elastic=OUT/elastic)``, with the planner's
search replaced by PLAN_FILE (the search that chooses idle devices is not this test's subject); it
saves every 2 steps and resumes from the newest checkpoint at every start.
Training rank 0 appends ``{"step", "loss", "world", "time"}`` per step to ``OUT/losses.jsonl``; every process
writes ``OUT/done<launch rank>`` (its rank and world size as the Trainer saw them) when ``fit``
returns. With FAIL_STEP, training rank 1 raises at that step. At a normal exit every process prints
``process groups at exit: <initialized>`` from an ``atexit`` handler registered before the strategy's,
so it runs after it (``runtime.host.destroy_groups_at_exit``: ``False`` expected).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TINY, loader, module

from lightning_hexiscale.lightning import plan_resolution
from lightning_hexiscale.lightning.launch.elastic import ElasticSettings
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.planner import Plan

CLUSTER = {"name": "three", "machines": [{"name": "m", "gpu": "CPU-FAST", "count": 3, "intra_bandwidth": "10 GB/s"}],
           "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"}}


class Steps(pl.Callback):
    def __init__(self, out: Path, fail_step: int | None):
        self.out, self.fail_step = out, fail_step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == self.fail_step:
            raise ValueError(f"injected failure on training rank 1 at step {self.fail_step}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            row = {"step": trainer.global_step, "loss": float(outputs["loss"]), "world": trainer.world_size,
                   "time": time.time()}
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def main() -> None:
    out, mode, plan_file, max_steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    fail_step = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    atexit.register(lambda: print(f"process groups at exit: {dist.is_initialized()}", flush=True))
    plan = Plan.load(plan_file)
    common = dict(timeout=30.0, watchdog_grace_s=2.0, num_threads=1)
    if mode == "elastic":
        from lightning_hexiscale.config.cluster import Cluster

        plan_resolution.search_plan = lambda *args, **kwargs: (plan, None)
        strategy = HexiScaleStrategy(cluster=Cluster.from_config(CLUSTER), global_batch=plan.global_batch,
                                     elastic=ElasticSettings(out / "elastic", every_n_steps=2), **common)
    else:
        strategy = HexiScaleStrategy(plan=plan, **common)
    saver = [ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, save_top_k=0, every_n_train_steps=2)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                         max_steps=max_steps, logger=False, enable_checkpointing=mode == "static",
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Steps(out, fail_step), *(saver if mode == "static" else [])])
    trainer.fit(module(), loader(plan.global_batch * 4, plan.global_batch))
    if mode == "static":
        trainer.save_checkpoint(str(out / "after_fit"))
    (out / f"done{os.environ['RANK']}").write_text(json.dumps([trainer.global_rank, trainer.world_size]))


if __name__ == "__main__":
    assert TINY.num_layers == 4
    main()
