"""The pre-registered rules of benchmarks/bench_hetero.py: its targets, its ranking test and its rounds.

Written down before any full run of the bench and printed with every result; no rule or target
changes after results are seen (a change needs a new issue, and the results page says which runs
were made under which rules).

**History.** Issue 28's first rule measured the search against ``fast-only``, the best symmetric plan
on ANY machine subset, the whole cluster included: on ``emu_headroom`` that is a Galvatron-style plan
on all six ranks, which ties the search, so that rule mixed two questions. Issue 43 (committed here
before its first run) splits it into rule 1 and rule 3 below and renames the baselines:
``leave-out-*`` (a strict subset: at least one machine left out) and ``symmetric-best`` (may use
every machine). Rules 2 and 3, the ranking test and the rounds are issue 28's, unchanged.

1. **Worth it** (:data:`WORTH_IT_TARGETS`): is using the slow machines worth it, against what a user
   does without this project? The search's plan, measured median step time, over the best measured
   leave-out plan (the lower median of :data:`LEAVE_OUT`, ``leave-out-search`` and
   ``leave-out-symmetric``: the best plan of any style on a strict machine subset): at least
   **1.20x on ``emu_headroom``** in every run; at least **0.98x on ``emu_4to1``** (where the search
   may leave the slow machine out itself). Other clusters have no target (the ratio is printed).
   Noted when this file was written, before any run (``bench_hetero.py --cluster emu_headroom
   --plan-only``, nominal figures): issue 43 quotes "priced 1.31x", which is the search (0.711 s)
   over the fast machine ALONE (0.929 s). The best leave-out plan as the issue defines it (search
   included) is the search on the fast machine and ONE slow machine, 0.839 s: priced **1.18x**,
   below the 1.20x target. The rule is kept as the issue wrote it (a target is not moved to fit a
   price); the fast machine alone is printed beside it as a reference, not a rule.
2. **Accuracy** (:data:`ACCURACY_TARGET`): every compared plan's estimate within 15 % of its measured
   median, ``|estimate / median - 1| <= 0.15``, the held-out plans included.
3. **Best plan** (ranking): the search's plan is the measured best or tied against EVERY compared
   plan, ``symmetric-best`` (which may be a Galvatron-style plan on all devices), ``megatron`` and
   ``galvatron`` on all devices included. A plan beats the search when its median is lower AND the
   paired test below rejects "no difference". The test: per round k,
   ``d_k = ln(search's round median / the plan's round median)`` (round k ran both under the same
   load, at rotated positions); two-sided exact Wilcoxon signed-rank test of "d is symmetric about 0"
   at :data:`RANK_ALPHA` = 0.05 (:func:`wilcoxon_p`). Not significant: a tie.

**Rounds for the ranking test** (:func:`rounds_for_power`, :data:`RANKING_ROUNDS` = 25): enough to
detect a 5 % difference (``delta = ln 1.05 = 0.0488``) with 80 % power at alpha 0.05, given the
round-to-round noise of the earlier runs, :data:`PRIOR_ROUND_SIGMA` = 0.08:

- sigma, the standard deviation of ``d_k``, from the three 7-round runs of 2026-11-25 (README, bench
  section): per plan, the range of its 28 step times over 4.0 (the expected range of 28 normal
  draws in standard deviations) gives a per-step sigma of ln-time of 0.071 (search), 0.131
  (megatron), 0.082 (galvatron), 0.097 (metis), 0.117 (dp-equal), RMS 0.102; a round's median of
  4 steps has 0.546 of that (the median of 4 normal draws), and a paired difference of two such
  medians sqrt(2) of it: 0.102 x 0.546 x 1.414 = 0.079. Cross-check: galvatron and metis ran the same
  plan, and their medians over 28 steps differed by 3 %, 3 % and 2 % (RMS 0.027, i.e. a per-round
  sigma of 0.027 x sqrt(7) / 1.25 = 0.057 with 1.25 for medians against means). Taken: 0.08.
- normal approximation: ``n = ((z_{1-alpha/2} + z_{power}) sigma / delta)^2 = ((1.960 + 0.842) x
  0.08 / 0.0488)^2 = 21.1``; small-sample t correction (Guenther 1981) ``+ z_{1-alpha/2}^2 / 2 =
  1.92``: 23.0; the Wilcoxon test needs ``1 / ARE = pi / 3`` as many (ARE 0.955 under normal noise):
  24.1, so 25 rounds. tests/runtime/test_bench_hetero_rules.py checks the power by simulation.

With fewer rounds the ranking verdict is printed but marked as below the pre-registered power.
The old rule (a pair is ordered only if every round orders it alike) flagged a 1-sigma difference
30 % of the time at 7 rounds: 0.841^7 + 0.159^7.
"""

