"""``hexiscale train cluster=auto``: before planning, the launching process discovers this machine's
cluster for the run's model and precision with the code of ``hexiscale discover --local N``
(:func:`lightning_hexiscale.cli.discover.run_discover`), reusing the cached file when its fingerprint
matches, and the job plans and trains on the discovered cluster file.

Local ranks: 4 forked CPU ranks (as the demo's 4 processes: a CPU machine has no device count to
read, and 4 ranks fit the 60 s budget). On a machine with CUDA GPUs ``cluster=auto`` is refused with
the fix: ``hexiscale discover --local`` forks gloo ranks that measure the CPU, not the GPUs, so the
GPUs are discovered by ``hexiscale discover`` under torchrun (one rank per GPU), then ``cluster=FILE``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CPU_RANKS = 4
"""Local ranks discovered on a machine without CUDA (the demo's count)."""


def local_ranks() -> int:
    """How many local ranks discover: :data:`CPU_RANKS` CPU processes; a ConfigError on a CUDA machine."""
    import torch

    from lightning_hexiscale.errors import ConfigError

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        raise ConfigError("cluster", "auto", f"hexiscale train discovers with forked CPU ranks, which would "
                          f"measure the CPU instead of this machine's {n} CUDA GPU(s)",
                          f"discover on the GPUs first (`torchrun --nproc-per-node={n} -m lightning_hexiscale.cli "
                          "discover --model <model> --out my_cluster.yaml`), then pass cluster=my_cluster.yaml")
    return CPU_RANKS


def discover_for_train(cfg: DictConfig, say) -> str:
    """Discover (or reuse the cached) cluster for ``cfg``'s model and precision; replace ``cfg.cluster``
    by the file's node and hand the file to the popen children. Returns the file's path."""
    from lightning_hexiscale.cli.discover import local_args, run_discover
    from lightning_hexiscale.cli.train_job import AUTO_ENV, FILES_ENV
    from lightning_hexiscale.config.schema import ClusterConfig, load_yaml_node
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.precision import default_precision

    n = local_ranks()
    model = LlamaConfig.from_config(cfg.model)
    precision = cfg.trainer.precision or default_precision(False)
    args = local_args(n, str(precision))
    say(f"cluster=auto: discovering this machine's cluster for {model.name} ({precision}) on {n} local ranks "
        f"(no CUDA: CPU processes, as many as the demo's) ...")
    found = run_discover(args, model)  # the composed model itself (a preset, a file or hf:DIR alike)
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

