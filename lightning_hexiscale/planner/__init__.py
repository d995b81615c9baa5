"""The planner: plans, the Appendix B cost model, and the two-phase search. No torch.distributed here.

- :mod:`.plan`        frozen Plan / Pipeline / Stage, validation, YAML/JSON
- :mod:`.cost_model`  each Appendix B term (and what the runtime allocates) as a named pure function
- :mod:`.dp_comm`     the data-parallel T_comm of every stage of a plan
- :mod:`.estimate`    a plan on a cluster -> :class:`Estimate` (times, memory, throughput)
- :mod:`.partition`   the device graph and its multilevel (pymetis) partitions
- :mod:`.assemble`    drafts -> pipelines: stage strategies, leaders, layer splits
- :mod:`.dp_split`    a layer split that sees the data-parallel links
- :mod:`.batching`    the exact best batches and micro-batch sizes of a layout
- :mod:`.floors`      lower bounds of a layout's time (hopeless layouts are not scored)
- :mod:`.search`      §4's two-phase iterative search (and what it adds)
- :mod:`.refine`      local improvement of the best layouts
- :mod:`.oracle`      the true optimum of the plan space on up to 8 devices
- :mod:`.cases`       random small heterogeneous clusters (search vs oracle)
- :mod:`.baselines`   Megatron / Galvatron / Metis / random / exhaustive under the same cost model

The functions ``estimate(plan, cluster, workload)`` and ``search(cluster, workload, G, settings)``
live in the modules of the same name (``from lightning_hexiscale.planner.search import search``);
the package root re-exports both.
"""

from lightning_hexiscale._lazy import lazy_exports
from lightning_hexiscale.planner.estimate import Estimate, Workload
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage

__all__ = ["Estimate", "Pipeline", "Plan", "SearchResult", "SearchSettings", "Stage", "Workload"]

# The search pulls in networkx and pymetis; `hexiscale estimate` does not need them.
__getattr__, __dir__ = lazy_exports(__name__, {name: "lightning_hexiscale.planner.search"
                                               for name in ("SearchResult", "SearchSettings")})
