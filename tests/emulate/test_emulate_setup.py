"""Set-up and tear-down of a real emulated cluster (cgroups, namespaces, shaped links): they exist
while it runs and are gone after it, also after an exception, Ctrl-C, a crashed rank and SIGTERM
of `hexiscale emulate`. Skipped without root / cgroups / `ip netns` (the reason says what is missing)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_hexiscale.emulate import EmulatedCluster, EmulationError, missing_support, remove_stale
from lightning_hexiscale.emulate.cgroups import CLOCKED_PERIOD_US, quota_period_us

REPO = Path(__file__).resolve().parents[2]
MISSING = missing_support() if sys.platform.startswith("linux") else ["Linux"]
pytestmark = [pytest.mark.skipif(bool(MISSING), reason=f"emulated cluster unsupported here: {'; '.join(MISSING)}"),
              pytest.mark.timeout(120)]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def assert_gone(emu: EmulatedCluster, cg_dirs: list[Path]) -> None:
    assert not any(ns.startswith(f"hx{emu.id}") for ns in namespaces())
    assert not list(Path("/etc/netns").glob(f"hx{emu.id}*"))
    assert not any(d.exists() for d in cg_dirs)


@pytest.mark.slow
def test_exists_during_and_gone_after():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        ns = {n for n in namespaces() if n.startswith(f"hx{emu.id}")}
        assert ns == {f"hx{emu.id}m0", f"hx{emu.id}m1", f"hx{emu.id}hub"}
        cpu = emu.cgroups.group_dir("cpu")
        dirs = [cpu] + [cpu / f"rank{r}" for r in range(4)]
        assert emu.clock.running, emu.clock.why  # root: the real-time sleepers of the quota clock start
        # (quota, period) per rank: the shortest period that allows the kernel's 1 ms minimum quota,
        # 2 ms with the clock: 0.4 core -> 1 ms per 2.5 ms, 0.1 core -> 1 ms per 10 ms
        assert [quota_and_period(emu, r) for r in range(4)] == [(1000, 2500), (1000, 2500), (1000, 10_000), (1000, 10_000)]
        assert sum(r.cores for r in emu.ranks) == pytest.approx(1.0)
        clock_pids = emu.clock.pids
        assert len(clock_pids) == len(os.sched_getaffinity(0)) and all(_is_fifo(p) for p in clock_pids)
        qd = subprocess.run(["tc", "-n", f"hx{emu.id}m0", "class", "show", "dev", "emu0"], capture_output=True,
                            text=True).stdout
        assert "htb" in qd and "320Mbit" in qd  # 40 MB/s = 320 Mbit/s towards the other machine
        assert f"emulated cluster {emu.id}" in emu.describe()
    assert_gone(emu, dirs)
    assert not any(Path(f"/proc/{p}").exists() for p in clock_pids)  # the sleepers went with the cluster


def quota_and_period(emu: EmulatedCluster, rank: int) -> tuple[int, int]:
    d = emu.cgroups.group_dir("cpu") / f"rank{rank}"
    if emu.cgroups.layout.version == 1:
        return int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
    q, p = (d / "cpu.max").read_text().split()
    return int(q), int(p)


def _is_fifo(pid: int) -> bool:
    return os.sched_getscheduler(pid) == os.SCHED_FIFO


@pytest.mark.slow
def test_set_cores_rewrites_quota_and_period_of_a_running_rank():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        procs = emu.launch(["sleep", "30"], master_port=29129)
        emu.set_cores([0.5, 0.3, 0.15, 0.05])
        assert [r.cores for r in emu.ranks] == [0.5, 0.3, 0.15, 0.05]
        want = [(round(c * quota_period_us(c, CLOCKED_PERIOD_US)), quota_period_us(c, CLOCKED_PERIOD_US))
                for c in (0.5, 0.3, 0.15, 0.05)]
        assert [quota_and_period(emu, r) for r in range(4)] == want == [(1000, 2000), (1000, 3334), (1000, 6667),
                                                                        (1000, 20_000)]
        assert all(p.poll() is None for p in procs)  # the ranks kept running
        with pytest.raises(EmulationError, match="4 ranks"):
            emu.set_cores([0.5])


@pytest.mark.slow
def test_ranks_environment_namespace_and_cgroup():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        script = ('echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $GLOO_SOCKET_IFNAME '
                  '$HEXISCALE_MACHINE $OMP_NUM_THREADS"; grep -E ":cpu[,:]" /proc/self/cgroup; ip -o -4 addr show; '
                  'getent hosts 10.77.0.2')
        procs = emu.launch(["sh", "-c", script], master_port=29123, stdout=subprocess.PIPE)
        outs = [p.communicate(timeout=30)[0].decode() for p in procs]
        assert emu.wait(procs, 30) == [0, 0, 0, 0]
    for r, out in enumerate(outs):
        machine = 0 if r < 2 else 1
        first = out.splitlines()[0].split()
        assert first == [str(r), "4", str(r % 2), "2", "10.77.0.1", "29123", f"emu{machine}",
                         ["fast", "slow"][machine], "1"]
        assert f"{emu.cgroups.name}/rank{r}" in out
        assert f"10.77.0.{machine + 1}/24" in out and "10.77.0.%d/24" % (2 - machine) not in out
        assert f"hx{emu.id}-m1" in out  # the namespace's /etc/hosts names the machines


@pytest.mark.slow
def test_gone_after_exception_and_ctrl_c():
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with EmulatedCluster("emu_4to1", cores=1.0) as emu:
                dirs = [emu.cgroups.group_dir("cpu")]
                emu.launch(["sleep", "30"], master_port=29124)
                raise exc
        assert_gone(emu, dirs)


@pytest.mark.slow
def test_rank_crash_stops_the_others_and_names_the_rank():
    with pytest.raises(EmulationError, match=r"rank 2 \(machine slow, EMU-SLOW\) exited with code 3"):
        with EmulatedCluster("emu_4to1", cores=1.0) as emu:
            dirs = [emu.cgroups.group_dir("cpu")]
            procs = emu.launch(["sh", "-c", 'if [ "$RANK" = 2 ]; then exit 3; fi; sleep 30'], master_port=29125)
            t0 = time.monotonic()
            try:
                emu.wait(procs, timeout=60)
            finally:
                assert time.monotonic() - t0 < 15  # not the 30 s of the survivors' sleep
                assert all(p.poll() is not None for p in procs)
    assert_gone(emu, dirs)


@pytest.mark.slow
def test_timeout_names_the_hanging_ranks():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        procs = emu.launch(["sh", "-c", 'if [ "$RANK" = 1 ]; then sleep 30; fi'], master_port=29126)
        with pytest.raises(EmulationError, match=r"ranks \[1\] still running after 2 s"):
            emu.wait(procs, timeout=2)


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default. A job started in the background of a
    non-interactive shell (`make test &`, `nohup`) inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler: the CLI would sleep through the test's Ctrl-C, as it should for
    its user."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_signal_cleans_up(sig, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # -X faulthandler: a CLI still running at the deadline is sent SIGABRT and writes every thread's
    # stack to its stderr, a file (the ranks hold any pipe open)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as err_file:
        p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "lightning_hexiscale.cli", "emulate",
                              "emu_4to1", "--cores", "1", "--", "sleep", "60"], stdout=subprocess.PIPE, stderr=err_file,
                             text=True, env=env, cwd=REPO, preexec_fn=_sigint_default)
    ident = None
    for line in p.stdout:
        m = re.search(r"emulated cluster (\w+):", line)
        if m:
            ident = m.group(1)
            break
    assert ident, err.read_text() if p.poll() is not None else "no id printed"
    assert any(ns.startswith(f"hx{ident}") for ns in namespaces())
    time.sleep(0.5)
    p.send_signal(sig)
    try:
        code = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        p.wait(timeout=30)
        remove_stale()
        pytest.fail(f"hexiscale emulate still running 60 s after {sig.name}; its stacks:\n{err.read_text()[-6000:]}")
    assert code == (130 if sig == signal.SIGINT else 128 + sig)
    assert not any(ns.startswith(f"hx{ident}") for ns in namespaces())
    assert not any(d.name.endswith(ident) for d in Path("/sys/fs/cgroup/cpu").glob("**/hexiscale-emu-*"))


@pytest.mark.slow
def test_memory_limits_apply():
    """--memory: limits proportional to device memory (4 GiB fast : 2 GiB slow); a slow rank that
    allocates more than its limit is killed and named, the fast ranks' larger limit holds it."""
    total = 240 * 2**20  # fast ranks 80 MiB each, slow ranks 40 MiB each
    alloc = "import sys, os; b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True)"
    with EmulatedCluster("emu_4to1", cores=1.0, memory=True, memory_total=total) as emu:
        limits = [r.memory_bytes for r in emu.ranks]
        assert limits == pytest.approx([80 * 2**20, 80 * 2**20, 40 * 2**20, 40 * 2**20])
        if emu.cgroups.layout.version == 1:
            mem = emu.cgroups.group_dir("memory")
            assert int((mem / "rank2" / "memory.limit_in_bytes").read_text()) == 40 * 2**20
        procs = emu.launch([sys.executable, "-S", "-c", alloc], master_port=29127, stdout=subprocess.PIPE)
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0, -9, -9]  # the kernel's OOM killer, inside the slow ranks' groups only
        with pytest.raises(EmulationError, match=r"rank 2 \(machine slow, EMU-SLOW\) was killed by the kernel's OOM "
                                                 r"killer at its --memory limit of 40.0 MiB \(exit code -9"):
            emu.wait(procs, timeout=60)


