"""Lightning's training hooks mapped onto the runtime's step phases (``PipelineEngine.step``).

``strategy.training_step`` opens the window, ``self.model.loss`` is the micro-step,
``strategy.optimizer_step`` runs the closure then closes the window (non-finite check, then sync or
discard), the precision plugin's ``clip_grad_by_norm`` clips (:func:`global_norm_precision`) and
Lightning's own ``optimizer.step()`` updates; ``strategy.backward`` does nothing. Under ZeRO the
optimizer Lightning holds is the engine's sharded one (:meth:`StepAdapter.engine_optimizers`, as
Lightning's DeepSpeed strategy hands Lightning its engine's optimizer). A non-finite step stops the
run or is skipped (:class:`GradientMethods`, the strategy's mixin). Why one adapter: ``Trainer.fit``
and ``PipelineEngine.fit_step`` then call the same phases in the same order
(``tests/lightning/test_fit_step_trace.py`` compares their communication call for call). The hook
table and why clipping goes through the precision plugin: docs/concepts/step.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hexiscale.errors import ConfigError, NonFiniteError
from lightning_hexiscale.lightning import internals
from lightning_hexiscale.lightning.launch.guard import agree, mark_agreed

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.runtime import PipelineEngine


def steps_after_this_batch(trainer) -> bool:
    """Does an optimizer step follow the current training batch? Lightning's rule
    (``_TrainingEpochLoop._should_accumulate``, lightning 2.4-2.6), restated from the fit loop's public
    counters so that no private name is needed: the batch fills the window
    (``ready % accumulate_grad_batches == 0``), or it is the epoch's last (``ready ==
    num_training_batches``, or the data fetcher saw the end) and the strategy does not accumulate across
    epochs. ``tests/lightning/test_step_adapter.py`` holds it to Lightning's own answer batch by batch."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    window_full = ready % trainer.accumulate_grad_batches == 0
    epoch_ends = ready == trainer.num_training_batches or progress.is_last_batch
    return window_full or (epoch_ends and not trainer.strategy.handles_gradient_accumulation)


