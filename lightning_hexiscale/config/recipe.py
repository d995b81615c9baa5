"""Typed settings of ``hexiscale train`` (and ``recipes/train.py``): the ``trainer`` and ``data`` nodes of the root config.

They sit beside the shared groups (``cluster``, ``model``, ``train``, ``planner``: what to train and
on what) in :class:`lightning_hexiscale.config.HexiScaleConfig`, so a typo such as
``trainer.max_step=5`` fails at composition. Pure dataclasses: importing this module costs nothing.
Override from the command line::

    hexiscale train trainer.max_steps=100 trainer.precision=bf16-mixed data.kind=text data.path=book.txt
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_hexiscale.config.fast_path import DEFAULT_LOSS_CHUNK_BYTES
from lightning_hexiscale.config.values import register_section_check


MAX_VAL_SAMPLES = 2**27
"""Most held-out sequences (``data.val_samples``): the generated corpus holds at most 2**27 tokens
(``data.datasets.MAX_GENERATED_TOKENS``, which caps ``data.num_samples``), and 2**27 sequences of a
text or token file are a tenth of a corpus of over 1.3e9 sequences."""


@dataclass
class FastPathConfig:
    """``trainer.fast_path.*``: the stage's speed switches (:class:`~.fast_path.FastPath`, where each
    is documented); null = auto (a GPU run takes the whole fast path, compile is off on CPU)."""

    compile: Optional[bool] = None
    fused_norm: Optional[bool] = None
    cast_once: Optional[bool] = None
    main_grads: Optional[bool] = None
    fused_adamw: Optional[bool] = None
    chunked_loss: Optional[bool] = None
    attention: str = "auto"
    """auto, flash_attn, sdpa, sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math or eager."""
    compile_backend: str = "inductor"
    loss_chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES


DEFAULT_GRADIENT_CLIP_VAL = 1.0
"""The recipe's clip by the global gradient norm: also the ``clip_norm`` with which calibration,
check-estimate and the benchmarks run ``PipelineEngine.fit_step``, so that they time the step the
recipe trains with."""


@dataclass
class TrainerConfig:
    """How the recipe runs Lightning's Trainer."""

    max_steps: int = 40
    """Optimizer steps (each on ``train.global_batch`` sequences)."""
    launcher: str = "popen"
    """popen (re-runs the script per rank; default, works under Hydra), spawn or fork. Hydra multirun
    (``-m``) always uses spawn, so no process or process group outlives its job."""
    precision: Optional[str] = None
    """Lightning precision: 32-true, bf16-mixed, bf16-true, 64-true or 16-true (16-mixed is refused:
    no fp16 gradient scaler); also the training dtype the cost model prices (:func:`precision_dtype`).
    null: 32-true on emulated CPU clusters, bf16-mixed on GPUs (:func:`effective_precision`); the
    run's config.yaml records the value used."""
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = DEFAULT_GRADIENT_CLIP_VAL
    """Clip by the global gradient norm over TP/PP/DP; null = off."""
    lr: float = 3e-3
    """AdamW peak learning rate."""
    adam_eps: float = 1e-8
    """AdamW eps. 1e-8 rounds to 0 in float16: with ``precision=16-true`` use e.g. 1e-4."""
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
    async_checkpoint: bool = False
    """Write checkpoints in the background (``HexiScaleStrategy(async_checkpoint=True)``): training
    waits only for the copy of this rank's pieces, a writer thread writes them."""
    save_on_interrupt: bool = True
    """Ctrl-C during training stops every rank at the end of the step; true (default): save that
    step to ``checkpoints/last.ckpt`` first (atomic; resuming from it continues exactly), so the
    steps since the last periodic checkpoint are kept; false: the last checkpoint written is kept as
    it is (docs/guide/interrupts.md says why true is the default)."""
    resume: Optional[str] = None
    """A checkpoint directory to resume from (any plan, any cluster); ``last``: the output directory's
    ``checkpoints/last.ckpt`` (refused when there is none in Hydra's new per-run directory; in a
    fixed ``trainer.output_dir`` or ``hydra.run.dir`` the first run starts from step 0 and says so)."""
    elastic: bool = False
    """Elastic training under torchrun (``--nnodes=MIN:MAX``, c10d; README "Elastic training"): every
    (re)start plans for the machines present (``HEXISCALE_MACHINE`` on each node), resumes from the
    newest complete checkpoint under ``<output_dir>/elastic``, saves there every ``checkpoint_every``
    steps and on SIGTERM. Needs ``trainer.output_dir`` on a file system all nodes share."""
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
    progress_bar: Optional[bool] = None
    """Lightning's progress bar. null: shown when stdout is a terminal, off when it is a file or a
    pipe (the bar's ``\r`` redraws would pile up there; the loss lines every ``log_every`` steps
    are printed either way); true: always; false: never."""
    nonfinite: str = "stop"
    """A non-finite loss or gradient on any rank: stop (exit status 4, naming the step and ranks) or
    skip (drop that update on every rank and go on)."""
    fast_path: FastPathConfig = field(default_factory=FastPathConfig)
    """The stage's speed switches, e.g. ``trainer.fast_path.compile=false`` (``HexiScaleStrategy(compile=False)``)."""
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
    """Sequences held out for validation (the last ones of the corpus), at most a tenth of it (the
    recipe says so when it holds out fewer)."""
    seed: int = 0
    """Seed of the generated corpus."""


