"""The planner: plans, the Appendix B cost model, and the two-phase search. No torch.distributed here.

- :mod:`.plan`        frozen Plan / Pipeline / Stage, validation, YAML/JSON
- :mod:`.cost_model`  each Appendix B term as a named pure function
- :mod:`.estimate`    a plan on a cluster -> :class:`Estimate` (times, memory, throughput)
- :mod:`.partition`   the device graph and its multilevel (pymetis) partitions
- :mod:`.assemble`    drafts -> pipelines -> plans: stage strategies, layer and batch splits
- :mod:`.search`      §4's two-phase iterative search
- :mod:`.baselines`   Megatron / Galvatron / Metis / random under the same cost model

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
