"""Typed settings of ``recipes/train.py``: the ``trainer`` and ``data`` nodes of the root config.

They sit beside the shared groups (``cluster``, ``model``, ``train``, ``planner``: what to train and
on what) in :class:`lightning_hexiscale.config.HexiScaleConfig`, so a typo such as
``trainer.max_step=5`` fails at composition. Pure dataclasses: importing this module costs nothing.
Override from the command line::

    python recipes/train.py trainer.max_steps=100 trainer.precision=bf16-mixed data.kind=text data.path=book.txt
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainerConfig:
    """How the recipe runs Lightning's Trainer."""

    max_steps: int = 40
    """Optimizer steps (each on ``train.global_batch`` sequences)."""
    launcher: str = "popen"
    """popen (re-runs the script per rank; default, works under Hydra), spawn or fork. Hydra multirun
    (``-m``) always uses spawn, so no process or process group outlives its job."""
    precision: str = "32-true"
    """Lightning precision: 32-true, bf16-mixed, bf16-true or 64-true."""
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    """Clip by the global gradient norm over TP/PP/DP; null = off."""
    lr: float = 3e-3
    """AdamW peak learning rate."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up, in optimizer steps."""
    weight_decay: float = 0.1
    val_every: int = 20
    """Validate every this many training batches (0 = never)."""
    limit_val_batches: int = 2
    log_every: int = 5
    """Log (CSV) every this many steps."""
    seed: int = 0
    """Weight init and data order seed."""
    checkpoint_every: int = 0
    """Save a plan-independent checkpoint every this many steps (0 = only ``last`` at the end)."""
    resume: Optional[str] = None
    """A checkpoint directory to resume from (any plan, any cluster)."""
    weights: Optional[str] = None
    """A LOCAL Hugging Face Llama directory (config.json + *.safetensors) to start from (no download);
    its config.json must match the model (ConfigError otherwise). ``model=hf:/dir`` sets it."""
    logger: str = "csv"
    """csv (default), tensorboard (extra ``[tensorboard]``) or wandb (extra ``[wandb]``): Lightning's
    loggers, writing into the output directory; the plan table and the estimate are logged as
    hyper-parameters."""
    wandb_project: Optional[str] = None
    """wandb project (default ``hexiscale``)."""
    wandb_offline: bool = True
    """wandb runs offline (files under the output directory; ``wandb sync`` later) unless set false."""
    output_dir: Optional[str] = None
    """Where logs, the plan and checkpoints go; null = Hydra's run directory."""
    progress_bar: bool = True
    nonfinite: str = "stop"
    """A non-finite loss or gradient on any rank: stop (exit status 4, naming the step and ranks) or
    skip (drop that update on every rank and go on)."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective or p2p wait on a dead or hung rank fails after this long;
    with the failure watch every rank then stops within a few seconds (exit status 4)."""


@dataclass
class DataConfig:
    """Where the tokens come from (no download)."""

    kind: str = "generated"
    """generated (a deterministic corpus that ships with the code), text (a local UTF-8 file, byte
    tokens) or bin (a token file from ``hexiscale prepare-data``, or raw ids)."""
    path: Optional[str] = None
    """File for kind=text or kind=bin."""
    dtype: Optional[str] = None
    """kind=bin without a JSON index beside the file: uint16 (default) or uint32. With an index
    (``hexiscale prepare-data`` writes one) the index decides."""
    num_samples: int = 2048
    """Sequences of the generated corpus."""
    val_samples: int = 64
    """Sequences held out for validation (the last ones of the corpus)."""
    seed: int = 0
    """Seed of the generated corpus."""
