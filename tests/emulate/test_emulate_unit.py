"""The emulated cluster's arithmetic and its refusal without privileges; no root needed (faked)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from lightning_hexiscale.emulate import EmulatedCluster, EmulationError, check_support, cpu_quotas, memory_limits
from lightning_hexiscale.emulate import support
from lightning_hexiscale.emulate.cgroups import CFS_PERIOD_US, CgroupLayout, RankCgroups, cfs_period_us


def test_quotas_proportional_and_sum_to_cores():
    q = cpu_quotas([4.0, 4.0, 1.0, 1.0], cores=1.0)
    assert sum(q) == pytest.approx(1.0)
    assert q == pytest.approx([0.4, 0.4, 0.1, 0.1])


def test_quotas_capped_at_one_core_keep_ratios():
    q = cpu_quotas([4.0, 1.0], cores=2.0)  # 1.6 + 0.4 would put the fast rank above its one thread
    assert q == pytest.approx([1.0, 0.25])
    assert sum(q) < 2.0


def test_quotas_reject_nonpositive_cores():
    with pytest.raises(ValueError, match="cores"):
        cpu_quotas([1.0], cores=0)


def test_cfs_period_grows_for_small_quotas():
    assert cfs_period_us([0.4, 0.1]) == CFS_PERIOD_US  # 1 ms of 10 ms: the default period suffices
    assert cfs_period_us([0.5, 0.025]) == 40_000  # 1 ms minimum quota -> 40 ms period
    with pytest.raises(ValueError, match="below the kernel's minimum"):
        cfs_period_us([1.0, 0.0005])


def test_memory_limits_proportional():
    m = memory_limits([2.0, 1.0, 1.0], total=8.0)
    assert m == pytest.approx([4.0, 2.0, 2.0]) and sum(m) == pytest.approx(8.0)


@pytest.mark.slow
def test_quotas_from_cluster_yaml():
    emu = EmulatedCluster("emu_4to1", cores=2.0)
    table = emu.describe()  # before entering: the planned ranks
    assert "EMU-FAST" in table and "0.800" in table and "0.200" in table and "40 MB/s" in table


@pytest.mark.parametrize("netem", [True, False, None])
def test_describe_shows_latency_only_where_it_is_emulated(monkeypatch, netem):
    """--describe (nothing set up yet) probes for sch_netem: without it no latency is shown as emulated."""
    from lightning_hexiscale.emulate import emulated

    monkeypatch.setattr(emulated, "netem_probe", lambda: netem)
    table = EmulatedCluster("emu_4to1", cores=1.0).describe()
    assert ("40 MB/s / 1000 us" in table) == bool(netem), table
    assert ("latency: NOT emulated" in table) == (netem is False)
    assert ("could not be checked" in table) == (netem is None)


def _fake_no_privileges(monkeypatch):
    monkeypatch.setattr(support.os, "geteuid", lambda: 1000)
    real_which = shutil.which
    monkeypatch.setattr(support.shutil, "which", lambda t: None if t == "tc" else real_which(t))


def test_check_support_names_everything_missing(monkeypatch, tmp_path):
    _fake_no_privileges(monkeypatch)
    with pytest.raises(EmulationError) as e:
        check_support(cgroup_root=tmp_path)  # an empty directory: no cgroup controller
    msg = str(e.value)
    assert "root privileges" in msg and "cgroup CPU controller" in msg and "`tc`" in msg and "Fix:" in msg
    assert "`ip`" not in msg  # present pieces are not reported


def test_check_support_memory_controller(monkeypatch, tmp_path):
    monkeypatch.setattr(support.os, "geteuid", lambda: 0)
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")  # a v2 tree without memory
    with pytest.raises(EmulationError, match="memory controller"):
        check_support(memory=True, cgroup_root=tmp_path)


@pytest.mark.slow
def test_enter_without_support_creates_nothing(monkeypatch, tmp_path):
    _fake_no_privileges(monkeypatch)
    emu = EmulatedCluster("emu_4to1", cores=1.0, cgroup_root=tmp_path)
    with pytest.raises(EmulationError, match="missing: root privileges"):
        with emu:
            pass
    assert emu.network is None and emu.cgroups is None and not list(tmp_path.iterdir())
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if shutil.which("ip") else ""
    assert not any(f"hx{emu.id}" in line for line in after.splitlines())


def test_cgroup_v2_files(tmp_path, monkeypatch):
    """The v2 layout writes ``cpu.max`` = "quota period" and ``memory.max`` (on a fake tree)."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    layout = CgroupLayout.detect(tmp_path)
    assert layout is not None and layout.version == 2
    cg = RankCgroups(layout, "emu-test", [0.4, 0.1], [2e9, 1e9])
    cg.create()
    assert (tmp_path / "emu-test" / "rank0" / "cpu.max").read_text() == f"{int(0.4 * CFS_PERIOD_US)} {CFS_PERIOD_US}"
    assert (tmp_path / "emu-test" / "rank1" / "cpu.max").read_text() == f"{int(0.1 * CFS_PERIOD_US)} {CFS_PERIOD_US}"
    assert (tmp_path / "emu-test" / "rank1" / "memory.max").read_text() == str(int(1e9))
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory"  # children get the controllers
    assert cg.rank_dirs(1) == [tmp_path / "emu-test" / "rank1"]


@pytest.mark.slow
def test_cli_help_and_errors(capsys, monkeypatch, tmp_path):
    from lightning_hexiscale.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["emulate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--bw-scale" in out and "-- COMMAND" in out and "--cleanup" in out
    assert "--check" in out and "--no-trim" in out and "--no-quota-clock" in out
    assert main(["emulate", "emu_4to1", "--describe", "--cores", "1"]) == 0
    out = capsys.readouterr().out
    assert "0.400" in out and "0.100" in out
    with pytest.raises(SystemExit) as e:
        main(["emulate", "emu_4to1", "--bw-scale", "0"])
    assert e.value.code == 2 and "must be > 0" in capsys.readouterr().err
    assert main(["emulate", "emu_4to1", "--cores", "1"]) == 2
    assert "no command given" in capsys.readouterr().err
    assert main(["emulate", "--cores", "1", "--", "true"]) == 2
    assert "no CLUSTER given" in capsys.readouterr().err
    for extra in (["emu_4to1"], ["--", "true"]):  # ignored before: removed nothing, ran nothing, exit 0
        assert main(["emulate", "--cleanup", *extra]) == 2
        assert "--cleanup takes no CLUSTER or command" in capsys.readouterr().err
    _fake_no_privileges(monkeypatch)
    monkeypatch.setattr(support, "CgroupLayout", type("NoCgroups", (), {"detect": staticmethod(lambda root: None)}))
    assert main(["emulate", "emu_4to1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "hexiscale emulate: error:" in err and "missing: root privileges" in err and "Traceback" not in err


# ---- per-rank periods, trimming, TP sync, load (pure arithmetic, fake trees) ----------------------------
def test_quota_period_is_the_shortest_the_kernel_allows():
    from lightning_hexiscale.emulate.cgroups import CLOCKED_PERIOD_US, quota_period_us

    assert quota_period_us(0.6, CLOCKED_PERIOD_US) == 2000  # 1.2 ms of 2 ms
    assert quota_period_us(0.4, CLOCKED_PERIOD_US) == 2500  # 1 ms (the minimum) of 2.5 ms
    assert quota_period_us(0.15, CLOCKED_PERIOD_US) == 6667
    assert quota_period_us(0.15) == CFS_PERIOD_US  # without the clock: 10 ms
    with pytest.raises(ValueError, match="below the kernel's minimum"):
        quota_period_us(0.0005)


def test_cgroup_v2_per_rank_periods_and_live_change(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    cg = RankCgroups(CgroupLayout.detect(tmp_path), "emu-test", [0.6, 0.15], None, base_period_us=2000)
    cg.create()
    assert (tmp_path / "emu-test" / "rank0" / "cpu.max").read_text() == "1200 2000"
    assert (tmp_path / "emu-test" / "rank1" / "cpu.max").read_text() == "1000 6667"
    cg.set_cores(1, 0.5)
    assert (tmp_path / "emu-test" / "rank1" / "cpu.max").read_text() == "1000 2000"
    assert cg.cpu_cores == [0.6, 0.5] and cg.periods_us == [2000, 2000]


def test_trimmed_cores_correct_the_measured_shares_and_keep_the_total():
    from lightning_hexiscale.emulate.fidelity import trimmed_cores

    # declared 4:1; the slow rank does 60 GFLOP per CPU-second, the fast one 75: the slow quota grows
    new = trimmed_cores([0.6, 0.15], [40e9, 10e9], [75e9, 60e9])
    assert sum(new) == pytest.approx(0.75)
    assert (new[0] * 75e9) / (new[1] * 60e9) == pytest.approx(4.0)  # the delivered rates stand 4:1
    # the fast rank does half the work per CPU-second: 2/1 : 1/1 -> 2 : 1 scaled to 1.5 is 1.0 : 0.5
    assert trimmed_cores([1.0, 0.5], [2.0, 1.0], [1.0, 1.0]) == pytest.approx([1.0, 0.5])
    capped = trimmed_cores([1.0, 0.5], [2.0, 1.0], [0.5, 1.0], max_per_rank=1.0)  # 4 : 1 -> 1.2 : 0.3, capped
    assert capped == pytest.approx([1.0, 0.25])


def test_type_rate_per_core_averages_ranks_and_measurements():
    from lightning_hexiscale.emulate.fidelity import RateCheck, type_rate_per_core

    a = RateCheck((4.0, 4.0, 1.0), (40.0, 44.0, 6.0), (0.5, 0.5, 0.1), ("F", "F", "S"))
    b = RateCheck((4.0, 4.0, 1.0), (36.0, 40.0, 8.0), (0.5, 0.5, 0.1), ("F", "F", "S"))
    assert type_rate_per_core([a]) == pytest.approx([84.0, 84.0, 60.0])
    assert type_rate_per_core([a, b]) == pytest.approx([80.0, 80.0, 70.0])


def test_rate_check_measures_each_rank_against_its_declared_share():
    from lightning_hexiscale.emulate.fidelity import RateCheck

    c = RateCheck((40.0, 10.0, 10.0), (40.0, 10.0, 8.0), (0.6, 0.15, 0.15), ("F", "S", "S"))
    assert c.errors == pytest.approx([0.0, 0.0, -0.2])  # against the median rank (m/F = 1)
    assert c.worst == pytest.approx(0.2) and not c.passes(0.1) and c.passes(0.25)
    measured, declared, label = c.type_ratio()
    assert label == "F/S" and declared == pytest.approx(4.0) and measured == pytest.approx(40 / 9)
    assert "BEYOND 10 %" in c.text() and "4.44:1 (declared 4.00:1)" in c.text()


def test_pair_sync_prices_the_cycle_beyond_the_work_at_the_quota():
    from lightning_hexiscale.emulate.fidelity import TP_WAIT_LIMIT_S, PairSync

    ok = PairSync((0, 1), "fast", 0.6, 0.002, 50e-6, cycle_s=2.3e-3, fluid_s=2.0e-3, exchange_s=(1e-3,))
    assert ok.overhead_s == pytest.approx(0.3e-3) and ok.passes and "PASS" in ok.text()
    slow = PairSync((0, 1), "fast", 0.6, 0.01, 50e-6, cycle_s=2.0e-3 + 50e-6 + TP_WAIT_LIMIT_S + 1e-4, fluid_s=2.0e-3,
                    exchange_s=(1e-3,))
    assert not slow.passes and "FAIL" in slow.text()


def test_load_refusal_above_the_limit_only():
    from lightning_hexiscale.emulate.hostload import LOAD_LIMIT, LoadSample, load_refusal

    quiet = LoadSample(3.0, others_cores=0.1, ours_cores=0.0, cpus=2, load_average=0.3)
    busy = LoadSample(3.0, others_cores=1.2, ours_cores=0.0, cpus=2, load_average=9.0)
    assert quiet.others_fraction == pytest.approx(0.05) and load_refusal(quiet) is None
    msg = load_refusal(busy)
    assert msg and "1.20 of this host's 2 cores (60 %" in msg and f"limit {LOAD_LIMIT * 100:.0f} %" in msg


def test_process_cpu_time_and_a_sample_of_the_load():
    import os
    import time

    from lightning_hexiscale.emulate.hostload import process_cpu_s, sample_load

    t0 = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of CPU in this process
        pass
    assert process_cpu_s(os.getpid()) - t0 == pytest.approx(0.2, abs=0.05)
    assert process_cpu_s(2**22 + 12345) is None  # no such process
    s = sample_load(0.3, ours=lambda: [os.getpid()])
    assert s.cpus >= 1 and s.seconds == pytest.approx(0.3, abs=0.2) and s.others_cores >= 0.0


@pytest.mark.slow
def test_quota_clock_refused_starts_nothing(monkeypatch):
    from lightning_hexiscale.emulate import clock

    monkeypatch.setattr(clock, "_SLEEPER", "print('refused [Errno 1] Operation not permitted', flush=True)")
    c = clock.QuotaClock(cpus=[0])
    assert c.start() is False and not c.running and "refused" in c.why and c.procs == [] and c.pids == []


@pytest.mark.parametrize("argv, words", [
    (["--cores", "inf"], "--cores: must be > 0 and finite, got inf"),  # was accepted: nan cores per rank
    (["--bw-scale", "inf"], "--bw-scale: must be > 0 and finite, got inf"),  # was accepted: links unshaped
    (["--cores", "abc"], "'abc' is not a number"),
    (["--master-port", "99999"], "--master-port: must be a TCP port from 1 to 65535, got 99999"),
])
def test_cli_refuses_infinite_scales_and_bad_ports(argv, words, capsys):
    from lightning_hexiscale.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["emulate", "emu_4to1", "--describe", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_api_refuses_infinite_cores_and_bw_scale():
    with pytest.raises(EmulationError, match="cores = inf: must be > 0 and finite"):
        EmulatedCluster("emu_4to1", cores=float("inf"))
    with pytest.raises(EmulationError, match="bw_scale = inf: must be > 0 and finite"):
        EmulatedCluster("emu_4to1", bw_scale=float("inf"))


def test_cli_a_command_without_the_double_dash_is_refused_with_the_fix(capsys):
    """`hexiscale emulate emu_4to1 --describe sleep 3` (no `--`): before, 'override 'sleep' is not
    KEY=VALUE. Fix: write e.g. cluster=hetero3', which emulate refuses too; now the fix names `--`."""
    from lightning_hexiscale.cli.main import main

    assert main(["emulate", "emu_4to1", "--describe", "sleep", "3"]) == 2
    err = capsys.readouterr().err
    assert "'sleep 3': takes no overrides" in err and "goes after `--`" in err and "cluster=hetero3" not in err


@pytest.mark.parametrize("argv, words", [
    (["--cleanup", "--cores", "1"], "--cleanup takes no other flag (got --cores)"),
    (["--cleanup", "--memory", "--no-trim", "--timeout", "5"], "(got --memory --no-trim --timeout)"),
    (["--cleanup", "--describe"], "(got --describe)"),
    (["emu_4to1", "--describe", "--", "sleep", "3"], "so -- sleep 3 would not run"),
    (["emu_4to1", "--describe", "--check"], "so --check would not run"),
])
def test_cli_flags_that_would_do_nothing_are_refused(argv, words, capsys, monkeypatch):
    """`--cleanup --cores 1 --memory` ignored every flag, and `--describe -- COMMAND` (or `--check`)
    printed the table and exited 0 without running the command: refused, naming what would not happen."""
    from lightning_hexiscale.cli.main import main
    import lightning_hexiscale.emulate as emulate

    monkeypatch.setattr(emulate, "remove_stale", lambda: pytest.fail("--cleanup removed before its flags were checked"))
    assert main(["emulate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Fix: " in err and "Traceback" not in err


def test_emulation_key_names_the_emulated_hardware():
    """Discovery caches by host names and device types, which an emulated cluster keeps whatever its
    quotas and links: the key (HEXISCALE_EMULATION, part of the fingerprint) tells them apart."""
    key = EmulatedCluster("emu_4to1", cores=1.0).emulation_key()
    assert key == EmulatedCluster("emu_4to1", cores=1.0).emulation_key()
    others = {EmulatedCluster("emu_4to1", cores=1.5).emulation_key(),
              EmulatedCluster("emu_4to1", cores=1.0, bw_scale=0.5).emulation_key(),
              EmulatedCluster("emu_4to1", cores=1.0, memory=True).emulation_key(),
              EmulatedCluster("emu_4to1", cores=1.0, quota_clock=False).emulation_key(),
              EmulatedCluster("emu_headroom", cores=1.0).emulation_key()}
    assert key not in others and len(others) == 5


def test_describe_shows_the_memory_limits_and_refuses_quotas_the_run_refuses(capsys, monkeypatch):
    """--describe planned apart from the run: with --memory it said 'no limit' for every rank, and with
    --cores 0.001 it printed quotas of 0.000 cores (exit 0) that the run then refused."""
    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.emulate import emulated

    monkeypatch.setattr(emulated, "netem_probe", lambda: False)  # no `tc` process in the fast lane

    emu = EmulatedCluster("emu_4to1", cores=1.0, memory=True, memory_total=8 * 2**30)
    text = emu.describe()  # 8 GiB in the ratio of the devices' memory: 2.7 GiB per fast rank, 1.3 GiB per slow
    assert "no limit" not in text and text.count("2.7 GiB") == 2 and text.count("1.3 GiB") == 2
    assert main(["emulate", "emu_4to1", "--describe", "--cores", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "below the kernel's minimum" in err and "Fix: give more --cores" in err


class _Proc:
    """A finished rank as wait() and _stop() see it."""

    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code

    def terminate(self):
        pass

    def wait(self, timeout=None):
        return self.code


def test_a_rank_killed_at_its_memory_limit_is_named_as_such(tmp_path):
    """Under --memory a rank over its limit dies by SIGKILL and prints nothing: the message said only
    'rank 2 ... exited with code -9 ... Fix: see that rank's output above' (there is none), and named
    the rank whose peer connection broke when that one failed first."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    emu = EmulatedCluster("emu_4to1", cores=1.0, memory=True, memory_total=8 * 2**30, cgroup_root=tmp_path)
    emu.ranks = emu._planned_ranks()
    emu.cgroups = RankCgroups(CgroupLayout.detect(tmp_path), "emu-test", [0.4, 0.4, 0.1, 0.1],
                              [r.memory_bytes for r in emu.ranks])
    emu.cgroups.create()
    for r in range(4):  # what the kernel writes (v2): rank 2 had one process OOM-killed
        (tmp_path / "emu-test" / f"rank{r}" / "memory.events").write_text(
            f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {int(r == 2)}\n")
    with pytest.raises(EmulationError) as e:
        emu.wait([_Proc(0), _Proc(1), _Proc(-9), _Proc(None)], timeout=5)
    assert str(e.value).startswith("rank 2 (machine slow, EMU-SLOW) was killed by the kernel's OOM killer at its "
                                   "--memory limit of 1.3 GiB")
    assert "Fix: run without --memory" in str(e.value)
    (tmp_path / "emu-test" / "rank2" / "memory.events").write_text("oom_kill 0\n")
    with pytest.raises(EmulationError, match="rank 1 .* exited with code 1"):
        emu.wait([_Proc(0), _Proc(1), _Proc(-9), _Proc(None)], timeout=5)


def test_more_cores_than_this_process_may_use_are_refused(monkeypatch, capsys):
    """--cores 8 on a 2-CPU host: the quotas (1 + 1 + 0.25 + 0.25 cores) were set up and the ranks
    contended for 2 CPUs, the fast ones losing most, without a word."""
    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.emulate import emulated

    monkeypatch.setattr(emulated, "available_cores", lambda layout: 2.0)
    assert main(["emulate", "emu_4to1", "--describe", "--cores", "8"]) == 2
    err = capsys.readouterr().err
    assert "cores = 8: the ranks' quotas sum to 2.5 cores, more than the 2 this process may use" in err
    assert "Fix: --cores 2 or less" in err
    assert EmulatedCluster("emu_4to1", cores=2.0)._planned_ranks()[0].cores == pytest.approx(0.8)  # 2 fits