from __future__ import annotations

import functools
import math
import statistics
from statistics import NormalDist

WORTH_IT_TARGETS = {"emu_headroom": 1.20, "emu_4to1": 0.98}
"""Cluster name -> the least measured speedup of the search over the best leave-out plan (rule 1)."""
LEAVE_OUT = ("leave-out-search", "leave-out-symmetric")
"""The compared plans rule 1 is measured against (the better one): each on a strict machine subset."""
ACCURACY_TARGET = 0.15
"""|estimate / measured median - 1| for every compared plan."""
RANK_ALPHA = 0.05
RANK_POWER = 0.80
RANK_DIFFERENCE = 0.05
"""The ranking test detects this relative difference of medians ..."""
PRIOR_ROUND_SIGMA = 0.08
"""... given this standard deviation of the per-round log ratio of two plans (module docstring)."""
WILCOXON_ARE = 3.0 / math.pi
"""Asymptotic relative efficiency of the Wilcoxon signed-rank test to the t-test under normal noise."""


def rounds_for_power(sigma: float = PRIOR_ROUND_SIGMA, difference: float = RANK_DIFFERENCE,
                     alpha: float = RANK_ALPHA, power: float = RANK_POWER) -> tuple[int, str]:
    """Rounds the ranking test needs (module docstring), and the arithmetic as a line of text."""
    z = NormalDist()
    za, zb = z.inv_cdf(1 - alpha / 2), z.inv_cdf(power)
    delta = math.log(1 + difference)
    n_z = ((za + zb) * sigma / delta) ** 2
    n_t = n_z + za ** 2 / 2
    n_w = n_t / WILCOXON_ARE
    text = (f"n = ((z {za:.3f} + z {zb:.3f}) x sigma {sigma} / ln(1 + {difference}) = {delta:.4f})^2 = {n_z:.1f}; "
            f"+ z^2/2 = {n_t:.1f} (t); / ARE {WILCOXON_ARE:.3f} = {n_w:.1f} (Wilcoxon) -> {math.ceil(n_w)} rounds")
    return math.ceil(n_w), text


RANKING_ROUNDS, RANKING_ARITHMETIC = rounds_for_power()