PRECISION_DTYPES = {"32-true": "fp32", "64-true": "fp64", "bf16-mixed": "bf16", "bf16-true": "bf16",
                    "16-true": "fp16"}
"""Lightning precision -> the dtype of weights, activations and gradients on the wire that the cost
model prices (mixed precision: bf16 activations and compute; fp32 master weights are counted in
the optimizer's bytes per parameter). The precisions the hexiscale runtime trains in; ``16-mixed``
is refused (:data:`REFUSED_PRECISIONS`)."""

REFUSED_PRECISIONS = {
    "16-mixed": "float16 mixed precision needs a gradient scaler in the backward, and the hexiscale strategy runs "
                "the backward itself without one (on CPU Lightning would silently train it as bf16-mixed instead)",
}
"""Lightning precisions that exist but that the runtime refuses, with the reason."""

PRECISION_SHORT_NAMES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}
"""The short names ``Trainer(precision=...)`` also takes, and the full names Lightning reads them as.
The recipe asks for the full name (it keys layer tables and the discovery cache by it), and its error
names the one meant."""


def device_kind(gpu_types: list[str]) -> str:
    """What the runtime runs on for devices of these types: ``cpu`` when every one is an emulated CPU
    device (a type named ``CPU`` or ``CPU-...``: the emulated presets, profiled CPU hosts), else
    ``cuda``. The cost model prices NCCL buffers and the multi-tensor optimizer step on ``cuda`` only."""
    types = [str(t).upper() for t in gpu_types]
    return "cpu" if types and all(t == "CPU" or t.startswith("CPU-") for t in types) else "cuda"


def effective_precision(precision: str | None, gpu_types: list[str]) -> str:
    """``trainer.precision`` as given, or when null: ``32-true`` when every device is an emulated CPU
    device (:func:`device_kind`; bf16 on CPUs is slow and inexact), else ``bf16-mixed``."""
    if precision is not None:
        precision_dtype(precision)  # checks it
        return str(precision)
    return "32-true" if device_kind(gpu_types) == "cpu" else "bf16-mixed"


def precision_dtype(precision: str, key: str = "trainer.precision") -> str:
    """The cost model's dtype of a Lightning precision (``32-true`` -> fp32, ``bf16-mixed`` -> bf16);
    a ConfigError naming ``key`` for a precision the runtime does not train in."""
    from lightning_hexiscale.errors import ConfigError

    valid = ", ".join(PRECISION_DTYPES)
    full = PRECISION_SHORT_NAMES.get(str(precision), str(precision))
    if full in REFUSED_PRECISIONS:
        said = "" if full == str(precision) else f"Lightning reads {precision} as {full}: "
        raise ConfigError(key, precision, f"{said}{REFUSED_PRECISIONS[full]}; the precisions the strategy trains "
                          f"in are {valid}", "use bf16-mixed (float32 weights, bfloat16 compute: float32's range, "
                          "so no scaler is needed), or 32-true")
    if str(precision) not in PRECISION_DTYPES:
        fix = "use 32-true (fp32) or bf16-mixed, or leave it out (null) to choose by the cluster"
        if full != str(precision):
            fix = f"write its full name, {full} (Lightning reads {precision} as {full})"
        raise ConfigError(key, precision, f"must be one of {valid}", fix)
    return PRECISION_DTYPES[str(precision)]


