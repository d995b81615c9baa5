"""The search for a plan: §4's two-phase hierarchical search and what it adds (no torch.distributed).

- :mod:`.entry`       what callers run: ``search(cluster, workload, G, settings)`` (recompute, subsets)
- :mod:`.two_phase`   the two-phase search itself on one (sub)cluster (SearchRun)
- :mod:`.settings`    what it takes and returns: SearchSettings, SearchResult, its log
- :mod:`.partition`   the device graph and its multilevel (pymetis) partitions
- :mod:`.assemble`    drafts -> pipelines: stage strategies, leaders, layer splits
- :mod:`.dp_split`    a layer split that sees the data-parallel links
- :mod:`.batching`    the exact best batches and micro-batch sizes of a layout
- :mod:`.floors`      lower bounds of a layout's time (hopeless layouts are not scored)
- :mod:`.refine`      local improvement of the best layouts
- :mod:`.regroup`     layouts built from TP groups: replicas per machine, the best layouts regrouped
- :mod:`.subsets`     which devices a plan uses: the search over subsets of the cluster
- :mod:`.infeasible`  why no plan fits (or gives every device work): the message that names the term

The package exports the names ``lightning_hexiscale.planner.search`` had as a module, lazily: the
search pulls in networkx and pymetis, and importing :mod:`.settings` alone should not. The package
is itself callable as :func:`.entry.search`, so that ``from lightning_hexiscale.planner import
search`` -- which yields this sub-package, whatever the planner's root binds -- is the search.
"""

import sys
import types

from lightning_hexiscale._lazy import lazy_exports

_TWO_PHASE = "lightning_hexiscale.planner.search.two_phase"
_ENTRY = "lightning_hexiscale.planner.search.entry"
_SETTINGS = "lightning_hexiscale.planner.search.settings"
__all__ = ["CUTS", "Iteration", "LogEntry", "SearchResult", "SearchRun", "SearchSettings", "capacity_message",
           "dp_candidates", "first_sweep", "search", "subset_search"]
__getattr__, __dir__ = lazy_exports(__name__, {
    "SearchRun": _TWO_PHASE,
    **{name: _ENTRY for name in ("search", "subset_search")},
    "capacity_message": "lightning_hexiscale.planner.search.infeasible",
    **{name: _SETTINGS for name in ("CUTS", "Iteration", "LogEntry", "SearchResult", "SearchSettings",
                                    "dp_candidates", "first_sweep")}})


class _CallableSearch(types.ModuleType):
    """This package, callable: ``search(cluster, workload, global_batch, settings, worth)`` runs
    :func:`.entry.search` (looked up at each call, so a patched entry.search is seen)."""

    def __call__(self, *args, **kwargs):
        from lightning_hexiscale.planner.search import entry

        return entry.search(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableSearch
