"""Discovery: what it measures (pure), the cache under a fingerprint, and a run on uneven machines
(1 + 3 forked CPU ranks, each told its machine by HEXISCALE_MACHINE as the emulator or a node does)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import pytest
import yaml

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.profiling import discovery_plan as dp
from lightning_hexiscale.profiling.discovery_plan import RankReport


def _reports(layout: list[tuple[str, str, int]]) -> list[RankReport]:
    """[(host, type, ranks)] -> one report per rank, in rank order."""
    return [RankReport(h, t, 8 * 2**30, "cpu") for h, t, k in layout for _ in range(k)]


def test_measurement_count_grows_with_machines_not_devices_squared():
    c8 = dp.measurement_count(8, 8)
    assert (c8.flops, c8.layer_cases, c8.inter_links, c8.nics, c8.intra_links) == (1, 36, 28, 8, 1)
    assert c8.total == 74 and c8.full_profile_pairs == 2016
    c128 = dp.measurement_count(128, 8)
    assert c128.total == 8294 and c128.full_profile_pairs == 523776
    # the same numbers as written in the module docstring (and the docs)
    assert "**74**" in dp.__doc__ and "**8294**" in dp.__doc__
    # twice the devices per machine adds no link measurement; a second device type doubles the per-type work
    assert dp.measurement_count(8, 16, tp_degrees=4).inter_links == c8.inter_links
    assert dp.measurement_count(8, 8, device_types=2).layer_cases == 2 * c8.layer_cases
    # the count from the ranks' own reports is the same for a homogeneous cluster
    reps = _reports([(f"h{i}", "A", 8) for i in range(8)])
    assert dp.count_for(reps, tp_degrees=4, micro_batches=3) == c8
    with pytest.raises(ValueError, match="device_types"):
        dp.measurement_count(2, 8, device_types=3)


def test_representative_pairs_uneven_machines():
    reps = _reports([("a", "FAST", 1), ("b", "SLOW", 3), ("c", "SLOW", 2), ("d", "FAST", 2)])
    hosts = dp.hosts_in_order(reps)
    assert hosts == {"a": [0], "b": [1, 2, 3], "c": [4, 5], "d": [6, 7]}
    steps = dp.inter_steps(reps)
    pairs = [p for s in steps for p in s]
    # every host pair exactly once, through the first rank of each host, no host twice in a step
    assert sorted(pairs) == sorted([(0, 1), (0, 4), (0, 6), (1, 4), (1, 6), (4, 6)])
    for s in steps:
        used = [reps[r].host for p in s for r in p]
        assert len(used) == len(set(used))
    assert len(steps) == 3  # round robin over 4 hosts: 3 rounds of 2 pairs
    assert dp.inter_steps(reps, max_pairs=1) == [[p] for s in steps for p in s]
    intra = dp.intra_pairs(reps)
    assert intra == {("SLOW", "SLOW"): (1, 2), ("FAST", "FAST"): (6, 7)}
    bw, lat, err = dp.fill_links(reps, {k: (1e-3, 40e6, 0.0) for k in
                                        [tuple(sorted((a, b))) for a in hosts for b in hosts if a < b]},
                                 {("SLOW", "SLOW"): (5e-5, 2e9, 0.0), ("FAST", "FAST"): (5e-5, 3e9, 0.0)})
    assert bw[0][1] == 40e6 and bw[2][3] == 2e9 and bw[6][7] == 3e9 and bw[3][3] == float("inf")
    assert lat[1][2] == 5e-5 and lat[0][7] == 1e-3


def test_fingerprint_and_cache_dir(tmp_path, monkeypatch):
    reps = _reports([("a", "A", 2)])
    base = dp.fingerprint(reps, {"hidden_size": 128}, "32-true", "2.5.0")
    assert base == dp.fingerprint(list(reps), {"hidden_size": 128}, "32-true", "2.5.0")
    others = [dp.fingerprint([replace(reps[0], memory_bytes=4 * 2**30), reps[1]], {"hidden_size": 128}, "32-true", "2.5.0"),
              dp.fingerprint([replace(reps[0], host="b"), reps[1]], {"hidden_size": 128}, "32-true", "2.5.0"),
              dp.fingerprint(reps, {"hidden_size": 256}, "32-true", "2.5.0"),
              dp.fingerprint(reps, {"hidden_size": 128}, "bf16-mixed", "2.5.0"),
              dp.fingerprint(reps, {"hidden_size": 128}, "32-true", "2.6.0"),
              dp.fingerprint(reps, {"hidden_size": 128}, "32-true", "2.5.0", {"micro_batches": [1, 2]})]
    assert len({base, *others}) == 7
    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path))
    assert dp.cache_path(base) == tmp_path / f"{base}.yaml"
    monkeypatch.delenv(dp.CACHE_ENV)
    assert dp.cache_dir().parts[-3:] == (".cache", "lightning_hexiscale", "clusters")


def _discover_uneven(rank: int, world: int, model, cache: str, rediscover: bool):
    # machine "solo" has rank 0, machine "trio" ranks 1-3 (set per rank before anything reads it)
    os.environ["HEXISCALE_MACHINE"] = "solo" if rank == 0 else "trio"
    os.environ[dp.CACHE_ENV] = cache
    from lightning_hexiscale.profiling.discover import discover_process_group

    return discover_process_group(model, matmul_time_s=0.2, micro_batches=[1, 2], layer_reps=1, reps=2,
                                  rediscover=rediscover, progress=rank == 0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_discover_uneven_machines_plans_and_reuses_cache(tmp_path, capfd):
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.lightning.plan_resolution import search_plan
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Workload
    from lightning_hexiscale.profiling.launch import run_local

    model = LlamaConfig.load("llama_tiny")
    cache = str(tmp_path / "cache")
    t0 = time.perf_counter()
    first = run_local(4, _discover_uneven, model, cache, False, timeout_s=180)
    took = time.perf_counter() - t0
    assert not first[0].reused and {d.path for d in first} == {first[0].path}  # every rank has rank 0's answer
    assert first[0].path.startswith(cache) and first[0].path.endswith(f"{first[0].fingerprint}.yaml")
    assert took < 60, f"discovery of 4 CPU ranks took {took:.1f} s (budget 60 s)"
    out = capfd.readouterr().out
    assert "discover [1/" in out and "measurements" in out  # plain progress lines when not a terminal

    cluster = Cluster.load(first[0].path)
    assert [(m.name, len(m.devices)) for m in cluster.machines] == [("solo", 1), ("trio", 3)]
    assert {t.gpu for t in cluster.layer_tables} == {"CPU"}
    assert {(r.tp, r.micro_batch) for r in cluster.layer_tables[0].rows} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    plan, est = search_plan(cluster, Workload.for_cluster(model, cluster), 8, {}, iterations=2)
    assert set(plan.device_order) <= {0, 1, 2, 3} and est is not None and est.feasible
    plan.validate(cluster, model, global_batch=8)

    # same hardware, model, precision, torch: the file is reused at once, and says so
    t0 = time.perf_counter()
    again = run_local(4, _discover_uneven, model, cache, False, timeout_s=60)
    assert again[0].reused and again[0].path == first[0].path and again[0].seconds < 2.0
    reuse_line = capfd.readouterr().out
    assert "reusing the cluster discovered earlier" in reuse_line
    assert "hexiscale discover --rediscover, or delete that file" in reuse_line  # a fix for train users too
    assert yaml.safe_load(open(first[0].path))["name"] == f"discovered_{first[0].fingerprint[:8]}"
    # --rediscover measures again
    forced = run_local(4, _discover_uneven, model, cache, True, timeout_s=180)
    assert not forced[0].reused and forced[0].fingerprint == first[0].fingerprint


def test_discover_cli_is_registered():
    from lightning_hexiscale.cli.main import build_parser

    args = build_parser().parse_args(["discover", "--local", "2", "--model", "llama_tiny", "--rediscover",
                                      "--out", "x.yaml", "--precision", "32-true"])
    assert (args.local, args.model, args.rediscover, args.out, args.precision) == (2, "llama_tiny", True, "x.yaml",
                                                                                   "32-true")


@pytest.mark.parametrize("argv", [["discover", "--model", "llama_tiny", "--budget", "-1"],
                                  ["discover", "--model", "llama_tiny", "--timeout", "-1"],
                                  ["discover", "--model", "llama_tiny", "--matmul-time", "0"],
                                  ["profile", "--timeout", "inf"], ["profile", "--matmul-time", "-1"],
                                  ["calibrate", "--timeout", "abc"]])
def test_bad_seconds_are_refused_before_any_rank_starts(argv, capsys, tmp_path, monkeypatch):
    """--budget -1 was a ConfigError traceback from every forked rank, --timeout -1 a c10d socket
    timeout, --matmul-time -1 was measured anyway: now argparse's usage error, exit status 2."""
    from lightning_hexiscale.cli.main import main

    monkeypatch.chdir(tmp_path)  # were it accepted: profile's default --out and discover's cache land here
    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "cache"))

    with pytest.raises(SystemExit) as e:
        main([argv[0], "--local", "2", *argv[1:]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}: " in err and "e.g. 60" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_discover_cli_writes_out_and_reuses(tmp_path, monkeypatch, capfd):
    from lightning_hexiscale.cli.main import main

    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "cache"))
    argv = ["discover", "--local", "2", "--model", "llama_tiny", "--out", str(tmp_path / "d.yaml"),
            "--layer-micro-batches", "1", "--layer-reps", "1", "--reps", "2", "--matmul-time", "0.2"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert f"wrote {tmp_path / 'd.yaml'}" in out and "cluster discovered_" in out
    doc = yaml.safe_load((tmp_path / "d.yaml").read_text())
    assert doc["matrix_file"] == str(tmp_path / "d.matrix.yaml") and doc["layer_times"]
    (tmp_path / "d.yaml").unlink()
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "reusing the cluster discovered earlier" in out and f"reused {tmp_path / 'd.yaml'}" in out
    assert (tmp_path / "d.yaml").is_file()


@pytest.mark.parametrize("kw,key", [(dict(micro_batches=[]), "--layer-micro-batches"),
                                    (dict(micro_batches=[0, 2]), "--layer-micro-batches"),
                                    (dict(budget_s=0), "--budget"), (dict(reps=0), "--reps"),
                                    (dict(layer_reps=1.5), "--layer-reps"),
                                    # --name '' named a measured file discovered_<fp> but a reused one ''
                                    (dict(name=""), "--name"), (dict(name=" "), "--name")])
def test_bad_settings_are_config_errors(kw, key):
    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.profiling.discover import check_settings

    args = dict(micro_batches=[1, 2, 4], budget_s=60.0, reps=3, layer_reps=2) | kw
    with pytest.raises(ConfigError) as e:
        check_settings(**args)
    assert e.value.key == key and "Fix:" in str(e.value)


def _discover_into(rank: int, world: int, model, cache: str):
    os.environ[dp.CACHE_ENV] = cache
    from lightning_hexiscale.profiling.discover import discover_process_group

    return discover_process_group(model, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unwritable_cache_is_the_same_config_error_on_every_rank(tmp_path):
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError) as e:  # before anything is measured, not a hang of the other rank
        run_local(2, _discover_into, LlamaConfig.load("llama_tiny"), str(tmp_path / "file"), timeout_s=40)
    text = str(e.value)
    assert "HEXISCALE_CACHE_DIR" in text and "cannot be written" in text and "Connection closed" not in text.split("---")[0]


def _discover_recorded(rank: int, world: int, model, cache: str):
    """Discovery of the 1 + 3 machines under the NCCL-semantics recorder; this rank's trace."""
    import nccl_semantics

    os.environ["HEXISCALE_MACHINE"] = "solo" if rank == 0 else "trio"
    os.environ[dp.CACHE_ENV] = cache
    from lightning_hexiscale.profiling.discover import discover_process_group

    recorder = nccl_semantics.Recorder()
    nccl_semantics.set_current(recorder.install())
    try:
        discover_process_group(model, matmul_time_s=0.1, micro_batches=[1], layer_reps=1, reps=1, progress=False,
                               sizes=[1 << 10, 1 << 16])
    finally:
        recorder.uninstall()
        nccl_semantics.set_current(None)
    return recorder.steps


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_discovery_communicates_under_nccl_rules(tmp_path):
    """The same collectives in the same order on every member, p2p matched by order only (no tags)."""
    import nccl_semantics

    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    traces = run_local(4, _discover_recorded, LlamaConfig.load("llama_tiny"), str(tmp_path), timeout_s=90)
    report = nccl_semantics.replay(traces)
    assert report.ok, str(report)
    kinds = {s.kind for t in traces for s in t}
    assert "coll" in kinds and kinds - {"coll"}, kinds  # collectives and the ping-pongs were both recorded


def test_nic_groups_one_per_kind_of_destination():
    from lightning_hexiscale.profiling.fit import nic_pairs

    reps = _reports([("a", "FAST", 2), ("b", "SLOW", 2), ("c", "SLOW", 2), ("d", "FAST", 2)])
    groups = dp.nic_groups(reps)
    assert [(h, dest) for h, dest, _ in groups] == [("a", ("b", "c")), ("a", ("d",)), ("b", ("a", "d")), ("b", ("c",)),
                                                    ("c", ("a", "d")), ("c", ("b",)), ("d", ("a",)), ("d", ("b", "c"))]
    assert groups[0][2] == [(0, 2), (1, 4)]  # a's ranks to the first ranks of b, then c
    assert dp.count_for(reps, 1, 1).nics == 8
    # one kind of other machines: the profile's pairs
    same = _reports([("a", "X", 2), ("b", "X", 3), ("c", "X", 1)])
    assert [(h, p) for h, _, p in dp.nic_groups(same)] == nic_pairs([r.host for r in same])


def test_nic_figure_per_kind_is_written_as_nics_to_and_priced(tmp_path):
    """A host whose NIC carried 4x less toward the other kind: its file says so (nics.to), and the
    planner's cluster caps a transfer toward that kind at the figure."""
    import numpy as np

    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.profiling.discover import nic_figures
    from lightning_hexiscale.profiling.fit import NicFit
    from lightning_hexiscale.profiling.writer import ProfileResult, write_cluster

    fits = {("a", ("b",)): NicFit(2, 1e9, (1e9, 1e9)), ("a", ("c",)): NicFit(2, .25e9, (.25e9, .25e9)),
            ("b", ("a", "c")): NicFit(2, 1e9, (0.95e9, 0.95e9))}
    nics, nic_to = nic_figures(fits)
    assert nics["a"].aggregate_Bps == 2e9 and nic_to == {"a": [(("c",), 0.5e9)]}  # b's 5 % is noise: not written
    hosts = ["a", "a", "b", "b", "c", "c"]
    bw = np.full((6, 6), 1e9)
    np.fill_diagonal(bw, np.inf)
    p = ProfileResult(hostnames=hosts, device_types=["X"] * 6, flops=[1e12] * 6, memory_bytes=[2**30] * 6,
                      bandwidth_Bps=bw, latency_s=np.zeros((6, 6)), fit_rel_rms=np.zeros((6, 6)), nics=nics,
                      nic_to=nic_to)
    path, _ = write_cluster(p, tmp_path / "d.yaml", tool="hexiscale discover")
    doc = yaml.safe_load(path.read_text())
    assert doc["machines"][0]["nics"]["to"] == [{"machines": ["c"], "bandwidth": "500 MB/s"}]
    assert "to" not in doc["machines"][1]["nics"]
    c = Cluster.load(str(path))
    assert c.bandwidth[0, 4] == 0.5e9 and c.bandwidth[0, 2] == 1e9


def _discover_small(rank: int, world: int, model, cache: str, rediscover: bool, out: str | None = None,
                    name: str | None = None):
    os.environ[dp.CACHE_ENV] = cache
    from lightning_hexiscale.profiling.discover import discover_process_group

    return discover_process_group(model, matmul_time_s=0.1, micro_batches=[1], layer_reps=1, reps=1,
                                  sizes=[1 << 10, 1 << 16], rediscover=rediscover, out=out, name=name,
                                  progress=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_cached_file_that_does_not_load_is_one_error_and_rediscover_replaces_it(tmp_path):
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path)
    first = run_local(2, _discover_small, model, cache, False, timeout_s=60)[0]
    with open(first.path, "a") as f:
        f.write("machines: 3\n")  # a duplicate key: the file no longer loads
    with pytest.raises(ConfigError) as e:
        run_local(2, _discover_small, model, cache, False, timeout_s=60)
    assert "does not load" in str(e.value) and "--rediscover" in str(e.value)
    assert f"delete {first.path}" in str(e.value)  # the fix that works from `hexiscale train` and Trainer too
    again = run_local(2, _discover_small, model, cache, True, timeout_s=60)[0]
    assert not again.reused and again.path == first.path
    assert run_local(2, _discover_small, model, cache, False, timeout_s=60)[0].reused


def test_progress_lines_and_the_budget(monkeypatch):
    import io

    from lightning_hexiscale.profiling.discover import Progress, budget_message

    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: plain lines, no bar
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    lines: list[str] = []
    bar = Progress(2, 60.0, True, lines.append)
    bar.step("ranks reported", "report")
    bar.step("layer times at TP 1", "layer times")
    assert bar.close() >= 0 and bar.bar is None
    assert [ln.split(" (")[0] for ln in lines] == ["discover [1/2] ranks reported", "discover [2/2] layer times at TP 1"]
    assert all("of 60 s budget" in ln for ln in lines) and set(bar.phases) == {"report", "layer times"}
    quiet: list[str] = []
    Progress(1, 60.0, False, quiet.append).step("x", "y")
    assert quiet == []
    assert budget_message(59.0, 60.0, {"layer times": 50.0}) is None
    msg = budget_message(75.0, 60.0, {"flops": 2.0, "layer times": 50.0, "NICs": 20.0})
    assert "75.0 s, over its budget of 60 s" in msg and "longest phase was layer times (50.0 s)" in msg


def test_into_a_pipe_progress_lines_are_one_per_phase_and_paced_within_it(monkeypatch):
    """At 128 machines x 8 GPUs discovery takes about 263 steps (127 pair rounds, 128 NIC groups); a
    line per step filled a log. Now: a line when a phase starts, the last step's, and at most one per
    ``every_s`` between them."""
    import io

    from lightning_hexiscale.profiling.discover import Progress

    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: lines
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    clock = [0.0]
    lines: list[str] = []
    bar = Progress(263, 60.0, True, lines.append, every_s=10.0, clock=lambda: clock[0])
    steps = [("ranks reported", "report"), ("matmul", "flops")]
    steps += [(f"layer TP {t}", "layer times") for t in (1, 2, 4, 8)]
    steps += [(f"round {k}", "inter links") for k in range(127)] + [(f"NIC {h}", "NICs") for h in range(128)]
    steps += [("intra", "intra links"), ("cluster file written", "write")]
    for label, phase in steps:
        clock[0] += 1.0  # one second a step
        bar.step(label, phase)
    heads = [ln.split(" (")[0] for ln in lines]
    assert heads[:3] == ["discover [1/263] ranks reported", "discover [2/263] matmul", "discover [3/263] layer TP 1"]
    assert "discover [7/263] round 0" in heads and "discover [134/263] NIC 0" in heads  # each phase's first step
    assert heads[-2:] == ["discover [262/263] intra", "discover [263/263] cluster file written"]
    assert "discover [17/263] round 10" in heads  # 10 s after round 0's line
    assert "discover [8/263] round 1" not in heads and "discover [16/263] round 9" not in heads
    assert len(lines) == 7 + 12 + 12, heads  # 7 phases' first lines (the last among them), 12 + 12 beats


def test_in_a_notebook_discovery_draws_the_bar(monkeypatch):
    """A Jupyter kernel's stderr is no terminal but shows tqdm's widget (as the search and prepare-data)."""
    import io
    import types

    from lightning_hexiscale.profiling.discover import Progress

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    lines: list[str] = []
    bar = Progress(2, 60.0, True, lines.append)
    bar.step("ranks reported", "report")
    bar.step("cluster file written", "write")
    bar.close()
    assert bar.bar is not None and lines == [] and "discover" in err.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["discover", "profile"])
