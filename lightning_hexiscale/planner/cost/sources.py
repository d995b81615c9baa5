"""What priced each device type: a measured layer table, calibrated FLOP/s, a measured GEMM
efficiency, the datasheet, or FLOP/s the user declared; and the rule that a layer table which does
not match the run is an error, never a silent fallback.

A device type's layer table **matches** a run when it was measured on the run's model shape
(:class:`~lightning_hexiscale.config.layer_table.ModelShape`: hidden, FFN, heads, KV heads,
sequence length, vocabulary) in a precision with the run's compute and parameter dtypes. Three
mismatches are refused with a :class:`ConfigError` naming the type, what the table holds and what
the run needs:

1. the cluster has tables for the type, but none for this shape and precision (raised where the
   table is looked up, :func:`compute.table_for`, so that no price is ever computed from a table
   that was skipped);
2. a plan puts a stage of the type, inside one machine, at a TP degree its table has no ``layer``
   row for (:func:`price_sources`, run on every plan the search returns and every plan
   ``hexiscale estimate`` prices);
3. a plan puts a device of the type in a TP group across machines or beside another type (same
   place). Why refused and not priced from FLOP/s as before: a table is measured over one machine's
   links on one type, so such a group has no row, and its FLOP/s price beside measured stages of the
   same type is another scale. The profiling page's example table pasted into a cluster of two
   3-device CPU machines at 50 GFLOP/s: every stage a TP-2 pair across the 1 GB/s link, 0.025 s per
   iteration on paper, against 0.76 s for the measured stages of one machine; the plan was chosen by
   the gap between two price sources, not by the hardware. (Pricing such a group from the table's
   per-device times plus its collectives over the cross-machine links would keep it; that is the
   computed path's change to make, and the measured group is what the profiler can give.)

With ``planner.allow_table_mismatch`` (``Workload.allow_table_mismatch``) all three become a
:class:`TableMismatchWarning` saying what prices the type instead. What the table still leaves to
the computed path is named in the type's source line, not refused: head / embedding rows at a TP
degree without them, and micro-batch sizes outside the measured range (extrapolated per sequence
from the nearest one, :func:`~lightning_hexiscale.config.layer_table.interpolate`).

The search proposes only what rules 2 and 3 accept (:class:`StageRule`): a TP group holding a type a
table prices is of that type alone, inside one machine, at a degree with ``layer`` rows; micro-batch
sizes are not restricted (extrapolated, as above). A type whose machines hold too few devices of it for
any measured degree is refused before the search (:func:`check_measured_tp`). With
``planner.allow_table_mismatch`` nothing is restricted (an unmeasured degree is priced from FLOP/s
with a warning), and without tables the rule is None: the search does no extra work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_hexiscale.config.cluster import Cluster, Device
from lightning_hexiscale.config.layer_table import LayerTable, TableMismatchWarning, refuse_or_warn, shape_text
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.planner.cost import roofline as rf
from lightning_hexiscale.planner.cost.workload import Workload
from lightning_hexiscale.planner.plan import Plan

__all__ = ["KINDS", "PriceSource", "StageRule", "TableMismatchWarning", "check_measured_tp", "computed_source",
           "measured_tp_degrees", "price_sources", "sources_text", "stage_rule", "table_source"]

KINDS = ("layer table", "calibrated", "measured GEMM efficiency", "datasheet", "declared")
"""The price sources, best first."""


@dataclass(frozen=True)
class PriceSource:
    """How one device type of the cluster is priced for one workload (and plan)."""

    gpu_type: str
    kind: str
    """One of :data:`KINDS`."""
    detail: str
    """What exactly: the table's model, precision, TP degrees, micro-batch sizes and note; or the
    efficiency; or the datasheet's default GEMM / HBM fractions."""

    def __str__(self) -> str:
        return f"{self.gpu_type}: {self.kind} ({self.detail})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def computed_source(device: Device, workload: Workload) -> PriceSource:
    """The source of a device priced without a layer table (:mod:`.compute`'s roofline or FLOPs path)."""
    from lightning_hexiscale.planner.cost.compute import flops_rate, uses_roofline

    t = device.gpu_type
    if device.efficiency is not None:
        return PriceSource(t, "calibrated", f"{flops_rate(device, workload) / 1e12:.4g} TFLOP/s sustained, "
                           f"efficiency {device.efficiency:.3g} of the peak")
    if uses_roofline(device, workload):
        gemm = device.gemm_efficiency or rf.DEFAULT_GEMM_EFFICIENCY
        hbm = device.hbm_efficiency or rf.DEFAULT_HBM_EFFICIENCY
        roof = f"roofline: GEMMs at {gemm:.0%} of the dense peak, memory-bound work at {hbm:.0%} of the bandwidth"
        if device.gemm_efficiency is not None:
            return PriceSource(t, "measured GEMM efficiency", roof)
        return PriceSource(t, "datasheet" if device.datasheet else "declared", roof)
    kind = "datasheet" if device.datasheet else "declared"
    return PriceSource(t, kind, f"{flops_rate(device, workload) / 1e12:.4g} TFLOP/s "
                       f"({'catalog peak' if device.datasheet else 'the cluster file'}'s figure, efficiency 1)")


