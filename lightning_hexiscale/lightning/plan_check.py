"""The plan checked while it trains: after the warm-up, the measured step against the plan's estimate.

``HexiScaleStrategy(plan_check=W)`` (default :data:`DEFAULT_WARMUP` = 5 optimizer steps; None: off)
leaves the first W steps alone (compilation, allocator and gloo warm-up), times the next
:data:`MEASURED_STEPS` on every rank, and then every training rank, at the end of the same optimizer
step, sends its times to the others (one ``all_gather_object`` on the default group: the same
collective, at the same step, on every rank) and read the output directory (:func:`output_dir`).
Global rank 0 then:

- prints one line: the estimated and measured step time, and the stage whose measured time is
  furthest from its price (:meth:`~lightning_hexiscale.profiling.check.RunCheck.line`);
- warns (:class:`PlanCheckWarning`) when the step is more than 25 % off, naming that stage and what
  to do (re-discover the cluster, or profile it);
- writes ``plan_check.json`` (:meth:`RunCheck.to_dict`: per stage its devices, estimated and
  measured seconds) into the log directory (:func:`output_dir`: the logger's, else the checkpoints').

What is timed, per rank and step: **wall** time from the first training batch of the optimizer step
(``batch_starts``) to the end of its optimizer step (``step_ends``), and **busy** time, the time
inside the engine's pipeline schedule (``executor.run``) minus the time inside its point-to-point
exchanges (``executor.exchange``: waiting for a neighbour stage and moving activations), i.e. the
stage's forward and backward with their TP collectives, which is what a stage's price
(``compute_s + tp_comm_s``) covers, timed by :class:`~lightning_hexiscale.profiling.check.StageTimer`
only during the measured steps. The comparison itself is pure:
:func:`lightning_hexiscale.profiling.check.compare_run`.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner import Estimate, Plan
from lightning_hexiscale.planner.cost.sources import PriceSource
from lightning_hexiscale.profiling.check import RunCheck, StageTimer, compare_run

DEFAULT_WARMUP = 5
"""Optimizer steps left alone before the measurement."""
MEASURED_STEPS = 3
"""Optimizer steps timed after the warm-up (the median is reported)."""
FILE_NAME = "plan_check.json"


class PlanCheckWarning(UserWarning):
    """The measured step is more than 25 % off the plan's estimate."""

    cli_notice = True
    """``hexiscale`` prints it as one line (``cli/main.py``)."""


def plan_check_setting(value: Any) -> int | None:
    """``HexiScaleStrategy(plan_check=...)``: warm-up steps before the check (an int >= 0), True for
    :data:`DEFAULT_WARMUP`, None or False for no check."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_WARMUP
    if isinstance(value, int) and value >= 0:
        return value
    raise ConfigError("HexiScaleStrategy(plan_check)", value,
                      "must be the number of warm-up steps before the check (an integer >= 0), True or None",
                      f"use plan_check={DEFAULT_WARMUP} (the default) or plan_check=None to skip the check")


class PlanCheck:
    """One training run's check of ``plan`` against ``estimate`` on this rank (module docstring)."""

    def __init__(self, engine, plan: Plan, estimate: Estimate, rank: int, world_size: int, warmup: int,
                 model_name: str = "<model>", measured_steps: int = MEASURED_STEPS,
                 sources: dict[int, PriceSource] | None = None):
        self.engine, self.plan, self.estimate = engine, plan, estimate
        self.sources = sources or {}
        """Device id -> what priced its type: the warning's fix depends on it (RunCheck.warning)."""
        self.rank, self.world_size, self.warmup = rank, world_size, warmup
        self.model_name, self.measured_steps = model_name, measured_steps
        self.steps = 0
        self.step_s: list[float] = []
        self.busy_s: list[float] = []
        self.result: RunCheck | None = None
        self._t0: float | None = None
        self.timer = StageTimer(engine)

    @classmethod
    def for_strategy(cls, strategy, trainer) -> PlanCheck:
        """The check of a strategy's run: its plan priced on its cluster and workload (``estimate()``).
        Global rank 0 prints what priced each device type (:mod:`planner.cost.sources`), the price
        the run is held against; a layer table that does not match the run is refused here (every
        rank raises the same ConfigError) unless ``planner.allow_table_mismatch``."""
        from lightning_hexiscale.planner import estimate, price_sources

        sources = price_sources(strategy.cluster, strategy.workload, strategy.plan)
        est = estimate(strategy.plan, strategy.cluster, strategy.workload)
        if strategy.global_rank == 0:
            print("hexiscale plan priced by: " + "; ".join(str(s) for s in sources), flush=True)
        by_type = {s.gpu_type: s for s in sources}
        by_device = {k: by_type[d.gpu_type] for k, d in enumerate(strategy.cluster.devices) if d.gpu_type in by_type}
        return cls(strategy.pipeline_model.engine, strategy.plan, est, strategy.global_rank, strategy.world_size,
                   strategy.plan_check, strategy.workload.model.name, sources=by_device)

    @property
    def measuring(self) -> bool:
        return self.warmup <= self.steps < self.warmup + self.measured_steps

    @property
    def done(self) -> bool:
        return self.steps >= self.warmup + self.measured_steps

    # ---- hooks the strategy calls ---------------------------------------------------------------
    def batch_starts(self) -> None:
        """A training batch begins; the first of an optimizer step opens its window."""
        if self._t0 is not None or not self.measuring:
            return
        self.timer.install()
        self.timer.sync()
        self.timer.busy_s = 0.0
        self._t0 = time.perf_counter()

    def step_ends(self, trainer) -> None:
        """An optimizer step ended (taken or skipped as non-finite): record it; at the end of the
        last measured step, the collective report (every rank, the same step)."""
        if self._t0 is not None:
            self.timer.sync()
            self.step_s.append(time.perf_counter() - self._t0)
            self.busy_s.append(self.timer.busy_s)
            self._t0 = None
        self.steps += 1
        if self.steps == self.warmup + self.measured_steps:
            self.timer.remove()
            self.report(trainer)

    # ---- the report -----------------------------------------------------------------------------
    def report(self, trainer) -> RunCheck:
        """Collective: gather every rank's times, then on global rank 0 the line, the warning and the file."""
        mine = (self.step_s, self.busy_s)
        everyone = [mine]
        if self.world_size > 1 and dist.is_initialized():
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        out_dir = output_dir(trainer)
        self.result = compare_run(self.plan, self.estimate, [s for s, _ in everyone], [b for _, b in everyone],
                                  self.warmup)
        if self.rank == 0:
            print(self.result.line(), flush=True)
            text = self.result.warning(self.model_name, self.sources)
            if text is not None:
                warnings.warn(text, PlanCheckWarning, stacklevel=2)
            if out_dir is not None:
                out = out_dir / FILE_NAME
                out.parent.mkdir(parents=True, exist_ok=True)
                doc = {**self.result.to_dict(), "plan": self.plan.to_dict(),
                       "per_rank": [{"rank": r, "step_s": s, "busy_s": b} for r, (s, b) in enumerate(everyone)]}
                out.write_text(json.dumps(doc, indent=2))
                print(f"hexiscale plan check written to {out}", flush=True)
        return self.result


def output_dir(trainer) -> Path | None:
    """Where ``plan_check.json`` goes: the log directory of the Trainer's first logger
    (``trainer.log_dir``: a broadcast from rank 0, so every rank calls this at the same point), else
    the checkpoint callback's directory, else nowhere (a run with neither writes no outputs, and the
    check does not start: ``logger=False`` without checkpoints would otherwise fill the working
    directory)."""
    if trainer.loggers:
        return Path(trainer.log_dir)
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    return Path(dirpath) if dirpath else None
