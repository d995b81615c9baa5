"""``planner.progress``: the search's bar is drawn on a terminal (or in a notebook) only. Into a pipe
or a log file (`hexiscale plan ... 2> log`, CI) each search wrote a line of carriage-returned bars, and
``hexiscale plan`` runs up to two searches per device subset (30 bars for hetero2). Each was named
``search`` alone, so that on a terminal the bars that restart from 0 % read as a loop: each now names
its devices and its recompute setting."""

import io
import sys
import types

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _search(progress: bool) -> None:
    search(Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny")), 8,
           SearchSettings(iterations=3, progress=progress, recompute=False, use_all_devices=True))


@pytest.mark.parametrize("stream, progress, notebook, drawn", [
    (Terminal, True, False, True),        # a terminal: the bar
    (io.StringIO, True, False, False),    # a pipe or a file: no bar
    (io.StringIO, True, True, True),      # a Jupyter kernel's stream is no terminal, and shows the bar
    (Terminal, False, False, False),      # planner.progress=false: never
])
def test_the_search_bar_is_drawn_on_a_terminal_only(monkeypatch, stream, progress, notebook, drawn):
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    if notebook:
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    else:
        monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    _search(progress)
    # the bar names its search (one per device subset and recompute setting: bars of one name read as a loop)
    assert ("search (4 devices, recompute off):" in err.getvalue()) == drawn, err.getvalue()
    assert ("search" in err.getvalue()) == drawn, err.getvalue()


@pytest.mark.parametrize("argv", [["--json"], []])
def test_hexiscale_plan_draws_the_bar_on_a_terminal_with_or_without_json(monkeypatch, capsys, argv):
    """`hexiscale plan --json > plan.json` at a terminal searched in silence: --json turned the bar off.
    The bar goes to stderr, so stdout stays the JSON document."""
    import json

    from lightning_hexiscale.cli.main import main

    out = io.StringIO()
    err = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert main(["plan", *argv, "cluster=cpu_hetero4", "model=llama_tiny", "train.global_batch=8",
                 "planner.iterations=3", "train.recompute=false", "planner.use_all_devices=true"]) == 0
    assert "search (4 devices, recompute off):" in err.getvalue(), err.getvalue()
    if argv:
        assert json.loads(out.getvalue())["plan"]["pipelines"]
