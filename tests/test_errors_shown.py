"""The value an error shows, and the type check of the API's entry points (lightning_hexiscale.errors):
one rule where six copies showed a list, a dict or a Cluster as its type's name only, and the entry
points said "must be a Cluster" without the type they were given."""

from __future__ import annotations

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, PlanError, check_argument_types, shown
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload, estimate, search
from lightning_hexiscale.planner.oracle import oracle


class _BrokenRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


@pytest.mark.parametrize("value, expected", [
    ("hetero1", "hetero1"), (3, 3), (0.5, 0.5), (None, None), (True, True),
    ("x" * 500, "x" * 500),  # a string is shown whole: it is what the user typed
    ([1, 2], [1, 2]), ({}, {}), ((2, 4), (2, 4)),
    (list(range(100)), "list"),  # a long repr: the type's name
    (_BrokenRepr(), "_BrokenRepr"), (b"ab", "bytes"),
])
def test_a_value_is_shown_as_itself_when_short_else_by_its_type(value, expected):
    assert shown(value) == expected


def test_an_object_is_shown_by_its_type_name_even_with_a_short_repr():
    """The error keeps the value and travels pickled between ranks: a lambda's repr is short too."""
    assert shown(Cluster.load("cpu2")) == "Cluster"  # repr: Cluster('cpu2', 2 devices, 1 machines)
    assert shown(lambda: 0) == "function"
    assert shown(LlamaConfig.load("llama_tiny")) == "LlamaConfig"
    assert shown([_BrokenRepr()]) == "list"


def test_the_type_check_names_the_call_the_type_given_and_the_types_wanted():
    with pytest.raises(PlanError) as ei:
        check_argument_types("f", (("a", 1, int, "x"), ("b", [1], (Cluster, type(None)), "pass a Cluster")), PlanError)
    e = ei.value
    assert (e.key, e.value, e.fix) == ("f(b)", [1], "pass a Cluster")
    assert e.rule == "is of type list; it must be a Cluster or None", e.rule
    check_argument_types("f", (("a", None, (int, type(None)), "x"),))  # None where None is allowed: no error


@pytest.mark.parametrize("call, key, rule", [
    (lambda c, w: search("cpu_hetero4", w, 8), "search(cluster)", "is of type str; it must be a Cluster"),
    (lambda c, w: search(c, w, 8, {"iterations": 2}), "search(settings)",
     "is of type dict; it must be a SearchSettings or None"),
    (lambda c, w: oracle(c, w.model, 8), "oracle(workload)", "is of type LlamaConfig; it must be a Workload"),
    (lambda c, w: estimate({"pipelines": []}, c, w), "estimate(plan)", "is of type dict; it must be a Plan"),
    (lambda c, w: oracle(c, w, 8, settings=3), "oracle(settings)",
     "is of type int; it must be an OracleSettings or SearchSettings or None"),  # 'an' before a vowel
    (lambda c, w: Workload("llama_tiny"), "Workload(model)", "is of type str; it must be a LlamaConfig"),
    # keyed by the call made, not by the recipe's trainer.weights
    (lambda c, w: LlamaLitModule("hf:/no/such/dir"), "LlamaLitModule(config)", "no such local directory (nothing is downloaded)"),
    (lambda c, w: LlamaLitModule(3), "LlamaLitModule(config)",
     "is of type int; it must be a LlamaConfig, a preset name, 'hf:/path/to/dir' or a transformers LlamaConfig"),
])
def test_the_entry_points_name_the_call_and_what_they_were_given(call, key, rule):
    cluster, workload = Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny"))
    with pytest.raises(ConfigError) as ei:
        call(cluster, workload)
    assert ei.value.key == key and ei.value.rule == rule, ei.value
