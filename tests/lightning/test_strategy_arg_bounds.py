"""HexiScaleStrategy's numeric arguments have upper bounds, checked at construction: num_threads=2**70
was torch's ValueError ("Overflow when unpacking long") in every rank, planner_iterations=2**70 a search
that never ends, watchdog_grace_s=1e308 an OverflowError from the watchdog's timedelta, and
recompute=0 was taken as False (0 == False) where True / False / 'auto' / None are the values."""

import pytest

from lightning_hexiscale import HexiScaleStrategy
from lightning_hexiscale.errors import ConfigError


@pytest.mark.parametrize("kwargs, key", [
    ({"num_threads": 2**70}, "HexiScaleStrategy(num_threads)"),
    ({"num_threads": 4097}, "HexiScaleStrategy(num_threads)"),
    ({"planner_iterations": 2**70}, "HexiScaleStrategy(planner_iterations)"),
    ({"watchdog_grace_s": 1e308}, "HexiScaleStrategy(watchdog_grace_s)"),
    ({"watchdog_grace_s": 2**70}, "HexiScaleStrategy(watchdog_grace_s)"),
    ({"recompute": 0}, "HexiScaleStrategy(recompute)"),
    ({"recompute": 1.0}, "HexiScaleStrategy(recompute)"),
])
def test_an_out_of_range_argument_is_refused_at_construction(kwargs, key):
    with pytest.raises(ConfigError) as e:
        HexiScaleStrategy(cluster="cpu_hetero4", **kwargs)
    assert e.value.key == key and e.value.fix, e.value


def test_the_bounds_themselves_are_accepted():
    s = HexiScaleStrategy(cluster="cpu_hetero4", num_threads=4096, planner_iterations=100_000,
                          watchdog_grace_s=86_400, recompute=False)
    assert s.settings.watchdog_grace_s == 86_400.0
