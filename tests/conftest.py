"""Suite-wide: every test's pytest timeout (its ``@pytest.mark.timeout``, else the ``--timeout`` or
pyproject.toml's ``timeout``) is multiplied by the host's load when the test starts
(``slow_host.py``), so a test that legitimately takes longer on a loaded host is not cut off, and a
hang still fails."""

from __future__ import annotations

import gc
import os

import pytest

from slow_host import slowdown


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    kwargs = dict(marker.kwargs) if marker is not None else {}
    base = kwargs.pop("timeout", None)
    if marker is not None and marker.args:
        base = marker.args[0]
    if base is None:
        base = getattr(item.config, "_env_timeout", None)  # pytest-timeout's --timeout / ini value
    factor = slowdown()
    if base and float(base) > 0 and factor > 1:
        # Prepended: pytest-timeout reads the closest marker after this hook.
        item.add_marker(pytest.mark.timeout(float(base) * factor, **kwargs), append=False)
    yield


def pytest_collection_finish(session):
    """Every fork collects the parent's garbage first (``runtime.host.collect_before_fork``), and a
    full collection of this process walks every object the imports and the collection made (about
    0.4 s for torch + Lightning + the test modules, at each of the suite's ~150 forks). Those live
    for the whole session: freeze them, so that a collection walks only what the tests made since."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _own_discovery_cache(tmp_path_factory):
    """Every test run discovers into a cache folder of its own (``$HEXISCALE_CACHE_DIR``, inherited by
    the ranks and commands the tests start), never the user's ``~/.cache/lightning_hexiscale``: a
    test then sees the same cache whatever ran on this host before (CI starts with none), and the
    user's cache keeps only what the user discovered. Under ``make test``'s workers (pytest-xdist)
    the base temporary folder, and so this cache, is per worker. Tests that test the cache folder
    set or delete the variable themselves (monkeypatch restores this one)."""
    old = os.environ.get("HEXISCALE_CACHE_DIR")
    os.environ["HEXISCALE_CACHE_DIR"] = str(tmp_path_factory.mktemp("discovery-cache", numbered=False))
    yield
    if old is None:
        os.environ.pop("HEXISCALE_CACHE_DIR", None)
    else:
        os.environ["HEXISCALE_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _fast_lane_guard(request):
    """Under ``make test-fast``: an unmarked test that starts a process fails (``fast_lane.py``)."""
    import fast_lane

    if not fast_lane.active() or request.node.get_closest_marker("slow") is not None:
        yield
        return
    with fast_lane.no_processes(request.node.nodeid):
        yield


@pytest.fixture
def searches(monkeypatch) -> list:
    """One entry per call of the planner's ``search`` (as ``hexiscale plan`` calls it) during the test:
    "refused before the search" is ``not searches``. The absence of the search's bar said it before,
    but the bar is drawn on a terminal only, and never with ``planner.iterations=1``."""
    import lightning_hexiscale.planner as planner

    calls, real = [], planner.search

    def counted(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "search", counted)
    return calls


@pytest.fixture
def no_measuring(monkeypatch):
    """Every measurement that profile, discover and calibrate start fails the test: for refusals that
    must come before minutes of measuring."""
    from lightning_hexiscale.cli import discover, profile
    from lightning_hexiscale.profiling import calibrate

    def measured(*a, **k):
        raise AssertionError("measured before the command line was checked")

    monkeypatch.setattr(profile, "run_profile", measured)
    monkeypatch.setattr(discover, "run_discover", measured)
    monkeypatch.setattr(calibrate, "calibrate", measured)