@functools.lru_cache(maxsize=256)
def _null_counts(doubled_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """counts[w] = number of the 2^n sign assignments whose positive ranks sum to w (ranks doubled,
    so that average ranks of ties are integers)."""
    counts = [1] + [0] * sum(doubled_ranks)
    top = 0
    for r in doubled_ranks:
        top += r
        for w in range(top, r - 1, -1):
            counts[w] += counts[w - r]
    return tuple(counts)


def wilcoxon_p(diffs: list[float]) -> float:
    """Two-sided exact p-value of the Wilcoxon signed-rank test that ``diffs`` are symmetric about 0.

    Zeros are dropped; tied |d| get their average rank. W+ = sum of the ranks of the positive
    differences; p = 2 min(P(W+ <= w), P(W+ >= w)) under the exact null distribution (every sign
    equally likely), capped at 1. 1.0 when no difference is non-zero."""
    d = [x for x in diffs if x != 0.0]
    n = len(d)
    if n == 0:
        return 1.0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    doubled = [0] * n
    i = 0
    while i < n:  # average ranks of ties, doubled: ranks i+1 .. j share (i+1+j)/2
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            doubled[order[k]] = i + 1 + j + 1
        i = j + 1
    w = sum(r for r, x in zip(doubled, d) if x > 0)
    counts = _null_counts(tuple(sorted(doubled)))
    total = float(2 ** n)
    low = sum(counts[: w + 1]) / total
    high = sum(counts[w:]) / total
    return min(1.0, 2.0 * min(low, high))


def paired_log_ratios(a_round_medians: list[float], b_round_medians: list[float]) -> list[float]:
    """Per round, ln(a / b) of the two plans' round medians."""
    return [math.log(a / b) for a, b in zip(a_round_medians, b_round_medians)]


def ordered(a_round_medians: list[float], b_round_medians: list[float], alpha: float = RANK_ALPHA) -> bool:
    """True when the rounds order the two plans: the test rejects "no difference" at ``alpha``."""
    return wilcoxon_p(paired_log_ratios(a_round_medians, b_round_medians)) < alpha


def compare(estimates: dict[str, float], measured: dict[str, dict], cluster_name: str,
            held_out: tuple[str, ...] = (), in_sample: tuple[str, ...] = ()) -> dict:
    """Rows (per plan), the estimate's order against the measurement's, and the three targets.

    ``estimates`` in seconds; ``measured`` per plan: PlanTimes.to_dict(). speedup_of_search = the
    plan's median / the search's (>1: the search's plan is faster); ratio = estimate / median.
    """
    names = [n for n in measured if n in estimates]
    base = measured.get("search", {}).get("median_s")
    rows = {}
    for n in names:
        m = measured[n]
        p_value = (wilcoxon_p(paired_log_ratios(measured["search"]["round_medians_s"], m["round_medians_s"]))
                   if base and n != "search" else None)
        rows[n] = {**m, "estimate_s": estimates[n], "ratio": estimates[n] / m["median_s"],
                   "speedup_of_search": (m["median_s"] / base) if base else None,
                   "estimated_speedup_of_search": (estimates[n] / estimates["search"]) if "search" in estimates else None,
                   "p_vs_search": p_value, "held_out": n in held_out, "in_sample": n in in_sample}
    by_est = sorted(names, key=lambda n: estimates[n])
    by_meas = sorted(names, key=lambda n: measured[n]["median_s"])
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    discordant = [(a, b) for a, b in pairs
                  if (estimates[a] - estimates[b]) * (measured[a]["median_s"] - measured[b]["median_s"]) < 0]
    unsettled = [(a, b) for a, b in discordant
                 if not ordered(measured[a]["round_medians_s"], measured[b]["round_medians_s"])]
    return {"rows": rows, "order_by_estimate": by_est, "order_by_measured": by_meas,
            "discordant_pairs": discordant, "unsettled_pairs": unsettled,
            "estimated_ties": [(a, b) for a, b in pairs if estimates[a] == estimates[b]],
            "targets": targets(rows, cluster_name)}


def targets(rows: dict[str, dict], cluster_name: str) -> dict[str, dict]:
    """The three pre-registered targets; ``pass`` None where a target cannot be judged (and why)."""
    out: dict[str, dict] = {}
    search = rows.get("search")
    left = [n for n in LEAVE_OUT if n in rows]
    goal = WORTH_IT_TARGETS.get(cluster_name)
    if search is None or not left:
        out["worth_it_over_leave_out"] = {"value": None, "target": f">= {goal}" if goal else "none for this cluster",
                                          "pass": None, "why": "the search's plan or every leave-out plan is missing"}
    else:
        best = min(left, key=lambda n: rows[n]["median_s"])
        sp = rows[best]["median_s"] / search["median_s"]
        out["worth_it_over_leave_out"] = {"value": sp, "against": best, "target": f">= {goal}" if goal else
                                          "none for this cluster", "pass": (sp >= goal) if goal else None}
    worst = max(rows, key=lambda n: abs(rows[n]["ratio"] - 1.0), default=None)
    out["estimates_within_15pct"] = {
        "value": abs(rows[worst]["ratio"] - 1.0) if worst else None, "worst_plan": worst,
        "held_out_worst": max((abs(r["ratio"] - 1.0) for r in rows.values() if r["held_out"]), default=None),
        "target": f"<= {ACCURACY_TARGET} for every plan, held-out ones included",
        "pass": (abs(rows[worst]["ratio"] - 1.0) <= ACCURACY_TARGET) if worst else None}
    if search is None:
        out["search_best_or_tied"] = {"value": None, "target": "no plan measured faster at p < 0.05", "pass": None,
                                      "why": "the search's plan did not run"}
    else:
        beaten = sorted(n for n, r in rows.items() if n != "search" and r["median_s"] < search["median_s"]
                        and r["p_vs_search"] is not None and r["p_vs_search"] < RANK_ALPHA)
        tied = sorted(n for n, r in rows.items() if n != "search" and r["median_s"] < search["median_s"]
                      and n not in beaten)
        out["search_best_or_tied"] = {"value": not beaten, "beaten_by": beaten, "tied_with": tied,
                                      "target": f"no plan measured faster at p < {RANK_ALPHA} (Wilcoxon, paired rounds)",
                                      "pass": not beaten}
    return out


def round_sigma(measured: dict[str, dict]) -> float | None:
    """This run's round-to-round noise (printed next to the prior, never used to change the rule): the
    standard deviation of d_k about its pair's mean, pooled over every pair of plans (one degree of
    freedom per pair for its mean)."""
    names = list(measured)
    squares, dof = 0.0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = paired_log_ratios(measured[a]["round_medians_s"], measured[b]["round_medians_s"])
            if len(d) > 1:
                mu = statistics.mean(d)
                squares += sum((x - mu) ** 2 for x in d)
                dof += len(d) - 1
    return math.sqrt(squares / dof) if dof else None
