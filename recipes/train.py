"""Train a LLaMA with the hexiscale strategy: ``hexiscale train`` under the recipe's name.

    python recipes/train.py                                  # discovers this machine (cached), plans, trains llama_demo
    python recipes/train.py cluster=cpu_demo                 # the demo: 4 CPU processes emulate cpu_demo
    python recipes/train.py trainer.max_steps=200 trainer.precision=bf16-mixed
    python recipes/train.py cluster=hetero3 model=llama_30b dry_run=true   # only plans, anywhere
    python recipes/train.py -m cluster=cpu2,cpu_hetero4 train.global_batch=8,16

The same Hydra app, config and exit statuses as ``hexiscale train`` (lightning_hexiscale/cli/train.py,
``python recipes/train.py --help``); its messages and the launch commands it prints name this script.
"""

from lightning_hexiscale.cli.common import end_command
from lightning_hexiscale.cli.train import main
from lightning_hexiscale.cli.train_job import RECIPE

if __name__ == "__main__":
    end_command(main(app=RECIPE, launch_prefix=()))
