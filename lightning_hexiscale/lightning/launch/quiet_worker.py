"""Quiet spawned ranks: :class:`QuietWorker`, a callback whose unpickling sets a rank's logs up.

Hydra multirun (``hexiscale train -m``) starts each job's ranks with ``spawn``: fresh interpreters
in which the launching process's log settings and warning filters do not exist, so every rank
printed Lightning's "Initializing distributed" banner and torch's ``LeafSpec`` deprecation (the
filter of :mod:`~lightning_hexiscale.lightning.notices`), a dozen lines per sweep point that a
single run does not print. The launcher pickles the Trainer with its callbacks; unpickling this one
in a rank quiets it there, before Lightning sets up the process group and logs its banner.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.callbacks import Callback

from lightning_hexiscale.lightning import notices


def quiet_lightning_logs() -> None:
    """Lightning's INFO lines (the recipe prints its own summary): no handler, no propagation."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        lg.propagate = False
        lg.handlers.clear()


class QuietWorker(Callback):
    """Does nothing in the process that builds it; a rank that unpickles it runs
    :func:`quiet_lightning_logs`, :func:`notices.install` and the launching process's ``ignore``
    warning filters first."""

    def __init__(self) -> None:
        super().__init__()
        # the launching process's warning filters (notices, the recipe's), for the ranks to apply
        self.filters = [f for f in warnings.filters if f[0] == "ignore"]

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        quiet_lightning_logs()
        notices.install()
        for action, message, category, module, lineno in reversed(self.filters):
            warnings.filterwarnings(action, message.pattern if message else "", category,
                                    module.pattern if module else "", lineno)
