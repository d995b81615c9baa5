"""When one rank fails, every rank stops within a bounded time and says which rank it was.

Two mechanisms, because each covers what the other cannot:

- **The process group timeout** (``init_process_group(timeout=...)``, the strategy's ``timeout``):
  a gloo/NCCL collective or p2p wait that does not complete in time raises on the waiting rank.
  It bounds every wait, but the error names no rank ("Timed out waiting 20000ms for recv"), and a
  rank that is healthy but blocked elsewhere (e.g. on a peer that is itself handling an exception)
  waits the full timeout.
- **This watch**, a daemon thread per rank that talks to the rendezvous store the process group
  was built on (the TCPStore every launcher already creates; no new port, no new service):
  it beats a per-rank heartbeat counter every ``interval_s``; a rank that catches an exception
  reports it (``failed/<rank>`` + a failure counter); every watch polls the counter, and once a
  failure is known it gives its own process ``grace_s`` to stop by itself, then prints the reason
  and ``os._exit(exit_code)``. A killed rank (SIGKILL, ``os._exit``, OOM killer) reports nothing,
  but its heartbeat stops: :meth:`FailureWatch.explain` names the ranks whose heartbeat did not
  move and the first rank that reported an exception.

Store traffic is O(1) per rank per interval (one add for the heartbeat, one for the counter); the
O(world) scan runs only in :meth:`explain`, after a failure. If the store itself is gone (its
host, global rank 0, died), the watch says so and exits after ``grace_s`` unless stopped first, so
the normal end of a job, where rank 0 may leave a moment earlier, is not mistaken for a failure.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

from lightning_hexiscale.torch_compat import store_clone

PREFIX = "hexiscale/watch"
EXIT_RANK_FAILED = 4
"""Exit status of a process the watch stops (recipes/train.py uses the same for TrainingFailure)."""


PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
                      "Socket Timeout", "Timed out waiting", "Connection refused", "NCCL communicator was aborted",
                      "ProcessGroupNCCL's watchdog")
"""What a rank's communication error says when ANOTHER rank failed (its sockets closed, it never
came, the communicator was aborted): the consequence of a failure, not its cause."""


def is_peer_failure(exc: BaseException | str) -> bool:
    """Whether an exception (or the last line of a traceback text) is a communication error caused
    by another rank (:data:`PEER_FAILURE_TEXTS`; torch's ``DistError`` family included)."""
    if isinstance(exc, BaseException):
        if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistStoreError):
            return True
        text = str(exc)
    else:
        lines = exc.strip().splitlines()
        text = lines[-1] if lines else ""
    return any(m in text for m in PEER_FAILURE_TEXTS)


