import numpy as np
import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose, preset_names
from lightning_hexiscale.errors import ConfigError

GiB = 2**30


@pytest.mark.parametrize("name", preset_names("cluster"))
def test_every_preset_loads_through_hydra(name):
    c = Cluster.from_config(compose([f"cluster={name}"]).cluster)
    n = c.num_devices
    assert c.bandwidth.shape == (n, n) and c.latency.shape == (n, n)
    off = ~np.eye(n, dtype=bool)
    assert (c.bandwidth[off] > 0).all() and np.isfinite(c.bandwidth[off]).all()
    assert np.array_equal(c.bandwidth, c.bandwidth.T)
    assert sum(len(m.devices) for m in c.machines) == n


@pytest.mark.parametrize("name,n,types", [
    ("case_study", 8, {"A800": 3, "RTX4090": 3, "RTX3090": 2}),
    ("hetero1", 40, {"RTX3080Ti": 8, "RTX3090": 8, "RTX4090": 24}),
    ("hetero2", 32, {"RTX3080Ti": 8, "RTX3090": 8, "RTX4090": 8, "A800": 8}),
    ("hetero3", 56, {"RTX3090": 16, "RTX4090": 32, "A800": 8}),
    ("large_240", 240, {"RTX3090": 64, "RTX4090": 160, "A800": 16}),
    ("h800_h20_32", 48, {"H800": 16, "H20": 32}),
    ("cpu_hetero4", 4, {"CPU-FAST": 2, "CPU-SLOW": 2}),
])
def test_paper_cluster_compositions(name, n, types):
    c = Cluster.load(name)
    assert c.num_devices == n
    counts = {}
    for d in c.devices:
        counts[d.gpu_type] = counts.get(d.gpu_type, 0) + 1
    assert counts == types


def test_case_study_links():
    c = Cluster.load("case_study")
    assert c.bandwidth[0, 1] == 200e9          # NVLink inside A
    assert c.bandwidth[3, 4] == 32e9           # PCIe inside B
    assert c.bandwidth[6, 7] == 16e9           # PCIe inside C
    assert c.bandwidth[0, 3] == 2**30 and c.bandwidth[5, 6] == 2**30  # 1 GiB/s Ethernet between machines
    assert c.devices[0].memory_bytes == 80 * GiB and c.devices[3].memory_bytes == 24 * GiB


def test_hetero_inter_machine_is_5_6_gbps():
    c = Cluster.load("hetero3")
    assert c.bandwidth[0, 8] == pytest.approx(0.7e9)
    assert c.bandwidth[8, 15] == 32e9 and c.bandwidth[8, 16] == pytest.approx(0.7e9)


def test_graph_view():
    c = Cluster.load("case_study")
    g = c.graph()
    assert g.number_of_nodes() == 8 and g.number_of_edges() == 28
    assert g.edges[0, 1]["bandwidth"] == 200e9 and g.nodes[3]["gpu_type"] == "RTX4090"
    assert set(c.graph([0, 1, 2]).nodes) == {0, 1, 2}


def test_replicate_and_subset():
    c = Cluster.load("hetero2")
    big = c.replicate(4)
    assert big.num_devices == 128 and len(big.machines) == 16
    assert big.bandwidth[0, 32] == pytest.approx(0.7e9) and big.bandwidth[32, 33] == c.bandwidth[0, 1]
    sub = c.subset([24, 25, 0])
    assert sub.num_devices == 3 and sub.devices[0].gpu_type == "A800" and sub.bandwidth[0, 1] == 200e9


def _write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


BASE = {"name": "t", "machines": [{"gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"}],
        "inter_machine": {"bandwidth": "1 GB/s", "latency": "10us"}}


def test_user_gpu_type_and_file_cluster(tmp_path):
    data = dict(BASE, gpu_types={"MI300X": {"flops": "1307 TFLOPS", "memory": "192 GiB"}},
                machines=[{"gpu": "MI300X", "count": 2, "intra_bandwidth": "400 GB/s"}])
    c = Cluster.load(str(_write(tmp_path, data)))
    assert c.devices[0].peak_flops == 1307e12 and c.devices[1].memory_bytes == 192 * GiB


