"""``cluster.gpu_types.<type>``: a GPU type's figures as a cluster file gives them, and their bounds.

A type is a catalog entry (:mod:`.catalog`) with the fields the file replaces, or a new type with its
own ``flops`` and ``memory``. Rates and sizes are parsed with their units (:mod:`.units`); a figure past
what any one device has (:data:`DEVICE_LIMITS`), an efficiency past its bound or an entry no machine
names is refused with the key to fix. :class:`~lightning_hexiscale.config.cluster.Cluster` builds its
devices from these types (:func:`device_figures`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.units import parse_bandwidth, parse_bytes, parse_flops
from lightning_hexiscale.errors import ConfigError


def device_figures(gt: catalog.GpuType) -> dict[str, Any]:
    """The :class:`Device` fields a GPU type gives each of its devices beyond FLOP/s and memory."""
    return dict(efficiency=gt.efficiency, fp32_flops=gt.fp32_flops, tf32_flops=gt.tf32_flops,
                memory_bandwidth_Bps=gt.memory_bandwidth_Bps, gemm_efficiency=gt.gemm_efficiency,
                hbm_efficiency=gt.hbm_efficiency, datasheet=gt.datasheet)


def gpu_type_from_config(tname: str, t: dict) -> catalog.GpuType:
    """``cluster.gpu_types.<tname>``: a new type (``flops`` and ``memory`` required) or, when
    ``tname`` is a catalog name or alias, that type with the given fields replaced. Rates and
    bandwidths are parsed with their units; fractions must be positive (efficiencies at most 1 for
    the measured GEMM / HBM fractions)."""
    key = f"cluster.gpu_types.{tname}"
    base = catalog.lookup(tname)
    t = {k: v for k, v in t.items() if v is not None}
    for req in ("flops", "memory"):
        if base is None and req not in t:
            raise ConfigError(f"{key}.{req}", None, f"a new GPU type needs its {req} ({tname} is not in the catalog)",
                              f"add {req}: ... (e.g. flops: \"312 TFLOPS\", memory: \"80 GiB\"), or use a catalog name: "
                              f"{', '.join(catalog.known_names())}")
    fields: dict[str, Any] = {}
    if "flops" in t:
        fields["peak_flops"] = parse_flops(t["flops"], f"{key}.flops")
    if "memory" in t:
        fields["memory_bytes"] = parse_bytes(t["memory"], f"{key}.memory")
    for name, field_ in (("fp32_flops", "fp32_flops"), ("tf32_flops", "tf32_flops")):
        if name in t:
            fields[field_] = parse_flops(t[name], f"{key}.{name}")
    if "memory_bandwidth" in t:
        fields["memory_bandwidth_Bps"] = parse_bandwidth(t["memory_bandwidth"], f"{key}.memory_bandwidth")
    if "efficiency" in t:  # of the catalog's datasheet peak unless this entry declares its own flops
        fields["efficiency"] = check_efficiency(t["efficiency"], f"{key}.efficiency",
                                                datasheet_peak=base is not None and "flops" not in t)
    for name in ("gemm_efficiency", "hbm_efficiency"):
        if name in t:
            fields[name] = _fraction(t[name], f"{key}.{name}")
    if "hopper" in t:
        fields["hopper"] = bool(t["hopper"])
    _check_device_figures(fields, t, key)
    if base is None:
        return catalog.GpuType(tname, fields.pop("peak_flops"), fields.pop("memory_bytes"), **fields)
    # a listed type: its figures stay datasheet figures only where the user changed no rate
    own_rates = {"peak_flops", "fp32_flops", "tf32_flops", "memory_bandwidth_Bps"} & set(fields)
    return replace(base, name=tname, datasheet=base.datasheet and not own_rates, **fields)


DEVICE_LIMITS = {"peak_flops": ("flops", 1e18, "1 EFLOP/s", "FLOP/s", "312 TFLOPS"),
                 "fp32_flops": ("fp32_flops", 1e18, "1 EFLOP/s", "FLOP/s", "67 TFLOPS"),
                 "tf32_flops": ("tf32_flops", 1e18, "1 EFLOP/s", "FLOP/s", "495 TFLOPS"),
                 "memory_bytes": ("memory", 2.0**50, "1 PiB", "bytes", "80 GiB"),
                 "memory_bandwidth_Bps": ("memory_bandwidth", 1e15, "1 PB/s", "bytes/s", "3.35 TB/s")}
"""Field -> (its key, the most any one device has, that in words, its unit, an example): 1 EFLOP/s (a
B200 has 2.25 PFLOP/s dense 16-bit), 1 PiB of memory (GPUs have under 300 GB), 1 PB/s of memory
bandwidth (an H200 has 4.8 TB/s). Past them the figure is a typo: "1e40 TFLOPS" priced every layer at ~0 s."""


def _check_device_figures(fields: dict[str, Any], t: dict, key: str) -> None:
    for field_, (name, most, words, unit, example) in DEVICE_LIMITS.items():
        if field_ in fields and fields[field_] > most:
            raise ConfigError(f"{key}.{name}", t[name], f"must be at most {words} for one device (it is "
                              f"{fields[field_]:.3g} {unit})", f'give the device\'s figure with its unit, e.g. "{example}"')


def check_unused_types(extra: dict[str, catalog.GpuType], machines_cfg: list) -> None:
    """A ``gpu_types`` entry that no machine names changes no machine: its figures were ignored
    silently (``gpu_types.A80O`` with ``gpu: A800`` priced the catalog's A800).

    - An override of a catalog type under another of its names (``gpu_types.4090`` with
      ``gpu: RTX4090``), or an entry close to a type the machines use that has no entry of its own
      (the misspelling above): a ConfigError naming the name to use.
    - Any other unused entry (a file that lists more types than this cluster uses, e.g. one catalog
      of types shared by several cluster files): a warning naming it, since it prices nothing."""
    import warnings

    from lightning_hexiscale.config.suggest import closest

    used = [str(m["gpu"]) for m in machines_cfg]
    names = list(dict.fromkeys(used))
    for tname in extra:
        if tname in used:
            continue
        listed = catalog.lookup(tname)
        for mi, u in enumerate(used):
            theirs = catalog.lookup(u)
            if listed is not None and u not in extra and theirs is not None and theirs.name == listed.name:
                raise ConfigError(f"cluster.gpu_types.{tname}", tname, f"no machine names {tname}: the machines name this "
                                  f"GPU {u} (machines[{mi}].gpu), so they keep the catalog's figures",
                                  f"write the override as gpu_types.{u}, or name the machines gpu: {tname}")
        what = f"overrides the catalog's {listed.name}, but" if listed is not None else "is a new type, but"
        near = [n for n in closest(tname, names) if n not in extra]
        if near:
            raise ConfigError(f"cluster.gpu_types.{tname}", tname, f"gpu_types.{tname} {what} no machine names it (the "
                              f"machines name {', '.join(names)}), so its figures would be ignored",
                              f"did you mean {near[0]}? write gpu_types.{near[0]} to give the machines of gpu: "
                              f"{near[0]} these figures; or name the machines that have it gpu: {tname}, or remove "
                              "the entry")
        warnings.warn(f"cluster.gpu_types.{tname}: {what} no machine names it (the machines name {', '.join(names)}); "
                      "its figures price nothing in this cluster", UserWarning, stacklevel=3)


def positive_float(v: Any, key: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(key, v, "must be a number", "write e.g. 1.0") from None
    if not (f > 0 and np.isfinite(f)):  # .inf would make every price 0 or inf downstream
        raise ConfigError(key, v, "must be a finite number greater than zero", "use a positive value")
    return f


MAX_EFFICIENCY = 10.0
"""Largest ``gpu_types.<type>.efficiency`` of a type whose ``flops`` the file declares. The efficiency is
the sustained fraction of ``flops`` (``hexiscale calibrate``: estimated / measured compute time).
Training cannot beat a datasheet peak, so there it is at most 1; a declared ``flops`` is often a
measured rate (``hexiscale profile``'s square matmul, an emulated device's figure) that training's
matmuls can beat a little, and the calibration test allows up to 10. Beyond that ``flops`` itself is
wrong: 2**70 priced every layer at 0 s."""


def check_efficiency(v: Any, key: str, datasheet_peak: bool) -> float:
    """``efficiency`` as a float in (0, 1] of a datasheet peak (``datasheet_peak``), else in
    (0, :data:`MAX_EFFICIENCY`]; a ConfigError naming ``key`` otherwise."""
    f = positive_float(v, key)
    if datasheet_peak and f > 1.0:
        raise ConfigError(key, v, "the efficiency of a datasheet peak (the catalog's flops: no flops given here) "
                          "must be at most 1: training does not beat the datasheet",
                          "give the calibrated fraction, e.g. 0.45, or declare the rate it is a fraction of as "
                          "flops (e.g. flops: \"400 TFLOPS\")")
    if f > MAX_EFFICIENCY:
        raise ConfigError(key, v, f"the efficiency (sustained fraction of flops) must be at most {MAX_EFFICIENCY:g}; "
                          "above 1 only where flops is a measured rate that training beats",
                          "give the fraction hexiscale calibrate wrote (e.g. 0.45); if flops is far off, declare the "
                          "rate the device sustains as flops")
    return f


def _fraction(v: Any, key: str) -> float:
    f = positive_float(v, key)
    if f > 1.0:
        raise ConfigError(key, v, "a measured fraction of a datasheet peak must be at most 1",
                          "give the fraction, e.g. 0.65 for 65 %")
    return f
