"""Baselines: the plan spaces of other systems, each chosen the way that system chooses, all timed
by the SAME cost model as §4 on the real cluster.

Every baseline returns a :class:`BaselineResult` whose plan (when one fits) is scored by
``estimate()`` on the true cluster, with the same micro-batch candidates as the search. Which
restriction stands for which system:

- :func:`megatron` (Megatron-LM): symmetric (dp, tp, pp) over all devices, dp * tp * pp = N,
  pp dividing the layers (equal layers per stage), equal batches per replica; ranks laid out in
  machine order with TP fastest, then DP then PP (Megatron's order) or TP, PP, DP; best over
  degrees, micro-batch sizes and both layouts.
- :func:`galvatron` (Galvatron): the same symmetric degrees and layouts, but the layer split per
  stage is free (chosen by the speed of the slowest replica at each stage, memory-capped).
- :func:`metis` (Metis, ATC'24): data-parallel first: D_dp replicas made by dealing every machine's
  GPUs over the replicas, TP raised (1, 2, 4, 8) only when a replica does not fit in memory,
  stages ordered by GPU type (fastest first), layers in proportion to speed, batches in
  proportion to replica speed.
- :func:`random_search` (the paper's Fig. 6 ablation): the §4 search with phase 1 replaced by
  random compute-agnostic partitions (a seeded random permutation cut into D_dp equal sizes).
- in :mod:`planner.subset_baselines` (also reachable here by name), the baselines that choose
  machines: ``symmetric_best`` (the best Megatron/Galvatron-style symmetric plan on any machine
  subset, the whole cluster included), ``leave_out`` (what a user does without this project: the
  best plan of any style, the search's included, that leaves at least one machine out) and
  ``uniform_tp`` (an ablation of per-stage TP: the search with one TP degree in every stage).
- :func:`exhaustive`: the true optimum of the whole plan space on clusters of up to 8 devices
  (:mod:`planner.oracle.exact`).

Two readings of Megatron and Galvatron (``aware``):

- faithful (default, ``aware=False``): the real systems are heterogeneity-unaware. Megatron's user
  and Galvatron's profiler-driven search see one GPU type and uniform links, so the candidates of
  the space are ranked by ``estimate()`` on :func:`homogeneous_belief` of the cluster, and the
  believed-best plan is then timed on the true cluster. That is what the paper measured: a plan
  picked blind to heterogeneity, run on heterogeneous GPUs.
- aware (``aware=True``, ``hexiscale plan --aware-baselines``): the candidates are ranked with the
  true cluster, giving the best plan of the restricted space; a speedup then measures the plan
  space alone. A stronger opponent than the real systems.

Metis is heterogeneity-aware (it profiles every GPU type and the links), so it has one reading.
Data-parallel sharding, independently: the system's own as the paper ran it (Appendix G: Megatron
and Metis DDP, Galvatron ZeRO-3) unless ``like_for_like=True``, which gives each the search's ddp /
zero2 / zero3 choice; a user's ``train.dp_sharding`` binds everyone.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.baselines.subsets import LEAVE_OUT_STYLES, leave_out, symmetric_best, uniform_tp
from lightning_hexiscale.planner.baselines.systems import (BaselineResult, best_recompute, believed_figures,
                                                           compute_ceiling, exhaustive, galvatron, homogeneous_belief,
                                                           megatron, metis, random_baseline, random_search)
from lightning_hexiscale.planner.cost.estimate import Workload
from lightning_hexiscale.planner.search.settings import SearchSettings

__all__ = ["BASELINES", "LEAVE_OUT_STYLES", "BaselineResult", "best_recompute", "believed_figures", "compute_ceiling",
           "exhaustive", "galvatron", "homogeneous_belief", "leave_out", "megatron", "metis", "random_baseline",
           "random_search", "run_baselines", "symmetric_best", "uniform_tp"]


BASELINES = ("megatron", "galvatron", "metis", "random", "symmetric-best", "leave-out", "uniform-tp")
"""What ``--baselines`` runs (``exhaustive`` only when asked: it is exponential)."""


def run_baselines(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
                  names: tuple[str, ...] = BASELINES,
                  like_for_like: bool = False, aware: bool = False) -> dict[str, BaselineResult]:
    """Run the named baselines; ``exhaustive`` only when asked (it is exponential).
    ``like_for_like`` gives megatron, galvatron and metis every dp sharding the search may use
    instead of their own (Appendix G: DDP, ZeRO-3, DDP); ``aware`` ranks megatron's and
    galvatron's candidates with the true cluster instead of the homogeneous belief."""
    s = replace(settings or SearchSettings(), progress=False)
    out = {}
    for n in names:
        if n in ("megatron", "galvatron"):
            fn = megatron if n == "megatron" else galvatron
            out[n] = fn(cluster, workload, global_batch, s, like_for_like=like_for_like, aware=aware)
        elif n == "metis":
            out[n] = metis(cluster, workload, global_batch, s, like_for_like=like_for_like)
        elif n == "random":
            out[n] = random_baseline(cluster, workload, global_batch, s)
        elif n == "exhaustive":
            out[n] = exhaustive(cluster, workload, global_batch, s)
        elif n == "symmetric-best":
            out[n] = symmetric_best(cluster, workload, global_batch, s)
        elif n == "leave-out":
            # symmetric-best (run first, same arguments) is the symmetric half of leave-out
            out[n] = leave_out(cluster, workload, global_batch, s, symmetric=out.get("symmetric-best"))
        elif n == "fast-only":  # renamed in issue 43: it ranged over the whole cluster too
            raise ConfigError("baselines", n, "fast-only was split: it also ranged over the whole cluster",
                              "use symmetric-best (the best symmetric plan on any machine subset, all machines "
                              "included) or leave-out (the best plan of any style that leaves a machine out)")
        elif n == "uniform-tp":
            out[n] = uniform_tp(cluster, workload, global_batch, s)
        else:
            raise ConfigError("baselines", n, "unknown baseline",
                              f"use one of {', '.join(BASELINES + ('exhaustive',))}")
        if out[n].plan is not None and out[n].compute_ceiling is None:
            out[n] = replace(out[n], compute_ceiling=compute_ceiling(out[n].plan, cluster))
    return out
