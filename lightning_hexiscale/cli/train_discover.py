"""``hexiscale train`` with ``cluster=auto``, its default: before planning, the launching process discovers this
machine's cluster for the run's model and precision with the code of ``hexiscale discover --local N``
(:func:`lightning_hexiscale.cli.discover.run_discover`), reusing the cached file when its fingerprint
matches, and the job plans and trains on the discovered cluster file. ``cluster=<preset or file>`` skips it.

Local ranks (:func:`lightning_hexiscale.cli.discover_local.local_launch`): one spawned NCCL rank per visible
CUDA GPU, else 4 forked CPU ranks (as the demo's 4 processes). Under torchrun/SLURM and in ``-m`` sweeps the
job does not discover (:func:`lightning_hexiscale.cli.train_job.take_auto_cluster` refuses with the fix).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

SKIP_HINT = "pass cluster=<preset or file> to skip discovery"


def banner(how: str | None, model: str, precision: str, ranks: str) -> str:
    """The line printed before discovery: why it runs (``cluster=auto`` given, or the default), for what, on
    which ranks, and how to skip it."""
    why = "cluster=auto" if how == "given" else "cluster defaults to auto (discovered and cached)"
    return (f"{why}: discovering this machine's cluster for {model} ({precision}) on {ranks}, or reusing the "
            f"cached one; {SKIP_HINT}")


def discover_for_train(cfg: DictConfig, say, how: str | None = "given") -> str:
    """Discover (or reuse the cached) cluster for ``cfg``'s model and precision; replace ``cfg.cluster``
    by the file's node and hand the file to the popen children. ``how``: ``given`` (cluster=auto on the
    command line) or ``default`` (no cluster=), for the banner. Returns the file's path."""
    from lightning_hexiscale.cli.discover import local_args, run_discover
    from lightning_hexiscale.cli.discover_local import local_launch
    from lightning_hexiscale.cli.train_job import AUTO_ENV, FILES_ENV
    from lightning_hexiscale.config.schema import ClusterConfig, load_yaml_node
    from lightning_hexiscale.lightning.launch import job_watch
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.precision import default_precision

    launch = local_launch()
    model = LlamaConfig.from_config(cfg.model)
    precision = cfg.trainer.precision or default_precision(launch.backend == "nccl")
    args = local_args(launch.ranks, str(precision))
    say(banner(how, model.name, str(precision), launch.describe()))
    # not a main-thread phase: on Ctrl-C the watch ends the job at once, the discovery ranks with it
    job_watch.set_phase("discovering")
    found = run_discover(args, model)  # the composed model itself (a preset, a file or hf:DIR alike)
    job_watch.set_phase("planning")
    path = str(Path(found.path).resolve())  # discovery said in one line whether it reused the cached file
    node = load_yaml_node(path, ClusterConfig, "cluster")
    OmegaConf.set_struct(cfg, False)
    cfg.cluster = node
    OmegaConf.set_struct(cfg, True)
    files = json.loads(os.environ.get(FILES_ENV, "{}"))
    files["cluster"] = path
    os.environ[FILES_ENV] = json.dumps(files)  # the popen children read the file, not cluster=auto
    os.environ.pop(AUTO_ENV, None)
    return path
