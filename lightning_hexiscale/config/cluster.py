"""Cluster: devices, machines, and N x N bandwidth (bytes/s) and latency (s) matrices.

Built from a :class:`~lightning_hexiscale.config.ClusterConfig` (a YAML preset under conf/cluster/,
a user file, or the profiler's output). Device ids are 0..N-1 in the order the machines are
declared. Links: GPUs of one machine use that machine's intra link; GPUs of different machines use
``inter_machine`` unless ``machine_links`` overrides the pair; a ``matrix_file`` (profiled cluster)
overrides everything with measured matrices. Each machine reaches the others through its NICs
(``nics``, :mod:`lightning_hexiscale.config.nics`): a cross-machine pair's bandwidth is capped by the
two NICs it crosses, and concurrent transfers share a NIC in the cost model.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.nics import (Nic, NicDeclaration, build_nics, cap_links, destination_bandwidth,
                                             fastest_links, machines_named, nic_index, nics_can_bind, parse_nics,
                                             resolve_toward)
from lightning_hexiscale.config.gpu_types import check_unused_types, device_figures, gpu_type_from_config, positive_float
from lightning_hexiscale.config.layer_table import LayerTable, parse_layer_tables
from lightning_hexiscale.errors import ConfigError, shown
from lightning_hexiscale.config.units import format_bandwidth, format_bytes, format_flops, parse_bandwidth, parse_time


@dataclass(frozen=True)
class Device:
    """One GPU (or emulated CPU device)."""

    id: int
    machine: int
    """Index of its machine in ``Cluster.machines``."""
    gpu_type: str
    peak_flops: float
    """Peak dense 16-bit FLOP/s."""
    flops: float
    """Sustained FLOP/s the cost model uses (peak * efficiency)."""
    memory_bytes: float
    hopper: bool = False
    efficiency: float | None = None
    """Calibrated fraction of ``peak_flops`` (``flops / peak_flops``); None: not calibrated."""
    fp32_flops: float | None = None
    """Peak FP32 FLOP/s (``catalog.GpuType.fp32_flops``); None: unknown."""
    tf32_flops: float | None = None
    memory_bandwidth_Bps: float | None = None
    """Device-memory bandwidth (bytes/s); None: unknown (no roofline for this device)."""
    gemm_efficiency: float | None = None
    """Measured GEMM fraction of the peak (the probe's); None: the roofline's default."""
    hbm_efficiency: float | None = None
    datasheet: bool = False
    """The type's figures are the catalog's datasheet values."""


@dataclass(frozen=True)
class Machine:
    name: str
    gpu_type: str
    devices: tuple[int, ...]
    hostname: str | None = None


@dataclass(frozen=True)
class Calibration:
    """Appendix B overlap slowdowns theta (1.0 = perfect overlap, as in the paper's defaults)."""

    theta_ddp: float = 1.0
    theta_zero2: float = 1.0
    theta_zero3_fwd: float = 1.0
    theta_zero3_bwd: float = 1.0


class Cluster:
    """Devices plus pairwise links. ``bandwidth[i, j]`` in bytes/s (inf on the diagonal),
    ``latency[i, j]`` in seconds (0 on the diagonal); both symmetric. ``nics``: the machines'
    network interfaces (default: one per machine at its fastest link to another machine); the
    bandwidth of a cross-machine pair is capped by its two NICs (``config.nics.cap_links``)."""

    def __init__(self, name: str, devices: list[Device], machines: list[Machine], bandwidth: np.ndarray,
                 latency: np.ndarray, calibration: Calibration = Calibration(), description: str = "",
                 nics: list[Nic] | tuple[Nic, ...] | None = None, layer_tables: tuple[LayerTable, ...] = (),
                 link_guess: frozenset[tuple[str, str]] | None = None):
        n = len(devices)
        if n == 0:
            raise ConfigError("cluster.machines", [], "a cluster needs at least one device", "declare a machine")
        for key, m in (("bandwidth", bandwidth), ("latency", latency)):
            if m.shape != (n, n):
                raise ConfigError(f"cluster.{key}", f"shape {m.shape}", f"must be {n} x {n} (one row per device)",
                                  "give one row and one column per device")
        self.name = name
        self.description = description
        self.devices = tuple(devices)
        self.machines = tuple(machines)
        self.machine_of = np.array([d.machine for d in devices], dtype=np.int64)
        """Machine index per device."""
        if nics is None:
            nics = build_nics([m.devices for m in machines], [None] * len(machines), self.machine_of, bandwidth)
        self.nics = tuple(nics)
        self.nic_of = nic_index(self.nics, n)
        """Index in ``nics`` of the NIC each device uses."""
        self.nic_bandwidth = np.array([nic.bandwidth_Bps for nic in self.nics], dtype=float)
        self.nic_to = destination_bandwidth(self.nics, len(self.machines))
        """[NIC, machine]: what the NIC carries in traffic with that machine (``nics.to``, else its bandwidth)."""
        self.nics_per_destination = any(nic.toward for nic in self.nics)
        self.nics_shared = nics_can_bind(self.nics)
        """Some NIC serves two or more GPUs (else concurrent hops never share one)."""
        self.bandwidth = cap_links(bandwidth.astype(float), self.machine_of, self.nic_of, self.nic_bandwidth,
                                   np.array([nic.machine for nic in self.nics], dtype=np.int64), self.nic_to)
        self.latency = latency.astype(float)
        np.fill_diagonal(self.bandwidth, np.inf)
        np.fill_diagonal(self.latency, 0.0)
        for a in (self.bandwidth, self.latency, self.machine_of, self.nic_of, self.nic_bandwidth, self.nic_to):
            a.setflags(write=False)
        self.calibration = calibration
        self.layer_tables = tuple(layer_tables)
        """Measured layer times (``layer_times`` of the cluster file; :mod:`.layer_table`)."""
        self.link_guess = link_guess
        """None when the links between machines were given (``inter_machine.bandwidth``, a matrix file);
        else the cluster file gave no ``inter_machine.bandwidth`` and these are the machine pairs
        (names) that ``machine_links`` set: every other pair is priced at :data:`DEFAULT_INTER_MACHINE`,
        a guess that the planner names (:meth:`default_links`)."""

    # ---- views ---------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def flops(self) -> np.ndarray:
        """Sustained FLOP/s per device."""
        return np.array([d.flops for d in self.devices])

    @property
    def memory(self) -> np.ndarray:
        """Memory in bytes per device."""
        return np.array([d.memory_bytes for d in self.devices])

    @property
    def total_memory(self) -> float:
        return float(self.memory.sum())

    def graph(self, devices: list[int] | None = None):
        """networkx view: vertices = devices (attrs flops, memory, gpu_type, machine), edges weighted
        by bandwidth (bytes/s) between every pair of the given devices (all by default)."""
        import networkx as nx

        ids = list(range(self.num_devices)) if devices is None else list(devices)
        g = nx.Graph()
        for i in ids:
            d = self.devices[i]
            g.add_node(i, flops=d.flops, memory=d.memory_bytes, gpu_type=d.gpu_type, machine=d.machine)
        for a_i, a in enumerate(ids):
            for b in ids[a_i + 1:]:
                g.add_edge(a, b, bandwidth=float(self.bandwidth[a, b]), latency=float(self.latency[a, b]))
        return g

    def subset(self, devices: list[int]) -> Cluster:
        """A cluster of the given devices, renumbered 0..k-1 in the given order. ``devices``: distinct
        device ids of this cluster, at least one (else a ConfigError: was an IndexError from numpy)."""
        n = self.num_devices
        if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
            raise ConfigError("Cluster.subset(devices)", devices, "must be a list of device ids",
                              f"pass e.g. [0, 1] (ids 0..{n - 1} of cluster {self.name})")
        devices = list(devices)
        bad = [d for d in devices if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < n]
        if not devices or bad or len(set(devices)) != len(devices):
            rule = (f"device {bad[0]!r} is not an id of cluster {self.name} (0..{n - 1})" if bad else
                    "names no device" if not devices else "names a device twice")
            raise ConfigError("Cluster.subset(devices)", devices, rule,
                              f"pass distinct ids from 0 to {n - 1}, at least one")
        devices = [int(d) for d in devices]
        idx = np.array(devices)
        remap = {old: new for new, old in enumerate(devices)}
        devs = [replace(self.devices[o], id=remap[o]) for o in devices]
        machines = [Machine(m.name, m.gpu_type, tuple(remap[d] for d in m.devices if d in remap), m.hostname)
                     for m in self.machines if any(d in remap for d in m.devices)]
        mid = {m.name: i for i, m in enumerate(machines)}
        devs = [replace(d, machine=mid[self.machines[self.devices[o].machine].name]) for d, o in zip(devs, devices)]
        kept = {i: mid[m.name] for i, m in enumerate(self.machines) if m.name in mid}
        nics = [Nic(mid[self.machines[nic.machine].name], nic.bandwidth_Bps, tuple(remap[d] for d in nic.devices if d in remap),
                    tuple((kept[m], bw) for m, bw in nic.toward if m in kept))
                for nic in self.nics if any(d in remap for d in nic.devices)]
        return Cluster(f"{self.name}[{len(devices)}]", devs, machines, self.bandwidth[np.ix_(idx, idx)].copy(),
                       self.latency[np.ix_(idx, idx)].copy(), self.calibration, self.description, nics,
                       self.layer_tables, self.link_guess)  # the machines keep their names

    def replicate(self, k: int, inter_bandwidth: float | None = None, inter_latency: float | None = None) -> Cluster:
        """k copies of this cluster joined by ``inter_bandwidth`` (bytes/s; default: this cluster's
        slowest link) with ``inter_latency`` (seconds; default: its largest latency)."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ConfigError("Cluster.replicate(k)", k, "must be a whole number of copies, at least 1",
                              "pass e.g. replicate(2)")
        def number(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float, np.number)) and math.isfinite(value)

        if inter_bandwidth is not None and not (number(inter_bandwidth) and inter_bandwidth > 0):
            raise ConfigError("Cluster.replicate(inter_bandwidth)", inter_bandwidth, "must be a finite number greater "
                              "than zero (bytes/s), or None for the default",
                              "pass e.g. inter_bandwidth=parse_bandwidth('10 Gbps')")
        if inter_latency is not None and not (number(inter_latency) and inter_latency >= 0):
            raise ConfigError("Cluster.replicate(inter_latency)", inter_latency, "must be a finite number zero or "
                              "more (seconds), or None for the default", "pass e.g. inter_latency=50e-6")
        n = self.num_devices
        bw_inter = inter_bandwidth if inter_bandwidth is not None else float(self.bandwidth[np.isfinite(self.bandwidth)].min() if n > 1 else 1e9)
        lat_inter = inter_latency if inter_latency is not None else float(self.latency.max())
        bw = np.full((n * k, n * k), bw_inter)
        lat = np.full((n * k, n * k), lat_inter)
        devices, machines = [], []
        for c in range(k):
            sl = slice(c * n, (c + 1) * n)
            bw[sl, sl] = self.bandwidth
            lat[sl, sl] = self.latency
            for m in self.machines:
                machines.append(Machine(f"{m.name}#{c}", m.gpu_type, tuple(d + c * n for d in m.devices), None))
            devices += [replace(d, id=d.id + c * n, machine=d.machine + c * len(self.machines)) for d in self.devices]
        # the NICs are copied; one that had no other machine to reach (inf) gets the new fastest link
        fast = fastest_links(np.array([d.machine for d in devices]), bw)
        nics = [Nic(nic.machine + c * len(self.machines),
                    nic.bandwidth_Bps if np.isfinite(nic.bandwidth_Bps) else float(fast[nic.machine + c * len(self.machines)]),
                    tuple(d + c * n for d in nic.devices),
                    tuple((m + c * len(self.machines), bw) for m, bw in nic.toward))  # within its own copy
                for c in range(k) for nic in self.nics]
        return Cluster(f"{self.name}x{k}", devices, machines, bw, lat, self.calibration, self.description, nics,
                       self.layer_tables)

    def default_links(self, machines: Collection[str] | None = None,
                      limit: int | None = 3) -> tuple[tuple[tuple[str, str], ...], int]:
        """The machine pairs priced at :data:`DEFAULT_INTER_MACHINE` because nothing gave their link
        (:attr:`link_guess`), among ``machines`` (names; default all): the first ``limit`` of them (None:
        all) in declaration order, and how many there are. Counted, not listed: a cluster of 16,384
        one-GPU machines has 134 million pairs."""
        if self.link_guess is None:
            return (), 0
        names = [m.name for m in self.machines if machines is None or m.name in machines]
        inside = set(names)
        total = len(names) * (len(names) - 1) // 2 - sum(a in inside and b in inside for a, b in self.link_guess)
        first: list[tuple[str, str]] = []
        for i, a in enumerate(names):  # stops after limit pairs (at most len(link_guess) + limit steps)
            for b in names[i + 1:]:
                if limit is not None and len(first) >= limit:
                    return tuple(first), total
                if (a, b) not in self.link_guess and (b, a) not in self.link_guess:
                    first.append((a, b))
        return tuple(first), total

    def summary(self) -> str:
        """One line per machine: name, GPUs, memory, intra link; then the inter-machine links."""
        n, k = self.num_devices, len(self.machines)  # "1 device on 1 machine", not "1 devices on 1 machines"
        lines = [f"cluster {self.name}: {n} device{'s' * (n != 1)} on {k} machine{'s' * (k != 1)}, "
                 f"{format_flops(float(self.flops.sum()))}, {format_bytes(self.total_memory)} memory"]
        for m in self.machines:
            d0 = m.devices[0]
            intra = format_bandwidth(self.bandwidth[d0, m.devices[1]]) if len(m.devices) > 1 else "-"
            mine = [nic for nic in self.nics if nic.machine == self.devices[d0].machine]
            nic = (f", {len(mine)} NIC{'s' if len(mine) > 1 else ''} x {format_bandwidth(mine[0].bandwidth_Bps)}"
                   if mine and all(np.isfinite(x.bandwidth_Bps) for x in mine) else "")
            if mine and mine[0].toward:
                nic += " (" + ", ".join(f"to {self.machines[t].name} {format_bandwidth(bw)}" for t, bw in mine[0].toward) + ")"
            lines.append(f"  {m.name}: {len(m.devices)}x{m.gpu_type} "
                         f"({format_bytes(self.devices[d0].memory_bytes)} each), intra {intra}{nic}, "
                         f"devices {m.devices[0]}-{m.devices[-1]}")
        guessed = self.default_links(limit=0)[1]
        if guessed:  # a guess: say so where the links are described
            lines.append(f"  between machines: {format_bandwidth(DEFAULT_INTER_MACHINE)}, the default (no "
                         f"inter_machine.bandwidth given) for {guessed} machine pair{'s' * (guessed != 1)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, {self.num_devices} devices, {len(self.machines)} machines)"

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Any) -> Cluster:
        """Build from a ClusterConfig (DictConfig or plain dict with the same keys; a dict may leave
        ``name``, a label, out: ``"cluster"``)."""
        if not isinstance(cfg, (dict, DictConfig)):  # a str / list / None was a TypeError (string indices ...)
            raise ConfigError("cluster", shown(cfg),
                              "Cluster.from_config takes a mapping of the cluster's keys (machines, inter_machine, ...)",
                              "pass a dict, or Cluster.load(name_or_path) for a preset or a file")
        if isinstance(cfg, dict):
            from lightning_hexiscale.config.schema import ClusterConfig, check_missing, merge_error

            cfg = cfg if "name" in cfg else {**cfg, "name": "cluster"}  # a label only (it read '???' before)
            from lightning_hexiscale.config.suggest import check_yaml_keys

            try:
                raw = OmegaConf.create(cfg)
            except Exception:  # noqa: BLE001 -- values OmegaConf cannot hold: the merge below names them
                raw = None
            if raw is not None:  # as a file's keys: a typo names the closest key, hopper: -1 is no flag
                check_yaml_keys(raw, ClusterConfig, "cluster", "the dict given to Cluster.from_config")
            try:
                cfg = OmegaConf.merge(OmegaConf.structured(ClusterConfig), cfg)
            except Exception as e:
                raise merge_error(e, cfg, "cluster", "the dict given to Cluster.from_config") from None
            check_missing(cfg, "cluster", "the dict given to Cluster.from_config")
        if isinstance(cfg, DictConfig):
            from lightning_hexiscale.config.suggest import check_interpolations

            check_interpolations(cfg, "cluster")  # a cluster file's ${oc.env:UNSET}: its key, no traceback
        c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        name = c["name"]
        if not isinstance(name, str) or not name.strip():  # '' was accepted: plans record it as meta.cluster
            raise ConfigError("cluster.name", name, "a cluster needs a name: plans record it (meta.cluster) and "
                              "the tables print it", "give it one, e.g. name: my_cluster")
        extra = {tname: gpu_type_from_config(tname, t or {}) for tname, t in (c.get("gpu_types") or {}).items()}
        machines_cfg = c.get("machines") or []
        if not machines_cfg:
            raise ConfigError("cluster.machines", machines_cfg, "a cluster needs at least one machine",
                              "add e.g. {gpu: A800, count: 8, intra_bandwidth: \"200 GB/s\"}")
        devices: list[Device] = []
        machines: list[Machine] = []
        intra_bw: list[float] = []
        intra_lat: list[float] = []
        nic_decl: list[NicDeclaration] = []
        entry_names: list[str] = []
        for mi, m in enumerate(machines_cfg):
            key = f"cluster.machines[{mi}]"
            gt = catalog.lookup(m["gpu"], extra)
            if gt is None:
                raise ConfigError(f"{key}.gpu", m["gpu"], "unknown GPU type",
                                  f"{_closest_type(str(m['gpu']), extra)}use one of "
                                  f"{', '.join(catalog.known_names(extra))} or define it under gpu_types")
            if m.get("name") is not None and not str(m["name"]).strip():  # was silently renamed A800-0
                raise ConfigError(f"{key}.name", m["name"], "a machine name must not be empty: machine_links, "
                                  "nics.to and the plan tables refer to machines by name",
                                  f"give it a name (e.g. name: {gt.name}-{mi}), or leave name out for that default")
            for field_, most in (("count", MAX_DEVICES_PER_MACHINE), ("repeat", MAX_DEVICES)):
                v = m.get(field_, 1)
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
                    raise ConfigError(f"{key}.{field_}", v, f"must be a whole number from 1 to {most}",
                                      "give the number of GPUs of the machine (count) or of identical machines (repeat)")
            if m.get("intra_bandwidth") is None and m["count"] > 1:
                raise ConfigError(f"{key}.intra_bandwidth", None, f"missing: a machine of {m['count']} devices needs "
                                  "intra_bandwidth (the link between its devices)",
                                  'add e.g. intra_bandwidth: "200 GB/s" (NVLink) or "32 GB/s" (PCIe)')
            # one device: no link inside the machine; its 1 x 1 block is the diagonal (inf), never priced
            bw = (np.inf if m.get("intra_bandwidth") is None
                  else parse_bandwidth(m["intra_bandwidth"], f"{key}.intra_bandwidth"))
            lat = parse_time(m.get("intra_latency", "5us"), f"{key}.intra_latency")
            decl = parse_nics(m.get("nics"), f"{key}.nics", m["count"])
            for r in range(m.get("repeat", 1)):
                label = m.get("name") or f"{gt.name}-{mi}"
                if m.get("repeat", 1) > 1:
                    label = f"{label}.{r}"
                ids = tuple(range(len(devices), len(devices) + m["count"]))
                machines.append(Machine(label, gt.name, ids, m.get("hostname")))
                for i in ids:
                    devices.append(Device(i, len(machines) - 1, gt.name, gt.peak_flops, gt.flops, gt.memory_bytes,
                                          gt.hopper, **device_figures(gt)))
                intra_bw.append(bw)
                intra_lat.append(lat)
                nic_decl.append(decl)
                entry_names.append(m.get("name") or f"{gt.name}-{mi}")
                if len(devices) > MAX_DEVICES:
                    field_ = "repeat" if m.get("repeat", 1) > 1 else "count"
                    raise ConfigError(f"{key}.{field_}", m.get(field_, 1), f"the cluster would have more than "
                                      f"{MAX_DEVICES} devices (its N x N bandwidth and latency matrices)",
                                      "describe a smaller cluster")
        check_unused_types(extra, machines_cfg)
        labels = [m.name for m in machines]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                j = _entry_of(machines_cfg, labels.index(label))
                raise ConfigError(f"cluster.machines[{_entry_of(machines_cfg, i)}].name", label,
                                  f"machine names must be unique (machines[{j}] is also {label!r}): machine_links and "
                                  "the plan tables refer to machines by name", "give each machine its own name")
        n = len(devices)
        inter = c.get("inter_machine") or {}
        inter_given = inter.get("bandwidth") is not None
        bw = np.full((n, n), parse_bandwidth(inter["bandwidth"], "cluster.inter_machine.bandwidth") if inter_given
                     else DEFAULT_INTER_MACHINE)
        lat = np.full((n, n), parse_time(inter.get("latency", "10us"), "cluster.inter_machine.latency"))
        for mi, m in enumerate(machines):
            ix = np.ix_(m.devices, m.devices)
            bw[ix], lat[ix] = intra_bw[mi], intra_lat[mi]
        given: dict[tuple[int, int], int] = {}
        for li, link in enumerate(c.get("machine_links") or []):
            key = f"cluster.machine_links[{li}]"
            lb = parse_bandwidth(link["bandwidth"], f"{key}.bandwidth")
            ll = parse_time(link.get("latency", "10us"), f"{key}.latency")
            for x, y in link_pairs(link["machines"], labels, entry_names, key, given, li):
                a, b = machines[x].devices, machines[y].devices
                bw[np.ix_(a, b)] = bw[np.ix_(b, a)] = lb
                lat[np.ix_(a, b)] = lat[np.ix_(b, a)] = ll
        guessed = None if inter_given or c.get("matrix_file") else frozenset(
            (labels[x], labels[y]) for x, y in given)
        if c.get("matrix_file"):
            bw, lat = _load_matrices(c["matrix_file"], n)
        cal = Calibration(**{k: _theta(v, f"cluster.calibration.{k}") for k, v in (c.get("calibration") or {}).items()})
        toward = [resolve_toward(decl, labels, entry_names, mi) for mi, decl in enumerate(nic_decl)]
        nics = build_nics([m.devices for m in machines], nic_decl, np.array([d.machine for d in devices]), bw,
                          toward=toward)
        tables = parse_layer_tables(c.get("layer_times"), {m.gpu_type for m in machines})
        return cls(name, devices, machines, bw, lat, cal, c.get("description", ""), nics, tables, guessed)

    @classmethod
    def load(cls, name_or_path: str, *, key: str | None = None) -> Cluster:
        """A preset name (conf/cluster/NAME.yaml) or a path to a cluster YAML. ``key``: what named it
        (``HexiScaleStrategy(cluster)``), so that the errors about the name or the whole file are
        written as that key takes it (:func:`~lightning_hexiscale.config.schema.load_preset`)."""
        from lightning_hexiscale.config.schema import ClusterConfig, load_preset

        return cls.from_config(load_preset("cluster", name_or_path, ClusterConfig, key))


def _closest_type(name: str, extra: dict[str, catalog.GpuType]) -> str:
    """``did you mean gpu: A800? `` for a type that is a listed name or alias in another case (``a800``,
    ``rtx4090``: difflib's ratio is case-sensitive, so none was offered) or close to one; else ''."""
    from lightning_hexiscale.config.suggest import closest

    names = [*catalog.known_names(extra), *catalog.ALIASES]
    near = [n for n in names if n.lower() == name.lower()] or closest(name, names)
    return f"did you mean gpu: {near[0]}? " if near else ""


DEFAULT_INTER_MACHINE = 1e9
"""Bytes/s between machines when the cluster file gives no ``inter_machine.bandwidth`` (1 GB/s: a
guess between 1 GbE and 10 GbE; the planner names the pairs it prices so)."""
MAX_DEVICES_PER_MACHINE = 1024
"""GPUs one machine entry may declare (the largest single systems hold a few hundred)."""
MAX_DEVICES = 16384
"""Devices of a whole cluster: its two N x N float64 matrices take 2 x 8 N^2 bytes (4 GiB at this N)."""


def link_pairs(names: Any, labels: list[str], entry_names: list[str], key: str, given: dict[tuple[int, int], int],
               index: int) -> list[tuple[int, int]]:
    """The machine pairs (indices) of ``machine_links[index]``: a name matches a machine (``fast``, or a
    ``repeat`` copy ``slow.1``) and an entry name all its copies (``slow``), as in ``nics.to``, so
    ``[fast, slow]`` sets the link from ``fast`` to every copy and ``[slow, slow]`` the links among the
    copies. ``given`` (pair -> link index) refuses a pair two links set: the later one would win silently."""
    if (not isinstance(names, (list, tuple)) or len(names) != 2
            or any(not isinstance(x, str) or x not in labels + entry_names for x in names)):  # [[a], b]: unhashable
        raise ConfigError(f"{key}.machines", names, "must name two declared machines",
                          f"use names from: {', '.join(dict.fromkeys(entry_names + labels))}")
    hits = [machines_named(x, labels, entry_names) for x in names]
    pairs = sorted({(min(x, y), max(x, y)) for x in hits[0] for y in hits[1] if x != y})
    if not pairs:  # it would silently replace the machine's intra_bandwidth
        raise ConfigError(f"{key}.machines", names, "a machine link joins two different machines",
                          f"give the figures inside machine {names[0]} as its intra_bandwidth and intra_latency")
    for pair in pairs:
        if pair in given:
            raise ConfigError(f"{key}.machines", names, f"the pair is already given by "
                              f"cluster.machine_links[{given[pair]}] (machines {labels[pair[0]]} and "
                              f"{labels[pair[1]]}): one link per machine pair",
                              "keep one of the two entries")
        given[pair] = index
    return pairs


def _entry_of(machines_cfg: list, machine_index: int) -> int:
    """The ``machines[i]`` entry that declared the ``machine_index``-th machine (``repeat`` expands)."""
    seen = 0
    for i, m in enumerate(machines_cfg):
        seen += int(m.get("repeat", 1))
        if machine_index < seen:
            return i
    return len(machines_cfg) - 1


MAX_THETA = 100.0
"""Largest overlap slowdown theta a cluster file may give: ``hexiscale calibrate`` fits theta_ddp within
[0.1, 20] (profiling/calibrate.py); 1e308 was accepted and priced every data-parallel step at ~1e300 s."""


def _theta(v: Any, key: str) -> float:
    f = positive_float(v, key)
    if f > MAX_THETA:
        raise ConfigError(key, v, f"an overlap slowdown (1.0 = none) must be at most {MAX_THETA:g}; hexiscale calibrate "
                          "fits it between 0.1 and 20", "use the value hexiscale calibrate wrote, or 1.0")
    return f


def _plain_number(x: Any) -> bool:
    """A matrix entry: a number, or text that is one (YAML reads 1e9 without a point as text)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    if isinstance(x, str):
        try:
            float(x)
        except ValueError:
            return False
        return True
    return False


def _load_matrices(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Read ``bandwidth_Bps`` and ``latency_s`` matrices (YAML/JSON); check shape, sign, symmetry."""
    from lightning_hexiscale.config.schema import packaged_file

    p = Path(path)
    if not p.is_file():
        p = packaged_file(path) or p
    if not p.is_file():
        raise ConfigError("cluster.matrix_file", path, "file not found",
                          "give a path relative to the cluster file's folder, the working directory or conf/, or an "
                          "absolute one")
    try:  # a syntax error, a folder or bytes were yaml's / the OS's tracebacks
        data = yaml.safe_load(p.read_text()) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ConfigError("cluster.matrix_file", path, f"cannot read it as YAML/JSON ({str(e).splitlines()[0]})",
                          "give the bandwidth_Bps / latency_s file `hexiscale profile` wrote") from None
    if not isinstance(data, dict):  # 5 was "argument of type 'int' is not iterable"
        raise ConfigError("cluster.matrix_file", path, f"holds a {type(data).__name__}, not a mapping of bandwidth_Bps "
                          "and latency_s", f"write bandwidth_Bps: and latency_s: as {n} x {n} lists of lists")
    out = []
    for key in ("bandwidth_Bps", "latency_s"):
        if key not in data:
            raise ConfigError(f"cluster.matrix_file:{key}", None, "missing matrix", f"add {key}: an {n} x {n} list of lists")
        rows = data[key]
        flat = [x for r in rows for x in (r if isinstance(r, list) else [r])] if isinstance(rows, list) else [rows]
        bad = next((x for x in flat if not _plain_number(x)), None)
        if bad is not None or (isinstance(rows, list) and len({len(r) if isinstance(r, list) else -1 for r in rows}) > 1):
            # 'a', "1 GB/s", true, or rows of unequal length were numpy's ValueError (or a bool read as 1.0)
            raise ConfigError(f"cluster.matrix_file:{key}", bad if bad is not None else "rows of unequal length",
                              f"must be an {n} x {n} list of lists of plain numbers "
                              + ("(bytes/s, no units)" if key == "bandwidth_Bps" else "(seconds, no units)"),
                              "regenerate the file with `hexiscale profile`, or write plain numbers")
        m = np.asarray(rows, dtype=float)
        if m.shape != (n, n):
            raise ConfigError(f"cluster.matrix_file:{key}", f"shape {m.shape}",
                              f"must be {n} x {n}: the machines declare {n} devices", "regenerate the matrix or fix the machines")
        off = ~np.eye(n, dtype=bool)
        if not np.isfinite(m[off]).all():  # .inf passes the sign checks: an infinitely fast or slow link
            i, j = np.argwhere(~np.isfinite(m) & off)[0]
            raise ConfigError(f"cluster.matrix_file:{key}[{i}][{j}]", float(m[i, j]), "every off-diagonal entry must be a "
                              "finite number", "measure the links again (`hexiscale profile`), or write the pair's "
                              + ("bandwidth in bytes/s" if key == "bandwidth_Bps" else "latency in seconds"))
        if key == "bandwidth_Bps" and not (m[off] > 0).all():
            i, j = np.argwhere(~(m > 0) & off)[0]
            raise ConfigError(f"cluster.matrix_file:{key}[{i}][{j}]", float(m[i, j]), "bandwidth must be > 0",
                              "measure the links again (`hexiscale profile`), or write the pair's bandwidth in bytes/s")
        if key == "latency_s" and not (m[off] >= 0).all():
            i, j = np.argwhere(~(m >= 0) & off)[0]
            raise ConfigError(f"cluster.matrix_file:{key}[{i}][{j}]", float(m[i, j]), "latency must be >= 0",
                              "measure the links again (`hexiscale profile`), or write the pair's latency in seconds")
        if not np.allclose(m[off], m.T[off], rtol=1e-6):
            i, j = np.argwhere(~np.isclose(m, m.T, rtol=1e-6) & off)[0]
            raise ConfigError(f"cluster.matrix_file:{key}[{i}][{j}]", float(m[i, j]),
                              f"matrix must be symmetric but [{j}][{i}] = {m[j, i]}", "average the two directions")
        out.append(m)
    return out[0], out[1]