@pytest.mark.parametrize("where", ["a folder", "below a file"])
def test_a_bad_out_is_refused_before_anything_is_measured(command, where, tmp_path, monkeypatch, capsys):
    """--out naming a folder was measured in full and then 55 lines of tracebacks from both ranks
    (IsADirectoryError on rank 0, 'Connection closed by peer' on rank 1), with a stray
    '<folder>.matrix.yaml' written beside the folder: now one ConfigError naming --out, before any rank starts."""
    from lightning_hexiscale.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    out = str(tmp_path / ("outdir" if where == "a folder" else "afile/d.yaml"))
    assert main([command, "--local", "2", "--out", out, "--reps", "1", "--matmul-time", "0.1",
                 *(["--model", "llama_tiny"] if command == "discover" else [])]) == 2
    err = capsys.readouterr().err
    assert f"--out = {out!r}" in err and "Fix:" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "outdir"]  # no cache, no stray matrix file


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_out_is_checked_on_rank_0_for_every_rank_and_may_name_the_cache_file(tmp_path):
    """out= a folder (the API and external launches, no pre-launch check): the same ConfigError on
    every rank before measuring, not rank 0's IsADirectoryError after it and the others' lost
    connections. out= the cache's own file: shutil.SameFileError after the measurement; now it is the file."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path / "cache")
    (tmp_path / "outdir").mkdir()
    with pytest.raises(ConfigError) as e:
        run_local(2, _discover_small, model, cache, False, str(tmp_path / "outdir"), timeout_s=60)
    root = str(e.value).split("---")[0]
    assert "--out" in root and "is a directory" in root and "Connection closed" not in root
    assert not (tmp_path / "outdir.matrix.yaml").exists() and not os.path.exists(cache)  # nothing measured
    first = run_local(2, _discover_small, model, cache, False, str(tmp_path / "d.yaml"), timeout_s=60)[0]
    again = run_local(2, _discover_small, model, cache, False, first.cache_path, timeout_s=60)[0]
    assert again.reused and again.path == first.cache_path
    with pytest.raises(ConfigError) as e:  # the cache's matrix file: the cached file would point to a cluster file
        run_local(2, _discover_small, model, cache, False, first.cache_path.replace(".yaml", ".matrix.yaml"), timeout_s=60)
    assert "the cache's matrix file" in str(e.value).split("---")[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_out_says_which_of_the_users_files_it_replaced(tmp_path, capfd):
    """--out d.yaml replaced an existing d.yaml and d.matrix.yaml (say, a hand-written cluster and its
    measured matrices) without a word; now the line that names the copy names the files it replaced."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path / "cache")
    (tmp_path / "d.matrix.yaml").write_text("bandwidth_Bps: mine\n")
    run_local(2, _discover_small, model, cache, False, str(tmp_path / "d.yaml"), timeout_s=60)  # measures
    out = capfd.readouterr().out
    assert f"replacing {tmp_path / 'd.matrix.yaml'}" in out and f"replacing {tmp_path / 'd.yaml'}" not in out
    run_local(2, _discover_small, model, cache, False, str(tmp_path / "d.yaml"), timeout_s=60)  # reuses the cache
    out = capfd.readouterr().out
    assert "reusing" in out and f"replacing {tmp_path / 'd.yaml'}, {tmp_path / 'd.matrix.yaml'}" in out
    run_local(2, _discover_small, model, cache, False, str(tmp_path / "x.yaml"), timeout_s=60)  # a new path: nothing to say
    assert "replacing" not in capfd.readouterr().out and (tmp_path / "x.matrix.yaml").is_file()


