"""calibrate / profile --model / discover --name rewrite a cluster file the user may have written by hand:
only the keys they change are written again, the rest stays as written (comments where they were,
quoting, flow style). Before, the file was dumped whole: every column-0 comment moved to the top and
every inline one was dropped."""

from __future__ import annotations

import yaml

from lightning_hexiscale.profiling.writer import copy_cluster, update_calibration, update_layer_tables
from lightning_hexiscale.profiling.yaml_blocks import rewrite_keys

HAND_WRITTEN = """\
# Our lab: two boxes.
name: lab  # the name plans record
gpu_types:
  BOX-A: {flops: "160 GFLOPS", memory: "4 GiB"}
  BOX-B: {flops: "40 GFLOPS", memory: "1 GiB"}

# the second box sits in the other room: slow cable
machines:
  - {name: a, gpu: BOX-A, count: 2, intra_bandwidth: "10 GB/s", intra_latency: "20us"}  # NVLink
  - {name: b, gpu: BOX-B, count: 2, intra_bandwidth: "0.5 GB/s", intra_latency: "20us"}
inter_machine: {bandwidth: "1 Gbps", latency: "50us"}  # measured with iperf
"""

KEPT = ["name: lab  # the name plans record", "# the second box sits in the other room: slow cable",
        '  - {name: a, gpu: BOX-A, count: 2, intra_bandwidth: "10 GB/s", intra_latency: "20us"}  # NVLink',
        'inter_machine: {bandwidth: "1 Gbps", latency: "50us"}  # measured with iperf']


def test_calibrate_keeps_the_comments_and_lines_it_does_not_change(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(HAND_WRITTEN)
    update_calibration(path, {"theta_ddp": 1.25}, {"BOX-B": 0.5})
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Our lab: two boxes." and lines[1].startswith("# Calibrated ")
    for line in KEPT:
        assert line in lines, text
    # the comment stays above the key it describes, not moved to the top
    assert lines.index("# the second box sits in the other room: slow cable") == lines.index("machines:") - 1
    doc = yaml.safe_load(text)
    assert doc["calibration"]["theta_ddp"] == 1.25 and doc["gpu_types"]["BOX-B"]["efficiency"] == 0.5
    assert doc["gpu_types"]["BOX-A"] == {"flops": "160 GFLOPS", "memory": "4 GiB"}
    update_calibration(path, {"theta_ddp": 1.5}, {})  # again: the block is replaced, not added twice
    again = path.read_text()
    assert again.count("calibration:") == 1 and yaml.safe_load(again)["calibration"]["theta_ddp"] == 1.5
    assert sum(ln.startswith("# Calibrated ") for ln in again.splitlines()) == 2
    for line in KEPT:
        assert line in again.splitlines()


def test_layer_tables_and_a_renaming_copy_keep_the_comments(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(HAND_WRITTEN)
    copy = copy_cluster(path, tmp_path / "copy.yaml", name="lab2")
    text = copy.read_text()
    assert "name: lab2" in text.splitlines() and all(line in text.splitlines() for line in KEPT[1:])
    assert yaml.safe_load(text)["name"] == "lab2"

    class Table:  # what update_layer_tables reads of a measured table
        gpu, precision, model_name, rows = "BOX-A", "32-true", "llama_tiny", [1, 2]

        def to_config(self):
            return {"gpu": "BOX-A", "precision": "32-true", "model": {"name": "llama_tiny", "hidden_size": 64},
                    "rows": [[1, 1, 0.5, 1.0]]}

    update_layer_tables(path, [Table()])
    text = path.read_text()
    assert all(line in text.splitlines() for line in KEPT) and "# Layer times measured " in text
    assert yaml.safe_load(text)["layer_times"][0]["gpu"] == "BOX-A"


def test_rewrite_keys_replaces_appends_removes_and_falls_back_where_it_cannot_split():
    doc = yaml.safe_load(HAND_WRITTEN)
    new = {**doc, "name": "x", "calibration": {"theta_ddp": 2.0}}
    del new["inter_machine"]
    out = rewrite_keys(HAND_WRITTEN, new, ["name", "calibration", "inter_machine"], stamp="# stamped")
    assert yaml.safe_load(out) == new
    lines = out.splitlines()
    assert lines[:2] == ["# Our lab: two boxes.", "# stamped"] and "name: x" in lines
    assert lines[-2:] == ["calibration:", "  theta_ddp: 2.0"] and not any("inter_machine" in ln for ln in lines)
    assert "# the second box sits in the other room: slow cable" in lines
    # a flow mapping, a key twice, an anchor whose block changes: the whole dump, comments on top
    for text in ('{name: a, machines: []}  # flow\n', "name: a\nname: b\n# c\n",
                 "base: &b {x: 1}\n# c\nother: *b\n"):
        doc = yaml.safe_load(text)
        changed = {**doc, "name": "n"} if "name" in doc else {**doc, "base": {"x": 2}}
        out = rewrite_keys(text, changed, ["name"] if "name" in doc else ["base"])
        assert yaml.safe_load(out) == changed, (text, out)


def test_a_list_written_at_column_0_stays_its_keys_block():
    """PyYAML writes a mapping's list without indenting its items (``machines:`` then ``- name: a``), and
    people copy that style: the items belong to the key above them, and the file is still split."""
    text = ("# ours\nname: lab\nmachines:\n- {name: a, gpu: BOX-A, count: 2}  # the big one\n-   name: b\n    gpu: BOX-B\n"
            "# links\ninter_machine: {bandwidth: 1 Gbps}  # iperf\n")
    doc = {**yaml.safe_load(text), "calibration": {"theta_ddp": 1.1}, "name": "lab2"}
    out = rewrite_keys(text, doc, ["calibration", "name"])
    assert yaml.safe_load(out) == doc
    for line in ("- {name: a, gpu: BOX-A, count: 2}  # the big one", "# links",
                 "inter_machine: {bandwidth: 1 Gbps}  # iperf", "# ours"):
        assert line in out.splitlines(), out
    doc2 = {**yaml.safe_load(text), "machines": [{"name": "c", "gpu": "BOX-A", "count": 1}]}
    out2 = rewrite_keys(text, doc2, ["machines"])  # the whole list's block is replaced, items included
    lines = out2.splitlines()
    assert yaml.safe_load(out2) == doc2 and "# the big one" not in out2
    assert lines[:2] == ["# ours", "name: lab"] and lines.index("# links") == lines.index("inter_machine: "
                                                                                         "{bandwidth: 1 Gbps}  # iperf") - 1
