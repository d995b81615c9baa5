"""Network interfaces (NICs) of the machines of a cluster: declaration, defaults, and the per-flow cap.

A machine reaches the other machines through its NICs. Each GPU uses one NIC (``nics.gpus`` says
which; by default the GPUs are dealt to the NICs in contiguous blocks, GPU g of a machine with G
GPUs and k NICs using NIC floor(g * k / G)), and every transfer between two machines leaves through
the sending GPU's NIC and enters through the receiving GPU's. Two figures bound a transfer from
device a to device b on another machine:

    the link:  beta[a, b]          (``inter_machine`` / ``machine_links`` / a measured matrix: the path)
    the NICs:  B_nic(a), B_nic(b)  (``nics.bandwidth``: what one interface carries, per direction)

A single transfer runs at min(beta[a, b], B_nic(a), B_nic(b)): :func:`cap_links` folds that into the
cluster's bandwidth matrix, so every term priced on one pair sees it. Concurrent transfers through
one NIC share it (:mod:`lightning_hexiscale.planner.cost.nic`, the cost model's part).

**Per destination** (``nics.to``): a NIC may carry less toward some machines than toward the others,
e.g. a fast network among machines of one kind beside a slow path between kinds:
``nics: {bandwidth: "100 Gbps", to: [{machines: [slow], bandwidth: "1 Gbps"}]}``. Traffic exchanged
with a listed machine (either direction) gets that figure, B_n(m), instead of B_n: the single-transfer
cap above uses B_n(a)(machine of b), and concurrent transfers share the NIC at the figure of their
own destination (:mod:`lightning_hexiscale.planner.cost.nic`). A name matches the machine entry of
that name, all its ``repeat`` copies included (``slow`` matches ``slow.0``, ``slow.1``).

Default (no ``nics`` key): one NIC per machine at the machine's fastest link to another machine,
i.e. the ``inter_machine`` bandwidth unless ``machine_links`` or a matrix file say more, so a single
transfer is priced as before and existing cluster files keep working. ``nics: {count: k}`` without
a bandwidth gives each of the k NICs that figure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_hexiscale.config.units import parse_bandwidth
from lightning_hexiscale.errors import ConfigError

_BARE = re.compile(r"\s*[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\s*")


@dataclass(frozen=True)
class Nic:
    """One network interface of a machine."""

    machine: int
    """Index of its machine in ``Cluster.machines``."""
    bandwidth_Bps: float
    """What it carries per direction, bytes/s (full duplex: each direction has this much)."""
    devices: tuple[int, ...]
    """Global ids of the GPUs that use it (at least one)."""
    toward: tuple[tuple[int, float], ...] = ()
    """(machine index, bytes/s) for each machine whose traffic through this NIC has a figure of its
    own (``nics.to``); every other machine: ``bandwidth_Bps``."""

    def to(self, machine: int) -> float:
        """What this NIC carries per direction in traffic with ``machine`` (bytes/s)."""
        return next((bw for m, bw in self.toward if m == machine), self.bandwidth_Bps)


@dataclass(frozen=True)
class NicDeclaration:
    """A machine entry's ``nics`` as parsed: bandwidth per NIC (None: the default, known only once
    the links are) and, per NIC, the machine-local GPU indices using it."""

    bandwidth_Bps: float | None
    local_gpus: tuple[tuple[int, ...], ...]
    toward: tuple[tuple[str, float], ...] = ()
    """``nics.to``: (machine name, bytes/s) per listed destination, resolved by :func:`resolve_toward`."""
    key: str = ""
    """The config key of this ``nics`` entry, for errors found once every machine is known."""


def parse_nics(cfg: Any, key: str, gpus: int) -> NicDeclaration:
    """Check and parse one machine entry's ``nics`` (a dict with count, bandwidth, gpus, or None) for a
    machine of ``gpus`` GPUs. Errors name the key, the value, the rule and the fix."""
    if cfg is None:
        return NicDeclaration(None, (tuple(range(gpus)),))
    count = cfg.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= gpus:
        raise ConfigError(f"{key}.count", count, f"must be a whole number from 1 to the machine's {gpus} GPU(s): "
                          "each GPU uses one NIC", "give the number of network interfaces the machine's GPUs use "
                          "(several ports of one GPU count as one NIC of their summed bandwidth)")
    bw = cfg.get("bandwidth")
    if bw is not None:
        bw = _nic_bandwidth(bw, f"{key}.bandwidth")
    toward = _parse_to(cfg.get("to"), f"{key}.to")
    lists = cfg.get("gpus")
    if lists is None:
        return NicDeclaration(bw, tuple(tuple(b) for b in _blocks(count, gpus)), toward, key)
    lists = [list(x) for x in lists]
    if len(lists) != count:
        raise ConfigError(f"{key}.gpus", lists, f"must list the GPUs of each of the {count} NIC(s), one list per NIC",
                          f"give {count} list(s) of local GPU indices, e.g. {_blocks(count, gpus)}")
    seen: dict[int, int] = {}
    for k, gl in enumerate(lists):
        if not gl:
            raise ConfigError(f"{key}.gpus[{k}]", gl, "a NIC needs at least one GPU using it",
                              "drop the NIC (lower count) or move a GPU to it")
        for g in gl:
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < gpus:
                raise ConfigError(f"{key}.gpus[{k}]", gl, f"GPU indices are local to the machine: 0 to {gpus - 1}",
                                  "number the machine's GPUs from 0")
            if g in seen:
                raise ConfigError(f"{key}.gpus", lists, f"GPU {g} is listed under NIC {seen[g]} and NIC {k}: each "
                                  "GPU uses one NIC", "list every GPU exactly once")
            seen[g] = k
    missing = sorted(set(range(gpus)) - set(seen))
    if missing:
        raise ConfigError(f"{key}.gpus", lists, f"GPU(s) {missing} use no NIC", "list every GPU of the machine once")
    return NicDeclaration(bw, tuple(tuple(gl) for gl in lists), toward, key)


def _nic_bandwidth(bw: Any, key: str) -> float:
    if isinstance(bw, (int, float)) and not isinstance(bw, bool) or isinstance(bw, str) and _BARE.fullmatch(bw):
        raise ConfigError(key, bw, "a NIC bandwidth needs a unit; a bare number is ambiguous "
                          "(bits or bytes per second?)", 'write e.g. "100 Gbps" (bits/s) or "12.5 GB/s" (bytes/s)')
    return parse_bandwidth(bw, key)


def _parse_to(entries: Any, key: str) -> tuple[tuple[str, float], ...]:
    """``nics.to``: a list of {machines: [names], bandwidth: "..."} -> ((name, bytes/s), ...)."""
    if entries is None:
        return ()
    out: dict[str, float] = {}
    for i, e in enumerate(entries):
        k = f"{key}[{i}]"
        if not isinstance(e, dict) or set(e) - {"machines", "bandwidth"} or not e.get("machines") or "bandwidth" not in e:
            raise ConfigError(k, e, "must be {machines: [names], bandwidth: ...}: the destination machines and "
                              "what the NIC carries in traffic with them", 'write e.g. {machines: [slow], bandwidth: "1 Gbps"}')
        names = [e["machines"]] if isinstance(e["machines"], str) else e["machines"]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
            # 5 was "'int' object is not iterable", [[a]] "unhashable type: 'list'"
            raise ConfigError(f"{k}.machines", e["machines"], "must be a list of machine names",
                              'write e.g. {machines: [slow], bandwidth: "1 Gbps"}')
        bw = _nic_bandwidth(e["bandwidth"], f"{k}.bandwidth")
        for name in names:
            if name in out:
                raise ConfigError(f"{k}.machines", names, f"machine {name!r} is listed twice under {key}",
                                  "give each destination one bandwidth")
            out[str(name)] = bw
    return tuple(out.items())


def machines_named(name: str, labels: Sequence[str], entry_names: Sequence[str]) -> list[int]:
    """The machine indices ``name`` stands for: the machine of that name (``fast``, or a ``repeat``
    copy ``slow.1``), or every copy of the entry of that name (``slow``). Shared by ``nics.to`` and
    ``machine_links``, so that both read a name alike."""
    return [i for i, (lab, ent) in enumerate(zip(labels, entry_names)) if name in (lab, ent)]


def resolve_toward(decl: NicDeclaration, labels: Sequence[str], entry_names: Sequence[str],
                   own: int) -> tuple[tuple[int, float], ...]:
    """``decl.toward`` as (machine index, bytes/s): a name matches the machines of the entry of that
    name (``labels``: each machine's name; ``entry_names``: the name of its entry, the same for all
    ``repeat`` copies). Unknown names and the machine itself are errors naming the key."""
    out = []
    for name, bw in decl.toward:
        hits = machines_named(name, labels, entry_names)
        if not hits:
            raise ConfigError(f"{decl.key}.to", name, "names no machine of the cluster",
                              f"use machine names from: {', '.join(dict.fromkeys(labels))}")
        if own in hits:
            raise ConfigError(f"{decl.key}.to", name, "is the NIC's own machine: nics.to is for traffic with other machines",
                              "list only other machines")
        out += [(i, bw) for i in hits]
    return tuple(out)


def destination_bandwidth(nics: Sequence[Nic], num_machines: int) -> np.ndarray:
    """[NIC, machine] -> what the NIC carries in traffic with that machine (bytes/s): its
    ``bandwidth_Bps``, or its ``nics.to`` figure for a listed machine."""
    out = np.array([[nic.bandwidth_Bps] * num_machines for nic in nics], dtype=float).reshape(len(nics), num_machines)
    for k, nic in enumerate(nics):
        for m, bw in nic.toward:
            out[k, m] = bw
    return out


def _blocks(count: int, gpus: int) -> list[list[int]]:
    """The default mapping: GPU g of ``gpus`` uses NIC floor(g * count / gpus) (contiguous blocks)."""
    blocks: list[list[int]] = [[] for _ in range(count)]
    for g in range(gpus):
        blocks[g * count // gpus].append(g)
    return blocks


def fastest_links(machine_of: np.ndarray, bandwidth: np.ndarray) -> np.ndarray:
    """Per machine, its fastest link to a device of another machine (bytes/s; inf when the cluster
    has one machine): the default NIC bandwidth. Row block by row block (no N x N temporary)."""
    n_m = int(machine_of.max()) + 1 if len(machine_of) else 0
    out = np.full(n_m, np.inf)
    for m in range(n_m):
        rows = np.flatnonzero(machine_of == m)
        others = machine_of != m
        if len(rows) and others.any():
            out[m] = float(bandwidth[np.ix_(rows, np.flatnonzero(others))].max())
    return out


def build_nics(machine_devices: Sequence[Sequence[int]], declarations: Sequence[NicDeclaration | None],
               machine_of: np.ndarray, bandwidth: np.ndarray, fast: np.ndarray | None = None,
               toward: Sequence[tuple[tuple[int, float], ...]] | None = None) -> tuple[Nic, ...]:
    """The cluster's NICs, machine by machine: declared ones as given, a bandwidth left out (or a
    machine without declaration: one NIC) at the machine's fastest link (:func:`fastest_links`,
    or ``fast`` when the caller has it); ``toward``: per machine, its NICs' resolved ``nics.to``
    (:func:`resolve_toward`)."""
    fast = fastest_links(machine_of, bandwidth) if fast is None else fast
    nics = []
    for m, (devs, dec) in enumerate(zip(machine_devices, declarations)):
        dec = dec or NicDeclaration(None, (tuple(range(len(devs))),))
        bw = float(fast[m]) if dec.bandwidth_Bps is None else float(dec.bandwidth_Bps)
        for gl in dec.local_gpus:
            nics.append(Nic(m, bw, tuple(int(devs[g]) for g in gl), toward[m] if toward else ()))
    return tuple(nics)


def nic_index(nics: Sequence[Nic], num_devices: int) -> np.ndarray:
    """nic_of[d]: the index in ``nics`` of the NIC device d uses; raises when a device has none or two."""
    nic_of = np.full(num_devices, -1, dtype=np.int64)
    for k, nic in enumerate(nics):
        for d in nic.devices:
            if nic_of[d] >= 0:
                raise ConfigError("cluster.nics", f"device {d}", f"uses NIC {int(nic_of[d])} and NIC {k}",
                                  "give every device one NIC")
            nic_of[d] = k
    if (nic_of < 0).any():
        d = int(np.flatnonzero(nic_of < 0)[0])
        raise ConfigError("cluster.nics", f"device {d}", "uses no NIC", "give every device one NIC")
    return nic_of


def cap_links(bandwidth: np.ndarray, machine_of: np.ndarray, nic_of: np.ndarray, nic_bw: np.ndarray,
              nic_machine: np.ndarray | None = None, nic_to: np.ndarray | None = None) -> np.ndarray:
    """The bandwidth matrix with every cross-machine pair capped by the two NICs it crosses:
    beta'[a, b] = min(beta[a, b], B_nic(a), B_nic(b)) when a and b sit on different machines (one
    transfer alone; sharing is the cost model's), with ``nic_to`` ([NIC, machine],
    :func:`destination_bandwidth`) min(beta[a, b], B_nic(a)(M(b)), B_nic(b)(M(a))). Idempotent;
    same-machine pairs unchanged. Returns ``bandwidth`` itself when no NIC is slower than its
    machine's fastest link and none has a figure per destination (``nic_machine``: the machine of
    each NIC; then nothing can change)."""
    varies = nic_to is not None and bool((nic_to != nic_bw[:, None]).any())
    if nic_machine is not None and len(nic_bw) and not varies:
        fast = fastest_links(machine_of, bandwidth)
        if (nic_bw >= fast[nic_machine]).all():
            return bandwidth
    if varies:
        toward = nic_to[nic_of][:, machine_of]  # [a, b]: NIC of a, in traffic with the machine of b
        cap = np.minimum(toward, toward.T)
    else:
        per = nic_bw[nic_of]
        cap = np.minimum(per[:, None], per[None, :])
    cross = machine_of[:, None] != machine_of[None, :]
    return np.where(cross, np.minimum(bandwidth, cap), bandwidth)


def nics_can_bind(nics: Sequence[Nic]) -> bool:
    """Whether sharing a NIC can ever slow a hop: some NIC (of finite bandwidth) serves two or more
    GPUs. (A NIC used
    by one GPU carries at most one of the cost model's concurrent transfers per direction, and one
    transfer is already capped by :func:`cap_links`.) When False the cost model skips the NIC terms."""
    return any(len(nic.devices) > 1 and np.isfinite(nic.bandwidth_Bps) for nic in nics)