def table_source(table: LayerTable, uses: dict[str, set], workload: Workload) -> PriceSource:
    """The source line of a type priced from ``table``: its model, precision, TP degrees and
    micro-batch sizes, the note the profiler wrote (how and when), and what of the plan (``uses``:
    TP degrees inside a machine, across machines, micro-batch sizes) it leaves to the computed path."""
    tps = sorted({r.tp for r in table.rows if r.part == "layer"})
    mbs = sorted({r.micro_batch for r in table.rows if r.part == "layer"})
    bits = [f"{table.model_name or 'model'} ({shape_text(table.shape)}), {table.precision}, TP {tps}, "
            f"micro-batches {mbs}", f"measured: {table.note}" if table.note else "no measurement note"]
    outside = sorted(m for m in uses.get("mb", ()) if mbs and not mbs[0] <= m <= mbs[-1])
    if outside:
        bits.append(f"micro-batches {outside} extrapolated per sequence from the nearest measured size")
    for part in ("head", "embedding"):
        missing = sorted(t for t in uses.get(part, ()) if not table.points(part, t))
        if missing:
            bits.append(f"{part} at TP {missing} computed (no rows)")
    if uses.get("across"):
        bits.append(f"TP groups across machines (TP {sorted(uses['across'])}) computed")
    return PriceSource(table.gpu, "layer table", "; ".join(bits))


def price_sources(cluster: Cluster, workload: Workload, plan: Plan | None = None) -> list[PriceSource]:
    """One :class:`PriceSource` per device type (of ``plan``'s devices when given, else of the
    cluster), in the cluster's order. With a plan, a stage on a type priced by a table, inside one
    machine, at a TP degree without ``layer`` rows is refused (module docstring, rule 2)."""
    from lightning_hexiscale.planner.cost.compute import table_for, without_place

    used = set(plan.device_order) if plan is not None else set(range(cluster.num_devices))
    uses: dict[str, dict[str, set]] = {}
    if plan is not None:
        for i, p in enumerate(plan.pipelines):
            for j, st in enumerate(p.stages):
                devs = [cluster.devices[d] for d in st.devices]
                one_machine = len({d.machine for d in devs}) == 1 and len({d.gpu_type for d in devs}) == 1
                if not one_machine:
                    _refuse_unmeasured_group(cluster, workload, f"plan.pipelines[{i}].stages[{j}].devices", st.devices)
                for d in devs:
                    u = uses.setdefault(d.gpu_type, {})
                    u.setdefault("mb", set()).add(p.micro_batch_size)
                    if not one_machine:
                        u.setdefault("across", set()).add(st.tp)
                        continue
                    if j == 0:
                        u.setdefault("embedding", set()).add(st.tp)
                    if j == len(p.stages) - 1:
                        u.setdefault("head", set()).add(st.tp)
                table = table_for(cluster, workload, devs[0].gpu_type) if one_machine else None
                if table is not None and not table.points("layer", st.tp):
                    have = sorted({r.tp for r in table.rows if r.part == "layer"})
                    refuse_or_warn(f"plan.pipelines[{i}].stages[{j}].tp", f"{devs[0].gpu_type} at TP {st.tp}",
                                   f"the layer table of {devs[0].gpu_type} for {table.model_name or 'this model'} has "
                                   f"layer rows at TP {have} only, and a stage at another degree would be priced "
                                   f"from FLOP/s beside measured stages",
                                   f"measure TP {st.tp} on {devs[0].gpu_type} (hexiscale discover --rediscover, or "
                                   f"hexiscale profile --model {workload.model.name}), or use a plan with TP in {have}",
                                   workload.allow_table_mismatch, "FLOP/s (the computed path)")
    out: dict[str, PriceSource] = {}
    for k, d in enumerate(cluster.devices):
        if k not in used or d.gpu_type in out:
            continue
        table = table_for(cluster, workload, d.gpu_type)
        out[d.gpu_type] = (table_source(table, uses.get(d.gpu_type, {}), workload) if table is not None
                           else computed_source(without_place(d), workload))
    return list(out.values())