CKPT_ALIASES = ("last", "best", "hpc", "registry")
"""``ckpt_path`` values Lightning resolves itself."""


def check_ckpt_path(path: str | Path | None, key: str = "ckpt_path") -> None:
    """A checkpoint to resume from must exist (a directory that ``ModelCheckpoint`` or
    ``trainer.save_checkpoint`` wrote under this strategy); checked before any rank starts."""
    from lightning_hexiscale.config.file_errors import is_dir, is_file
    from lightning_hexiscale.errors import ConfigError

    if path is None or (isinstance(path, str) and path.split(":")[0] in CKPT_ALIASES):
        return
    p = Path(path)
    if not (is_dir(p) or is_file(p)):  # not Path.exists: it raised OSError for a name longer than the OS allows
        raise ConfigError(key, str(path), "no such checkpoint",
                          "give a checkpoint directory the strategy saved (e.g. outputs/.../checkpoints/last.ckpt), "
                          "or leave it out to start from scratch")
    if not is_dir(p):
        # Most often the one file Lightning's own strategies (one device, DDP) save: say how its
        # weights can still be used, since only the strategy's own directories resume
        raise ConfigError(key, str(path), "a hexiscale checkpoint is a directory, not a file (a one-file "
                          "checkpoint, as Lightning writes on one device or under DDP, does not resume under the "
                          "hexiscale strategy)", "give the directory ModelCheckpoint wrote under the hexiscale "
                          "strategy; to start from a one-file checkpoint's weights, load them into the module "
                          "(LlamaLitModule.load_from_checkpoint(path, config=...), or your module's own) and "
                          "train or evaluate it without ckpt_path (its optimizer and loop state stay behind)")


def check_values(cfg) -> None:
    """The ``trainer.*`` and ``data.*`` values that can be checked without any process (the
    optimizer's, the schedule's, the data's sizes), checked before planning (``data.kind`` and the
    files: :func:`lightning_hexiscale.data.make_dataset`, also before planning): torch would refuse some of
    them only inside the ranks, after the search and the launch (``trainer.lr=-0.001`` was a
    ``ValueError`` traceback per rank), and others it would take silently (a negative warm-up).
    ``cfg`` is the composed config (the ``trainer`` and ``data`` nodes)."""
    from lightning_hexiscale.errors import ConfigError

    t, d = cfg.trainer, cfg.data
    positive = {"lr": ("the AdamW learning rate", "3e-3"), "adam_eps": ("AdamW's eps", "1e-8")}
    # nan and inf pass a plain comparison (or fail it silently): AdamW would take them and the loss turn nan
    for key, (what, example) in positive.items():
        if not 0 < float(t[key]) < float("inf"):
            raise ConfigError(f"trainer.{key}", t[key], f"{what} must be a positive number (finite)",
                              f"e.g. trainer.{key}={example}")
    at_least = {"trainer.weight_decay": (t.weight_decay, 0, "0.1"), "trainer.warmup_steps": (t.warmup_steps, 0, "5"),
                "trainer.val_every": (t.val_every, 0, "20 (0: never)"),
                "trainer.checkpoint_every": (t.checkpoint_every, 0, "100 (0: only last at the end)"),
                "trainer.limit_val_batches": (t.limit_val_batches, 1, "2"), "trainer.seed": (t.seed, 0, "0"),
                "data.num_samples": (d.num_samples, 1, "2048"), "data.val_samples": (d.val_samples, 0, "64"),
                "data.seed": (d.seed, 0, "0")}
    for key, (value, low, example) in at_least.items():
        if not low <= float(value) < float("inf"):
            rule = ("must not be negative" if low == 0 else f"must be at least {low}") + " (and finite)"
            raise ConfigError(key, value, rule, f"e.g. {key}={example}")
    if int(d.val_samples) > MAX_VAL_SAMPLES:  # 2**70 was taken here, then cut to a tenth of the corpus in the ranks
        raise ConfigError("data.val_samples", d.val_samples, f"must be at most {MAX_VAL_SAMPLES:,} sequences (the "
                          "generated corpus's cap of 2**27 tokens; at most a tenth of a corpus validates)",
                          "e.g. data.val_samples=64")
    if t.gradient_clip_val is not None and not float(t.gradient_clip_val) > 0:
        raise ConfigError("trainer.gradient_clip_val", t.gradient_clip_val, "the clip norm must be positive, or null "
                          "for no clipping", "e.g. trainer.gradient_clip_val=1.0, or trainer.gradient_clip_val=null")


