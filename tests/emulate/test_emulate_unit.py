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


def test_cli_help_and_errors(capsys, monkeypatch, tmp_path):
    from lightning_hexiscale.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["emulate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--bw-scale" in out and "-- COMMAND" in out and "--cleanup" in out
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
    _fake_no_privileges(monkeypatch)
    monkeypatch.setattr(support, "CgroupLayout", type("NoCgroups", (), {"detect": staticmethod(lambda root: None)}))
    assert main(["emulate", "emu_4to1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "hexiscale emulate: error:" in err and "missing: root privileges" in err and "Traceback" not in err
