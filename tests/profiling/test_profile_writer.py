"""The cluster YAML the profiler writes loads with Cluster.load / compose and round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.profiling.writer import ProfileResult, infer_machines, update_calibration, write_cluster


def synthetic(n_per_host=(2, 2), hosts=("nodeA", "nodeB")) -> ProfileResult:
    """Two hosts; intra-host links 10 GB/s / 20 us, cross-host 1 GB/s / 80 us, +1 % per pair."""
    names = [h for h, k in zip(hosts, n_per_host) for _ in range(k)]
    n = len(names)
    bw = np.full((n, n), np.inf)
    lat = np.zeros((n, n))
    for a in range(n):
        for b in range(a + 1, n):
            same = names[a] == names[b]
            bw[a, b] = bw[b, a] = (10e9 if same else 1e9) * (1 + 0.01 * (a + b))
            lat[a, b] = lat[b, a] = (20e-6 if same else 80e-6) * (1 + 0.01 * b)
    types = ["GPU-X" if names[r] == hosts[0] else "GPU-Y" for r in range(n)]
    return ProfileResult(hostnames=names, device_types=types, flops=[100e12 + r * 1e9 for r in range(n)],
                         memory_bytes=[80 * 2**30 if t == "GPU-X" else 24 * 2**30 for t in types],
                         bandwidth_Bps=bw, latency_s=lat, fit_rel_rms=np.zeros((n, n)), hopper=[False] * n,
                         backend="nccl", flops_dtype="bfloat16", sizes_bytes=[4096, 1 << 20, 16 << 20],
                         notes=["synthetic"])


def test_round_trip_through_cluster_load(tmp_path):
    p = synthetic()
    path, mpath = write_cluster(p, tmp_path / "prof.yaml")
    assert mpath.name == "prof.matrix.yaml" and mpath.is_file()
    c = Cluster.load(str(path))
    assert c.num_devices == 4 and c.name == "prof"
    assert [m.name for m in c.machines] == ["nodeA", "nodeB"]
    assert [m.hostname for m in c.machines] == ["nodeA", "nodeB"]
    assert [d.gpu_type for d in c.devices] == ["GPU-X", "GPU-X", "GPU-Y", "GPU-Y"]
    off = ~np.eye(4, dtype=bool)
    np.testing.assert_allclose(c.bandwidth[off], p.bandwidth_Bps[off], rtol=1e-12)
    np.testing.assert_allclose(c.latency, p.latency_s, rtol=1e-12, atol=0)
    # gpu_types carry the median FLOP/s of the type's ranks and its memory, efficiency 1.0.
    assert c.devices[0].flops == pytest.approx(100e12 + 0.5e9, rel=1e-8)  # median of 100e12, 100e12 + 1e9
    assert c.devices[2].memory_bytes == 24 * 2**30
    assert c.calibration.theta_ddp == 1.0


def test_compose_reads_the_written_file_from_another_directory(tmp_path, monkeypatch):
    path, _ = write_cluster(synthetic(), tmp_path / "sub" / "prof.yaml")
    monkeypatch.chdir(tmp_path)  # matrix_file is absolute: works from any working directory
    cfg = compose([f"cluster={path}"])
    c = Cluster.from_config(cfg.cluster)
    assert c.num_devices == 4 and c.bandwidth[0, 3] == pytest.approx(1e9 * 1.03)


def test_machines_are_consecutive_runs_of_one_host_and_type():
    ms = infer_machines(["a", "a", "b", "a", "a"], ["T", "U", "T", "T", "T"])
    assert [(m.name, m.hostname, m.device_type, m.ranks) for m in ms] == [
        ("a", "a", "T", (0,)), ("a.1", "a", "U", (1,)), ("b", "b", "T", (2,)), ("a.2", "a", "T", (3, 4))]


def test_single_device_machines_and_one_rank(tmp_path):
    p = synthetic(n_per_host=(1, 1))
    c = Cluster.load(str(write_cluster(p, tmp_path / "two.yaml")[0]))
    assert c.bandwidth[0, 1] == pytest.approx(1e9 * 1.01)
    one = ProfileResult(hostnames=["h"], device_types=["CPU"], flops=[1e11], memory_bytes=[2**30],
                        bandwidth_Bps=np.full((1, 1), np.inf), latency_s=np.zeros((1, 1)),
                        fit_rel_rms=np.zeros((1, 1)), sizes_bytes=[1, 2])
    assert Cluster.load(str(write_cluster(one, tmp_path / "one.yaml")[0])).num_devices == 1


def test_update_calibration_keeps_the_rest(tmp_path):
    path, _ = write_cluster(synthetic(), tmp_path / "prof.yaml")
    update_calibration(path, {"theta_ddp": 1.3}, {"GPU-X": 0.5})
    text = path.read_text()
    assert text.startswith("# Written by `hexiscale profile`") and "# Calibrated" in text
    c = Cluster.load(str(path))
    assert c.calibration.theta_ddp == 1.3 and c.calibration.theta_zero2 == 1.0
    assert c.devices[0].flops == pytest.approx(0.5 * c.devices[0].peak_flops)
    assert c.devices[2].flops == c.devices[2].peak_flops
    assert yaml.safe_load(text)["gpu_types"]["GPU-X"]["efficiency"] == 0.5
    with pytest.raises(KeyError, match="GPU-Z"):
        update_calibration(path, {}, {"GPU-Z": 0.5})



def test_update_calibration_refuses_an_efficiency_the_loader_would(tmp_path):
    """A fit past the loader's bound (config.gpu_types.check_efficiency) is refused before the file is
    written: it was written, and the file then no longer loaded."""
    from lightning_hexiscale.errors import ConfigError

    path, _ = write_cluster(synthetic(), tmp_path / "prof.yaml")
    update_calibration(path, {}, {"GPU-X": 1.4})  # a measured flops that training beats a little
    assert Cluster.load(str(path)).devices[0].efficiency == 1.4
    before = path.read_text()
    with pytest.raises(ConfigError, match="must be at most 10") as ei:
        update_calibration(path, {"theta_ddp": 1.3}, {"GPU-X": 50.0})
    assert ei.value.key == "cluster.gpu_types.GPU-X.efficiency" and path.read_text() == before


@pytest.mark.timeout(60)
def test_two_writers_of_one_file_do_not_crash_each_other(tmp_path):
    """Two jobs discovering the same fingerprint at once (two `hexiscale train` on one machine, say) write
    the same cache file. Both used the temporary name '<file>.tmp': one renamed it away under the
    other, whose rename then failed (FileNotFoundError in 3 of 3 runs of 2 x 300 writes). Each writer
    now has its own temporary name; the file is always one writer's whole text, and no temporary stays."""
    import threading

    from lightning_hexiscale.profiling.writer import atomic_write

    path, errors = tmp_path / "c.yaml", []
    texts = [f"name: w{k}\n" * 200 for k in range(2)]

    def write(k: int) -> None:
        for _ in range(300):
            try:
                atomic_write(path, texts[k])
            except OSError as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]
