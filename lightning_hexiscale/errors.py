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


SHORT_REPR = 60
"""Characters of a value's repr up to which an error shows the value itself (else its type's name)."""


def shown(value: object) -> object:
    """The value an error shows: itself when it is a str, a number or None, or a list, tuple, dict or
    set whose repr is short (``[1, 2]``, ``{}``); else its type's name. Not any object with a short
    repr: the error keeps the value, and it travels between ranks pickled (a lambda would not), and an
    object's repr can run to pages (a tensor)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if type(value) in (list, tuple, dict, set, frozenset):
        try:
            if len(repr(value)) <= SHORT_REPR:
                return value
        except Exception:  # an element's broken __repr__ must not hide the error being raised
            pass
    return type(value).__name__


def check_argument_types(call: str, arguments, error: type[ConfigError] = ConfigError) -> None:
    """Each ``(name, value, kind, fix)`` of ``arguments``: ``value`` is an instance of ``kind`` (a type,
    or a tuple of types where ``type(None)`` allows None), else ``error`` keyed ``call(name)``, e.g.
    ``search(cluster) = 'cpu_hetero4': is of type str; it must be a Cluster. Fix: ...`` (the API's
    entry points ran into an AttributeError deep inside instead)."""
    for name, value, kind, fix in arguments:
        if not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            wanted = " or ".join([k.__name__ for k in kinds if k is not type(None)] + ["None"] * (type(None) in kinds))
            article = "an" if wanted[0] in "AEIOU" else "a"
            raise error(f"{call}({name})", shown(value), f"is of type {type(value).__name__}; it must be {article} {wanted}",
                        fix)
