"""One rank of a 3-rank CPU training job, started as torchrun would start it (RANK, WORLD_SIZE, ...
in the environment; no launcher that could kill the other ranks): the worker of
test_rank_failure.py.

    python rank_job.py OUT_DIR FAIL_RANK FAIL_STEP {raise,kill,hang} TIMEOUT_S

Rank FAIL_RANK raises, ``os._exit``s (as a SIGKILL or the OOM killer would end it) or hangs inside
``training_step`` of step FAIL_STEP, while the other ranks are already waiting for it in the
pipeline's p2p and collective calls; there it first writes ``OUT_DIR/at_failure``, waits for
``OUT_DIR/loaded`` (the test has started its CPU load), and writes the time to ``OUT_DIR/failed_at``.
Each rank writes ``OUT_DIR/done{rank}`` if ``fit`` returns.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from strategy_helpers import TINY, loader, module, plan_of

from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

# Pipeline 0: two stages on ranks 0 and 1; pipeline 1: one stage on rank 2.
PLAN = plan_of([(4, 2, [([0], (0, 2)), ([1], (2, 4))]), (2, 1, [([2], (0, 4))])])


class FailingModule(type(module())):
    def __init__(self, out: str, fail_rank: int, fail_step: int, how: str):
        super().__init__(TINY, dtype=torch.float64, init_seed=7, lr=1e-2)
        self.out = out
        self.fail_rank, self.fail_step, self.how = fail_rank, fail_step, how

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.trainer.global_step == self.fail_step:
            Path(self.out, "at_failure").write_text("")
            for _ in range(3000):  # the test's loops start now (at most 60 s: a test that is gone never writes it)
                if Path(self.out, "loaded").exists():
                    break
                time.sleep(0.02)
            Path(self.out, "failed_at").write_text(repr(time.time()))
            if self.how == "kill":
                os._exit(9)
            if self.how == "hang":  # alive, heartbeat beating, but never enters the next collective
                time.sleep(3600)
            raise ValueError(f"injected failure on rank {self.global_rank} at step {self.fail_step}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, fail_rank, fail_step, how, timeout_s = sys.argv[1:6]
    torch.set_num_threads(1)
    strategy = HexiScaleStrategy(plan=PLAN, timeout=float(timeout_s), watchdog_grace_s=3.0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=PLAN.world_size, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FailingModule(out, int(fail_rank), int(fail_step), how), loader(6 * 6, 6))
    Path(out, f"done{trainer.global_rank}").write_text("ok")


if __name__ == "__main__":
    main()
