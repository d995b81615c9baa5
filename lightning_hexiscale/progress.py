"""Progress on long work, where it goes: a bar on a terminal (tqdm, drawn by the callers), and where
no bar can be drawn (a pipe, a log file, CI) plain lines, few of them.

- :func:`is_terminal`: the one "is this stream a terminal" check of the package (a replaced or
  closed stream is no terminal, never an exception).
- :func:`bar_wanted`: a terminal, or a Jupyter kernel's stream (no terminal, but it draws tqdm's
  widget; tqdm's own ``disable=None`` would hide the bar there).
- :func:`shown_as`: which of the two a piece of work shows ("bar", "lines" or None).
- :class:`Heartbeat`: plain lines at most one per ``every_s`` seconds. Into a pipe a tqdm bar is one
  line of carriage returns per run (``hexiscale plan`` runs up to two searches per device subset,
  up to 60 of them), and nothing at all left a 50 s plan of 32 GPUs silent: a heartbeat says the
  work goes on, and how far it is, without a line per step.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is a terminal (False for None, a replaced stream without ``isatty``, or a
    closed one)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def bar_wanted(stream: TextIO | None) -> bool:
    """Whether a progress bar drawn on ``stream`` is seen as a bar: a terminal or a Jupyter kernel."""
    return is_terminal(stream) or "ipykernel" in sys.modules


def shown_as(wanted: bool, stream: TextIO | None) -> str | None:
    """How long work shows its progress on ``stream``: ``"bar"`` where a bar is seen
    (:func:`bar_wanted`), ``"lines"`` elsewhere (a :class:`Heartbeat`'s plain lines), None when not
    ``wanted`` (``--no-progress``, ``planner.progress=false``)."""
    if not wanted:
        return None
    return "bar" if bar_wanted(stream) else "lines"


class Heartbeat:
    """Plain progress lines, at most one per ``every_s`` seconds: the first ``every_s`` after the first
    :meth:`beat`, then ``every_s`` after the previous line. ``clock`` and ``write`` are for tests
    (default: ``time.monotonic`` and a flushed line on stderr)."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str], None] | None = None):
        if not every_s > 0:
            raise ValueError(f"every_s = {every_s!r}: must be a positive number of seconds")
        self.every_s, self.clock = every_s, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.last: float | None = None

    def restart(self) -> None:
        """Count the next ``every_s`` from the next :meth:`beat` (a new piece of work in the same process)."""
        self.last = None

    def beat(self, line: Callable[[], str]) -> bool:
        """Write ``line()`` when ``every_s`` has passed since the previous line (or the first beat);
        ``line`` is called only then (a line may cost a formatting). Returns whether it wrote."""
        now = self.clock()
        if self.last is None:
            self.last = now
            return False
        if now - self.last < self.every_s:
            return False
        self.write(line())
        self.last = now
        return True

    def write_now(self, line: str) -> None:
        """Write ``line`` at once (one that must be seen: a new phase, the end of the work) and count
        the next ``every_s`` from it."""
        self.write(line)
        self.last = self.clock()
