"""One process, started as torchrun starts a rank (world size 1, so the strategy runs in this
process): two ``Trainer.fit`` calls one after another, as in a notebook or a sweep. After each fit
and the Trainer dropped, the engine of that fit and every parameter of its stage must be gone.
Prints one JSON line per fit: {"main_grads": bool, "params": n, "alive": n, "engine_alive": bool}.

    python release_job.py          # the worker of test_release.py
"""

from __future__ import annotations

import gc
import json
import weakref

import lightning.pytorch as pl
import torch
from strategy_helpers import PG_TIMEOUT, loader, module, plan_of

from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

PLAN = plan_of([(4, 2, [([0], (0, 4))])])


class Grab(pl.Callback):
    """Weak references to the engine and its parameters at the end of training."""

    def __init__(self) -> None:
        self.found: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.pipeline_model.engine
        self.found = {"engine": weakref.ref(engine), "params": [weakref.ref(p) for p in engine.parameters()],
                      "main_grads": engine.main_grads is not None}


def fit_once() -> dict:
    grab = Grab()
    trainer = pl.Trainer(strategy=HexiScaleStrategy(plan=PLAN, timeout=PG_TIMEOUT), accelerator="cpu", devices=1,
                         precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[grab])
    trainer.fit(module(dtype=torch.float32), loader(8, 4))
    return grab.found


def main() -> None:
    torch.set_num_threads(1)
    for _ in range(2):
        found = fit_once()
        gc.collect()
        print(json.dumps({"main_grads": found["main_grads"], "params": len(found["params"]),
                          "alive": sum(r() is not None for r in found["params"]),
                          "engine_alive": found["engine"]() is not None}), flush=True)


if __name__ == "__main__":
    main()
