"""The planner: plans, the Appendix B cost model, and the two-phase search. No torch.distributed here.

Every caller outside the planner imports from here (tests/planner/test_root_imports.py checks)::

    from lightning_hexiscale.planner import Plan, Workload, estimate, search, SearchSettings

One sub-package per concern, each importing only those above it in this list:

- :mod:`.plan`        frozen Plan / Pipeline / Stage, validation, YAML/JSON (the runtime reads only this)
- :mod:`.layout`      the rank layout derived from a Plan (RankLayout)
- :mod:`.cost`        the cost model: Appendix B's terms composed once (:mod:`.cost.compose`) -> ``estimate()``
- :mod:`.search`      §4's two-phase search and what it adds: partitions, layouts, batches, subsets
- :mod:`.oracle`      the true optimum of the plan space on up to 8 devices (what the search is held to)
- :mod:`.baselines`   Megatron / Galvatron / Metis / random / exhaustive under the same cost model

The search pulls in networkx and pymetis, the baselines the search: their names are resolved on
first use, so ``hexiscale estimate`` and ``import lightning_hexiscale.planner`` do not load them.
The cost model's internals (terms, the batch timer) stay in their modules.
"""

from lightning_hexiscale._lazy import lazy_exports
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload, estimate, workload_from_config
from lightning_hexiscale.planner.plan import DP_SHARDINGS, SCHEDULES, Pipeline, Plan, Stage

_LAZY = {
    "RankLayout": "lightning_hexiscale.planner.layout",
    "PricingCache": "lightning_hexiscale.planner.cost.cache",
    "pricing_cache": "lightning_hexiscale.planner.cost.cache",
    "price_sources": "lightning_hexiscale.planner.cost.sources",
    # settings.py alone does not import networkx / pymetis; the search does
    "SearchResult": "lightning_hexiscale.planner.search.settings",
    "SearchSettings": "lightning_hexiscale.planner.search.settings",
    "compute_ceiling": "lightning_hexiscale.planner.baselines",
    "exhaustive": "lightning_hexiscale.planner.baselines",
    "run_baselines": "lightning_hexiscale.planner.baselines",
    "search": "lightning_hexiscale.planner.search",  # the sub-package itself (see below)
}

# ``search`` is the sub-package .search itself, which is callable as its search() (an attribute set
# here would be replaced by the sub-package as soon as anything imports it: the import system
# binds a loaded sub-module on its parent); ``from lightning_hexiscale.planner import search`` and
# ``planner.search`` import it on first use like the lazy names (_LAZY's entry above).
__all__ = sorted(["DP_SHARDINGS", "Estimate", "Pipeline", "Plan", "SCHEDULES", "Stage", "Workload", "estimate",
                  "workload_from_config", *_LAZY])

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
