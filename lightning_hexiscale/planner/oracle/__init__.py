"""The true optimum of the plan space under ``estimate()``, on clusters of up to 8 devices: what the
search is held against (tests/planner/oracle/test_search_vs_oracle.py, ``hexiscale plan --oracle``).

- :mod:`.exact`   the exhaustive branch and bound: ``oracle(cluster, workload, G, settings)``
- :mod:`.space`   its space and its result: OracleSettings, OracleResult, compositions, partitions
- :mod:`.terms`   every time and memory term of a stage, a hop and a pipeline, and their bounds
- :mod:`.cases`   random small heterogeneous clusters (search vs oracle)

The package exports the names ``lightning_hexiscale.planner.oracle`` had as a module
(``from lightning_hexiscale.planner.oracle import oracle``), lazily.
"""

from lightning_hexiscale._lazy import lazy_exports

_EXACT = "lightning_hexiscale.planner.oracle.exact"
_SPACE = "lightning_hexiscale.planner.oracle.space"
__all__ = ["MAX_DEVICES", "Oracle", "OracleResult", "OracleSettings", "OracleTimeout", "compositions",
           "device_classes", "oracle", "vector_partitions"]
__getattr__, __dir__ = lazy_exports(__name__, {
    "MAX_DEVICES": _EXACT, "Oracle": _EXACT, "oracle": _EXACT,
    "OracleTimeout": "lightning_hexiscale.planner.oracle.terms",
    **{name: _SPACE for name in ("OracleResult", "OracleSettings", "compositions", "device_classes",
                                 "vector_partitions")}})
