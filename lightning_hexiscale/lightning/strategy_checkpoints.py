"""HexiScaleStrategy's checkpoint methods: Lightning's checkpoint hooks onto torch.distributed.checkpoint.

A mixin of :class:`~lightning_hexiscale.lightning.strategy.HexiScaleStrategy` (kept apart so that each
file holds one concern). Every rank writes and reads only its own pieces
(:mod:`lightning_hexiscale.runtime.checkpoint`); rank 0's Lightning state goes to ``meta.pt``. It
uses the strategy's ``_checkpointer`` (made in ``setup``), ``pipeline_model`` and ``optimizers``.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.optim import Optimizer
from typing_extensions import override

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.step_adapter import steps_after_this_batch, state_to_device, unwrap_optimizer

_BATCH_COUNTERS = ("ready", "started", "processed", "completed")


def rewind_to_window_start(checkpoint: dict[str, Any], trainer) -> int:
    """Make a checkpoint saved inside a gradient-accumulation window read as saved at its start.

    With ``accumulate_grad_batches`` k, a save after batch r of an epoch whose gradient is still
    pending (ModelCheckpoint after a validation that falls mid-window, e.g. ``val_check_interval=3``
    with k=2, or ``trainer.save_checkpoint`` in a callback) holds the parameters and optimizer of
    the window's start, but Lightning's loop state and the loader's position count the p = r mod k
    batches trained since, whose accumulated gradient no checkpoint holds: the resumed run skipped
    them and its next step took the gradient of k - p batches. Here the batch counters of the
    epoch loop and the loader's position (``batches`` of :class:`~lightning_hexiscale.data.PlanBatchSampler`,
    and its generator state: the one the window's first batch found) go back by p, so that the
    checkpoint is the state after batch r - p and its step (what Lightning restores as a save "on
    last", validation included) and the resumed run trains the window again.
    Returns p (0: the save is at a step boundary, nothing changed)."""
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if loops is None or trainer.state.fn != "fit" or trainer.sanity_checking or steps_after_this_batch(trainer):
        return 0
    progress = loops.get("epoch_loop.batch_progress")
    p = trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches
    if not p or progress is None:
        return 0
    for scope in ("total", "current"):
        start = progress[scope]["ready"] - p
        progress[scope].update({c: start for c in _BATCH_COUNTERS})
    for state in (loops.get("state_dict") or {}).get("combined_loader", []):
        if isinstance(state, dict) and "batches" in state:
            state["batches"] -= p
            state["window_start"] = True  # its permutation is the saved one, even at batch 0
            if state.get("window_rng") is not None:  # the generator as the window's first batch found it
                state["rng"] = state["window_rng"]
    return p


def check_checkpoint_before_launch(ckpt_path, module, weights_only: bool | None) -> None:
    """A ``ckpt_path`` that every rank would refuse after its setup (a partial save, a folder of
    checkpoints, the previous format, another model's checkpoint when the module names its
    :class:`~lightning_hexiscale.models.config.LlamaConfig` as ``config``), refused once in the
    launching process, before the processes, the cluster discovery and the plan search (the recipe
    does the same for ``trainer.resume``)."""
    from lightning_hexiscale.config.recipe import CKPT_ALIASES
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.runtime import check_checkpoint_complete, check_checkpoint_model

    if ckpt_path is None or str(ckpt_path).split(":")[0] in CKPT_ALIASES:
        return
    check_checkpoint_complete(ckpt_path)
    config = getattr(module, "config", None)
    if isinstance(config, LlamaConfig):
        check_checkpoint_model(ckpt_path, config, weights_only=weights_only)


class CheckpointMethods:
    """Lightning's checkpoint hooks for plan-independent DCP shards."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage (and so the shards to load into) exists only after setup

    @property
    def checkpointer(self):
        """This run's :class:`~lightning_hexiscale.runtime.Checkpointer` (after ``setup``)."""
        if self._checkpointer is None:
            raise RuntimeError("HexiScaleStrategy.setup has not run yet")
        return self._checkpointer

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's own state outside the pipeline (the pipeline's shards go to DCP)."""
        return {k: v for k, v in self.lightning_module.state_dict().items() if not k.startswith("model.")}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # written by save_checkpoint: every rank its own pieces, by global parameter name

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Collective: every rank enters (the Trainer barriers right after) and writes its own
        pieces; rank 0's ``checkpoint`` (Lightning's state) goes to ``meta.pt``."""
        if self._checkpointer is None:  # no setup in this process: Lightning's spawn/fork workers ran the call
            raise ConfigError("trainer.save_checkpoint", str(filepath), "the ranks of the last Trainer call ran in "
                              f"start_method='{self.settings.start_method}' worker processes, which held the model's "
                              "shards and ended with the call; this process holds no part of the model",
                              "save during fit: ModelCheckpoint (save_last=True), or trainer.save_checkpoint in a "
                              "callback (e.g. on_train_end); or use start_method='popen' (the default), where this "
                              "process is rank 0 and keeps its stage")
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: "
                            "hexiscale checkpoints are written by torch.distributed.checkpoint, not a CheckpointIO")
        filepath = self.broadcast(str(filepath), 0)  # one directory for all ranks (a string, no tensors)
        with_optim = "optimizer_states" in checkpoint and bool(self.optimizers)
        if with_optim and len(self.optimizers) > 1:
            raise ConfigError("configure_optimizers", f"{len(self.optimizers)} optimizers",
                              "hexiscale checkpoints hold one optimizer's state", "use one optimizer")
        optimizer = unwrap_optimizer(self.optimizers[0]) if with_optim else None  # under ZeRO the sharded one
        rewind_to_window_start(checkpoint, self.lightning_module.trainer)
        self.checkpointer.save(filepath, self.pipeline_model.engine, optimizer, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning_hexiscale.runtime import read_checkpoint_meta

        self.checkpointer.wait()
        # Lightning's weights_only (trainer.fit(..., weights_only=...)): None/True loads plain types
        # only and refuses a pickled callable; False, for a checkpoint the caller trusts, loads any
        meta = read_checkpoint_meta(checkpoint_path, weights_only=weights_only)
        meta["hexiscale"]["path"] = str(checkpoint_path)
        meta["hexiscale"]["weights_only"] = weights_only
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from lightning_hexiscale.runtime import load_checkpoint_model

        extra = checkpoint.get("state_dict") or {}
        if extra:
            self.lightning_module.load_state_dict(extra, strict=False)
        load_checkpoint_model(checkpoint["hexiscale"]["path"], self.pipeline_model.engine, dict(checkpoint),
                              self.checkpointer.group, weights_only=checkpoint["hexiscale"].get("weights_only"))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning_hexiscale.runtime import load_checkpoint_optimizer

        for optimizer in self.optimizers[:1]:  # under ZeRO the sharded one: its chunks' state is loaded
            inner = unwrap_optimizer(optimizer)
            load_checkpoint_optimizer(checkpoint["hexiscale"]["path"], self.pipeline_model.engine, inner,
                                      dict(checkpoint), self.checkpointer.group,
                                      weights_only=checkpoint["hexiscale"].get("weights_only"))
            state_to_device([inner], self.root_device)

    @override
    def remove_checkpoint(self, filepath) -> None:
        from lightning_hexiscale.runtime import remove_checkpoint as remove_directory

        if self._checkpointer is not None:
            self._checkpointer.wait_for(filepath)  # an asynchronous save may still be writing it
        if self.is_global_zero:
            remove_directory(filepath)
