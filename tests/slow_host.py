"""Time limits of the test suite on a loaded host.

A limit written for an idle host (a subprocess's ``timeout=``, a wait for ranks to start, pytest's
``@pytest.mark.timeout``) is multiplied by :func:`slowdown`: the 1-minute load average per usable
core (at least 1, at most 20), read when the test starts. On 2 cores with a load average of 20 every
runnable process gets about a tenth of a core, and the imports, start-up and training steps of a
multi-process test take about 10 times longer; a hang still ends in a failure, later.
``tests/conftest.py`` scales every test's pytest timeout this way; tests scale their own waits with
:func:`scaled`.
"""

from __future__ import annotations

from lightning_hexiscale.runtime.host import host_slowdown

CAP = 20.0
"""Most a limit is stretched: a bogus load average must not turn a hang into hours."""


def slowdown() -> float:
    return host_slowdown(cap=CAP)


def scaled(seconds: float) -> float:
    """``seconds`` (the limit on an idle host) times :func:`slowdown`."""
    return seconds * slowdown()
