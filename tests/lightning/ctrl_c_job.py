"""``recipes/train.py`` with one phase made slow, so that a test's Ctrl-C lands in it for sure.

    python tests/lightning/ctrl_c_job.py PHASE KEY=VALUE ...

PHASE (the popen launcher re-runs this script, so every rank applies it):

- ``child_sleeps``: the ranks the launcher starts sleep before importing anything (rank 0 waits in
  the rendezvous for them, as when they are slow to import torch; it prints ``SLOW rendezvous``);
- ``child_dies``: they exit with status 3 at once (a rank that dies while the job starts);
- ``worker_starts`` (with ``-m``: spawn workers): each worker sleeps while multiprocessing's spawn
  bootstrap re-runs this script in it (``__mp_main__``), before any of the package's code runs there
  (prints ``SLOW worker start``);
- ``setup``: every rank sleeps in the strategy's setup (after the process group exists);
- ``step``: every rank sleeps in the training step of step 3;
- ``save``: every rank sleeps in the strategy's save_checkpoint.

Each prints ``SLOW <phase> (pid N)`` as it starts sleeping: rank 0 only under popen (the ranks the
launcher starts have ``LOCAL_RANK`` from the start), every worker under spawn and fork.
"""

import os
import sys
import time

PHASE = sys.argv.pop(1)
CHILD = "LOCAL_RANK" in os.environ


def slow(what: str, seconds: float = 300.0) -> None:
    if not CHILD:
        # one write(2) of the whole line: fork workers share stdout, and print's text and newline are
        # two writes there, so two workers' lines came out as "SLOW step (pid 1)SLOW step (pid 2)"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"SLOW {what} (pid {os.getpid()})\n".encode())
    time.sleep(seconds)


if PHASE == "child_sleeps" and CHILD:
    time.sleep(300)
if PHASE == "worker_starts" and __name__ == "__mp_main__":
    print("SLOW worker start", flush=True)
    time.sleep(300)
if PHASE == "child_dies" and CHILD:
    print(f"rank {os.environ['LOCAL_RANK']}: dying on purpose", file=sys.stderr, flush=True)
    sys.exit(3)

from lightning_hexiscale.cli.common import end_command  # noqa: E402
from lightning_hexiscale.cli.train import main  # noqa: E402
from lightning_hexiscale.cli.train_job import RECIPE  # noqa: E402

if PHASE == "child_sleeps":
    from lightning_hexiscale.lightning.launch.guard import LaunchGuard

    run = LaunchGuard.run  # rank 0, after starting the others; next: init_process_group waits for them
    LaunchGuard.run = lambda self, *a, **k: (print("SLOW rendezvous", flush=True), run(self, *a, **k))[1]
elif PHASE == "setup":
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    setup = HexiScaleStrategy.setup
    HexiScaleStrategy.setup = lambda self, trainer: (slow("setup"), setup(self, trainer))[1]
elif PHASE == "step":
    from lightning_hexiscale.lightning.example import LlamaLitModule

    step = LlamaLitModule.training_step
    LlamaLitModule.training_step = lambda self, *a, **k: (
        slow("step") if self.trainer.global_step == 2 else None, step(self, *a, **k))[1]
elif PHASE == "save":
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    save = HexiScaleStrategy.save_checkpoint
    HexiScaleStrategy.save_checkpoint = lambda self, *a, **k: (slow("save"), save(self, *a, **k))[1]

if __name__ == "__main__":
    end_command(main(sys.argv[1:], app=RECIPE, launch_prefix=(PHASE,)))