def test_cluster_file_via_compose(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = compose([f"cluster={p}"])
    assert Cluster.from_config(cfg.cluster).num_devices == 2


def test_matrix_file_overrides_links(tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump({"bandwidth_Bps": [[0, 5e9], [5e9, 0]], "latency_s": [[0, 2e-5], [2e-5, 0]]}))
    c = Cluster.load(str(_write(tmp_path, dict(BASE, matrix_file=str(m)))))
    assert c.bandwidth[0, 1] == 5e9 and c.latency[1, 0] == 2e-5


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["machines"][0].update(gpu="Z9000"), "unknown GPU type"),
    (lambda d: d["machines"][0].update(intra_bandwidth="200"), "needs a unit"),
    (lambda d: d["machines"][0].update(intra_bandwidth="-3 GB/s"), "greater than zero"),
    (lambda d: d["machines"][0].update(count=0), "must be a whole number from 1 to 1024"),
    (lambda d: d["inter_machine"].update(bandwith="1 GB/s"), "bandwith"),
    (lambda d: d.update(machines=[]), "at least one machine"),
    (lambda d: d.update(gpu_types={"X": {"flops": "1 TFLOPS", "memory": "12"}}), "needs a unit"),
])
def test_bad_cluster_files_give_clear_errors(tmp_path, mutate, fragment):
    import copy

    data = copy.deepcopy(BASE)
    mutate(data)
    with pytest.raises(ConfigError) as ei:
        Cluster.load(str(_write(tmp_path, data)))
    assert fragment in str(ei.value)


@pytest.mark.parametrize("matrix,fragment", [
    ({"bandwidth_Bps": [[0, 1e9, 1e9]] * 3, "latency_s": [[0, 0], [0, 0]]}, "must be 2 x 2"),
    ({"bandwidth_Bps": [[0, 1e9], [2e9, 0]], "latency_s": [[0, 0], [0, 0]]}, "symmetric"),
    ({"bandwidth_Bps": [[0, 0], [0, 0]], "latency_s": [[0, 0], [0, 0]]}, "must be > 0"),
    ({"bandwidth_Bps": [[0, 1e9], [1e9, 0]]}, "missing matrix"),
])
def test_bad_matrix_files(tmp_path, matrix, fragment):
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(matrix))
    with pytest.raises(ConfigError, match=fragment):
        Cluster.load(str(_write(tmp_path, dict(BASE, matrix_file=str(m)))))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="hetero3"):
        Cluster.load("hetero9")
    with pytest.raises(ConfigError, match="available cluster presets"):
        compose(["cluster=hetero9"])


def test_relative_matrix_file_resolves_next_to_the_cluster_file(tmp_path, monkeypatch):
    sub = tmp_path / "profiled"
    sub.mkdir()
    (sub / "m.yaml").write_text(yaml.safe_dump({"bandwidth_Bps": [[0, 7e9], [7e9, 0]], "latency_s": [[0, 1e-5], [1e-5, 0]]}))
    path = _write(sub, dict(BASE, matrix_file="m.yaml"))
    monkeypatch.chdir(tmp_path)  # the matrix is not in the working directory
    assert Cluster.load(str(path)).bandwidth[0, 1] == 7e9
    assert Cluster.from_config(compose([f"cluster={path}"]).cluster).bandwidth[0, 1] == 7e9


def test_machines_given_as_names_name_the_entry_the_rule_and_an_example():
    """machines: [a, b] said "cluster = '<dict>': Invalid type assigned: str is not a subclass of
    MachineConfig" (a file: cluster = '<path>': ...), naming neither the entry nor what it should be."""
    with pytest.raises(ConfigError, match=r"^cluster\.machines\[1\] = 'b': an entry of machines must be a mapping "
                                          r"with the keys gpu, count, intra_bandwidth, .*not a str.*Fix: write it as "
                                          r"e\.g\. \{name: b, gpu: A800, count: 8, intra_bandwidth: \"200 GB/s\"\}"):
        Cluster.from_config({"name": "x", "machines": [{"gpu": "A800", "count": 1, "intra_bandwidth": "1 GB/s"}, "b"]})


def test_an_empty_machine_name_is_refused_and_a_left_out_one_is_defaulted():
    """name: "" was silently renamed (A800-0), as if it had been left out."""
    machine = {"gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"}
    assert [m.name for m in Cluster.from_config({"name": "x", "machines": [machine]}).machines] == ["A800-0"]
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=r"^cluster\.machines\[0\]\.name = '\s*': a machine name must not be "
                                              r"empty.*Fix: give it a name \(e\.g\. name: A800-0\)"):
            Cluster.from_config({"name": "x", "machines": [{**machine, "name": empty}]})


