"""A user's script that calls the Python API with the default ``popen`` launcher (which re-runs this
script per rank, so it cannot run inside pytest): the worker of test_api_errors.py.

    python api_error_job.py CASE

Cases: ``layers`` (a plan for 6 layers with a 4-layer model: every rank finds it in setup),
``kill`` (rank 1 dies by ``os._exit`` at step 2). The launching process catches what ``fit``
raises and prints ``CAUGHT <type>: <message>``, waits long enough that an observer killing it
would show, and prints ``ALIVE``.
"""

from __future__ import annotations

import os
import sys
import time

import lightning.pytorch as pl
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader, module, plan_of

from lightning_hexiscale.lightning.strategy import HexiScaleStrategy


class DiesOnRank1(type(module())):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step == 2:
            os._exit(9)  # as SIGKILL or the OOM killer would end it
        return super().training_step(batch, batch_idx)


def main() -> None:
    case = sys.argv[1]
    torch.set_num_threads(1)
    layers = 6 if case == "layers" else 4
    plan = plan_of([(4, 2, [([0], (0, layers))]), (2, 1, [([1], (0, layers))])], num_layers=layers)
    strategy = HexiScaleStrategy(plan=plan, timeout=PG_TIMEOUT)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    mod = DiesOnRank1(TINY, dtype=torch.float64, init_seed=7) if case == "kill" else module()
    try:
        trainer.fit(mod, loader(36, 6))
        print("FINISHED", flush=True)
    except Exception as e:  # noqa: BLE001 -- what the user's code sees is what is tested
        print(f"CAUGHT {type(e).__name__}: {e}", flush=True)
        time.sleep(6)  # Lightning's own observer would SIGKILL this process within 5 s
        print("ALIVE", flush=True)


if __name__ == "__main__":
    main()
