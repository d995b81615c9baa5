"""Lightning's notices that do not apply to a hexiscale run, silenced precisely (one message each).

A normal run should print nothing it does not mean. Two notices come from inside Lightning 2.6
whatever the caller does, so they are filtered here by their exact text and origin:

- the ``💡 Tip: ... litlogger`` line Lightning prints at every ``Trainer(...)`` whose loggers
  include no LitLogger (an advertisement for a cloud service, logged through ``rank_zero_info``);
- torch 2.13's ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated``, raised inside
  ``lightning/pytorch/utilities/_pytree.py``: Lightning's CombinedLoader flattens every DataLoader
  it is given with ``LeafSpec()``, so no way of passing loaders avoids it; only Lightning can.

Everything else still shows. :func:`install` is idempotent; the strategy calls it when built.
"""

from __future__ import annotations

import logging
import warnings

LITLOGGER_TIP = "💡 Tip: For seamless cloud"
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LITLOGGER_TIP)


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_DropTip())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
