"""Measured layer times: the ``layer_times`` section of a cluster file (schema, parsing, lookup).

``hexiscale profile --model M`` (and ``hexiscale calibrate --layer-times``) times, on the cluster's
own devices, the forward and backward of one transformer layer per (device type, TP degree,
micro-batch size), with its TP collectives inside, and the embedding and the LM head + loss
separately, and writes them here. The cost model (:mod:`lightning_hexiscale.planner.cost.compute`) uses
a table where it covers a case and prices FLOPs / efficiency (or the roofline) otherwise.

YAML (one entry per device type, model shape and precision)::

    layer_times:
      - gpu: A800                          # a machines[].gpu of this cluster
        precision: bf16-mixed              # the Lightning precision it was measured in
        model: {name: llama2_7b, hidden_size: 4096, ffn_hidden_size: 11008, num_heads: 32,
                num_kv_heads: 32, seq_len: 4096, vocab_size: 32000}
        rows:                              # times per micro-batch, with units
          - {part: layer, tp: 2, micro_batch: 1, forward: "21.3 ms", backward: "44.0 ms",
             backward_recompute: "65.1 ms"}
          - {part: head, tp: 2, micro_batch: 1, forward: "9.1 ms", backward: "17.8 ms"}
          - {part: embedding, tp: 2, micro_batch: 1, forward: "0.4 ms", backward: "2.1 ms"}

Fields: ``part`` is ``layer`` (one transformer block), ``embedding`` (the first stage's
vocabulary-parallel embedding) or ``head`` (the last stage's final norm, LM head and loss); ``tp``
the TP degree of the stage (the TP group sits inside one machine); ``micro_batch`` sequences of
``seq_len`` tokens; ``forward`` / ``backward`` seconds of one micro-batch on the slowest rank of
the TP group, TP collectives included; ``backward_recompute`` (layers only, optional) the backward
with activation recomputation (the re-run forward included). A table applies to a model of the
same shape (the fields above) trained in the same precision. This module is pure data: no torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from lightning_hexiscale.config.units import parse_time
from lightning_hexiscale.errors import ConfigError

PARTS = ("layer", "embedding", "head")


# ---- Hydra schema (the cluster YAML's layer_times entries) ---------------------------------------
@dataclass
class LayerTimeRowConfig:
    """One measured case: a part of the model at one TP degree and micro-batch size."""

    tp: int = MISSING
    """TP degree of the stage (1 = one device)."""
    micro_batch: int = MISSING
    """Sequences per micro-batch."""
    forward: str = MISSING
    """Forward time of one micro-batch, e.g. "21.3 ms" (the TP group's slowest rank, collectives included)."""
    backward: str = MISSING
    """Backward time of one micro-batch without recomputation, e.g. "44 ms"."""
    backward_recompute: Optional[str] = None
    """Backward with activation recomputation (layers only); null: priced as backward + forward."""
    part: str = "layer"
    """``layer``, ``embedding`` or ``head`` (final norm + LM head + loss)."""


@dataclass
class LayerTableShapeConfig:
    """The model shape a table was measured on (what layer times depend on)."""

    name: str = ""
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    seq_len: int = MISSING
    vocab_size: int = MISSING


@dataclass
class LayerTableConfig:
    """Measured times of one device type for one model shape and precision."""

    gpu: str = MISSING
    """Device type (a ``machines[].gpu`` of the cluster)."""
    precision: str = MISSING
    """Lightning precision measured in (``bf16-mixed``, ``32-true``, ...)."""
    model: LayerTableShapeConfig = MISSING
    rows: List[LayerTimeRowConfig] = field(default_factory=list)
    note: str = ""
    """How it was measured (written by the profiler)."""


# ---- parsed, typed table -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The fields of a model that layer times depend on."""

    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    seq_len: int
    vocab_size: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of a ``LlamaConfig`` (or of anything with the same attributes)."""
        return cls(*(int(getattr(model, f)) for f in cls.__dataclass_fields__))


@dataclass(frozen=True)
class LayerTimeRow:
    part: str
    tp: int
    micro_batch: int
    forward_s: float
    backward_s: float
    backward_recompute_s: float | None = None

    def backward_with(self, recompute: bool) -> float:
        """Backward seconds; with recomputation the measured value, else backward + forward (the
        re-run forward; it re-runs half the forward's TP all-reduces, so this is an upper bound)."""
        if not recompute:
            return self.backward_s
        return self.backward_recompute_s if self.backward_recompute_s is not None else self.backward_s + self.forward_s


@dataclass(frozen=True)
class LayerTable:
    """One ``layer_times`` entry, parsed: times in seconds per micro-batch."""

    gpu: str
    precision: str
    shape: ModelShape
    rows: tuple[LayerTimeRow, ...]
    model_name: str = ""
    note: str = ""

    def points(self, part: str, tp: int) -> list[LayerTimeRow]:
        """The rows of ``part`` at TP ``tp``, by micro-batch size."""
        return sorted((r for r in self.rows if r.part == part and r.tp == tp), key=lambda r: r.micro_batch)

    def times(self, part: str, tp: int, micro_batch: int, recompute: bool = False) -> tuple[float, float] | None:
        """(forward, backward) seconds of ``part`` at TP ``tp`` for a micro-batch of ``micro_batch``
        sequences (:func:`interpolate`), None when the table has no row of that part and TP degree."""
        pts = self.points(part, tp)
        if not pts:
            return None
        mbs = [r.micro_batch for r in pts]
        return (interpolate(mbs, [r.forward_s for r in pts], micro_batch),
                interpolate(mbs, [r.backward_with(recompute) for r in pts], micro_batch))

    def to_config(self) -> dict[str, Any]:
        """The YAML entry (``LayerTableConfig`` fields; times with units)."""
        def t(x: float) -> str:
            return f"{x * 1e3:.6g} ms"

        rows = []
        for r in self.rows:
            row = {"part": r.part, "tp": r.tp, "micro_batch": r.micro_batch, "forward": t(r.forward_s),
                   "backward": t(r.backward_s)}
            if r.backward_recompute_s is not None:
                row["backward_recompute"] = t(r.backward_recompute_s)
            rows.append(row)
        return {"gpu": self.gpu, "precision": self.precision,
                "model": {"name": self.model_name, **{k: getattr(self.shape, k) for k in ModelShape.__dataclass_fields__}},
                "rows": rows, **({"note": self.note} if self.note else {})}


def interpolate(micro_batches: list[int], values: list[float], micro_batch: int) -> float:
    """A time at ``micro_batch`` from times measured at the sorted sizes ``micro_batches``:

    - between two measured sizes m_a < m < m_b: linear, v_a + (v_b - v_a) * (m - m_a) / (m_b - m_a);
    - at a measured size: its value;
    - outside the measured range (the only extrapolation): the per-sequence time of the nearest
      measured size, v(m) = v_near * m / m_near. Above the largest size this is an upper bound
      (per-sequence time falls as micro-batches grow); below the smallest, a mild under-estimate.
    """
    if micro_batch <= micro_batches[0]:
        return values[0] * micro_batch / micro_batches[0]
    if micro_batch >= micro_batches[-1]:
        return values[-1] * micro_batch / micro_batches[-1]
    for (ma, va), (mb, vb) in zip(zip(micro_batches, values), zip(micro_batches[1:], values[1:])):
        if ma <= micro_batch <= mb:
            return va + (vb - va) * (micro_batch - ma) / (mb - ma)
    raise AssertionError("unreachable: micro_batches must be sorted")


def parse_layer_tables(entries: list | None, gpu_types: set[str], key: str = "cluster.layer_times") -> tuple[LayerTable, ...]:
    """Parse and check the ``layer_times`` entries of a cluster (plain containers). Errors name the
    entry and field: an unknown device type, precision or part, a TP degree the shape's heads do
    not allow, a non-positive size or time, a duplicated row."""
    from lightning_hexiscale.config.recipe import PRECISION_DTYPES

    tables, first = [], {}
    for i, e in enumerate(entries or []):
        k = f"{key}[{i}]"
        gpu = e["gpu"]
        if gpu not in gpu_types:
            raise ConfigError(f"{k}.gpu", gpu, f"no machine of the cluster has this device type "
                              f"(its types: {', '.join(sorted(gpu_types))})",
                              "use the gpu name of the machines it was measured on, or remove the entry")
        if e["precision"] not in PRECISION_DTYPES:
            raise ConfigError(f"{k}.precision", e["precision"], f"must be one of {', '.join(PRECISION_DTYPES)}",
                              "write the trainer.precision the table was measured in")
        m = e["model"]
        shape = ModelShape.of(_Attrs(m))
        for f in ModelShape.__dataclass_fields__:
            if getattr(shape, f) < 1:
                raise ConfigError(f"{k}.model.{f}", getattr(shape, f), "must be a positive whole number",
                                  "copy the model's shape from its preset")
        same = first.setdefault((gpu, str(e["precision"]), shape), i)
        if same != i:  # the planner prices from the first table that matches: this one's rows were never read
            raise ConfigError(k, f"gpu {gpu}, {e['precision']}, {m.get('name') or 'model'} ({shape_text(shape)})",
                              f"{key}[{same}] is a table of the same device type, precision and model shape: "
                              "one table per case", f"merge the two tables' rows into {key}[{same}] and remove this one")
        rows, seen = [], set()
        for j, r in enumerate(e.get("rows") or []):
            rk = f"{k}.rows[{j}]"
            row = _row(r, rk, shape, m.get("name") or "the model")
            ident = (row.part, row.tp, row.micro_batch)
            if ident in seen:
                raise ConfigError(rk, f"{row.part} tp {row.tp} micro_batch {row.micro_batch}",
                                  "a case may appear once per table", "remove the duplicate row")
            seen.add(ident)
            rows.append(row)
        tables.append(LayerTable(gpu, str(e["precision"]), shape, tuple(rows), m.get("name") or "", e.get("note") or ""))
    return tuple(tables)


class _Attrs:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def _row(r: dict, key: str, shape: ModelShape, model_name: str) -> LayerTimeRow:
    part = "layer" if r.get("part") is None else r["part"]  # part: "" was read as a layer row
    if part not in PARTS:
        raise ConfigError(f"{key}.part", part, f"must be one of {', '.join(PARTS)}", "use layer, embedding or head")
    tp = r["tp"]
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= shape.num_kv_heads:
        raise ConfigError(f"{key}.tp", tp,
                          f"a TP group needs at least one key/value head per rank; {model_name} has "
                          f"{shape.num_kv_heads} KV heads, so TP must be between 1 and {shape.num_kv_heads}",
                          f"remove the row, or measure TP degrees from 1 to {shape.num_kv_heads}")
    mb = r["micro_batch"]
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ConfigError(f"{key}.micro_batch", mb, "must be a whole number of sequences >= 1", "e.g. micro_batch: 1")
    times = {}
    for f in ("forward", "backward", "backward_recompute"):
        if r.get(f) is None:
            continue
        v = parse_time(r[f], f"{key}.{f}")
        if not v > 0:
            raise ConfigError(f"{key}.{f}", r[f], "a measured time must be greater than zero", "e.g. \"12.5 ms\"")
        times[f] = v
    if "backward_recompute" in times and part != "layer":
        raise ConfigError(f"{key}.backward_recompute", r["backward_recompute"], "only layers are recomputed",
                          "remove it from the embedding / head row")
    return LayerTimeRow(part, tp, mb, times["forward"], times["backward"], times.get("backward_recompute"))


# ---- a table that does not match the run (planner/cost/sources.py states the rules) ----------------
class TableMismatchWarning(UserWarning):
    """A layer table does not match the run and ``planner.allow_table_mismatch`` lets it be priced otherwise."""

    cli_notice = True
    """``hexiscale`` prints it as one line (``cli/main.py``)."""


def precision_name(workload: Any) -> str:
    """The Lightning precision of a ``Workload``'s dtypes (bf16 compute over fp32 parameters: bf16-mixed)."""
    if workload.mixed:
        return f"{'bf16' if workload.dtype == 'bf16' else '16'}-mixed"
    return {"fp32": "32-true", "fp64": "64-true", "bf16": "bf16-true", "fp16": "16-true"}[workload.dtype]


def shape_text(shape: ModelShape) -> str:
    return (f"hidden {shape.hidden_size}, ffn {shape.ffn_hidden_size}, heads {shape.num_heads}/{shape.num_kv_heads} KV, "
            f"seq {shape.seq_len}, vocab {shape.vocab_size}")


def mismatch_rule(tables: list[LayerTable], workload: Any) -> str:
    """Why none of a type's ``tables`` applies to ``workload`` (a ``Workload``): each table's model
    and precision, and the fields that differ from the run's."""
    want = ModelShape.of(workload.model)
    parts = []
    for t in tables:
        diff = [f"{f} {getattr(t.shape, f)} vs {getattr(want, f)}" for f in ModelShape.__dataclass_fields__
                if getattr(t.shape, f) != getattr(want, f)]
        if t.precision != precision_name(workload):
            diff.append(f"precision {t.precision} vs {precision_name(workload)}")
        parts.append(f"{t.model_name or 'a model'} in {t.precision} ({'; '.join(diff) or 'dtypes differ'})")
    return (f"its layer tables were measured on {', '.join(parts)}; the run trains {workload.model.name} "
            f"({shape_text(want)}) in {precision_name(workload)}, so no table prices it")


def refuse_or_warn(key: str, value: str, rule: str, fix: str, allow: bool, instead: str) -> None:
    """Raise the ConfigError; or, when ``allow`` (``planner.allow_table_mismatch``), warn once per
    message that ``instead`` prices it."""
    if not allow:
        raise ConfigError(key, value, rule, fix + "; or set planner.allow_table_mismatch=true (hexiscale "
                          "--allow-table-mismatch) to price it from FLOP/s with a warning")
    msg = f"{value}: {rule}; priced from {instead} instead (planner.allow_table_mismatch)"
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, TableMismatchWarning, stacklevel=4)


_WARNED: set[str] = set()