def _short(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text[:300]


class FailureWatch:
    """Heartbeat, failure reports and a bounded stop for one rank (see the module doc).

    Args:
        rank / world_size: this process's global rank and the world size.
        token: a string shared by all ranks of this run (keys of earlier runs on the same store do
            not count); the strategy broadcasts rank 0's.
        interval_s: heartbeat and poll period.
        grace_s: once a failure is known, time this process has to stop by itself before the watch
            ends it (its own exception path usually gets there first).
        exit_code: status of a process the watch ends.
        store: the rendezvous store; default: the default process group's.
    """

    def __init__(self, rank: int, world_size: int, token: str, *, interval_s: float = 0.5, grace_s: float = 5.0,
                 exit_code: int = EXIT_RANK_FAILED, store=None):
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.grace_s, self.exit_code = interval_s, grace_s, exit_code
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._prefix = f"{PREFIX}/{token}"
        # The thread gets its own connection with a short timeout: a blocking store call must not
        # outlast the grace period, and the main thread's connection stays free for the collectives.
        self._store = store_clone(base)
        self._store.set_timeout(datetime.timedelta(seconds=max(1.0, 2 * interval_s)))
        self._main_store = base
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reported = False

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FailureWatch:
        self._store.add(self._key(f"hb/{self.rank}"), 1)
        self._thread = threading.Thread(target=self._run, name=f"hexiscale-watch-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Disarm (normal end of the run): the thread exits at its next tick and never ends the process."""
        self._stop.set()

    # ---- reports -----------------------------------------------------------------------------
    def report(self, exc: BaseException) -> None:
        """Tell every rank that this one failed (best effort: the store may be gone)."""
        if self.reported:
            return
        self.reported = True
        try:
            order = self._store.add(self._key("failures"), 1)
            self._store.set(self._key(f"failed/{self.rank}"), f"{order}|{_short(exc)}")
        except Exception:  # the store's host is gone; explain() says so
            pass

    def explain(self, wait_s: float | None = None) -> str:
        """Which ranks failed: those whose heartbeat stopped moving over ``wait_s`` (default three
        intervals), then the reports in the order they came; a sentence for a log or an exception."""
        wait_s = 3 * self.interval_s if wait_s is None else wait_s
        try:
            before = self._beats()
            time.sleep(wait_s)
            after = self._beats()
            reports = []
            for r in range(self.world_size):
                key = self._key(f"failed/{r}")
                if self._store.check([key]):
                    order, _, msg = self._store.get(key).decode().partition("|")
                    reports.append((int(order), r, msg))
        except Exception as e:
            return (f"the rendezvous store (hosted by global rank 0) is unreachable ({_short(e)}): rank 0 failed "
                    f"or was killed")
        # A rank whose heartbeat stopped and that reported nothing died without a word (SIGKILL,
        # os._exit, a segfault, the OOM killer, a hang): the likely origin. Ranks that reported
        # did so in order; after a death their reports are mostly the peers' broken connections.
        reports.sort()
        reporters = {r for _, r, _ in reports}
        silent = [r for r in range(self.world_size) if r != self.rank and before[r] == after[r] and r not in reporters]
        parts = []
        if silent:
            who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
            parts.append(f"{who} stopped without reporting an error (no heartbeat for {wait_s:.1f} s: killed, "
                         f"crashed or hung)")
        if any("Timed out" in msg for _, _, msg in reports):
            # Some ranks timed out waiting; a rank that is alive and has not timed out too never
            # entered that collective: it is blocked elsewhere (a hang, a deadlock, endless work).
            # Any report counts, not only the first: a peer's "connection closed" (the timed-out
            # rank dropping its sockets) can be filed a moment before the timeout itself.
            quiet = [r for r in range(self.world_size)
                     if r != self.rank and r not in reporters and r not in silent and not self._reported(r)]
            if quiet:
                who = f"rank {quiet[0]} is" if len(quiet) == 1 else f"ranks {quiet} are"
                parts.append(f"{who} alive but never joined the collective the others timed out in (hung, or "
                             f"blocked outside the collectives)")
        # A report that is a broken connection (is_peer_failure) is the consequence of a failure,
        # not its cause: the first real error leads; the broken connections are only counted, their
        # raw text (gloo's "Connection reset by peer ... GLHF") shown only when nothing else is known.
        causes = [(r, msg) for _, r, msg in reports if not is_peer_failure(msg)]
        lost = [r for _, r, msg in reports if is_peer_failure(msg)]
        if causes:
            first, msg = causes[0]
            parts.append(f"{'then' if parts else 'first'} rank {first} failed: {msg}")
            if len(causes) > 1:
                parts.append(f"then rank(s) {[r for r, _ in causes[1:]]} failed too")
        elif lost and not parts:
            _, first, msg = reports[0]
            parts.append(f"first rank {first} failed: {msg}")
            lost = lost[1:]
        if lost:
            parts.append(f"rank(s) {lost} lost their connection to it")
        if not parts:
            parts.append("no rank reported a failure and every rank is alive: a collective timed out (a rank "
                         "blocked outside the collectives, or ranks calling different collectives)")
        return "; ".join(parts)

    def _reported(self, rank: int) -> bool:
        """A report that arrived after the scan (a peer that timed out a moment later)."""
        try:
            return self._store.check([self._key(f"failed/{rank}")])
        except Exception:
            return False

    def _beats(self) -> list[int]:
        return [self._store.add(self._key(f"hb/{r}"), 0) for r in range(self.world_size)]

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        known_since: float | None = None
        store_lost_since: float | None = None
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._key(f"hb/{self.rank}"), 1)
                failures = self._store.add(self._key("failures"), 0)
                store_lost_since = None
            except Exception:
                failures = 0
                store_lost_since = store_lost_since or time.monotonic()
                if time.monotonic() - store_lost_since > self.grace_s and not self._stop.is_set():
                    self._end("the rendezvous store (hosted by global rank 0) is unreachable: rank 0 failed or "
                              "was killed")
                continue
            if failures and known_since is None:
                known_since = time.monotonic()
            if known_since is not None and time.monotonic() - known_since > self.grace_s and not self._stop.is_set():
                self._end(self.explain())

    def _end(self, why: str) -> None:
        sys.stderr.write(f"hexiscale: rank {self.rank} stops: {why}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(self.exit_code)

