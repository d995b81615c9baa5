"""A profiled cluster moved as a pair (cluster YAML + matrix YAML, ``matrix_file`` relative: the
layout docs/guide/profiling.md recommends) is read AND rewritten beside the cluster file, from any
working directory. `hexiscale calibrate` loaded such a pair, measured, then looked the matrix file up
from the working directory to add the sync latency: "No such file" after the whole measurement, or a
different file of that name rewritten; and a second calibration added its delta on top of the first."""

from __future__ import annotations

import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import matrix_file_path
from lightning_hexiscale.profiling.writer import (copy_cluster, previous_sync_latency, update_calibration,
                                                  write_cluster)
from test_profile_writer import synthetic


@pytest.fixture
def moved_pair(tmp_path, monkeypatch):
    """prof.yaml + prof.matrix.yaml in pair/, matrix_file relative; the working directory elsewhere,
    holding a decoy file of the matrix file's name."""
    path, mpath = write_cluster(synthetic(), tmp_path / "pair" / "prof.yaml")
    doc = yaml.safe_load(path.read_text())
    doc["matrix_file"] = mpath.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / mpath.name).write_text("decoy: not a matrix\n")
    monkeypatch.chdir(elsewhere)
    return path, mpath, elsewhere / mpath.name


def test_calibration_rewrites_the_matrix_beside_the_cluster_file(moved_pair):
    path, mpath, decoy = moved_pair
    assert Cluster.load(str(path)).latency[0, 1] == pytest.approx(20e-6 * 1.01)  # the loader finds it
    update_calibration(path, {"theta_ddp": 1.2}, {"GPU-X": 0.5}, sync_latency_s=300e-6)
    assert decoy.read_text() == "decoy: not a matrix\n"
    assert yaml.safe_load(path.read_text())["matrix_file"] == mpath.name  # still movable as a pair
    c = Cluster.load(str(path))
    assert c.latency[0, 1] == pytest.approx(20e-6 * 1.01 + 300e-6)
    assert previous_sync_latency(path) == pytest.approx(300e-6)
    # calibrating again replaces the delta (it was read as 0 from the working directory, and added twice)
    update_calibration(path, {}, {}, sync_latency_s=100e-6)
    assert Cluster.load(str(path)).latency[0, 1] == pytest.approx(20e-6 * 1.01 + 100e-6)


def test_a_copy_takes_the_matrix_beside_the_source(moved_pair, tmp_path):
    path, mpath, decoy = moved_pair
    out = copy_cluster(path, tmp_path / "copy" / "c.yaml")
    assert (tmp_path / "copy" / "c.matrix.yaml").read_text() == mpath.read_text()
    assert Cluster.load(str(out)).num_devices == 4


def test_the_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd.yaml").write_text("x: 1\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "both.yaml").write_text("x: 1\n")
    (tmp_path / "both.yaml").write_text("x: 2\n")
    c = tmp_path / "d" / "c.yaml"
    assert matrix_file_path(c, "both.yaml") == tmp_path / "d" / "both.yaml"  # beside the cluster file first
    assert matrix_file_path(c, "cwd.yaml").resolve() == tmp_path / "cwd.yaml"  # then the working directory
    assert matrix_file_path(c, tmp_path / "cwd.yaml") == tmp_path / "cwd.yaml"  # absolute: as written
    assert matrix_file_path(c, "none.yaml") == tmp_path / "d" / "none.yaml"  # nowhere: named beside, for the error