register_section_check(("trainer", "data"), check_values)  # what a "did you mean" proposes passes these too


def check_output_file(flag: str, path: str, example: str, kind: str | None = None) -> None:
    """``flag PATH`` names a file this command may write: checked before the work that fills it (a
    search, a measurement), so that a typo costs nothing. Missing folders are created when it is
    written (as ``hexiscale profile`` and ``discover`` do); a folder, or a path below a file, is refused.
    ``kind`` (``cluster``, ``plan``): the file written is of that kind, so an existing file it would
    replace must be one too, or empty (:func:`check_replaced_kind`)."""
    from pathlib import Path

    from lightning_hexiscale.errors import ConfigError

    if not str(path).strip():
        raise ConfigError(flag, path, "is empty; this option names the file to write", f"give a file path, e.g. {flag} {example}")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(flag, path, "is a directory; this option names the file to write",
                          f"give a file path, e.g. {flag} {p / example}")
    if p.exists() and not p.is_file():  # the write's rename put a plain file in a FIFO's or device's place
        raise ConfigError(flag, path, "exists and is not a regular file (a FIFO, socket or device)",
                          f"give the path of a new or regular file, e.g. {flag} {example}")
    parent = nearest_existing(p.parent)
    if not parent.is_dir():
        raise ConfigError(flag, path, f"{parent} is a file, not a directory", "give a path inside a directory")
    refused = cannot_create_in(parent)
    if refused:
        raise ConfigError(flag, path, refused, "give a path inside a writable directory")
    if kind is not None:
        check_replaced_kind(flag, path, kind)


def check_replaced_kind(flag: str, path: str, kind: str) -> None:
    """An existing file at ``path`` that ``flag`` would replace with a ``kind`` file must be a ``kind``
    file already (by its top-level keys: :data:`~lightning_hexiscale.config.suggest.FILE_MARKERS`) or
    empty: ``hexiscale profile --out p.yaml`` replaced a plan file without a word."""
    from pathlib import Path

    import yaml

    from lightning_hexiscale.config.suggest import FILE_MARKERS, file_kind
    from lightning_hexiscale.errors import ConfigError

    p = Path(path)
    if not p.is_file():
        return
    try:
        text = p.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if text.strip() else {FILE_MARKERS[kind]: None}  # empty: nothing is lost
    except (OSError, ValueError, yaml.YAMLError):
        data = None
    found = file_kind(data) if isinstance(data, dict) else None
    if found == kind:
        return
    what = (f"is a {found} file (it has {FILE_MARKERS[found]}:)" if found is not None
            else f"is not a {kind} file (it has no {FILE_MARKERS[kind]}: key)")
    raise ConfigError(flag, path, f"exists and {what}; writing the {kind} file there would replace what it holds",
                      f"give a new path, or the path of a {kind} file to replace (delete this file first if it is "
                      "meant to go)")


def nearest_existing(path):
    """``path`` or its nearest ancestor that exists (``.`` at worst, for a relative path)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(key: str, path, fix: str) -> None:
    """``path`` names a directory a run creates and writes into (its checkpoints): refused before the run
    when it is a file, lies below a file, or the nearest folder that exists cannot be written (rank 0's
    raw ``OSError`` from ``mkdir`` when the first checkpoint was saved, after the training)."""
    from pathlib import Path

    from lightning_hexiscale.errors import ConfigError

    parent = nearest_existing(Path(path))
    if not parent.is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory" if parent == Path(path) else
                          f"lies below {parent}, which is a file, so no directory can be created there", fix)
    refused = cannot_create_in(parent)
    if refused:
        raise ConfigError(key, str(path), refused, fix)


def cannot_create_in(folder) -> str | None:
    """Why no file can be created in ``folder`` (an existing directory), or None when one can. The
    permission bits (``os.access``) do not say it for root, to whom every folder looks writable: /proc,
    /sys and a read-only mount refuse only the write itself, which came after the search or measurement
    (``hexiscale plan --out /proc/plan.yaml`` searched, then failed). So an empty file of a unique name
    is created there and removed at once: nothing is left that the user did not ask for."""
    import os
    import tempfile

    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in {folder} (no permission)"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".hexiscale-write-check-")
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None