def test_the_copy_names_its_own_matrix_file_in_its_header(tmp_path):
    """--out d.yaml kept the cache's header line 'matrices in <fingerprint>.matrix.yaml', a file that is
    not beside d.yaml; the copy's header now names d.matrix.yaml, as its matrix_file does."""
    from lightning_hexiscale.profiling.writer import copy_cluster

    (tmp_path / "cache").mkdir()
    src = tmp_path / "cache" / "abc.yaml"
    (tmp_path / "cache" / "abc.matrix.yaml").write_text("bandwidth_Bps: []\n")
    src.write_text("# half round trips at sizes 1024, 65536 B; matrices in abc.matrix.yaml.\n# other note\n"
                   f"name: x\nmatrix_file: {tmp_path / 'cache' / 'abc.matrix.yaml'}\n")
    dst = copy_cluster(src, tmp_path / "d.yaml")
    text = dst.read_text()
    assert "matrices in d.matrix.yaml." in text and "abc.matrix" not in text and "# other note" in text
    assert yaml.safe_load(text) == {"name": "x", "matrix_file": str(tmp_path / "d.matrix.yaml")}
    assert (tmp_path / "d.matrix.yaml").read_text() == "bandwidth_Bps: []\n"


def test_a_copy_takes_a_relative_matrix_file_from_beside_its_cluster_file(tmp_path, monkeypatch):
    """A relative matrix_file is read beside its cluster file (as the schema reads it), whatever the
    working directory; a file without one is copied as it is, renamed when asked."""
    from lightning_hexiscale.profiling.writer import copy_cluster

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "c.matrix.yaml").write_text("bandwidth_Bps: [[0]]\n")
    (tmp_path / "src" / "c.yaml").write_text("name: c\nmatrix_file: c.matrix.yaml\n")
    monkeypatch.chdir(tmp_path)
    dst = copy_cluster(tmp_path / "src" / "c.yaml", tmp_path / "out" / "d.yaml", name="d")
    assert yaml.safe_load(dst.read_text()) == {"name": "d", "matrix_file": str(tmp_path / "out" / "d.matrix.yaml")}
    assert (tmp_path / "out" / "d.matrix.yaml").read_text() == "bandwidth_Bps: [[0]]\n"
    (tmp_path / "plain.yaml").write_text("# hand-written\nname: p\n")
    assert copy_cluster(tmp_path / "plain.yaml", tmp_path / "p2.yaml").read_text() == "# hand-written\nname: p\n"