def _refuse_unmeasured_group(cluster: Cluster, workload: Workload, key: str, stage: Sequence[int]) -> None:
    """Rule 3 of the module docstring: a TP group across machines or of mixed types that holds a
    type a layer table prices is refused (with ``allow_table_mismatch``: a warning, then FLOP/s)."""
    from lightning_hexiscale.planner.cost.compute import table_for

    devs = [cluster.devices[d] for d in stage]
    tabled = [t for t in dict.fromkeys(d.gpu_type for d in devs) if table_for(cluster, workload, t) is not None]
    if not tabled:
        return
    where = ", ".join(f"{d.gpu_type} on {cluster.machines[d.machine].name}" for d in devs)
    across = len({d.machine for d in devs}) > 1
    refuse_or_warn(key, f"a TP-{len(devs)} group of {where}",
                   f"the layer table of {', '.join(tabled)} was measured on TP groups of that type inside one "
                   f"machine; a group {'across machines' if across else 'of mixed types'} has no row, and its "
                   f"FLOP/s price beside measured stages of the same type is another scale",
                   f"put the group's devices inside one machine and of one type (TP degrees with layer rows), or "
                   f"give each its own stage", workload.allow_table_mismatch, "FLOP/s (the computed path)")


def measured_tp_degrees(cluster: Cluster, workload: Workload) -> dict[str, frozenset[int]]:
    """Device type -> the TP degrees its layer table has ``layer`` rows for, for every type of
    ``cluster`` a table prices for ``workload`` (:func:`compute.table_for`, which refuses tables of
    another shape / precision: rule 1). Empty without tables or with ``allow_table_mismatch`` (then
    any degree is priced)."""
    from lightning_hexiscale.planner.cost.compute import table_for

    if not cluster.layer_tables or workload.allow_table_mismatch:
        return {}
    out = {}
    for gpu_type in dict.fromkeys(d.gpu_type for d in cluster.devices):
        table = table_for(cluster, workload, gpu_type)
        if table is not None:
            out[gpu_type] = frozenset(r.tp for r in table.rows if r.part == "layer")
    return out


