"""``Tuner(trainer).lr_find`` in a user's script with the default ``popen`` launcher (which re-runs
this script per rank, so it cannot run inside pytest): the worker of test_callbacks.py.

    python lr_find_job.py single|hexiscale ROOT_DIR

(``single``, one device and no launcher, is also ``run("single", ROOT_DIR)`` in the test's process.)

Each process writes ``LOSSES <the finder's losses> SUGGEST <lr> MODULE_LR <the module's lr>`` to
``ROOT_DIR/rank<r>.txt`` (the ranks share stdout, where their lines could interleave).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.tuner import Tuner
from strategy_helpers import PG_TIMEOUT, loader, module, plan_of

from lightning_hexiscale.lightning.strategy import HexiScaleStrategy


def main() -> None:
    run(sys.argv[1], sys.argv[2])


def run(case: str, root: str) -> None:
    """The case in this process (``single`` needs no launcher: the test calls it in its own)."""
    torch.set_num_threads(1)
    kw = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=root)
    if case == "hexiscale":
        plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])
        trainer = pl.Trainer(strategy=HexiScaleStrategy(plan=plan, timeout=PG_TIMEOUT), devices=2, **kw)
    else:
        trainer = pl.Trainer(devices=1, **kw)
    mod = module()
    found = Tuner(trainer).lr_find(mod, loader(6 * 12, 6), num_training=12, min_lr=1e-4, max_lr=1e-1)
    Path(root, f"rank{trainer.global_rank}.txt").write_text(
        f"LOSSES {found.results['loss']} SUGGEST {found.suggestion(skip_begin=2)} MODULE_LR {mod.lr}")


if __name__ == "__main__":
    main()
