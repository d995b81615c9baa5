"""The JSON documents other programs read are the ones docs/reference/configuration.md describes, field
for field: ``hexiscale estimate --json``, ``hexiscale plan --json`` and a run's ``plan_check.json``.
Every documented field is in what the code writes, and every field the code writes is documented
(a table row names a field, ``pipelines[i].batch``, ``.micro_batch`` the next one beside it; a
``{a, b}`` in its meaning names the keys of its object, or of each item of its list; ``{name: {a,
b}}`` a map whose values have those keys). A field added or renamed without the docs fails here."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_hexiscale.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference" / "configuration.md"


def documented_fields(heading: str) -> set[str]:
    """The field paths of the table under ``## heading``: list indices as ``[]``, map keys as ``*``."""
    text = REFERENCE.read_text()
    section = text[text.index(f"## {heading}\n"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    out: set[str] = set()
    for line in re.findall(r"^\| `.*$", section, re.M):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        names, unit, meaning = cells[0], cells[1], cells[-1]
        full: list[str] = []
        for n in re.findall(r"`([^`]+)`", names):
            n = re.sub(r"\[\w\]", "[]", n)
            if n.startswith(".") and full:
                n = full[-1].rsplit(".", 1)[0] + n
            full.append(n)
        out.update(full)
        inner = re.match(r"[^{]*?`\{([^`]*)\}`", meaning)
        if inner and len(full) == 1:  # the keys of this field's object, its items (unit: list) or map values
            body = inner.group(1)
            mapped = re.match(r"\w+: \{(.*)\}$", body)
            field = full[0] + (".*" if mapped else "[]" if unit.startswith("list") else "")
            out.update(f"{field}.{k.strip()}" for k in (mapped.group(1) if mapped else body).split(", "))
    return out


def actual_fields(doc, documented: set[str], path: str = "") -> set[str]:
    """Paths in ``doc``, descending only where the docs describe the insides (documented longer paths)."""
    out = set()
    below = [d for d in documented if d.startswith(path) and d != path] if path else list(documented)
    if not below:
        return out
    if isinstance(doc, list):
        for item in doc:
            out |= actual_fields(item, documented, path + "[]")
    elif isinstance(doc, dict):
        mapped = any(d.startswith(f"{path}.*") for d in documented)
        for k, v in doc.items():
            p = f"{path}.{'*' if mapped else k}" if path else k
            out |= {p, p + "[]"} if isinstance(v, list) else {p}
            out |= actual_fields(v, documented, p)
    return out


def check(doc: dict, heading: str) -> None:
    documented = documented_fields(heading)
    have = actual_fields(doc, documented)
    described = {""} | {d.rsplit(".", 1)[0] for d in documented if "." in d}  # objects whose keys the docs list

    def parent(p: str) -> str:
        return p.rsplit(".", 1)[0] if "." in p else ""

    missing = sorted(documented - have)
    undocumented = sorted(p for p in have - documented if parent(p) in described and not p.endswith("[]")
                          and not any(d.startswith((p + ".", p + "[")) for d in documented))
    assert not missing and not undocumented, (f"{heading}: documented but not written {missing}; "
                                              f"written but not documented {undocumented}")


def test_estimate_json_is_the_documented_document(capsys):
    # the paper's Tab. 7 plan under bf16-mixed: some devices out of memory, so out_of_memory has items
    assert main(["estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out_of_memory"]
    check(doc, "`hexiscale estimate --json`")


@pytest.mark.slow
def test_plan_json_is_the_documented_document(capsys):
    assert main(["plan", "cluster=cpu_demo", "model=llama_demo", "planner.iterations=3", "planner.progress=false",
                 "--baselines", "--optimum", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    check(doc, "`hexiscale plan --json`")  # its estimate: the estimate test's document (this plan fits: no OOM items)


def test_plan_check_json_is_the_documented_document(tmp_path, capsys):
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.lightning.plan_check import FILE_NAME, PlanCheck
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Plan, Workload, estimate

    plan = Plan.from_dict({"num_layers": 4, "pipelines": [
        {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 4]}]}]})
    est = estimate(plan, Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny")))
    check_ = PlanCheck(SimpleNamespace(device="cpu"), plan, est, rank=0, world_size=1, warmup=0, measured_steps=2)
    check_.step_s, check_.busy_s = [0.2, 0.3], [0.1, 0.2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 0.25 s against its price: the PlanCheckWarning
        check_.report(SimpleNamespace(loggers=[object()], log_dir=str(tmp_path)))
    check(json.loads((tmp_path / FILE_NAME).read_text()), "`plan_check.json`")
