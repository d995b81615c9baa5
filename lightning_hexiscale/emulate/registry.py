"""A record per live emulated cluster, so that one whose owner was killed (SIGKILL, a crash of the
machine's OOM killer) can be removed later: ``/run/hexiscale-emulate/<id>.json`` holds the owner's
pid and start time, the namespaces and the cgroup directories. The owner deletes its record when it
tears down; :func:`remove_stale` removes what a dead owner left (the next ``EmulatedCluster`` does
it on entry, ``hexiscale emulate --cleanup`` on demand). An owner counts as alive while a process
with its pid AND its start time exists, so a reused pid does not keep garbage alive, and a live
cluster of another process is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

REGISTRY = Path(os.environ.get("HEXISCALE_EMULATE_REGISTRY", "/run/hexiscale-emulate"))


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), or None when no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def record(cluster_id: str, namespaces: list[str], cgroup_dirs: list[Path]) -> None:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    doc = {"pid": os.getpid(), "start": _start_time(os.getpid()), "namespaces": namespaces,
           "cgroups": [str(d) for d in cgroup_dirs]}
    tmp = REGISTRY / f".{cluster_id}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(REGISTRY / f"{cluster_id}.json")


def forget(cluster_id: str) -> None:
    (REGISTRY / f"{cluster_id}.json").unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Remove the clusters of owners that no longer run; return their ids."""
    from lightning_hexiscale.emulate.network import sh

    removed = []
    for f in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("start") is not None and _start_time(int(doc["pid"])) == doc["start"]:
            continue  # its owner runs
        for ns in doc.get("namespaces", []):
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                sh("kill", "-9", pid, check=False)
            sh("ip", "netns", "delete", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for d in sorted((Path(x) for x in doc.get("cgroups", [])), key=lambda p: -len(p.parts)):
            for sub in sorted(d.glob("rank*"), reverse=True):
                _kill_and_rmdir(sub)
            _kill_and_rmdir(d)
        f.unlink(missing_ok=True)
        removed.append(f.stem)
    return removed


def _kill_and_rmdir(d: Path) -> None:
    import signal
    import time

    try:
        for pid in (d / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    except OSError:
        return
    for _ in range(40):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
