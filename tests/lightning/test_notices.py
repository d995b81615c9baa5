"""The filters of :mod:`lightning_hexiscale.lightning.notices` hold after a caller's
``warnings.catch_warnings()`` block: ``hexiscale train`` builds the strategy inside one, and the filter
its constructor added was dropped with the block, so torch's LeafSpec deprecation (raised inside
Lightning) reached every run's stderr again."""

from __future__ import annotations

import logging
import warnings

from lightning_hexiscale.lightning import notices

LEAFSPEC = ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
            "treespec.is_leaf()` instead.")


def _shown() -> int:
    """How many times the deprecation, raised from Lightning's ``_pytree`` module, gets through the
    filters in force (a fresh registry: not hidden as already shown)."""
    with warnings.catch_warnings(record=True) as seen:  # keeps the filters; records what gets through
        warnings.warn_explicit(LEAFSPEC, FutureWarning, "_pytree.py", 21,
                               module="lightning.pytorch.utilities._pytree", registry={})
    return len(seen)


def test_the_filter_holds_after_a_callers_catch_warnings_block():
    with warnings.catch_warnings():  # the test's own: every filter back as it was after it
        warnings.resetwarnings()
        assert _shown() == 1  # the check can fail: with no filter the deprecation shows
        with warnings.catch_warnings():  # as hexiscale train's fit() builds the strategy
            notices.install()
            assert _shown() == 0
        notices.install()  # as each rank's setup_environment does: it was a no-op (a flag said installed)
        assert _shown() == 0
        other = ("`isinstance(treespec, LeafSpec)` is deprecated, somewhere else")
        with warnings.catch_warnings(record=True) as seen:  # only Lightning's _pytree is silenced
            warnings.warn_explicit(other, FutureWarning, "mine.py", 1, module="my_project.trees", registry={})
        assert len(seen) == 1


def test_install_twice_adds_each_filter_once():
    with warnings.catch_warnings():
        notices.install()
        notices.install()
        leafspec = [f for f in warnings.filters if f[1] is not None and "LeafSpec" in f[1].pattern]
        assert len(leafspec) == 1
    for name in notices._LOGGERS:
        assert sum(isinstance(f, notices._DropTip) for f in logging.getLogger(name).filters) == 1
