"""Typed errors. Every message names the config key, the bad value, the rule and the fix.

The CLI and recipes catch :class:`HexiScaleError` and print its message without a traceback;
the Python API lets it propagate so callers can catch it by type.
"""

from __future__ import annotations


class HexiScaleError(Exception):
    """Base class for every error this package raises on bad input."""


class ConfigError(HexiScaleError, ValueError):
    """A configuration value breaks a rule.

    Built from its parts so that every message has the same shape:
    ``<key> = <value>: <rule>. Fix: <fix>``.
    """

    def __init__(self, key: str, value: object, rule: str, fix: str | None = None):
        self.key, self.value, self.rule, self.fix = key, value, rule, fix
        msg = f"{key} = {value!r}: {rule}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)

    def __reduce__(self):
        # Rebuilt from its parts (the default would call __init__ with the message alone): the error
        # of one rank travels to the others and to the launching process (lightning/launch/guard.py).
        return (type(self), (self.key, self.value, self.rule, self.fix), self.__dict__)


class PlanError(ConfigError):
    """A plan is inconsistent with itself, the cluster or the model."""


class InfeasiblePlan(HexiScaleError):
    """No plan fits: the message says what is missing (e.g. memory needed vs available)."""


class TrainingFailure(HexiScaleError):
    """A running job stopped: every rank raises it (or exits) together, the message says why and
    where. Not a configuration error: `hexiscale train` exits with status 4 for it."""


class NonFiniteError(TrainingFailure):
    """A non-finite loss or gradient, with ``nonfinite='stop'``: the message names the step and the ranks."""


class RankFailure(TrainingFailure):
    """Another rank failed or stopped responding: the message names it when it can be known."""


class ElasticStop(TrainingFailure):
    """Elastic training: the workers stopped on SIGTERM after saving a checkpoint, and torchrun restarts
    them. A planned stop (a machine joins, or the agent is told to stop), agreed by every rank: not a
    failure of any rank (`hexiscale train` exits with status 5 for it)."""


class TrainingInterrupted(HexiScaleError):
    """Ctrl-C (SIGINT) or SIGTERM stopped training at the end of a step, on every rank together (the
    message says at which step and where the last checkpoint is). ``signal_name`` says which:
    `hexiscale train` exits with status 130 for SIGINT, 143 for SIGTERM (128 + the signal number)."""

    def __init__(self, message: str, signal_name: str = "SIGINT"):
        super().__init__(message)
        self.signal_name = signal_name
