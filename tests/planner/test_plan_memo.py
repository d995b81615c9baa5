"""The test-only planner memo (plan_memo.py) gives each caller a result of its own: a test that
changes the plan it got must not change what a later test of the module gets."""

from __future__ import annotations

from plan_memo import _memo


def test_a_changed_result_does_not_reach_the_next_caller():
    calls = []

    def plan(cluster: str, batch: int) -> dict:
        calls.append((cluster, batch))
        return {"pipelines": [{"batch": batch, "stages": [1, 2]}]}

    stats = {"computed": 0, "reused": 0}
    memo = _memo(plan, {}, stats)
    first = memo("hetero3", 8)
    first["pipelines"][0]["stages"].append(3)  # what a careless test might do
    second = memo("hetero3", 8)
    assert second == {"pipelines": [{"batch": 8, "stages": [1, 2]}]}
    assert calls == [("hetero3", 8)] and stats == {"computed": 1, "reused": 1}
    assert memo("hetero3", 16)["pipelines"][0]["batch"] == 16 and len(calls) == 2
