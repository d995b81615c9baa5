"""The oracle searches the plans ``estimate()`` prices: where layer tables restrict TP groups
(measured degrees, inside one machine: :class:`~lightning_hexiscale.planner.cost.sources.StageRule`)
it enumerates only those, as the search does. It enumerated every group, so ``--optimum`` offered a
TP-1 stage of a type measured only at TP 2, or a pair across machines, that ``estimate()`` refuses."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner import SearchSettings, Workload, estimate, search
from lightning_hexiscale.planner.cost import sources
from lightning_hexiscale.planner.oracle.exact import OracleSettings, oracle
from tests.planner.search.test_search_table_tp import MODEL, W, _doc


def _stages_follow_the_rule(plan, cluster: Cluster, w: Workload) -> bool:
    rule = sources.stage_rule(cluster, w)
    return all(rule(st.devices) for p in plan.pipelines for st in p.stages)


@pytest.mark.parametrize("tp,counts,other", [(2, (2, 2), 0), (2, (2,), 2), (1, (1, 1), 1)])
def test_the_oracle_plans_only_groups_the_tables_price(tp, counts, other):
    """(2, (2, 2)): TP-2 rows only, two 2-device machines: TP-1 stages and pairs across machines are
    out; (2, (2,), 2): beside two FLOP/s-priced devices; (1, (1, 1), 1): TP-1 rows, lone devices on
    three machines (a pair of them would be across machines)."""
    c = Cluster.from_config(_doc(tp, counts, other=other))
    settings = OracleSettings(recompute="auto")
    best = oracle(c, W, 8, settings, time_limit_s=60)
    assert best.complete and best.plan is not None
    assert _stages_follow_the_rule(best.plan, c, W), best.plan.table(c)
    priced = estimate(best.plan, c, W)  # refused (ConfigError) for a group the tables do not price
    assert priced.cost == pytest.approx(best.cost, rel=1e-9)
    found = search(c, W, 8, SearchSettings(iterations=6, progress=False))
    assert found.estimate.cost >= best.cost * (1 - 1e-9)  # the oracle's optimum bounds the search
    assert found.estimate.cost <= best.cost * 1.02, (found.plan.table(c), best.plan.table(c))


def test_allow_table_mismatch_lets_the_oracle_use_any_group():
    c = Cluster.from_config(_doc(2, (2, 2)))
    w = dataclasses.replace(W, allow_table_mismatch=True)
    assert sources.stage_rule(c, w) is None
    best = oracle(c, w, 8, OracleSettings(recompute="auto"), time_limit_s=60)
    assert best.complete and best.plan is not None
