"""Profile result -> a cluster YAML the planner reads directly (plus its matrix file). No torch.

Output, for a profile named ``NAME`` written to ``DIR/NAME.yaml``:

- ``DIR/NAME.yaml``: a :class:`~lightning_hexiscale.config.ClusterConfig` document. Machines are
  inferred from host names: a maximal run of consecutive ranks on one host with one device type is
  one machine, so device id == global rank (the runtime's rank mapping for a plan over devices
  0..N-1; a host whose ranks are not consecutive becomes several machine entries). ``gpu_types``
  holds each device type's measured sustained matmul FLOP/s (median over its ranks) and memory,
  with ``efficiency`` 1.0 until :mod:`~lightning_hexiscale.profiling.calibrate` fits it.
  ``intra_bandwidth`` / ``inter_machine`` carry medians for reading; the measured matrices override them.
  A machine whose host's NIC was measured (several ranks sending to other hosts at once,
  :func:`~lightning_hexiscale.profiling.measure.measure_nics`) gets ``nics: {count: 1, bandwidth:
  <what they carried together>}``; the cost model divides it among concurrent transfers. Several
  machine entries of one host (mixed device types) each get that figure.
- ``DIR/NAME.matrix.yaml``: ``bandwidth_Bps`` and ``latency_s`` N x N (symmetric; diagonal inf / 0),
  plus the per-rank raw figures (flops, memory, hosts) and the fit residuals, for the record.
  ``matrix_file`` in the cluster YAML is written as an absolute path, which works from anywhere on
  this machine; the loader also resolves a relative path against the YAML's own folder first, so
  after moving the two files together, ``matrix_file: NAME.matrix.yaml`` is enough.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.gpu_types import check_efficiency
from lightning_hexiscale.config.schema import matrix_file_path
from lightning_hexiscale.config.units import format_bandwidth
from lightning_hexiscale.profiling.fit import NicFit
from lightning_hexiscale.profiling.yaml_blocks import rewrite_keys


@dataclass
class ProfileResult:
    """Everything the profiler measured, indexed by global rank. Units: FLOP/s, bytes, bytes/s, s."""

    hostnames: list[str]
    device_types: list[str]
    """Per rank: a type name, e.g. ``CPU`` or ``NVIDIA-H100-80GB-HBM3`` (sanitised device name)."""
    flops: list[float]
    """Per rank: sustained matmul FLOP/s (in the run's compute dtype, ``flops_dtype``)."""
    memory_bytes: list[float]
    """Per rank: CUDA total device memory, or on CPU the host's RAM / ranks on that host."""
    bandwidth_Bps: np.ndarray
    """N x N fitted beta (inf on the diagonal)."""
    latency_s: np.ndarray
    """N x N fitted alpha (0 on the diagonal)."""
    fit_rel_rms: np.ndarray
    """N x N relative RMS residual of each pair's alpha-beta fit (0 on the diagonal)."""
    hopper: list[bool] = field(default_factory=list)
    backend: str = "gloo"
    flops_dtype: str = "float32"
    sizes_bytes: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Human-readable caveats written as comments into the YAML (e.g. how memory was derived)."""
    nics: dict[str, NicFit] = field(default_factory=dict)
    """Per host name: its concurrent-transfer measurement (hosts with several ranks and other hosts)."""
    nic_to: dict[str, list[tuple[tuple[str, ...], float]]] = field(default_factory=dict)
    """Per host name: (destination hosts, bytes/s) where its NIC carried clearly less toward those
    hosts than its ``nics`` figure (``hexiscale discover``, per kind of destination), written as
    the machine's ``nics.to``."""
    layer_tables: tuple = ()
    """Measured layer times (:class:`~lightning_hexiscale.config.layer_table.LayerTable`, one per
    device type), written as the cluster's ``layer_times`` (``hexiscale profile --model``)."""

    @property
    def world_size(self) -> int:
        return len(self.hostnames)


@dataclass(frozen=True)
class MachineGroup:
    name: str
    hostname: str
    device_type: str
    ranks: tuple[int, ...]


def infer_machines(hostnames: list[str], device_types: list[str]) -> list[MachineGroup]:
    """Maximal runs of consecutive ranks with the same (host, device type), in rank order.

    Names are the host names, made unique with ``.1``, ``.2`` ... when a host yields several runs
    (non-consecutive ranks or mixed device types).
    """
    runs: list[tuple[str, str, list[int]]] = []
    for r, (h, t) in enumerate(zip(hostnames, device_types)):
        if runs and runs[-1][0] == h and runs[-1][1] == t:
            runs[-1][2].append(r)
        else:
            runs.append((h, t, [r]))
    seen: dict[str, int] = {}
    out = []
    for h, t, ranks in runs:
        k = seen.get(h, 0)
        seen[h] = k + 1
        out.append(MachineGroup(h if k == 0 else f"{h}.{k}", h, t, tuple(ranks)))
    return out


def _fmt_flops(x: float) -> str:
    return f"{x / 1e9:.9g} GFLOPS"


def _fmt_bytes(x: float) -> str:
    return f"{int(round(x))} B"


def _fmt_bw(x: float) -> str:
    return f"{x / 1e6:.9g} MB/s"


def _fmt_time(x: float) -> str:
    return f"{x * 1e6:.6g}us"


def _median_off_diag(m: np.ndarray, mask: np.ndarray) -> float | None:
    vals = m[mask & ~np.eye(len(m), dtype=bool)]
    return float(np.median(vals)) if vals.size else None


def cluster_document(p: ProfileResult, name: str, matrix_path: str,
                     calibration: dict[str, float] | None = None,
                     efficiency: dict[str, float] | None = None, tool: str = "hexiscale profile") -> dict[str, Any]:
    """The ClusterConfig dict for ``p`` (see the module docstring for the layout); ``tool`` names
    the command that measured it (``hexiscale profile`` or ``hexiscale discover``)."""
    n = p.world_size
    hosts = np.array(p.hostnames)
    same_host = hosts[:, None] == hosts[None, :]
    bw_all = _median_off_diag(p.bandwidth_Bps, np.ones((n, n), dtype=bool))
    lat_all = _median_off_diag(p.latency_s, np.ones((n, n), dtype=bool))
    machines = []
    groups = infer_machines(p.hostnames, p.device_types)
    names_of = {h: [g.name for g in groups if g.hostname == h] for h in dict.fromkeys(p.hostnames)}
    for m in groups:
        idx = list(m.ranks)
        inside = np.zeros((n, n), dtype=bool)
        inside[np.ix_(idx, idx)] = True
        # A one-device machine has no intra link; the field is required, so write the overall median.
        bw = _median_off_diag(p.bandwidth_Bps, inside) or bw_all or 1e9
        lat = _median_off_diag(p.latency_s, inside)
        lat = lat if lat is not None else (lat_all or 0.0)
        machines.append({"name": m.name, "gpu": m.device_type, "count": len(idx), "intra_bandwidth": _fmt_bw(bw),
                         "intra_latency": _fmt_time(lat), "hostname": m.hostname})
        if m.hostname in p.nics:
            machines[-1]["nics"] = {"count": 1, "bandwidth": _fmt_bw(p.nics[m.hostname].aggregate_Bps)}
            if p.nic_to.get(m.hostname):
                machines[-1]["nics"]["to"] = [{"machines": [n for h in dest for n in names_of[h]], "bandwidth": _fmt_bw(bw)}
                                              for dest, bw in p.nic_to[m.hostname]]
    inter_bw = _median_off_diag(p.bandwidth_Bps, ~same_host) or bw_all or 1e9
    inter_lat = _median_off_diag(p.latency_s, ~same_host)
    inter_lat = inter_lat if inter_lat is not None else (lat_all or 0.0)
    gpu_types = {}
    for t in dict.fromkeys(p.device_types):
        ranks = [r for r in range(n) if p.device_types[r] == t]
        gpu_types[t] = {"flops": _fmt_flops(float(np.median([p.flops[r] for r in ranks]))),
                        "memory": _fmt_bytes(min(p.memory_bytes[r] for r in ranks)),
                        "efficiency": float((efficiency or {}).get(t, 1.0)),
                        "hopper": bool(p.hopper[ranks[0]]) if p.hopper else False}
    doc = {"defaults": ["base_cluster", "_self_"],  # so that it also works as a preset under conf/cluster/
           "name": name,
           "description": f"measured by `{tool}`: {n} ranks on {len(set(p.hostnames))} host(s), "
                          f"{p.backend}, matmul {p.flops_dtype}",
           "machines": machines,
           "inter_machine": {"bandwidth": _fmt_bw(inter_bw), "latency": _fmt_time(inter_lat)},
           "gpu_types": gpu_types,
           "matrix_file": matrix_path}
    if calibration:
        doc["calibration"] = {k: float(v) for k, v in calibration.items()}
    if p.layer_tables:
        doc["layer_times"] = [t.to_config() for t in p.layer_tables]
    return doc


def matrix_document(p: ProfileResult) -> dict[str, Any]:
    """The matrix file: the two matrices the loader reads, plus the raw per-rank record."""
    def mat(m: np.ndarray) -> list[list[float]]:
        return [[float(x) for x in row] for row in m]

    return {"bandwidth_Bps": mat(p.bandwidth_Bps), "latency_s": mat(p.latency_s),
            "fit_rel_rms": mat(p.fit_rel_rms), "hostnames": list(p.hostnames), "device_types": list(p.device_types),
            "flops_per_rank": [float(x) for x in p.flops], "memory_bytes_per_rank": [float(x) for x in p.memory_bytes],
            "sizes_bytes": [int(s) for s in p.sizes_bytes], "backend": p.backend, "flops_dtype": p.flops_dtype,
            "nics": {h: {"flows": f.flows, "single_Bps": f.single_Bps, "per_flow_Bps": list(f.per_flow_Bps),
                         "span_Bps": f.span_Bps, "aggregate_Bps": f.aggregate_Bps} for h, f in p.nics.items()}}


def write_cluster(p: ProfileResult, out: str | Path, name: str | None = None,
                  calibration: dict[str, float] | None = None,
                  efficiency: dict[str, float] | None = None, tool: str = "hexiscale profile") -> tuple[Path, Path]:
    """Write ``out`` (cluster YAML) and ``<out stem>.matrix.yaml`` next to it; return both paths.

    Each file is written to a temporary name and renamed, so a reader never sees half a file.
    """
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    name = name or re.sub(r"[^A-Za-z0-9_.-]", "_", out.stem)
    mpath = out.with_name(out.stem + ".matrix.yaml")
    header = [f"# Written by `{tool}` on {datetime.datetime.now().isoformat(timespec='seconds')}.",
              f"# {p.world_size} ranks; device id = global rank. Links: alpha + size/beta fitted to ping-pong",
              f"# half round trips at sizes {', '.join(str(s) for s in p.sizes_bytes)} B; matrices in {mpath.name}."]
    header += [f"# {line}" for line in p.notes]
    atomic_write(mpath, yaml.safe_dump(matrix_document(p), sort_keys=False, width=1 << 16))
    doc = cluster_document(p, name, str(mpath), calibration, efficiency, tool)
    atomic_write(out, "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=1 << 16))
    return out, mpath


def update_calibration(path: str | Path, calibration: dict[str, float], efficiency: dict[str, float],
                       sync_latency_s: float | None = None) -> None:
    """Rewrite a profiled cluster YAML with fitted ``calibration`` and ``gpu_types.*.efficiency``,
    keeping its header comments and every other field.

    With ``sync_latency_s`` (delta, seconds) the matrix file is rewritten too: its measured link
    latencies are kept as ``latency_link_s`` and ``latency_s`` := latency_link_s + delta off the
    diagonal, so that calibrating again replaces delta instead of adding to it.
    """
    path = Path(path)
    text = path.read_text()
    doc = yaml.safe_load(text)
    cal = dict(doc.get("calibration") or {})
    cal.update({k: float(v) for k, v in calibration.items()})
    doc["calibration"] = cal
    for t, e in efficiency.items():
        if t not in (doc.get("gpu_types") or {}):
            raise KeyError(f"device type {t!r} is not under gpu_types of {path}")
        if not (math.isfinite(e) and e > 0):
            raise ValueError(f"efficiency of {t} must be a finite positive number, got {e}")
        # the loader's rule, before writing: a fit it would refuse left a file that no longer loaded
        entry = doc["gpu_types"][t] or {}
        check_efficiency(e, f"cluster.gpu_types.{t}.efficiency",
                         datasheet_peak=catalog.lookup(t) is not None and "flops" not in entry)
        doc["gpu_types"][t] = {**entry, "efficiency": float(e)}
    notes = [f"{k}={v:.4g}" for k, v in calibration.items()] + [f"efficiency[{t}]={e:.4g}" for t, e in efficiency.items()]
    if sync_latency_s is not None:
        if not (math.isfinite(sync_latency_s) and sync_latency_s >= 0):
            raise ValueError(f"sync latency must be a finite number >= 0 s, got {sync_latency_s}")
        mpath = matrix_file_path(path, doc["matrix_file"])
        mdoc = yaml.safe_load(mpath.read_text())
        link = np.asarray(mdoc.get("latency_link_s", mdoc["latency_s"]), dtype=float)
        n = len(link)
        mdoc["latency_link_s"] = [[float(x) for x in row] for row in link]
        mdoc["latency_s"] = [[float(x) for x in row] for row in link + sync_latency_s * (1.0 - np.eye(n))]
        mdoc["sync_latency_s"] = float(sync_latency_s)
        atomic_write(mpath, yaml.safe_dump(mdoc, sort_keys=False, width=1 << 16))
        notes.append(f"sync latency {sync_latency_s * 1e6:.0f} us added to every alpha in {mpath.name}")
    stamp = f"# Calibrated {datetime.datetime.now().isoformat(timespec='seconds')}: " + ", ".join(notes)
    atomic_write(path, rewrite_keys(text, doc, ("calibration", "gpu_types") if efficiency else ("calibration",), stamp))


def update_layer_tables(path: str | Path, tables) -> None:
    """Write measured layer tables into the cluster YAML at ``path`` (``layer_times``), replacing
    any entry of the same device type, precision and model shape, keeping every other field and
    the header comments."""
    path = Path(path)
    text = path.read_text()
    doc = yaml.safe_load(text)
    new = [t.to_config() for t in tables]

    def ident(e: dict) -> tuple:
        shape = {k: v for k, v in (e.get("model") or {}).items() if k != "name"}
        return e.get("gpu"), e.get("precision"), tuple(sorted(shape.items()))

    replaced = {ident(e) for e in new}
    doc["layer_times"] = [e for e in (doc.get("layer_times") or []) if ident(e) not in replaced] + new
    stamp = (f"# Layer times measured {datetime.datetime.now().isoformat(timespec='seconds')}: "
             + ", ".join(f"{t.gpu} {t.precision} {t.model_name or 'model'} ({len(t.rows)} rows)" for t in tables))
    atomic_write(path, rewrite_keys(text, doc, ("layer_times",), stamp))


def copy_cluster(src: str | Path, dst: str | Path, name: str | None = None) -> Path:
    """Copy a cluster YAML to ``dst`` (missing folders are made) with its matrix file, to
    ``<dst stem>.matrix.yaml``, the copy's ``matrix_file`` pointing there (absolute, as
    :func:`write_cluster` writes it) and its header comments kept; named ``name`` when given.
    Returns ``dst``. Why the matrix too: a calibration rewrites the matrix file its cluster YAML
    names (:func:`update_calibration`), and a copy naming the source's would change the source's
    link latencies. ``dst`` may be ``src`` itself: then only the name changes (discovery: ``--name``
    is no part of the fingerprint). A file without a matrix file is copied as it is. Each file is
    written to a temporary name and renamed."""
    src, dst = Path(src), Path(dst).resolve()
    text = src.read_text()
    doc = yaml.safe_load(text)
    doc = doc if isinstance(doc, dict) else {}
    renamed = name is not None and doc.get("name") != name
    if renamed:
        doc["name"] = name
    if dst == src.resolve():  # --out named the source itself: only the name may change
        if renamed:
            atomic_write(dst, rewrite_keys(text, doc, ("name",)))
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    mfile = doc.get("matrix_file")
    msrc = None
    if mfile:  # where the loader finds it (beside the cluster file first)
        msrc = matrix_file_path(src, mfile)
    if msrc is None or not msrc.is_file():
        if renamed:
            atomic_write(dst, rewrite_keys(text, doc, ("name",)))
        else:
            atomic_write(dst, text)
        return dst
    mdst = dst.with_name(dst.stem + ".matrix.yaml")
    atomic_write(mdst, msrc.read_text())
    doc["matrix_file"] = str(mdst)
    # the writer's header names the matrix file beside it: the copy's is mdst
    text = "\n".join(ln.replace(f"matrices in {msrc.name}.", f"matrices in {mdst.name}.") if ln.startswith("#")
                     else ln for ln in text.splitlines()) + "\n"
    atomic_write(dst, rewrite_keys(text, doc, ("name", "matrix_file")))
    return dst


def previous_sync_latency(path: str | Path) -> float:
    """The sync latency delta (s) a calibrated cluster file already added to its alphas (0 if none)."""
    doc = yaml.safe_load(Path(path).read_text())
    mfile = doc.get("matrix_file")
    mpath = matrix_file_path(path, mfile) if mfile else None
    if mpath is None or not mpath.is_file():
        return 0.0
    return float((yaml.safe_load(mpath.read_text()) or {}).get("sync_latency_s", 0.0))


def link_summary(p: ProfileResult) -> str:
    """Per-rank compute/memory lines and the range of the measured links, for the terminal."""
    lines = []
    for r in range(p.world_size):
        lines.append(f"  rank {r:3d} {p.hostnames[r]:>16s} {p.device_types[r]:>10s} "
                     f"{p.flops[r] / 1e9:10.2f} GFLOP/s ({p.flops_dtype})  memory {p.memory_bytes[r] / 2**30:8.2f} GiB")
    n = p.world_size
    if n > 1:
        off = ~np.eye(n, dtype=bool)
        bw, lat, err = p.bandwidth_Bps[off], p.latency_s[off], p.fit_rel_rms[off]
        lines.append(f"  links: beta {format_bandwidth(bw.min())} .. {format_bandwidth(bw.max())} "
                     f"(median {format_bandwidth(float(np.median(bw)))}), alpha {lat.min() * 1e6:.1f} .. "
                     f"{lat.max() * 1e6:.1f} us, fit residual <= {err.max() * 100:.1f} %")
    for host, f in p.nics.items():
        lines.append(f"  NIC of {host}: {f.flows} transfers at once {format_bandwidth(f.aggregate_Bps)} together "
                     f"({format_bandwidth(f.aggregate_Bps / f.flows)} each), one alone "
                     f"{format_bandwidth(f.single_Bps)}: shared {f.sharing:.2f}x")
    return "\n".join(lines)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name of this writer's own, then rename it to ``path``: a reader sees
    the old file or the new one, whole. Two writers of one file (two jobs discovering one fingerprint)
    each rename their own temporary; with one shared name the second rename found it gone."""
    import uuid

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # nothing stays behind when the write or the rename failed
