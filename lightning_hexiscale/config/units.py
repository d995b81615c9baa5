"""Parsing of quantities with units: bandwidth, bytes, time, FLOP/s.

Internally everything is SI base units: bytes, seconds, bytes/s, FLOP/s.
Decimal prefixes are powers of 10 (1 GB = 1e9 B), binary prefixes powers of 2 (1 GiB = 2**30 B);
``bps`` is bits per second (1 Gbps = 1e9 / 8 bytes/s). A bare number is rejected: the unit must be
written, so that "200" never silently means 200 bytes/s when GB/s was meant.
"""

from __future__ import annotations

import math
import re

from lightning_hexiscale.errors import ConfigError

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN_PREFIX = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}  # µ: the micro sign, μ: Greek mu


def _split(key: str, text: object, kind: str, example: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ConfigError(key, text, f"expected a {kind} written with its unit", f'write e.g. "{example}"')
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"\s*(.*)", s)
    if not m:
        if re.fullmatch(r"-\s*" + _NUM + r".*", s):  # "-5 Gbps": say what is wrong, not just "not a bandwidth"
            rule = "must not be negative" if kind == "time" else "must be greater than zero"  # a latency may be 0
            raise ConfigError(key, text, f"a {kind} {rule}", f'write e.g. "{example}"')
        raise ConfigError(key, text, f"not a {kind}", f'write e.g. "{example}"')
    value, unit = float(m.group(1)), m.group(2).strip()
    sep = re.match(r"[,_'](\d+)\s*(.*)", unit)
    if sep and len(sep.group(1)) != 3 and unit[0] == ",":  # "1,5 GB/s": a decimal comma
        raise ConfigError(key, text, f"a {kind} is written with a decimal point, not a comma",
                          f'write e.g. "{m.group(1)}.{sep.group(1)} {sep.group(2)}"')
    if sep:  # "1,000 MB/s" was read as 1 with the unit ",000 MB/s"
        number, rest = re.fullmatch(r"([\d.,_'\s]*\d)\s*(.*)", s).groups()
        plain = re.sub(r"[,_'\s]", "", number)
        raise ConfigError(key, text, f"a {kind} is written without thousands separators", f'write e.g. "{plain} {rest}"')
    if not math.isfinite(value):  # "1e400 GB/s" reads as inf: the planner would divide by it or by zero
        raise ConfigError(key, text, f"a {kind} must be a finite number ({m.group(1)} overflows a float)",
                          f'write e.g. "{example}"')
    if not unit:
        raise ConfigError(key, text, f"a {kind} needs a unit; a bare number is ambiguous", f'write e.g. "{example}"')
    return value, unit


def _prefixed(unit: str, base: str) -> float | None:
    """Multiplier of ``unit`` = <prefix><base>, decimal or binary prefix; None if it does not match."""
    if not unit.endswith(base):
        return None
    p = unit[: len(unit) - len(base)]
    if p in _PREFIX:
        return _PREFIX[p]
    if p in _BIN_PREFIX:
        return _BIN_PREFIX[p]
    return None


