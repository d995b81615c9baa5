"""Several plans measured on the same ranks, interleaved in rounds, so that machine noise cannot decide their order.

One launch of the ranks builds every plan's :class:`~lightning_hexiscale.runtime.engine.PipelineEngine`
(collective: every rank builds them in the same order, the plans' names sorted), then runs
``rounds`` rounds. Round k runs every plan once, in the name order rotated by k places (round 0:
a b c, round 1: b c a, round 2: c a b, ...), each run being ``warmup`` untimed steps and ``steps``
timed steps. Every plan thus takes every position of a round in turn, and a burst of load from
other jobs at one moment falls on different plans in different rounds instead of deciding a ranking.

What one step of a rank is: from the release of a barrier to the end of
:meth:`~lightning_hexiscale.runtime.engine.PipelineEngine.fit_step`, the step ``Trainer.fit`` runs
(forward and backward, the non-finite check, the gradient sync, clipping by the global norm at the
recipe's default and the optimizer step: plain SGD, no momentum). The optimizer step is inside the
window because under ZeRO-2/3 it is where the parameters are all-gathered, which the cost model
prices as part of the data-parallel term; SGD's update (one multiply-add per parameter element) is
the smallest unpriced part any optimizer could add. A plan's step time = the slowest of its ranks' times of that step
(the step ends when the last rank is done). Units: seconds.

**Plans on part of the ranks.** A plan may leave devices idle (``plan.idle_devices``) when the
launch has one rank per device of its ``launch_order``: it then runs on the ranks of its used
devices (:func:`~lightning_hexiscale.runtime.topology.rank_map`), next to the plans that use every
rank, in the same rounds. A rank the plan leaves idle takes part only in what every rank must do
alike (NCCL: the same collectives, in the same order, with the same sizes, on every member): the
``new_group`` calls of the plan's construction (:func:`~lightning_hexiscale.runtime.topology.create_groups`)
and each step's barrier, on the default group. It builds no engine, trains nothing, and reports
``None`` for that plan: absent, not a time. So every rank's result has the same keys in the same
order, and :func:`slowest_rank` takes each plan's maximum over the ranks that ran it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The plans' order in each round: the sorted names rotated by the round's index (mod the count)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    base = sorted(names)
    n = len(base)
    return [base[k % n:] + base[:k % n] for k in range(rounds)] if n else [[] for _ in range(rounds)]


def check_same_batch(plans: dict[str, Plan]) -> int:
    """The global batch every plan trains (the comparison is per step of the same work); raises if they differ."""
    batches = {name: p.global_batch for name, p in plans.items()}
    if len(set(batches.values())) != 1:
        raise ValueError(f"the plans train different global batches {batches}: a step time compares plans "
                         "only on the same work; plan them for one train.global_batch")
    return next(iter(batches.values()))


def measure_plans_rank(rank: int, world: int, plan_dicts: dict[str, dict], config: LlamaConfig, steps: int,
                       warmup: int, rounds: int, lr: float = 1e-4,
                       extra: dict[str, Callable[[], list[float]]] | None = None
                       ) -> dict[str, list[list[float]] | None]:
    """Collective: train every plan on this rank, interleaved in rounds (module docstring).

    ``extra``: other named measurements that take their turn in every round like a plan (e.g. the
    calibration's, so that the cost model is fitted under the load the plans ran under); each call
    is collective and returns this rank's timed step seconds. Their names must differ from the plans'.

    Returns ``{name: [[step seconds of each timed step] for each round]}`` for THIS rank, plans and
    extras; ``None`` for a plan that leaves this rank's device idle. Every plan must run on ``world``
    ranks or on one per device of its launch order (``world``), else a PlanError, on every rank
    alike, before any communication.
    """
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(plan_dicts))
    if clash:
        raise ValueError(f"extra measurements {clash} have the names of plans")
    from lightning_hexiscale.profiling.check import make_batch, prime
    from lightning_hexiscale.profiling.measure import current_device
    from lightning_hexiscale.runtime.engine import PipelineEngine
    from lightning_hexiscale.runtime.topology import create_groups, rank_map

    plans = {name: Plan.from_dict(d, f"plan {name}") for name, d in plan_dicts.items()}
    maps = {}
    for name, p in plans.items():
        try:
            maps[name] = rank_map(p, world)  # pure: every rank raises alike, before any collective
        except PlanError as e:
            raise PlanError(f"plan {name}: world_size", world, e.rule, e.fix) from None
    global_batch = check_same_batch(plans)
    device = current_device()
    prime(device)  # one-time lazy initialisation before any timed step
    runs: dict[str, tuple | None] = {}
    for name in sorted(plans):  # construction is collective (process groups): same order on every rank
        if rank in maps[name]:
            engine = PipelineEngine(plans[name], config, rank, seed=0, device=device, dtype=torch.float32)
            runs[name] = (engine, engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=lr)))
        else:  # idle in this plan: its part of the new_group calls, nothing else
            create_groups(plans[name], config, maps[name])
            runs[name] = None
    times: dict[str, list[list[float]] | None] = {name: [] for name in [*plans, *extra]}
    for order in round_orders([*plans, *extra], rounds):
        for name in order:
            if name in extra:
                times[name].append(list(extra[name]()))
                continue
            if runs[name] is None:
                for _ in range(warmup + steps):
                    dist.barrier()  # the round's bookkeeping: the same barriers as the plan's ranks
                times[name] = None
                continue
            engine, opt = runs[name]
            mine = []
            for k in range(warmup + steps):
                tok, tgt = make_batch(config, global_batch, k)
                dist.barrier()
                t0 = time.perf_counter()
                engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if k >= warmup:
                    mine.append(time.perf_counter() - t0)
            times[name].append(mine)
    return times


def gather_to_rank0(mine: dict) -> list[dict] | None:
    """Collective: every rank's ``mine``, by rank, on rank 0; None elsewhere."""
    everything: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    return everything if dist.get_rank() == 0 else None


@dataclass(frozen=True)
class PlanTimes:
    """One plan's measured step times (seconds) over all rounds."""

    per_round: list[list[float]]
    """[round][timed step]: the slowest rank's time of that step."""

    @property
    def steps_s(self) -> list[float]:
        return [t for r in self.per_round for t in r]

    @property
    def min_s(self) -> float:
        return min(self.steps_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def max_s(self) -> float:
        return max(self.steps_s)

    @property
    def round_medians_s(self) -> list[float]:
        return [statistics.median(r) for r in self.per_round]

    def to_dict(self) -> dict:
        return {"min_s": self.min_s, "median_s": self.median_s, "max_s": self.max_s,
                "round_medians_s": self.round_medians_s, "steps_s": self.per_round}


def slowest_rank(per_rank: list[dict[str, list[list[float]] | None]]) -> dict[str, PlanTimes]:
    """Per plan, per round, per step: the maximum of the step times over the ranks that ran the plan
    (a rank the plan leaves idle reports ``None``: absent). Every rank must report the same names."""
    if not per_rank:
        raise ValueError("no rank reported")
    names = {tuple(r) for r in per_rank}
    if len(names) != 1:
        raise ValueError(f"the ranks reported different measurements {sorted(names)}")
    out = {}
    for name in per_rank[0]:
        ran = [r[name] for r in per_rank if r[name] is not None]
        if not ran:
            raise ValueError(f"plan {name}: no rank ran it")
        shape = {(len(t), tuple(len(x) for x in t)) for t in ran}
        if len(shape) != 1:
            raise ValueError(f"plan {name}: the ranks timed different numbers of steps {sorted(shape)}")
        out[name] = PlanTimes([[max(t[k][j] for t in ran) for j in range(len(ran[0][k]))]
                               for k in range(len(ran[0]))])
    return out