@pytest.mark.slow
def test_sigkilled_owner_leftovers_removed_by_cleanup():
    """An owner killed with SIGKILL cannot clean up; `hexiscale emulate --cleanup` (and the next
    EmulatedCluster) removes what it left, and leaves a live cluster alone."""
    code = ("import sys, time\nfrom lightning_hexiscale.emulate import EmulatedCluster\n"
            "emu = EmulatedCluster('emu_4to1', cores=1.0).__enter__()\n"
            "emu.launch(['sleep', '60'], master_port=29128)\nprint(emu.id, flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    ident = owner.stdout.readline().strip()
    assert ident, "the owner did not start its cluster"
    with EmulatedCluster("emu_4to1", cores=1.0) as live:
        assert ident not in remove_stale()  # its owner still runs
        owner.kill()
        owner.wait(timeout=10)
        assert any(ns.startswith(f"hx{ident}") for ns in namespaces())  # left behind
        cli = subprocess.run([sys.executable, "-m", "lightning_hexiscale.cli", "emulate", "--cleanup"], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and ident in cli.stdout, cli.stdout + cli.stderr
        assert not any(ns.startswith(f"hx{ident}") for ns in namespaces())
        assert not list(Path("/sys/fs/cgroup/cpu").glob(f"**/hexiscale-emu-{ident}"))
        assert any(ns.startswith(f"hx{live.id}") for ns in namespaces())  # the live one is untouched
