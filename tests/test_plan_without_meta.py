"""A plan file whose ``meta:`` was deleted (or written by hand without one) was priced on the demo's
defaults, cpu_demo and llama_demo, when no ``cluster=`` / ``model=`` was given: `hexiscale estimate
--plan p.yaml` exit 0, no note. Refused, naming the key and the fix; given on the command line, or
named by the meta, it runs as before; ``model.*`` keys alone build on the default preset, which a
warning line names."""

from __future__ import annotations

import pytest
import yaml

from lightning_hexiscale.cli.main import main

PLAN = ["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", "planner.progress=false"]


@pytest.fixture
def plans(tmp_path, capsys):
    """{name: path}: the plan `hexiscale plan` writes, and it without meta / with only meta.model."""
    full = tmp_path / "p.yaml"
    assert main([*PLAN, "--out", str(full)]) == 0
    capsys.readouterr()
    doc = yaml.safe_load(full.read_text())
    meta = doc.pop("meta")
    (tmp_path / "no_meta.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "no_cluster.yaml").write_text(yaml.safe_dump({**doc, "meta": {"model": meta["model"]}}))
    return {p.stem: p for p in tmp_path.glob("*.yaml")}


@pytest.mark.parametrize("name, extra, said", [
    ("no_meta", [], "cluster = None: {path} names no cluster and no model (meta.cluster or meta.cluster_file, "
                    "meta.model)"),
    ("no_meta", ["cluster=cpu_hetero4"], "model = None: {path} names no model (meta.model)"),
    ("no_cluster", [], "cluster = None: {path} names no cluster (meta.cluster or meta.cluster_file)"),
])
def test_estimate_refuses_a_plan_that_names_no_cluster_or_model(plans, capsys, name, extra, said):
    path = plans[name]
    assert main(["estimate", "--plan", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert said.format(path=path) in err and ("Fix: pass cluster=" in err or "Fix: pass model=" in err)
    assert "Traceback" not in err


def test_cluster_plan_needs_only_the_cluster(plans, capsys):
    assert main(["cluster", f"plan={plans['no_meta']}"]) == 2
    assert "names no cluster (meta.cluster or meta.cluster_file)" in capsys.readouterr().err
    assert main(["cluster", f"plan={plans['no_cluster']}", "cluster=cpu_hetero4"]) == 0


def test_named_on_the_command_line_or_in_the_meta_it_runs(plans, capsys):
    assert main(["estimate", "--plan", str(plans["p"]), "--json"]) == 0
    assert '"cluster": "cpu_hetero4"' in capsys.readouterr().out
    assert main(["estimate", "--plan", str(plans["no_meta"]), "cluster=cpu_hetero4", "model=llama_tiny", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"cluster": "cpu_hetero4"' in out and '"model": "llama_tiny"' in out
    assert main(["estimate", "--plan", str(plans["no_cluster"]), "cluster=cpu_hetero4", "--json"]) == 0


def test_model_keys_alone_build_on_the_default_preset_with_a_warning(plans, capsys):
    keys = ["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=2",
            "model.ffn_hidden_size=352", "model.vocab_size=256"]
    assert main(["estimate", "--plan", str(plans["no_meta"]), "cluster=cpu_hetero4", *keys]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "names no model (meta.model) and no model= was given: the model is the default " \
                                  "preset llama_demo with the model.* overrides given" in err