class StepAdapter:
    """One rank's hooks -> the phases of ``engine.step``; holds the accumulation window's state."""

    def __init__(self, engine: PipelineEngine):
        self.step = engine.step
        self._engine = engine
        self.accumulate = 1
        """k = the Trainer's ``accumulate_grad_batches`` (read at each batch)."""
        self._last = False
        """The current batch ends the window: its last backward starts the gradient reduction."""
        self.configured: list = []
        """The optimizers ``configure_optimizers`` returned (under ZeRO Lightning holds another)."""
        self.given: torch.Tensor | None = None
        """The loss ``self.model.loss`` returned in the current training batch (None before the call)."""

    # ---- strategy.training_step ----------------------------------------------------------------
    def begin_batch(self, trainer) -> None:
        """Open the window on its first batch (Lightning's own rule for zero_grad, which the
        strategy's ``_skip_backward`` disables), and note whether an optimizer step follows."""
        self.accumulate = trainer.accumulate_grad_batches
        if trainer.fit_loop.epoch_loop.batch_idx % self.accumulate == 0:
            self.step.open_window()
        self._last = steps_after_this_batch(trainer)
        self.given = None

    def end_batch(self, output: Any) -> Any:
        """``training_step``'s output, once it is known to be the loss ``self.model.loss`` gave (its
        value: a tensor or Lightning's dict, detached or not): the backward ran inside that call, so
        a factor or a term added afterwards would not reach the gradients that one device's would.
        Every rank has the same values and runs the same code: one error reaches the caller."""
        loss = output.get("loss") if isinstance(output, dict) else output
        given = self.given
        if given is None or loss is given or (isinstance(loss, torch.Tensor) and loss.numel() == 1
                                              and _same(loss.detach().reshape(()).to(given), given)):
            return output
        value = float(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else type(loss).__name__
        raise self._loss_error(f"returned {value:.6g}" if isinstance(value, float) else f"returned {value}",
                               f"self.model.loss gave {float(given):.6g} and ran the backward of that loss inside "
                               "the call: a factor or a term added to it afterwards (a regulariser, another loss) "
                               "does not reach the gradients, which one device would train on")

    # ---- self.model.loss in training --------------------------------------------------------------
    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward + backward of this pipeline's rows, weighted by 1/k; returns this batch's global
        mean loss (the step returns it / k: the shown loss is the batch's, as on one device)."""
        if self.given is not None:  # before any communication: every rank stops here together
            raise self._loss_error("self.model.loss called twice", "each call runs the forward and the backward "
                                   "of the whole batch, so a second loss (an auxiliary term) adds its whole gradient "
                                   "whatever the step then does with the values")
        last, self._last = self._last, False
        return self.step.micro_step(tokens, targets, accumulate=self.accumulate, last=last) * self.accumulate

    def _loss_error(self, value: str, rule: str) -> BaseException:
        return mark_agreed(ConfigError("LightningModule.training_step", value, "under the hexiscale strategy " + rule,
                                       "return the value of one self.model.loss call per training_step, unchanged "
                                       "(a dict {'loss': it} or it detached are fine)"),
                           list(range(self._engine.plan.world_size)))

    # ---- strategy.optimizer_step ------------------------------------------------------------------
    def close_window(self, closure: Callable[[], Any]) -> tuple[Any, dict[int, int]]:
        """Run Lightning's closure (the training step: the window's last micro-step) here, not inside
        ``optimizer.step``, so that a non-finite step is dropped before Lightning's hooks, clipping
        and the update see it; then the step's close (check, then sync or discard, every rank alike).
        Returns the closure's output and the check's answer ({global rank: code}, empty when synced)."""
        with torch.enable_grad():
            out = closure()
        return out, self.step.close_window(out)

    # ---- the precision plugin -------------------------------------------------------------------------
    def clip(self, max_norm: float) -> float:
        """Clip by the whole model's norm (collective); returns ||g||."""
        return self.step.clip(max_norm)

    def grad_norm(self) -> float:
        """||g|| of the whole model's reduced gradient, every element once (collective)."""
        return self.step.grad_norm()

    def check_value_clipping(self) -> None:
        """Value clipping clamps ``p.grad`` (each element alone: local is exact), which holds the reduced
        gradients under ddp; under ZeRO they are this rank's chunks and ``p.grad`` is empty. The same
        answer on every rank, at the same point: one error reaches the caller."""
        if self._engine.sharding == "ddp":
            return
        world = self._engine.plan.world_size
        raise mark_agreed(ConfigError(
            "Trainer(gradient_clip_algorithm)", "value",
            f"under dp_sharding={self._engine.sharding} each rank holds its reduced gradients as chunks outside "
            "the parameters' .grad, which value clipping clamps", "use gradient_clip_algorithm='norm' (clipped by "
            "the global norm over TP, PP and DP), or dp_sharding='ddp'"), list(range(world)))

    # ---- strategy.setup -------------------------------------------------------------------------------
    def engine_optimizers(self, optimizers: list, lr_scheduler_configs: list) -> list:
        """After ``configure_optimizers``: the optimizers Lightning is to hold and step. ddp: the
        user's. zero2/zero3: the engine's :class:`~lightning_hexiscale.runtime.zero.ShardedOptimizer`
        of the one optimizer (its class and hyper-parameters over this rank's chunks, sharing its
        ``param_groups``), and each LR scheduler of the user's optimizer is re-pointed at it, so that
        Lightning's step, zero_grad and the scheduler's step-order check all see the one that steps."""
        self.configured = [unwrap_optimizer(o) for o in optimizers]
        if not optimizers or self._engine.sharding == "ddp":
            return list(optimizers)
        if len(optimizers) > 1:
            raise ConfigError("configure_optimizers", f"{len(optimizers)} optimizers",
                              f"dp_sharding={self._engine.sharding} shards one optimizer's state over the "
                              "pipelines", "return one optimizer, or use dp_sharding='ddp'")
        user = self.configured[0]
        if user.state:  # nothing has stepped yet: the class creates its state when built
            raise mark_agreed(ConfigError(
                "configure_optimizers", type(user).__name__, f"it creates its state when it is built (per "
                f"parameter: {sorted(next(iter(user.state.values())))}), and dp_sharding={self._engine.sharding} "
                "builds it over empty stand-ins that take this rank's chunks only when it steps (the first step "
                "stopped with a size mismatch inside torch)", "use dp_sharding='ddp', or an optimizer that creates "
                "its state at its first step (AdamW, SGD, RMSprop, ...)"), list(range(self._engine.plan.world_size)))
        sharded = self._engine.wrap_optimizer(user)
        sharded.__class__ = named_like(type(sharded), type(user))
        for config in lr_scheduler_configs:
            if config.scheduler.optimizer in (user, optimizers[0]):
                config.scheduler.optimizer = sharded
                internals.track_step_calls(sharded)  # what torch's scheduler did to the user's step when built
        return [sharded]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN included (a non-finite loss is the non-finite check's to handle)."""
    return bool(a == b) or bool(a.isnan() and b.isnan())


_NAMED: dict[tuple[type, type], type] = {}


def named_like(cls: type, user: type) -> type:
    """A subclass of ``cls`` (the engine's sharded optimizer) whose ``__name__`` is the user's
    optimizer class's: Lightning names what it logs about the optimizer it holds after its class
    (LearningRateMonitor's ``lr-AdamW``), which under ZeRO would otherwise read ``lr-ShardedOptimizer``
    where one device logs ``lr-AdamW``. Its qualified name says what it is."""
    key = (cls, user)
    if key not in _NAMED:
        _NAMED[key] = type(user.__name__, (cls,), {"__module__": cls.__module__,
                                                   "__qualname__": f"{cls.__qualname__}[{user.__qualname__}]"})
    return _NAMED[key]


def frozen(model: torch.nn.Module, where: str) -> torch.nn.Module:
    """``model``, once none of its parameters is frozen (``requires_grad=False``), else ConfigError.
    The strategy builds each rank's stage anew from the Llama's shape and its gradient sync hooks
    every parameter of the stage: a Llama frozen in ``configure_model`` would train whole, and a stage
    parameter frozen in ``configure_optimizers`` stops the first step inside the sync."""
    names = [name for name, p in model.named_parameters() if not p.requires_grad]
    if not names:
        return model
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ConfigError(f"{where}.requires_grad", False, f"{len(names)} parameter(s) are frozen ({shown}); the "
                      "hexiscale strategy trains every parameter of each rank's stage", "leave requires_grad on and "
                      "put those parameters in a param group with lr=0 and weight_decay=0 (AdamW then leaves them "
                      "as they are, as one device leaves frozen ones; their gradients still count in the norm that "
                      "gradient_clip_val clips by)")


def every_parameter_optimized(module: torch.nn.Module, optimizers: list) -> None:
    """ConfigError when ``configure_optimizers`` leaves parameters of ``module`` out of its optimizer.
    One device then keeps them as they are and clips by the norm of the optimizer's parameters only;
    the strategy's clipping norm counts every parameter of the stage (a step with
    ``gradient_clip_val`` came out slightly off), and ZeRO's sharded optimizer holds every
    parameter's state (it stopped the first step with a ValueError from inside the runtime)."""
    given = {id(p) for opt in optimizers for group in unwrap_optimizer(opt).param_groups for p in group["params"]}
    names = [name for name, p in module.named_parameters() if id(p) not in given]
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ConfigError(f"{type(module).__name__}.configure_optimizers", f"an optimizer without {len(names)} "
                      f"parameter(s) ({shown})", "the hexiscale strategy trains every parameter of each rank's "
                      "stage: its clipping norm counts them all and ZeRO shards every parameter's optimizer state",
                      "build the optimizer over self.parameters() and put those parameters in a param group with "
                      "lr=0 and weight_decay=0 (AdamW then leaves them as they are, as one device leaves parameters "
                      "outside its optimizer)")


def one_evaluation_per_step(optimizers: list) -> None:
    """ConfigError for an optimizer whose step evaluates the closure several times (torch's LBFGS: a
    forward and a backward per inner iteration). Under the strategy a batch's forward and backward
    run once, inside ``self.model.loss``: LBFGS's further evaluations got the same loss and
    gradients back and it trained silently otherwise (loss 5.5768 after 2 steps, one device 4.8446)."""
    for optimizer in optimizers:
        inner = unwrap_optimizer(optimizer)
        if isinstance(inner, torch.optim.LBFGS):
            raise ConfigError("configure_optimizers", type(inner).__name__, "its step evaluates the closure (a "
                              "forward and a backward of the batch) several times, while under the hexiscale "
                              "strategy the forward and the backward of a batch run once, inside self.model.loss",
                              "use an optimizer that evaluates it once per step (AdamW, SGD, ...)")


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or the argument itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def state_to_device(optimizers, device) -> None:
    """Move each optimizer's state tensors to ``device``, ``step`` counters excepted (torch keeps
    those on the CPU unless the optimizer is fused or capturable), as Lightning's strategies do."""
    for optimizer in optimizers:
        for state in unwrap_optimizer(optimizer).state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = move_data_to_device(value, device)


class GlobalNormClipping:
    """Mixin placed before a Lightning ``Precision`` class: while :attr:`adapter` is set (the
    strategy's ``setup`` sets it, ``teardown`` clears it) ``clip_grad_by_norm`` clips by the global
    norm (every element of the model's gradient once, over all ranks), and ``clip_grad_by_value`` is
    refused under ZeRO (:meth:`StepAdapter.check_value_clipping`); the base class's otherwise."""

    adapter: StepAdapter | None = None
    base: type = Precision
    """The Lightning plugin class this one extends (set on each subclass)."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.adapter is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        self.adapter.clip(clip_val)

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        if self.adapter is not None:
            self.adapter.check_value_clipping()
        super().clip_grad_by_value(optimizer, clip_val)

    def __reduce__(self):
        # The class is made at run time (one per plugin class): pickle the plugin's own class and
        # state, and rebuild this subclass around them (spawn pickles the Trainer's strategy).
        state = {k: v for k, v in vars(self).items() if k != "adapter"}
        return _rebuild, (self.base, state)


_SUBCLASSES: dict[type, type] = {}


def global_norm_precision(plugin: Precision) -> Precision:
    """``plugin`` as an instance of ``GlobalNorm<its class>`` (its class with :class:`GlobalNormClipping`
    first), holding the same attributes; ``plugin`` itself when it already is one."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    base = type(plugin)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = _SUBCLASSES[base] = type(f"GlobalNorm{base.__name__}", (GlobalNormClipping, base),
                                       {"__module__": __name__, "base": base,
                                        "__doc__": f"{base.__qualname__}, clipping by the global norm "
                                                   "(lightning_hexiscale.lightning.step_adapter)."})
    new = cls.__new__(cls)
    new.__dict__.update(vars(plugin))
    return new


def _rebuild(base: type, state: dict[str, Any]) -> Precision:
    plugin = base.__new__(base)
    plugin.__dict__.update(state)
    return global_norm_precision(plugin)


def eps_underflow(optimizers) -> str | None:
    """The cause and fix when an optimizer's ``eps`` is 0 in its parameters' dtype, else None.

    Adam's update is ``m / (sqrt(v) + eps)``. In float16 (``16-true``) the default ``eps=1e-8`` rounds
    to 0 (the smallest float16 is 6.0e-8), and ``v = g^2`` underflows to 0 for every element with
    ``|g| < 2.4e-4``: the update divides by zero and the parameters become inf or NaN in the first
    step, which the non-finite check sees on the next one. bfloat16 has float32's range."""
    for opt in optimizers:
        inner = unwrap_optimizer(opt)
        for group in inner.param_groups:
            eps = group.get("eps")
            params = [p for p in group["params"] if p.is_floating_point()]
            if not isinstance(eps, float) or eps <= 0 or not params:
                continue
            dtype = params[0].dtype
            if float(torch.tensor(eps, dtype=dtype)) == 0.0:
                name = str(dtype).replace("torch.", "")
                smallest = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
                return (f"Cause: the parameters are {name} and {type(inner).__name__}'s eps={eps:g} rounds to 0 in "
                        f"{name} (its smallest value is {smallest:.1e}), so every element whose squared gradient "
                        "underflows divides by zero in the update m / (sqrt(v) + eps). Fix: train in bf16-mixed or "
                        f"bf16-true (bfloat16 has float32's range), or give the optimizer an eps that {name} holds, "
                        "e.g. eps=1e-4 (LlamaLitModule(eps=1e-4); recipe: trainer.adam_eps=1e-4)")
    return None


class GradientMethods:
    """The strategy's mixin: its one optimizer, a non-finite step's policy, and the precision plugin
    tied to the step."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Lightning's last hook before it builds the batch's closure, which reads ``_skip_backward``:
        set it again here, not only at setup, because a callback may clear it (Lightning's
        StochasticWeightAveraging does at every epoch end) and Lightning's zero_grad would then wipe
        the gradients the schedule produces inside ``training_step``."""
        internals.skip_lightning_backward(self.lightning_module.trainer)
        super().on_train_batch_start(batch, batch_idx)

    def _setup_one_optimizer(self, trainer) -> None:
        """Lightning's ``setup_optimizers``. Its error for several optimizers advises manual
        optimisation, which this strategy refuses: say what it supports instead. Every rank's
        ``configure_optimizers`` returns the same, so rank 0 reports for all."""
        try:
            # ZeRO-3 keeps a block's parameters as empty tensors between uses: a configure_optimizers
            # that picks param groups by shape (p.dim() >= 2 for weight decay) must see what one device
            # does, so it runs with every local parameter whole (collective: every rank is here)
            with self.pipeline_model.engine.full_params():
                self.setup_optimizers(trainer)
            # an optimizer the step cannot run, a parameter frozen there or left out of it: every rank
            # says, before the first step (ranks that hold none would wait in the first sync for the others)
            agree(lambda: (one_evaluation_per_step(self.optimizers), every_parameter_optimized(
                frozen(self.lightning_module, type(self.lightning_module).__name__), self.optimizers)),
                self.global_rank, self.world_size)
            if trainer.gradient_clip_val and str(trainer.gradient_clip_algorithm).lower().endswith("value"):
                # refused here, before the first step ran (the Trainer's settings: every rank alike)
                self.pipeline_model.step_adapter.check_value_clipping()
        except RuntimeError as e:
            if "multiple optimizers" not in str(e):
                raise
            raise mark_agreed(ConfigError(
                "configure_optimizers", "several optimizers",
                "the hexiscale strategy runs automatic optimisation (forward and backward inside "
                "self.model.loss) with one optimizer", "return one optimizer over self.parameters(), with "
                "param groups for different settings"), list(range(self.world_size))) from None

    def _nonfinite_step(self, bad: dict[int, int]) -> None:
        """A step whose loss or gradients were not finite on the ranks ``bad`` ({global rank: code},
        the answer of the step's ``close_window``, the same on every rank, which already dropped the
        gradients): record it, then stop or skip per
        ``nonfinite``."""
        trainer = self.lightning_module.trainer
        what = " and ".join(w for bit, w in ((1, "loss"), (2, "gradients")) if any(c & bit for c in bad.values()))
        event = {"step": trainer.global_step, "epoch": trainer.current_epoch,
                 "batch": trainer.fit_loop.epoch_loop.batch_idx, "ranks": sorted(bad), "what": what,
                 "action": self.nonfinite}
        self.nonfinite_events.append(event)
        where = (f"non-finite {what} at optimizer step {event['step']} (epoch {event['epoch']}, batch "
                 f"{event['batch']}) on rank(s) {event['ranks']}")
        if self.nonfinite == "stop":
            cause = eps_underflow(self.pipeline_model.step_adapter.configured or self.optimizers)
            if cause:
                raise NonFiniteError(f"{where}; stopping (nonfinite='stop'). {cause}")
            raise NonFiniteError(f"{where}; stopping (nonfinite='stop'). Fix: lower the learning rate, enable "
                                 f"gradient clipping, check the data of that batch, or pass nonfinite='skip' to drop "
                                 f"such steps")
        if self.global_rank == 0:
            rank_zero_warn(f"{where}; the update is skipped (nonfinite='skip')")

    def _install_global_clipping(self) -> None:
        """Clip through the step's phases: the Trainer's precision plugin becomes its
        :func:`~lightning_hexiscale.lightning.step_adapter.global_norm_precision` subclass, tied to
        this run's :class:`~lightning_hexiscale.lightning.step_adapter.StepAdapter` (``teardown``
        unties it: the plugin then clips as its base class does)."""
        self.precision_plugin = global_norm_precision(self.precision_plugin)
        self.precision_plugin.adapter = self.pipeline_model.step_adapter

    def _release_global_clipping(self) -> None:
        if isinstance(self.precision_plugin, GlobalNormClipping):
            self.precision_plugin.adapter = None
