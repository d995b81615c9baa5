"""One composition of a pipeline's stage terms into its time: what ``estimate()`` and the search's
batch timer (planner/search/batching.py) both call, so the two cannot price a plan differently.

Per micro-batch stage j of a pipeline takes (Appendix B eq. 5, 7, 8)

    Stage_j = sum over its layer intervals of n_layers * step(T_f, T_b, T_comm)  + head/embedding
    Tail_j  = exposed embedding / head / norm syncs + sum of n_layers * exposed(T_f, T_b, T_comm)

and with charge_j its share of the hops (``cost.model.hop_charges``) and n micro-batches

    Pipeline-Time = A + (n - 1) * B + C,   A = sum_j (Stage_j + charge_j),
                                           B = max_j (Stage_j + charge_j),   C = max_j Tail_j

(eq. 8 plus the data-parallel time the last backward cannot hide); the iteration takes the slowest
pipeline (eq. 9). Times in seconds; Stage and charge per micro-batch, Tail and the pipeline time per
iteration. The large-cluster path (``BatchTimer.abc_all``) takes the array forms at the end of this
module (summed in another order: equal to float rounding, tested).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import zero_terms as Z

NO_EDGES = (0.0, 0.0, 0.0)
"""(embedding, LM head, norms) sync times of a stage that holds none of them."""


def dp_t_comm(sharding: str, t_red: float, t_par: float) -> float:
    """T_comm entering DP-Overhead-Layer (whose collectives cost 2*T_comm): ddp all-reduces gradients
    (reduce-scatter + all-gather, both at reduce_dtype); zero2 reduce-scatters gradients
    (reduce_dtype) and all-gathers parameters (B_type); zero3 is dominated by its per-use parameter
    gathers (B_type)."""
    if sharding == "ddp":
        return t_red
    if sharding == "zero2":
        return 0.5 * (t_red + t_par)
    return t_par


def dp_intervals(dp_red: dict, dp_par: dict, sharding: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """Per stage (i, j), [(layers, T_comm)] as DP-Overhead-Layer takes it: :func:`dp_t_comm` of the
    reduce-byte and parameter-byte terms (``estimate.dp_terms``) of each interval of layers."""
    return {k: [(n, dp_t_comm(sharding, t_red, t_par)) for (n, t_red), (_, t_par) in zip(v, dp_par[k])]
            for k, v in dp_red.items()}


def dp_edge_exposed(times: tuple[float, float, float], backward_s: float, sharding: str = "ddp") -> tuple[float, float]:
    """(total, exposed) of ``estimate.dp_edge_times``: the embedding's gradient is final only at the end
    of the backward (fully exposed), the head's sync overlaps the stage's last backward
    ``backward_s`` as far as the runtime starts it there (:func:`zero_terms.zero_head_exposed`),
    the norms' broadcast follows the sync."""
    t_emb, t_head, t_norms = times
    return t_emb + t_head + t_norms, t_emb + Z.zero_head_exposed(t_head, backward_s, sharding) + t_norms


def layer_step(t_f: float, t_b: float, t_comm: float, sharding: str,
               theta: tuple[float, float, float, float]) -> tuple[float, float]:
    """(time per micro-batch, exposed data-parallel time per iteration) of one layer (eq. 5, as the
    runtime runs it: :mod:`.zero_terms`): ZeRO-3 overlaps every forward and backward with its
    gathers (theta_3f*max(T_f, T_comm) + theta_3b*max(T_b, T_comm)) and stalls for the uses it
    serves (:func:`zero_terms.zero3_serve_layer`), then reduce-scatters after the backward
    (:func:`zero_terms.zero3_exposed_layer`); DDP and ZeRO-2 run T_f + T_b, DDP's exposed part is
    :func:`cost.model.dp_exposed_layer`, ZeRO-2's :func:`zero_terms.zero2_exposed_layer` (its
    all-gather follows the optimizer step). Both are non-decreasing in ``t_comm``."""
    if sharding == "zero3":
        step = theta[2] * max(t_f, t_comm) + theta[3] * max(t_b, t_comm) + Z.zero3_serve_layer(t_comm)
        return step, Z.zero3_exposed_layer(t_comm)
    if sharding == "zero2":
        return t_f + t_b, Z.zero2_exposed_layer(t_b, t_comm, theta[1])
    return t_f + t_b, cm.dp_exposed_layer(t_b, t_comm, sharding, theta)