def _one_device_machines(intra: dict) -> dict:
    return {"name": "x", "inter_machine": {"bandwidth": "3 GB/s"},
            "machines": [{"name": "a", "gpu": "A800", "count": 1, **intra}, {"name": "b", "gpu": "A800", "count": 1, **intra},
                         {"name": "c", "gpu": "RTX4090", "count": 2, "intra_bandwidth": "32 GB/s"}]}


def test_a_one_device_machine_needs_no_intra_bandwidth_and_is_priced_the_same_whatever_it_says():
    """count: 1 without intra_bandwidth was "intra_bandwidth = '???': not a bandwidth". One device has
    no link inside its machine: the figure given (or not) changes no link and no estimate."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate, search, SearchSettings

    workload = Workload(LlamaConfig.load("llama_tiny"))
    plans = [Plan((Pipeline(8, 2, (Stage((0,), (0, 1)), Stage((1,), (1, 2)), Stage((2, 3), (2, 4)))),), 4),
             Plan((Pipeline(4, 1, (Stage((0, 1), (0, 4)),)), Pipeline(4, 2, (Stage((2, 3), (0, 4)),))), 4)]
    variants = [Cluster.from_config(_one_device_machines(intra)) for intra in
                ({}, {"intra_bandwidth": "1 KB/s", "intra_latency": "1s"}, {"intra_bandwidth": "900 GB/s"})]
    left_out = variants[0]
    plans.append(search(left_out, workload, 8, SearchSettings(iterations=2)).plan)
    for c in variants[1:]:
        assert np.array_equal(c.bandwidth, left_out.bandwidth) and np.array_equal(c.latency, left_out.latency)
        for plan in plans:
            assert estimate(plan, c, workload).iteration_time_s == estimate(plan, left_out, workload).iteration_time_s


def test_a_machine_of_several_devices_says_it_needs_intra_bandwidth():
    machine = {"name": "a", "gpu": "A800", "count": 2}
    with pytest.raises(ConfigError, match=r"^cluster\.machines\[0\]\.intra_bandwidth = None: missing: a machine of 2 "
                                          r"devices needs intra_bandwidth \(the link between its devices\)\. Fix: add "
                                          r"e\.g\. intra_bandwidth: \"200 GB/s\""):
        Cluster.from_config({"name": "x", "machines": [machine]})


def test_a_cluster_file_that_is_not_yaml_says_where_to_correct_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmachines: [{gpu: A800\n")
    with pytest.raises(ConfigError, match=r"(?s)cannot read YAML .*line.*Fix: correct the syntax at the line and column named"):
        Cluster.load(str(bad))


def test_a_cluster_dict_may_leave_its_name_out():
    """A label only: the Python API took such a dict before (naming it '???'); a file still needs it."""
    c = Cluster.from_config({"machines": [{"gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"}]})
    assert c.name == "cluster" and c.num_devices == 2


def test_a_gpu_type_no_machine_names_warns_unless_it_looks_like_a_misspelling():
    """An entry that no machine names prices nothing. Close to a type the machines use that has no
    entry of its own (A80O beside gpu: A800): an error (bad_configs/cluster/unused_gpu_type.yaml).
    Otherwise (a file listing more types than this cluster uses, such as one catalog of types shared
    by several cluster files, or an H100 override beside A800 machines): a warning naming it, and the
    cluster is the one without the entry."""
    import warnings

    from lightning_hexiscale.config.cluster import Cluster

    machines = [{"name": "m0", "gpu": "T0", "count": 2, "intra_bandwidth": "32 GB/s"}]
    types = {f"T{i}": {"flops": f"{10 * (i + 1)} TFLOPS", "memory": "24 GiB"} for i in range(3)}
    with pytest.warns(UserWarning, match=r"cluster.gpu_types.T1: is a new type, but no machine names it"):
        shared = Cluster.from_config({"name": "c", "gpu_types": types, "machines": machines})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone = Cluster.from_config({"name": "c", "gpu_types": {"T0": types["T0"]}, "machines": machines})
    assert shared.devices == alone.devices
    a800 = [{"name": "m0", "gpu": "A800", "count": 2, "intra_bandwidth": "32 GB/s"}]
    with pytest.warns(UserWarning, match="overrides the catalog's H100, but no machine names it"):
        Cluster.from_config({"name": "c", "gpu_types": {"H100": {"memory": "40 GiB"}}, "machines": a800})


def test_efficiency_is_a_fraction_of_the_peak_it_names():
    """``gpu_types.<type>.efficiency``: at most 1 of a catalog type's datasheet peak; up to 10 of a
    declared flops, which may be a measured rate that training beats a little (what hexiscale
    calibrate fits on a profiled CPU cluster). 2**70 was accepted and priced every layer at ~0 s."""
    from lightning_hexiscale.config.gpu_types import MAX_EFFICIENCY
    from lightning_hexiscale.errors import ConfigError

    def cluster(gpu, entry):
        return Cluster.from_config({"name": "c", "gpu_types": {gpu: entry},
                                    "machines": [{"name": "m0", "gpu": gpu, "count": 1}]})

    assert cluster("A800", {"efficiency": 0.45}).devices[0].flops == pytest.approx(0.45 * 312e12)
    declared = cluster("X", {"flops": "10 TFLOPS", "memory": "24 GiB", "efficiency": 1.5})
    assert declared.devices[0].flops == pytest.approx(15e12)
    assert cluster("A800", {"flops": "200 TFLOPS", "efficiency": 1.2}).devices[0].flops == pytest.approx(240e12)
    for gpu, entry, rule in (("A800", {"efficiency": 2**70}, "efficiency of a datasheet peak"),
                             ("A800", {"efficiency": 1.5}, "must be at most 1: training does not beat"),
                             ("X", {"flops": "10 TFLOPS", "memory": "24 GiB", "efficiency": 2**70},
                              f"must be at most {MAX_EFFICIENCY:g}")):
        with pytest.raises(ConfigError, match=rule) as ei:
            cluster(gpu, entry)
        assert ei.value.key == f"cluster.gpu_types.{gpu}.efficiency" and "Fix:" in str(ei.value)


@pytest.mark.parametrize("name,value,rule", [
    ("flops", "1e40 TFLOPS", "at most 1 EFLOP/s for one device"),
    ("flops", "1e300 TFLOPS", "times its unit it overflows"),
    ("fp32_flops", "1e40 TFLOPS", "at most 1 EFLOP/s"),
    ("tf32_flops", "1e40 TFLOPS", "at most 1 EFLOP/s"),
    ("memory", "1e30 GiB", "at most 1 PiB"),
    ("memory", "1e300 TiB", "times its unit it overflows"),
    ("memory_bandwidth", "1e40 TB/s", "at most 1 PB/s"),
    ("memory_bandwidth", "1e300 TB/s", "times its unit it overflows"),
])
def test_a_device_figure_past_any_device_is_refused(name, value, rule):
    """Finite figures no device has (and finite numbers that overflow to inf in their unit) were
    accepted: compute or memory-bound work priced at 0 s, every plan fitting in memory."""
    from lightning_hexiscale.errors import ConfigError

    with pytest.raises(ConfigError, match=rule) as ei:
        Cluster.from_config({"name": "c", "gpu_types": {"A800": {name: value}},
                             "machines": [{"name": "m0", "gpu": "A800", "count": 1}]})
    assert ei.value.key == f"cluster.gpu_types.A800.{name}" and "Fix:" in str(ei.value)


def test_a_machine_link_naming_a_repeated_entry_sets_every_copy_as_nics_to_does():
    """``machine_links: [{machines: [fast, slow]}]`` with ``slow`` declared ``repeat: 2`` was refused
    ("must name two declared machines. Fix: use names from: fast, slow.0, slow.1") although
    ``nics.to`` takes the entry name for all its copies (docs/guide/clusters.md): the entry name
    now stands for every copy, ``[slow, slow]`` for the links among the copies, and a pair set by
    two links is refused naming both."""
    base = {"name": "rep", "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"},
            "machines": [{"name": "fast", "gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"},
                         {"name": "slow", "gpu": "RTX4090", "count": 1, "repeat": 3}]}
    c = Cluster.from_config(dict(base, machine_links=[
        {"machines": ["fast", "slow"], "bandwidth": "10 GB/s", "latency": "20us"},
        {"machines": ["slow", "slow"], "bandwidth": "5 GB/s"}]))
    assert [m.name for m in c.machines] == ["fast", "slow.0", "slow.1", "slow.2"]
    for s in (2, 3, 4):  # device 2, 3, 4: the three copies
        assert c.bandwidth[0, s] == c.bandwidth[s, 1] == 10e9 and c.latency[1, s] == pytest.approx(20e-6)
    assert c.bandwidth[2, 3] == c.bandwidth[3, 4] == c.bandwidth[4, 2] == 5e9
    # a copy's own name still sets that copy alone
    one = Cluster.from_config(dict(base, machine_links=[{"machines": ["slow.1", "fast"], "bandwidth": "7 GB/s"}]))
    assert one.bandwidth[0, 3] == 7e9 and one.bandwidth[0, 2] == one.bandwidth[0, 4] == 1e9
    with pytest.raises(ConfigError, match=r"machine_links\[1\].machines.*already given by cluster.machine_links\[0\] "
                                          r"\(machines fast and slow.1\)"):
        Cluster.from_config(dict(base, machine_links=[{"machines": ["fast", "slow"], "bandwidth": "10 GB/s"},
                                                      {"machines": ["slow.1", "fast"], "bandwidth": "7 GB/s"}]))
    with pytest.raises(ConfigError, match="must name two declared machines. Fix: use names from: fast, slow, slow.0"):
        Cluster.from_config(dict(base, machine_links=[{"machines": ["fast", "slwo"], "bandwidth": "10 GB/s"}]))


@pytest.mark.parametrize("devices,rule", [
    ([9], "device 9 is not an id of cluster cpu_hetero4 (0..3)"),
    ([], "names no device"),
    ([0, 0], "names a device twice"),
    (3, "must be a list of device ids"),
    ([True], "device True is not an id"),
])
def test_subset_of_devices_it_lacks_is_a_config_error(devices, rule):
    """`Cluster.subset([9])` was numpy's IndexError ("tuple index out of range"), [] another one."""
    with pytest.raises(ConfigError) as caught:
        Cluster.load("cpu_hetero4").subset(devices)
    assert caught.value.key == "Cluster.subset(devices)" and rule in caught.value.rule and caught.value.fix


