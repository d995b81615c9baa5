"""Lightning's notices that do not apply to a hexiscale run, silenced precisely (one message each).

A normal run should print nothing it does not mean. Two notices come from inside Lightning 2.6
whatever the caller does, so they are filtered here by their exact text and origin:

- the ``💡 Tip: ... litlogger`` line Lightning prints at every ``Trainer(...)`` whose loggers
  include no LitLogger (an advertisement for a cloud service, logged through ``rank_zero_info``);
- torch 2.13's ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated``, raised inside
  ``lightning/pytorch/utilities/_pytree.py``: Lightning's CombinedLoader flattens every DataLoader
  it is given with ``LeafSpec()``, so no way of passing loaders avoids it; only Lightning can.

Everything else still shows. :func:`install` is idempotent; the strategy calls it when built and
again when each rank sets up (see there).
"""

from __future__ import annotations

import logging
import warnings

LITLOGGER_TIP = "💡 Tip: For seamless cloud"
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LITLOGGER_TIP)


def install() -> None:
    """Add both filters; idempotent. The warning filter is added again at every call (the warnings
    module moves an equal filter to the front rather than adding a second): a caller's
    ``warnings.catch_warnings()`` block restores the filters it found, so a filter first added inside
    one (``hexiscale train`` builds the strategy in such a block) was gone after it, and the
    deprecation came back; the strategy calls this again in :meth:`setup_environment` for that reason.
    The logging filter is added once per logger (loggers keep theirs)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTip) for f in logger.filters):
            logger.addFilter(_DropTip())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