def parse_bytes(text: object, key: str = "memory", example: str = "80 GiB") -> float:
    """'80GB' -> 8e10, '24 GiB' -> 24 * 2**30, '512MiB' -> 512 * 2**20. Returns bytes. ``example``: the
    size the fix suggests (a GPU's memory by default; a chunk or a shard is far smaller)."""
    value, unit = _split(key, text, "size", example)
    mult = _prefixed(unit, "B")
    if mult is None or unit.endswith("bps"):
        raise ConfigError(key, text, f"unknown size unit {unit!r}", "use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    return _positive(key, text, value * mult, example)


def parse_bandwidth(text: object, key: str = "bandwidth") -> float:
    """'200 GB/s' -> 2e11, '1 GiB/s' -> 2**30, '5.6 Gbps' -> 7e8 (bits / 8). Returns bytes/s."""
    value, unit = _split(key, text, "bandwidth", "200 GB/s")
    if unit.endswith("/s"):
        mult = _prefixed(unit[:-2], "B")
        if mult is not None:
            return _positive(key, text, value * mult, "200 GB/s")
    if unit.endswith("bps") or unit.endswith("bit/s") or unit.endswith("b/s"):
        stem = unit[: -3] if unit.endswith("bps") else unit[: unit.index("b")]
        if stem in _PREFIX:
            return _positive(key, text, value * _PREFIX[stem] / 8.0, "200 GB/s")
    raise ConfigError(key, text, f"unknown bandwidth unit {unit!r}", "use e.g. GB/s, GiB/s, MB/s or Gbps (bits)")


def parse_time(text: object, key: str = "latency") -> float:
    """'10us' -> 1e-5, '0.5 ms' -> 5e-4, '2s' -> 2.0. Returns seconds (zero allowed)."""
    value, unit = _split(key, text, "time", "10us")
    if unit not in _TIME:
        raise ConfigError(key, text, f"unknown time unit {unit!r}", "use s, ms, us or ns")
    return value * _TIME[unit]


def parse_flops(text: object, key: str = "flops") -> float:
    """'312 TFLOPS' -> 3.12e14, '71 TFLOP/s' -> 7.1e13. Returns FLOP/s."""
    value, unit = _split(key, text, "compute rate", "312 TFLOPS")
    for base in ("FLOPS", "FLOP/s", "flops", "flop/s"):
        if unit.endswith(base):
            p = unit[: len(unit) - len(base)]
            if p in _PREFIX:
                return _positive(key, text, value * _PREFIX[p], "312 TFLOPS")
    raise ConfigError(key, text, f"unknown compute unit {unit!r}", "use e.g. TFLOPS or GFLOPS")


def _positive(key: str, text: object, value: float, example: str) -> float:
    if not value > 0:
        raise ConfigError(key, text, "must be greater than zero", "give a positive value")
    if value == math.inf:  # "1e300 TFLOPS": the number is finite, times its unit's 1e12 it is not
        raise ConfigError(key, text, "must be a finite quantity (times its unit it overflows a float)",
                          f'write e.g. "{example}"')
    return value


def format_bytes(n: float) -> str:
    """Human-readable binary size: 3.2 GiB."""
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(t: float, sep: str = " ", like: float | None = None) -> str:
    """A duration as the planner's reports print it: three decimals of a second ("7.341 s",
    "0.027 s") while that shows the value, and a nonzero time under half a millisecond, which three
    decimals would print as "0.000 s" (a tiny model on big GPUs), in us or ns with three significant
    digits ("406 us"). Zero stays "0.000 s"; ``sep`` goes between number and unit ("0.236s" in the
    stage table). ``like``: take the unit this value would get (a table's largest time, so that one
    column shows one unit)."""
    ref = abs(t if like is None else like)
    if ref == 0 or not math.isfinite(ref) or ref >= 5e-4:
        return f"{t:.3f}{sep}s"
    if ref >= 5e-7:
        return f"{t * 1e6:.3g}{sep}us"
    return f"{t * 1e9:.3g}{sep}ns"


def format_bandwidth(bps: float) -> str:
    """Human-readable decimal bandwidth: 200 GB/s."""
    for unit, mult in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= mult:
            return f"{bps / mult:.3g} {unit}"
    return f"{bps:.3g} B/s"


def format_flops(flops_per_s: float) -> str:
    """Human-readable compute rate in the largest unit that keeps a digit before the point:
    2.46 PFLOPS on a GPU cluster, 367 GFLOPS on emulated CPU devices (never "0.000 PFLOPS")."""
    for unit, mult in (("PFLOPS", 1e15), ("TFLOPS", 1e12), ("GFLOPS", 1e9), ("MFLOPS", 1e6)):
        if flops_per_s >= mult:
            return f"{flops_per_s / mult:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOPS"
