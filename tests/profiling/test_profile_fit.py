"""alpha-beta least squares on synthetic ping-pong timings, and the pair schedule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_hexiscale.profiling.fit import fit_alpha_beta, pair_schedule, round_robin, split_round

SIZES = [1 << 10, 64 << 10, 512 << 10, 2 << 20, 4 << 20]


@pytest.mark.parametrize("alpha,beta", [(50e-6, 2e9), (5e-6, 200e9), (2e-3, 1e8), (0.0, 1e9)])
def test_exact_timings_recover_alpha_beta(alpha, beta):
    times = [alpha + s / beta for s in SIZES]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9, abs=1e-15)
    assert fit.beta_Bps == pytest.approx(beta, rel=1e-9)
    assert fit.rel_rms < 1e-9


def test_noisy_repeats_recover_alpha_beta_within_noise():
    """5 reps per size with 5 % multiplicative noise and one 10x outlier per size: the median per
    size and the relative-residual fit keep alpha and beta within a few percent."""
    alpha, beta = 40e-6, 3e9
    rng = np.random.default_rng(0)
    sizes, times = [], []
    for s in SIZES:
        for k in range(5):
            t = (alpha + s / beta) * (1 + 0.05 * rng.standard_normal())
            sizes.append(s)
            times.append(t * 10 if k == 0 else t)
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.15)
    assert fit.beta_Bps == pytest.approx(beta, rel=0.05)


def test_min_statistic_ignores_slow_wakeups():
    """Half the samples pay an extra 2 ms (a sleeping receiver's wake-up): min recovers the link."""
    alpha, beta = 30e-6, 2e9
    sizes = [s for s in SIZES for _ in range(4)]
    times = [alpha + s / beta + (2e-3 if k % 2 else 0.0) for k, s in enumerate(sizes)]
    fit = fit_alpha_beta(sizes, times, reduce="min")
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.beta_Bps == pytest.approx(beta, rel=1e-6)


def test_negative_intercept_is_clamped_to_zero():
    """Noise that would give a negative alpha: alpha = 0 and beta from the slope alone."""
    times = [s / 1e9 * f for s, f in zip(SIZES, [0.9, 0.99, 1.0, 1.0, 1.0])]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.alpha_s == 0.0 and fit.beta_Bps == pytest.approx(1e9, rel=0.1)


def test_bad_inputs_raise_with_the_reason():
    with pytest.raises(ValueError, match="two distinct"):
        fit_alpha_beta([1024, 1024], [1e-5, 1e-5])
    with pytest.raises(ValueError, match="does not grow"):
        fit_alpha_beta(SIZES, [1e-3, 9e-4, 8e-4, 7e-4, 6e-4])
    with pytest.raises(ValueError, match="> 0"):
        fit_alpha_beta(SIZES, [0.0, 1, 1, 1, 1])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 13, 64])
def test_round_robin_covers_every_pair_once_with_disjoint_rounds(n):
    rounds = round_robin(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))  # each exactly once, (low, high)
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks)), f"round {r} reuses a rank"
        assert len(r) == n // 2


def test_split_round_limits_pairs_and_isolates_host_links():
    hosts = ["a"] * 4 + ["b"] * 4
    rnd = [(0, 7), (1, 6), (2, 3), (4, 5)]  # two cross-host pairs, two inside hosts
    subs = split_round(rnd, hosts)
    assert sorted(p for s in subs for p in s) == sorted(rnd)
    for s in subs:
        assert sum(hosts[a] != hosts[b] for a, b in s) <= 1  # hosts a, b share one NIC each
    assert len(subs) == 2
    assert [len(s) for s in split_round(rnd, hosts, max_pairs=1)] == [1, 1, 1, 1]
    assert len(split_round(rnd, hosts, isolate_hosts=False)) == 1


def test_pair_schedule_64_ranks_on_8_hosts():
    hosts = [f"h{r // 8}" for r in range(64)]
    steps = pair_schedule(64, hosts)
    assert sorted(p for s in steps for p in s) == list(itertools.combinations(range(64), 2))
    for s in steps:
        used = [x for p in s for x in p]
        assert len(used) == len(set(used))
        cross_hosts = [h for a, b in s if hosts[a] != hosts[b] for h in (hosts[a], hosts[b])]
        assert len(cross_hosts) == len(set(cross_hosts))
    # 1792 cross-host pairs, at most 4 per step (8 hosts): >= 448 steps, and not many more.
    assert 448 <= len(steps) <= 700
    assert len(pair_schedule(64, hosts, isolate_hosts=False)) == 63