def _discover_tp(rank: int, world: int, model, cache: str, tp: list[int]):
    os.environ[dp.CACHE_ENV] = cache
    os.environ["HEXISCALE_MACHINE"] = f"m{rank}"  # one rank per machine: no TP group of 2 can form
    from lightning_hexiscale.profiling.discover import discover_process_group

    return discover_process_group(model, matmul_time_s=0.1, micro_batches=[1], layer_reps=1, reps=1,
                                  sizes=[1 << 10, 1 << 16], tp_degrees=tp, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tp_degree_no_machine_can_form_is_refused(tmp_path):
    """tp_degrees=[2] (--layer-tp 2) on machines of one rank each: no TP group formed, so the file was
    written without any layer_times (the planner then priced FLOP/s) while the log counted '3 layer
    cases'; now the same ConfigError on every rank, naming --layer-tp, before anything is measured."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path / "cache")
    with pytest.raises(ConfigError) as e:
        run_local(2, _discover_tp, model, cache, [1, 2], timeout_s=60)
    root = str(e.value).split("---")[0]
    assert "--layer-tp = [2]" in root and "Connection closed" not in root and "largest here has 1" in str(e.value)
    assert not os.path.exists(cache)
    found = run_local(2, _discover_tp, model, cache, [1], timeout_s=60)[0]
    assert yaml.safe_load(open(found.path))["layer_times"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_name_is_the_files_name_when_the_cache_is_reused_too(tmp_path):
    """--name (not part of the fingerprint) was dropped when the cached file was reused:
    'discover --name mine --out n.yaml' wrote 'name: discovered_c243951f'. Now the file it answers with
    carries the name: the --out copy, else the cache's file."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.profiling.launch import run_local
    from lightning_hexiscale.models.config import LlamaConfig

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path / "cache")
    first = run_local(2, _discover_small, model, cache, False, None, None, timeout_s=60)[0]
    named = run_local(2, _discover_small, model, cache, False, str(tmp_path / "n.yaml"), "mine", timeout_s=60)[0]
    assert named.reused and Cluster.load(named.path).name == "mine"
    assert Cluster.load(first.path).name == f"discovered_{first.fingerprint[:8]}"  # the cache's file kept its own
    again = run_local(2, _discover_small, model, cache, False, None, "other", timeout_s=60)[0]
    assert again.reused and again.path == first.path and Cluster.load(again.path).name == "other"
    text = open(again.path).read()
    assert text.startswith("# Written by `hexiscale discover`")  # the header comments stay