def check_measured_tp(cluster: Cluster, workload: Workload,
                      degrees: Sequence[int] | None = None) -> dict[str, frozenset[int]]:
    """Refuse, before a search, a type that a table prices and none of whose machines holds as many
    devices of it as a measured TP degree (a ConfigError): no stage of it could be priced from its
    table, and the search would leave it idle, or find no plan, without a word why. With the
    settings' TP ``degrees`` (the ``uniform-tp`` baseline) a type they leave no degree is idle, as
    machines no TP group of those degrees covers are; an InfeasiblePlan when that is every type.
    Returns :func:`measured_tp_degrees`, which the search passes to every :func:`stage_rule` it
    builds (one per device subset and recompute setting) instead of reading the tables again."""
    measured = measured_tp_degrees(cluster, workload)
    unusable = []
    for gpu_type, have in measured.items():
        counts: dict[str, int] = {}
        for d in cluster.devices:
            if d.gpu_type == gpu_type:
                name = cluster.machines[d.machine].name
                counts[name] = counts.get(name, 0) + 1
        most = max(counts.values())
        usable = [t for t in have if t <= most and (not degrees or t in degrees)]
        if usable:
            continue
        fits = list(range(1, min(most, workload.model.num_kv_heads) + 1))
        rule = (f"a stage of {gpu_type} inside a machine is priced from its table only at a measured TP degree, "
                f"and its machines hold at most {most} {gpu_type} device(s) "
                f"({', '.join(f'{k}: {v}' for k, v in counts.items())})")
        fix = (f"measure TP {fits} on {gpu_type} (hexiscale profile --model {workload.model.name} --layer-tp "
               f"{','.join(map(str, fits))}, or hexiscale discover --model {workload.model.name} --rediscover), or "
               f"remove the {gpu_type} entries from layer_times; or set planner.allow_table_mismatch=true "
               f"(hexiscale --allow-table-mismatch) to price unmeasured degrees from FLOP/s with a warning")
        if not degrees:
            raise ConfigError("cluster.layer_times", f"{gpu_type}: layer rows at TP {sorted(have)}",
                              f"{rule}, so no stage of {gpu_type} can be priced", fix)
        unusable.append(f"{gpu_type} (layer rows at TP {sorted(have)})")
    if unusable and len(unusable) == len({d.gpu_type for d in cluster.devices}):
        raise InfeasiblePlan(f"no stage at TP {sorted(degrees or ())} can be priced: the layer tables of "
                             f"{', '.join(unusable)} have no rows at those degrees that their machines can form. "
                             f"Fix: measure them (hexiscale profile --model {workload.model.name} --layer-tp "
                             f"{','.join(map(str, sorted(degrees or ())))}), or set planner.allow_table_mismatch=true")
    return measured


@dataclass(frozen=True)
class StageRule:
    """Which TP groups (a stage's devices) the search may form: a TP degree in ``degrees`` (the
    ``uniform-tp`` baseline's ``SearchSettings.tp_degrees``; None: any), and a group holding a type
    in ``measured`` only of that type, inside one machine, at one of its measured degrees (rules 2
    and 3 of the module docstring). Groups of types no table prices are not restricted."""

    degrees: frozenset[int] | None
    measured: dict[str, frozenset[int]]
    gpu_type: tuple[str, ...]
    """Per device id."""
    machine: tuple[int, ...]

    def __call__(self, stage: Sequence[int]) -> bool:
        t = len(stage)
        if self.degrees is not None and t not in self.degrees:
            return False
        if not self.measured:
            return True
        first = stage[0]
        kind, where = self.gpu_type[first], self.machine[first]
        if all(self.gpu_type[d] == kind and self.machine[d] == where for d in stage):
            have = self.measured.get(kind)
            return have is None or t in have
        # across machines or of mixed types: the tables price none (rule 3), so none holds a tabled type
        return not any(self.gpu_type[d] in self.measured for d in stage)


def stage_rule(cluster: Cluster, workload: Workload, degrees: Sequence[int] | None = None,
               measured: dict[str, frozenset[int]] | None = None) -> StageRule | None:
    """The :class:`StageRule` of ``cluster`` for ``workload`` (and the TP ``degrees`` a setting
    allows), or None when nothing restricts a stage (no table prices a type, or
    ``allow_table_mismatch``, and no ``degrees``): the search then checks nothing. ``measured``:
    :func:`measured_tp_degrees` of this cluster or of one it is a subset of (a type's degrees do not
    depend on which of its devices are kept), computed here when None."""
    if measured is None:
        measured = measured_tp_degrees(cluster, workload)
    if not measured and not degrees:
        return None
    return StageRule(frozenset(degrees) if degrees else None, measured,
                     tuple(d.gpu_type for d in cluster.devices), tuple(d.machine for d in cluster.devices))


def sources_text(sources: list[PriceSource]) -> str:
    """The report lines: ``priced by:`` then one line per device type."""
    return "\n".join(["priced by:"] + [f"  {s}" for s in sources])
