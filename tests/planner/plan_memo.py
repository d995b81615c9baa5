"""Memoised planner calls for tests that run ``hexiscale plan`` on the same inputs several times
(importable by name; ``conftest`` is ambiguous: the suite has several).

The search and the baselines are deterministic for their inputs (tests/planner/search/test_search.py
checks the same seed gives the same plan and log), so a test that asks again for a plan an earlier
test of its module already searched gets that result back instead of searching again; what the
command does with it (validation, reports, files written) still runs, on a copy of its own. The key is the pickled
arguments (cluster, workload, batch, settings) with ``progress`` set aside: it draws a bar and
changes no result. tests/planner/test_cli_plan.py plans case_study / Llama-2 13B / batch 24 in seven
tests, two of them with the baselines (three runs, one with --aware-baselines): 19.0 s for the file
on an idle 2-core host, 11.3 s memoised.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import pickle
from typing import Any, Callable, Iterator

from lightning_hexiscale.planner import SearchSettings, baselines
from lightning_hexiscale.planner.search import entry

BASELINE_FUNCTIONS = ("megatron", "galvatron", "metis", "random_baseline", "symmetric_best", "leave_out", "uniform_tp")
"""What :func:`baselines.run_baselines` calls by these names (looked up in its module at each call)."""


def _key(args: tuple, kwargs: dict) -> bytes:
    def plain(v: Any) -> Any:
        return dataclasses.replace(v, progress=False) if isinstance(v, SearchSettings) else v
    return pickle.dumps((tuple(plain(a) for a in args), sorted((k, plain(v)) for k, v in kwargs.items())))


def _memo(fn: Callable, store: dict, stats: dict) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        key = (fn.__name__, _key(args, kwargs))
        if key not in store:  # an exception (InfeasiblePlan, ConfigError) is not kept: raised again each time
            store[key] = fn(*args, **kwargs)
            stats["computed"] += 1
        else:
            stats["reused"] += 1
        # a copy each time: a test that changes the plan it got (a stage, a batch) must not change the
        # next test's result
        return copy.deepcopy(store[key])
    return call


@contextlib.contextmanager
def memoised_planner(monkeypatch) -> Iterator[dict]:
    """Within the block, ``entry.search`` (what ``lightning_hexiscale.planner.search(...)`` calls) and
    the baselines :func:`baselines.run_baselines` runs return the first result for equal arguments.
    Yields the counts {"computed": n, "reused": n}."""
    store: dict = {}
    stats = {"computed": 0, "reused": 0}
    monkeypatch.setattr(entry, "search", _memo(entry.search, store, stats))
    for name in BASELINE_FUNCTIONS:
        monkeypatch.setattr(baselines, name, _memo(getattr(baselines, name), store, stats))
    yield stats
