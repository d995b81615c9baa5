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
  failure is known it gives its own process ``grace_s`` (times :func:`host_slowdown`) to stop by
  itself, then prints the reason and ``os._exit(exit_code)``.

Which rank is named (:meth:`FailureWatch.explain`: the rank that raised, then a process that ended
without a word, then heartbeat silence, then a rank outside the collective), why each waits as long
as it does, and the bounds on every wait: ``docs/concepts/processes.md``, "The failure watch".
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence

import torch.distributed as dist

from lightning_hexiscale.runtime.host import host_slowdown, process_identity, process_ended
from lightning_hexiscale.torch_compat import store_clone

PREFIX = "hexiscale/watch"
EXIT_RANK_FAILED = 4
"""Exit status of a process the watch stops (``hexiscale train`` uses the same for TrainingFailure)."""


STOPPED_BY_WATCH = "stopped by its failure watch"
"""How a rank that its watch ended reports itself: a consequence of another rank's failure."""

PEER_FAILURE_TEXTS = (STOPPED_BY_WATCH, "Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
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
            ends it (its own exception path usually gets there first), times :func:`host_slowdown`
            when the failure becomes known, counted from the end of this rank's own :meth:`explain`.
        exit_code: status of a process the watch ends.
        store: the rendezvous store; default: the default process group's.
        call_timeout_s: timeout of the store calls of :meth:`report` and :meth:`explain` (default
            ``max(10, 2 * grace_s)``): long enough for a slow store on a loaded host.
        collective_timeout_s: the process group's timeout (seconds), the longest a rank that is
            only waiting in a collective or p2p call takes to report it (module doc, point 4);
            None: unknown, the wait is ``4 * settle``.
    """

    def __init__(self, rank: int, world_size: int, token: str, *, interval_s: float = 0.5, grace_s: float = 5.0,
                 exit_code: int = EXIT_RANK_FAILED, store=None, call_timeout_s: float | None = None,
                 collective_timeout_s: float | None = None):
        self.rank, self.world_size = rank, world_size
        self.collective_timeout_s = collective_timeout_s
        self.interval_s, self.grace_s, self.exit_code = interval_s, grace_s, exit_code
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._prefix = f"{PREFIX}/{token}"
        # The thread gets its own connection with a short timeout: a blocking store call must not
        # outlast the grace period, and the main thread's connection stays free for the collectives.
        self._store = store_clone(base)
        self._store.set_timeout(datetime.timedelta(seconds=max(1.0, 2 * interval_s)))
        # Reports and explanations (the exception path, from either thread) get another with a long
        # timeout: a report lost to a slow store would leave the peers only the heartbeats to go by.
        self._calls = store_clone(base)
        self._calls.set_timeout(datetime.timedelta(seconds=call_timeout_s or max(10.0, 2 * grace_s)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._explaining = False
        self._pid = -1  # the process that started the thread (start())
        self._beating = False  # the thread is inside beat()'s store calls (joined at exit: _join_at_exit)
        self.reported = False
        self.last_explanation: str | None = None
        """What :meth:`explain` said last (the watch ends a process with it rather than wait again)."""

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FailureWatch:
        """Publish this process's identity, beat once and start the thread."""
        self._calls.set(self._key(f"proc/{self.rank}"), process_identity())
        self._calls.add(self._key(f"hb/{self.rank}"), 1)
        self._thread = threading.Thread(target=self._run, name=f"hexiscale-watch-{self.rank}", daemon=True)
        self._thread.start()
        _at_exit(self)
        return self

    def stop(self) -> None:
        """Disarm (the end of the run): the thread exits at its next tick and never ends the
        process; a rank that did not fail marks itself done, so its silence is never blamed."""
        self._stop.set()
        if not self.reported:
            try:
                self._calls.set(self._key(f"done/{self.rank}"), "1")
            except Exception:  # noqa: BLE001 -- the store's host already left: nobody is left to ask
                pass

    def beat(self) -> int:
        """One heartbeat of this rank; returns the number of failures reported so far."""
        self._store.add(self._key(f"hb/{self.rank}"), 1)
        return self._store.add(self._key("failures"), 0)

    # ---- reports -----------------------------------------------------------------------------
    def report(self, exc: BaseException | str) -> None:
        """Tell every rank that this one failed (once; best effort: the store may be gone). ``exc``:
        the exception, or a message that counts as a consequence (:data:`PEER_FAILURE_TEXTS`)."""
        if self.reported:
            return
        self.reported = True
        try:
            order = self._calls.add(self._key("failures"), 1)
            self._calls.set(self._key(f"failed/{self.rank}"), f"{order}|{exc if isinstance(exc, str) else _short(exc)}")
        except Exception:  # noqa: BLE001 -- the store's host is gone; explain() says so
            pass

    def explain(self) -> str:
        """Which rank failed and how (module doc, points 1-4), in a sentence for a log or an
        exception; waits at most ``4 * settle`` seconds, not at all once a rank reported an error."""
        in_thread = threading.current_thread() is self._thread
        if not in_thread:
            self._explaining = True  # the thread's grace waits for this explanation
        try:
            why = self._explain(self._calls, beat=in_thread)
        except Exception as e:  # noqa: BLE001 -- any store error: its host is gone
            why = (f"the rendezvous store (hosted by global rank 0) is unreachable ({_short(e)}): rank 0 failed "
                   f"or was killed")
        finally:
            if not in_thread:
                self._explaining = False
        self.last_explanation = why
        return why

    def _explain(self, store, beat: bool) -> str:
        settle = 3 * self.interval_s * host_slowdown()
        t0 = time.monotonic()
        before = self._beats(store)
        others = [r for r in range(self.world_size) if r != self.rank]
        done = {r for r in others if store.check([self._key(f"done/{r}")])}
        ident = {r: store.get(self._key(f"proc/{r}")).decode() if store.check([self._key(f"proc/{r}")]) else ""
                 for r in others}
        reports: list[tuple[int, int, str]] = []
        seen = -1
        unchanged: tuple[tuple[int, ...], float] = ((), t0)
        while True:
            count = store.add(self._key("failures"), 0)
            # The O(world) scan only when a report came, or while one is counted but its message not
            # yet written (report() counts, then writes).
            if count != seen or len(reports) < count:
                seen, reports = count, self._reports(store)
            if any(not is_peer_failure(msg) for _, _, msg in reports):
                return _account(reports)  # 1: the rank that raised
            reporters = {r for _, r, _ in reports}
            open_ = [r for r in others if r not in reporters and r not in done]
            ended = [r for r in open_ if process_ended(ident[r])]
            if ended:
                # A rank writes its report before its process ends: read them again after seeing the
                # end, so that a report written since the scan above does not pass for no word at all.
                reports = self._reports(store)
                if any(not is_peer_failure(msg) for _, _, msg in reports):
                    return _account(reports)
                reporters = {r for _, r, _ in reports}
                open_ = [r for r in open_ if r not in reporters]
                ended = [r for r in ended if r not in reporters]
            # 4: who never joined the collective the peers timed out in: alive and silent, or stopped
            # by its own watch without a timeout of its own (a rank that only waited reports one).
            timed_out = any("Timed out" in msg for _, _, msg in reports if not msg.startswith(STOPPED_BY_WATCH))
            absent = [r for _, r, msg in reports if timed_out and r != self.rank and msg.startswith(STOPPED_BY_WATCH)]
            # The watch thread of a rank that never reported while the others timed out: this rank
            # was outside their collective (or entered it late), not a victim of the first to time out.
            late = self.rank if beat and timed_out and not self.reported else None
            if ended or not open_:  # 2: a process gone without a word; or every rank has spoken
                return _account(reports, ended, absent=absent, late=late)
            if beat:  # the watch thread explains: it beats here, or the others would find it silent
                store.add(self._key(f"hb/{self.rank}"), 1)
            now_beats = self._beats(store)
            elapsed = time.monotonic() - t0
            silent = [r for r in open_ if now_beats[r] == before[r]]  # 3
            quiet = [r for r in open_ if r not in silent]  # 4, where the others timed out
            outside = tuple(sorted(quiet + absent))
            if outside != unchanged[0]:
                unchanged = (outside, time.monotonic())
            waited = elapsed >= settle and now_beats[self.rank] - before[self.rank] >= 3
            patience = 4 * settle
            if timed_out and len(outside) > 1:  # some may only be waiting: they report within the timeout
                settled = False
                # Not for the watch's own stop line (beat): it would hold a hung process that long.
                if self.collective_timeout_s is not None and not beat:
                    patience = max(patience, self.collective_timeout_s + 2 * settle)
            elif timed_out:
                settled = waited and time.monotonic() - unchanged[1] >= settle
            else:  # only broken connections so far: the peer that broke them is alive and reports later
                settled = waited and bool(silent)
            if settled or elapsed >= patience:
                # quiet: alive outside the collective; not when this rank is the one outside (``late``):
                # then they are waiting for it, as the ranks that timed out were
                return _account(reports, silent=silent, quiet=quiet if timed_out and late is None else [],
                                absent=absent, waited_s=elapsed, late=late)
            time.sleep(self.interval_s / 2)

    def _reports(self, store) -> list[tuple[int, int, str]]:
        """(order, rank, message) of every report so far, in the order they came."""
        out = []
        for r in range(self.world_size):
            key = self._key(f"failed/{r}")
            if store.check([key]):
                order, _, msg = store.get(key).decode().partition("|")
                out.append((int(order), r, msg))
        return sorted(out)

    def _beats(self, store) -> list[int]:
        return [store.add(self._key(f"hb/{r}"), 0) for r in range(self.world_size)]

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        known_since: float | None = None
        store_lost_since: float | None = None
        closed = False
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                if closed:  # no call on a closed connection: each one logs a C++ warning and trace
                    raise ConnectionError("the rendezvous store closed the connection")
                self._beating = True  # before the check: _leave_at_exit sets the stop, then reads this
                if self._stop.is_set():
                    break
                try:
                    failures = self.beat()
                finally:
                    self._beating = False
                store_lost_since = None
            except Exception as e:  # noqa: BLE001 -- a timeout on a loaded host, or the store's host is gone
                closed = closed or connection_closed(e)
                store_lost_since = store_lost_since or now
                if now - store_lost_since > 2 * self.grace_s * host_slowdown():
                    self._end("the rendezvous store (hosted by global rank 0) is unreachable: rank 0 failed or "
                              "was killed")
                continue
            if failures and known_since is None or (known_since is not None and self._explaining):
                known_since = now  # the grace counts from the end of this rank's own explanation
            if known_since is not None and now - known_since > self.grace_s * host_slowdown():
                self._end(self.last_explanation or self.explain())

    def _leave_at_exit(self) -> None:
        """At interpreter exit: stop the thread and wait for it to end, at most its beat's two store
        calls' timeouts (``max(1, 2 interval_s)`` s each) when it is inside one, else 0.2 s (it wakes
        from its wait at once). A daemon thread that runs a torch call once the interpreter finalizes
        aborts the process: pybind11 takes the GIL back in a ``noexcept`` destructor, CPython ends the
        thread there, and the process dies with SIGABRT ("terminate called without an active
        exception", exit -6) after all its work is done. Two such calls: a beat in flight (a store
        host that answers 1 s late at the end of a run: 4 of 4 processes aborted without this wait),
        and the thread's own end, which drops the last reference to this watch and so destroys its
        store connections. Only here, not in :meth:`stop`: a wait in the run's teardown changed the
        pace of the Ctrl-C and SIGTERM stops that the suite bounds (two of its tests failed in full
        runs). A thread still explaining a failure (long store calls) is left after the 0.2 s, with a
        reference kept to this watch so that its end at least destroys nothing."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * max(1.0, 2 * self.interval_s) + self.interval_s if self._beating else 0.2)
            if thread.is_alive():
                _LEFT.append(self)

    def _end(self, why: str) -> None:
        if self._stop.is_set():  # the run ended normally meanwhile
            return
        self.report(f"{STOPPED_BY_WATCH}: {why}")  # a consequence: the others do not blame this rank
        sys.stderr.write(f"hexiscale: rank {self.rank} stops: {why}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(self.exit_code)


_STARTED: weakref.WeakSet[FailureWatch] = weakref.WeakSet()
"""The watches this process started (held weakly: a stopped watch whose thread ended goes)."""


def _at_exit(watch: FailureWatch) -> None:
    """Have ``watch`` leave its store calls before the interpreter finalizes (:meth:`FailureWatch._leave_at_exit`).
    ``atexit`` runs after the main thread ended and before finalization; ``os._exit`` (the watch's
    own end, a forked worker's) skips it, as it skips finalization."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_join_at_exit)
        _REGISTERED = True
    watch._pid = os.getpid()
    _STARTED.add(watch)


_REGISTERED = False
_LEFT: list[FailureWatch] = []
"""Watches whose thread was still busy at exit (:meth:`FailureWatch._leave_at_exit`)."""


def _join_at_exit() -> None:
    for watch in list(_STARTED):
        if watch._pid == os.getpid():  # not a forked child's copy of its parent's watch (no thread here)
            watch._leave_at_exit()


CLOSED_TEXTS = ("got 0 bytes", "Broken pipe", "Connection reset", "Connection refused")
"""TCPStore client errors after its server closed the connection (its host ended): the client does
not reconnect, so every later call fails too, each after a ``TCPStore.cpp`` warning with ~13 C++ frames."""


def connection_closed(exc: BaseException) -> bool:
    """``exc`` says the store's connection is closed for good (not a timeout on a loaded host)."""
    return isinstance(exc, getattr(dist, "DistNetworkError", ())) and any(t in str(exc) for t in CLOSED_TEXTS)


def _account(reports: list[tuple[int, int, str]], ended: Sequence[int] = (), silent: Sequence[int] = (),
             quiet: Sequence[int] = (), absent: Sequence[int] = (), waited_s: float = 0.0,
             late: int | None = None) -> str:
    """The sentence of :meth:`FailureWatch.explain`: the first real error leads; ranks that ended
    or fell silent without a word, or that are alive outside the collective the others timed out
    in (``quiet``), or that their watch stopped while outside it (``absent``), come next; peers'
    broken connections are only counted (their raw text, gloo's "Connection reset by peer ...
    GLHF", shown only when nothing else is known). ``late``: the explaining rank itself, when its
    watch explains after the others timed out and it never did: it comes first, as the one they
    waited for, rather than the first of them to time out passing for the failed rank."""
    causes = [(r, msg) for _, r, msg in reports if not is_peer_failure(msg)]
    lost = [r for _, r, msg in reports if is_peer_failure(msg) and r not in absent]
    parts = []
    if causes:
        parts.append(f"first rank {causes[0][0]} failed: {causes[0][1]}")
        if len(causes) > 1:
            parts.append(f"then rank(s) {[r for r, _ in causes[1:]]} failed too")
    elif late is not None:
        waited = [r for _, r, msg in reports if "Timed out" in msg and not msg.startswith(STOPPED_BY_WATCH)]
        parts.append(f"{_ranks(waited)} timed out in a collective that this rank ({late}) had not joined in time "
                     f"(it hung or ran late, or was blocked outside the collectives)")
        lost = [r for r in lost if r not in waited]
    if ended:
        parts.append(f"{_ranks(ended)} stopped without reporting an error (the process ended: killed or crashed)")
    if silent:
        parts.append(f"{_ranks(silent)} stopped without reporting an error (no heartbeat for {waited_s:.1f} s: "
                     f"killed, crashed or hung)")
    if quiet:
        parts.append(f"{_ranks(quiet)} {'is' if len(quiet) == 1 else 'are'} alive but never joined the collective "
                     f"the others timed out in (hung, or blocked outside the collectives)")
    if absent:
        parts.append(f"{_ranks(absent)} never joined the collective the others timed out in (hung, or blocked "
                     f"outside the collectives, until {'its' if len(absent) == 1 else 'their'} failure watch "
                     f"stopped {'it' if len(absent) == 1 else 'them'})")
    if lost and not parts:
        _, first, msg = reports[0]
        parts.append(f"first rank {first} failed: {msg}")
        lost = lost[1:]
    if lost:
        parts.append(f"rank(s) {lost} lost their connection to it")
    if not parts:
        parts.append("no rank reported a failure and every rank is alive: a collective timed out (a rank "
                     "blocked outside the collectives, or ranks calling different collectives)")
    return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"