def test_subset_keeps_the_order_it_is_given():
    c = Cluster.load("cpu_hetero4")
    sub = c.subset([3, 0])
    assert [d.gpu_type for d in sub.devices] == [c.devices[3].gpu_type, c.devices[0].gpu_type]


@pytest.mark.parametrize("kwargs,key", [
    ({"k": 0}, "Cluster.replicate(k)"), ({"k": -1}, "Cluster.replicate(k)"), ({"k": "2"}, "Cluster.replicate(k)"),
    ({"k": 2, "inter_bandwidth": -1.0}, "Cluster.replicate(inter_bandwidth)"),
    ({"k": 2, "inter_bandwidth": float("inf")}, "Cluster.replicate(inter_bandwidth)"),
    ({"k": 2, "inter_latency": -1e-6}, "Cluster.replicate(inter_latency)"),
])
def test_replicate_refuses_a_bad_count_or_link(kwargs, key):
    """replicate(-1) was numpy's "negative dimensions are not allowed", replicate('2') a TypeError and
    inter_bandwidth=-1 a cluster with a negative link (and a RuntimeWarning)."""
    with pytest.raises(ConfigError) as caught:
        Cluster.load("cpu_hetero4").replicate(**kwargs)
    assert caught.value.key == key and caught.value.fix


@pytest.mark.parametrize("typed,meant", [("a800", "A800"), ("rtx4090", "RTX4090"), ("A8000", "A800"),
                                         ("rtx-3090", "RTX-3090")])
def test_an_unknown_gpu_name_in_another_case_or_misspelled_names_the_listed_one(typed, meant):
    """gpu: a800 was "unknown GPU type" with the whole catalog and no hint (the closest-name match is case-sensitive)."""
    with pytest.raises(ConfigError, match=rf"cluster.machines\[0\].gpu = '{typed}': unknown GPU type. Fix: did you mean "
                                          rf"gpu: {meant}\? use one of"):
        Cluster.from_config({"name": "x", "machines": [{"gpu": typed, "count": 1}]})