def test_an_empty_name_is_refused_before_any_rank_starts(capsys, tmp_path, monkeypatch):
    from lightning_hexiscale.cli.main import main

    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as e:
        main(["discover", "--local", "2", "--model", "llama_tiny", "--name", ""])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --name: must not be empty" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()
    # profile's --name too: '' fell back to the file's stem in silence, after the whole measurement
    with pytest.raises(SystemExit) as e:
        main(["profile", "--local", "2", "--out", str(tmp_path / "p.yaml"), "--name", " "])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --name: must not be empty" in err and not (tmp_path / "p.yaml").exists()


@pytest.mark.timeout(60)
def test_two_jobs_probing_one_cache_folder_do_not_fail_each_other(tmp_path):
    """Rank 0 proves the cache folder writable with a probe file before measuring. Every job used the
    name '.<fingerprint>.yaml.probe': one job unlinked it under another, whose unlink then failed, and
    it stopped with 'the cache folder cannot be written (No such file or directory)'. Now each probe
    has its own name."""
    import threading

    from lightning_hexiscale.profiling.discover import _cache_state

    cached, answers = tmp_path / "cache" / "abc.yaml", []

    def probe() -> None:
        answers.extend(_cache_state(cached, False) for _ in range(300))

    threads = [threading.Thread(target=probe) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a for a in answers if a is not False] == [] and len(answers) == 600
    assert list((tmp_path / "cache").iterdir()) == []


def _discover_emulated(rank: int, world: int, model, cache: str, key: str):
    os.environ["HEXISCALE_EMULATION"] = key  # as `hexiscale emulate` sets it: another --cores / --bw-scale
    return _discover_small(rank, world, model, cache, False)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_another_emulation_is_not_served_from_the_cache(tmp_path):
    """Before: inside `hexiscale emulate`, a run with another --cores or --bw-scale reused the file
    measured on the first (same machine names and device types), with the first run's FLOP/s and links."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.launch import run_local

    model, cache = LlamaConfig.load("llama_tiny"), str(tmp_path)
    first = run_local(1, _discover_emulated, model, cache, "a" * 16, timeout_s=60)[0]
    other = run_local(1, _discover_emulated, model, cache, "b" * 16, timeout_s=60)[0]
    assert not other.reused and other.fingerprint != first.fingerprint
    assert run_local(1, _discover_emulated, model, cache, "b" * 16, timeout_s=60)[0].reused
