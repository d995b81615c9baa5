"""The planner: plans, the Appendix B cost model, and the two-phase search. No torch.distributed here.

One sub-package per concern, each importing only those above it in this list:

- :mod:`.plan`        frozen Plan / Pipeline / Stage, validation, YAML/JSON (the runtime reads only this)
- :mod:`.cost`        the cost model: Appendix B's terms, memory, the wire, shared NICs -> ``estimate()``
- :mod:`.search`      §4's two-phase search and what it adds: partitions, layouts, batches, subsets
- :mod:`.oracle`      the true optimum of the plan space on up to 8 devices (what the search is held to)
- :mod:`.baselines`   Megatron / Galvatron / Metis / random / exhaustive under the same cost model

``estimate(plan, cluster, workload)`` is in :mod:`.cost.estimate`; ``search(cluster, workload, G,
settings)`` in :mod:`.search` (``from lightning_hexiscale.planner.search import search``). The
package root exports the types (Plan, Estimate, Workload, SearchSettings, SearchResult). The flat
module paths before the split (``planner.cost_model``, ``planner.estimate``, ...) are gone; the
CHANGELOG lists where each moved.
"""

from lightning_hexiscale._lazy import lazy_exports
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage

__all__ = ["Estimate", "Pipeline", "Plan", "SearchResult", "SearchSettings", "Stage", "Workload"]

# The search pulls in networkx and pymetis; `hexiscale estimate` does not need them.
__getattr__, __dir__ = lazy_exports(__name__, {name: "lightning_hexiscale.planner.search.settings"
                                               for name in ("SearchResult", "SearchSettings")})
