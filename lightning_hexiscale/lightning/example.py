"""An ordinary one-device LightningModule for causal language modelling with the plain LLaMA.

Nothing in it knows about pipelines, tensor parallelism or heterogeneous devices: it trains as is
on one device (``Trainer(accelerator="cpu", devices=1)``) and unchanged under
``Trainer(strategy="hexiscale", devices=N)``. It meets the strategy's contract:

- ``configure_model`` builds the :class:`Llama` as ``self.model`` (the strategy builds it on the meta
  device and replaces it by this rank's stage); it initialises the weights only when they are real,
  from ``self.init_seed``, which is also the seed the strategy initialises its shards from, or from
  ``self.init_state_dict`` (global name -> full tensor, e.g. HF weights via ``weights.attach_weights``,
  or ``LlamaLitModule("hf:/path/to/dir")``, which takes the shape and the weights of that directory);
- the loss is ``self.model.loss(self.model(tokens), targets)``: the mean token cross-entropy of the
  batch (under the strategy: of the global batch, the same value on every rank);
- a batch is a (B, S + 1) tensor of token ids: inputs are [:, :-1], targets [:, 1:] (or a mapping
  holding it as ``input_ids``, Hugging Face's style: :func:`token_batch`).
"""

from __future__ import annotations

import math
import numbers
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_hexiscale.config.hf_model import HF_PREFIX
from lightning_hexiscale.errors import ConfigError, shown
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama


def token_batch(batch, key: str) -> torch.Tensor:
    """The (B, S + 1) integer tensor of a batch: the tensor itself, the one tensor of a list or tuple
    (``TensorDataset``'s rows), or a Hugging Face style mapping's ``input_ids`` (its targets are the
    next tokens, ``input_ids[:, 1:]``, as a causal LM's ``labels=input_ids`` are). What the module
    would not read as given (``labels`` other than ``input_ids``, padding in ``attention_mask``, any
    other key) is a ConfigError rather than dropped; so is anything else (it was a TypeError or
    IndexError from the slicing)."""
    from collections.abc import Mapping

    fix = ("collate each batch into a (batch, seq_len + 1) tensor of token ids, or write your own "
           "training_step")
    if isinstance(batch, (list, tuple)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
        others = sorted(str(k) for k in batch if k not in ("input_ids", "labels", "attention_mask"))
        if others:
            raise ConfigError(key, f"a mapping with {others}", "LlamaLitModule reads input_ids (and labels / "
                              "attention_mask where they change nothing), no other key", fix)
        labels, mask = batch.get("labels"), batch.get("attention_mask")
        if labels is not None and not (torch.is_tensor(labels) and torch.is_tensor(ids) and torch.equal(labels, ids)):
            raise ConfigError(f"{key}['labels']", "not input_ids", "LlamaLitModule trains every next token of "
                              "input_ids (targets input_ids[:, 1:]); other labels (masked with -100, shifted) "
                              "would not be read", "leave labels out of the batch, or write your own training_step")
        if mask is not None and not (torch.is_tensor(mask) and bool((mask == 1).all())):
            raise ConfigError(f"{key}['attention_mask']", "not all ones", "LlamaLitModule trains on whole "
                              "rows; padded positions would be trained on as tokens", "pack the text into full rows "
                              "(hexiscale prepare-data does), or write your own training_step")
        batch = ids
    if not (torch.is_tensor(batch) and batch.dim() == 2 and not batch.is_floating_point() and not batch.is_complex()
            and batch.dtype != torch.bool and batch.shape[1] >= 2):
        what = (f"a {batch.dim()}-D {str(batch.dtype).removeprefix('torch.')} tensor of shape {list(batch.shape)}"
                if torch.is_tensor(batch) else f"a {type(batch).__name__}")
        raise ConfigError(key, what, "a batch is a (batch, seq_len + 1) integer tensor of token ids: inputs "
                          "[:, :-1], targets [:, 1:] (or a mapping holding it as input_ids)", fix)
    return batch


class LlamaLitModule(pl.LightningModule):
    """Causal LM training of :class:`Llama` with AdamW.

    Args:
        config: the model shape: a :class:`LlamaConfig`, a preset name such as ``"llama_tiny"``, a model
            YAML file's path (str or Path), or
            ``"hf:/path/to/dir"`` (a local Hugging Face Llama directory: its config.json and weights), or
            a transformers ``LlamaConfig`` (``AutoConfig.from_pretrained(...)``: its shape only, the weights
            initialised from ``init_seed``).
        lr: AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        init_seed: weight initialisation seed (``Llama.init_weights``).
        dtype: parameter dtype (``torch.float64`` for exactness tests).
        eps: AdamW eps. The default 1e-8 rounds to 0 in float16: under ``precision="16-true"`` use
            e.g. 1e-4 (or train in bf16-mixed / bf16-true).
    """

    def __init__(self, config: LlamaConfig | str | os.PathLike = "llama_tiny", lr: float = 3e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0, init_seed: int = 0,
                 dtype: torch.dtype = torch.float32, eps: float = 1e-8):
        super().__init__()
        if isinstance(config, os.PathLike):  # a model file as a Path, as HexiScaleStrategy(cluster=Path) takes one
            config = os.fspath(config)
        if isinstance(config, str) and config.startswith(HF_PREFIX):
            from lightning_hexiscale.data.weights import load_hf

            config, self.init_state_dict = load_hf(config[len(HF_PREFIX):], key="LlamaLitModule(config)")
        elif not isinstance(config, (LlamaConfig, str)) and callable(getattr(config, "to_dict", None)):
            config = LlamaConfig.from_hf(config)  # a transformers config (AutoConfig): its shape only
        if not isinstance(config, (LlamaConfig, str)):
            raise ConfigError("LlamaLitModule(config)", shown(config), f"is of type {type(config).__name__}; it must "
                              "be a LlamaConfig, a preset name, 'hf:/path/to/dir' or a transformers LlamaConfig",
                              "pass e.g. LlamaLitModule('llama_tiny')")
        self.config = LlamaConfig.load(config, key="LlamaLitModule(config)") if isinstance(config, str) else config
        _check_optimizer_args(lr, weight_decay, betas, warmup_steps, init_seed, dtype, eps)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, tuple(betas), eps
        self.warmup_steps, self.init_seed, self.param_dtype = warmup_steps, init_seed, dtype
        self.model: Llama | None = None

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's, and also a checkpoint directory the hexiscale strategy saved (Lightning's
        ``torch.load`` fails on a directory): the module with the checkpoint's model shape and its
        full weights, gathered from the shards of any plan, built on this process's default device
        (then ``map_location``, a device, when given); ``kwargs`` go to the constructor (lr, ...).
        The parameters keep the dtype they were saved in (as ``load_llama``: float64 for a 64-true run,
        bfloat16 for bf16-true, float32 for 32-true and bf16-mixed, whose weights are float32); they were
        built in the constructor's float32, which rounded a float64 checkpoint without a word.
        ``dtype=`` casts them."""
        import os
        from pathlib import Path

        if not isinstance(checkpoint_path, (str, os.PathLike)) or not Path(checkpoint_path).is_dir():
            return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        from lightning_hexiscale.runtime import load_checkpoint_state_dict, read_checkpoint_meta

        if "config" in kwargs:
            raise ConfigError("config", kwargs["config"], "the checkpoint defines the model's shape",
                              f"drop config=: LlamaLitModule.load_from_checkpoint({str(checkpoint_path)!r})")
        meta = read_checkpoint_meta(checkpoint_path)  # a complete checkpoint, or a ConfigError saying what it is
        state = load_checkpoint_state_dict(checkpoint_path)
        kwargs.setdefault("dtype", next(iter(state.values())).dtype)  # the saved dtype: the run's parameters'
        module = cls(config=LlamaConfig(**meta["hexiscale"]["model"]), **kwargs)
        module.init_state_dict = state
        module.configure_model()  # builds the Llama and loads init_state_dict into it
        return module.to(map_location) if isinstance(map_location, (str, torch.device)) else module

    @override
    def configure_model(self) -> None:
        if self.model is not None:  # called again by a later fit/validate
            return
        device = torch.empty(0).device  # the Trainer's init context: meta under the hexiscale strategy
        # Built on the meta device, then materialised and initialised from init_seed: nn.Linear's
        # default initialisation would draw from torch's global generator (only to be overwritten),
        # and a shuffled DataLoader draws its order from that generator; so the data order is the
        # same on one device and under the strategy, where the model is never built on a real device.
        with torch.device("meta"):
            self.model = Llama(self.config).to(self.param_dtype)
        if device.type == "meta":
            return  # the strategy initialises its stage from init_seed (or init_state_dict)
        self.model.to_empty(device=device).init_weights(self.init_seed)
        given = getattr(self, "init_state_dict", None)  # set by weights.attach_weights
        if given is not None:
            self.model.load_state_dict({k: given[k] for k in self.model.state_dict()})

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, S, V) of ``tokens`` (under the strategy: a placeholder, see predict_step)."""
        return self.model(tokens)

    @override
    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Logits of the inputs of a (B, S + 1) batch; under the strategy the whole batch's, on rank 0."""
        return self(token_batch(batch, f"{type(self).__name__}.predict_step(batch)")[:, :-1])

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        batch = token_batch(batch, f"{type(self).__name__}.{'training' if self.training else 'validation'}_step(batch)")
        tokens, targets = batch[:, :-1], batch[:, 1:]
        return self.model.loss(self.model(tokens), targets)

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)  # equal on every rank: a no-op mean
        return loss

    @override
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
                                eps=self.eps)
        if not self.warmup_steps:
            return opt
        warm = self.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _check_optimizer_args(lr, weight_decay, betas, warmup_steps, init_seed, dtype, eps) -> None:
    """LlamaLitModule's arguments, checked at construction: AdamW refused some of them only inside
    every rank, after the search and the launch (lr=-1: torch's ValueError traceback from
    configure_optimizers), and took others silently (lr=nan, a negative warm-up, betas of 1.5).
    The recipe checks its trainer.* equivalents the same way (``config.recipe.check_values``)."""
    def number(v):  # numpy's numbers too; a bool is no rate
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    for name, v, low, example in (("lr", lr, None, "3e-3"), ("eps", eps, None, "1e-8"),
                                  ("weight_decay", weight_decay, 0.0, "0.1")):
        ok = number(v) and math.isfinite(v) and (v > 0 if low is None else v >= low)
        if not ok:
            rule = "must be a finite number " + ("greater than zero" if low is None else "that is not negative")
            raise ConfigError(f"LlamaLitModule({name})", v, rule, f"pass e.g. {name}={example}")
    pair = tuple(betas) if isinstance(betas, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(number(b) and 0.0 <= b < 1.0 for b in pair):
        raise ConfigError("LlamaLitModule(betas)", betas, "must be two numbers in [0, 1) (AdamW's moment decays)",
                          "pass e.g. betas=(0.9, 0.95)")
    for name, v, example in (("warmup_steps", warmup_steps, "0 (none) or 100"), ("init_seed", init_seed, "0")):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 <= v < 2**63:  # torch's seeds: 64-bit
            raise ConfigError(f"LlamaLitModule({name})", v, "must be a whole number from 0 to 2**63 - 1",
                              f"pass e.g. {name}={example}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError("LlamaLitModule(dtype)", dtype, "must be a floating-point torch.dtype",
                          "pass e.g. dtype=torch.float32 (or leave it out)")


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar for step-bounded runs: without the logger's version number (``v_num``),
    which says nothing about training (Lightning's documented way: override ``get_metrics``). The
    Rich bar Lightning picks by default shows ``Epoch 0/-2`` when only ``max_steps`` bounds the run."""

    def get_metrics(self, trainer, module):
        items = super().get_metrics(trainer, module)
        items.pop("v_num", None)
        return items


class LossPrinter(pl.Callback):
    """Prints the training loss (under the hexiscale strategy: the global one) every ``log_every_n_steps``
    optimizer steps and, at the end, the first and last values of this run and the steps it ran (after
    a resume: from the resumed step on, not counting the steps before it); on global rank 0 only."""

    def __init__(self):
        self.first: float | None = None
        self.start_step = 0
        self.steps_run = 0
        self._seen_step = 0

    def on_train_start(self, trainer, module):
        self.first, self.start_step, self.steps_run = None, trainer.global_step, 0  # after any checkpoint restore
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # a batch ended an optimizer step when the step count moved: a window full of
        # accumulate_grad_batches batches, or the epoch's last window, which may be shorter
        if trainer.global_step == self._seen_step:
            return
        self._seen_step = trainer.global_step
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches
        self.first = loss if self.first is None else self.first
        self.steps_run += 1
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % max(1, trainer.log_every_n_steps) == 0):
            _print(trainer, f"step {step:5d}  loss {loss:.4f}")

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero and self.first is not None:
            last = float(trainer.callback_metrics.get("train_loss", float("nan")))
            resumed = (f" (steps {self.start_step + 1}-{trainer.global_step}, resumed at step {self.start_step})"
                       if self.start_step else "")
            steps = f"{self.steps_run} step{'' if self.steps_run == 1 else 's'}"
            _print(trainer, f"training loss: first {self.first:.4f} -> last {last:.4f} after {steps}{resumed}")


class LogHyperparams(pl.Callback):
    """Logs ``hparams`` (e.g. the plan and its estimate) at fit start. Lightning's loggers log on
    the training rank 0, which is not global rank 0 when the plan leaves that device idle."""

    def __init__(self, hparams: dict):
        self.hparams = hparams

    def on_fit_start(self, trainer, module):
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(self.hparams)


def _print(trainer, line: str) -> None:
    """A line on stdout that does not break the progress bar (Lightning's ``ProgressBar.print``)."""
    bar = trainer.progress_bar_callback
    if bar is not None and bar.is_enabled:
        bar.print(line)
    else:
        print(line, flush=True)