def stage_time(t_f: float, t_b: float, intervals: Iterable[tuple[int, float]], extra_s: float,
               edges: tuple[float, float, float] | None, num_layers: int, sharding: str,
               theta: tuple[float, float, float, float]) -> tuple[float, float]:
    """(Stage_j per micro-batch, Tail_j per iteration) of one stage: its layer intervals
    [(n_layers, T_comm)] each priced by :func:`layer_step`, plus ``extra_s`` (the head / embedding
    compute and communication, ``estimate.stage_extra_times`` summed); the tail starts from the
    exposed part of the stage's embedding / head / norm syncs ``edges`` (None: none)."""
    tail = dp_edge_exposed(edges, num_layers * t_b, sharding)[1] if edges is not None else 0.0
    stage = 0.0
    for n_layers, t_comm in intervals:
        step, exposed = layer_step(t_f, t_b, t_comm, sharding, theta)
        stage += n_layers * step
        tail += n_layers * exposed
    return stage + extra_s, tail


@dataclass(frozen=True)
class PipelineTime:
    """A pipeline's time as a function of its micro-batch count n: ``(A + (n - 1) * B) + C``."""

    steps: list[float]
    """Stage_j + charge_j per micro-batch, per stage."""
    charges: list[float]
    """Each stage's share of the hops per micro-batch (``cost.model.hop_charges``)."""
    A: float
    """sum_j steps[j]: the first micro-batch's trip through every stage."""
    B: float
    """max_j steps[j]: the pace of the following micro-batches."""
    C: float
    """max_j Tail_j: exposed data-parallel time after the last backward, per iteration."""

    def time_s(self, num_micro_batches: int) -> float:
        """Pipeline-Time (eq. 8) + C, in seconds per iteration."""
        return pipeline_seconds(self.A, self.B, self.C, num_micro_batches)

    @property
    def bubble_s(self) -> float:
        """Fill and drain per iteration: sum_j steps - max_j steps."""
        return self.A - self.B


def pipeline_time(stage_s: Sequence[float], hop_s: Sequence[float], tails: Sequence[float],
                  schedule: str) -> PipelineTime:
    """Compose per-micro-batch stage times ``stage_s``, the hop times ``hop_s`` (Comm-PP-Hop of the
    link from stage j to j + 1, 0 for the last stage) and the stages' tails into a
    :class:`PipelineTime` under ``schedule``."""
    charges = cm.hop_charges(list(hop_s), schedule)
    steps = [s + h for s, h in zip(stage_s, charges)]
    return PipelineTime(steps, charges, sum(steps), max(steps), max(tails))


def pipeline_seconds(A, B, C, n):
    """``(A + (n - 1) * B) + C``: a pipeline's time per iteration with n micro-batches, for floats or
    arrays alike (the batch timer evaluates it over many (m, n) at once); the one place it is written."""
    return (A + (n - 1) * B) + C


def iteration_time(pipeline_s: Sequence[float]) -> float:
    """Total-Time = max_i Pipeline-Time(i) (eq. 9)."""
    return cm.total_time(pipeline_s)


# ---- the same formulas over arrays of stages (BatchTimer.abc_all: hundreds of pipelines at once) ----

def layer_steps(t_f: np.ndarray, t_b: np.ndarray, t_comm: np.ndarray, sharding: str,
                theta: tuple[float, float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`layer_step` element-wise over arrays of (T_f, T_b, T_comm) (zero_terms: ZeRO-3 serves
    and reduce-scatters after the backward, ZeRO-2's all-gather follows the step)."""
    th1, th2, th3f, th3b = theta
    if sharding == "zero3":
        return th3f * np.maximum(t_f, t_comm) + th3b * np.maximum(t_b, t_comm) + 2.0 * t_comm, t_comm
    if sharding == "zero2":
        return t_f + t_b, np.maximum(0.0, th2 * np.maximum(t_b, t_comm) - t_b) + t_comm
    return t_f + t_b, np.maximum(0.0, th1 * np.maximum(t_b, 2 * t_comm) - t_b)


def head_exposed(t_head: np.ndarray, backward_s: np.ndarray, sharding: str) -> np.ndarray:
    """:func:`zero_terms.zero_head_exposed` element-wise (the exposed part of the LM head's sync)."""
    if sharding == "ddp":
        return np.maximum(0.0, t_head - backward_s)
    if sharding == "zero2":
        return np.maximum(0.0, 0.5 * t_head - backward_s) + 0.5 * t_head
    return t_head


def pipelines_abc(steps: np.ndarray, tails: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, C) per pipeline of stages laid end to end (``starts``: each pipeline's first stage):
    the sum and max of Stage_j + charge_j, the max of Tail_j (:func:`pipeline_time`, vectorised)."""
    return np.add.reduceat(steps, starts), np.maximum.reduceat(steps, starts), np.maximum.reduceat(tails, starts)
