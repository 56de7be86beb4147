"""One background thread per process renews every held grant.

Each grant is renewed every third of its TTL: a lease is extended, a session
lock is checked with the server (see ``LockBackend.renew``). A grant held past
its ``max_hold`` is renewed no more and taken back at its store. A renewal that the store
refuses marks the grant lost at once; a store that cannot be reached is tried
again until the holder's belief runs out (never past the TTL), and then the
grant is lost.

Where the store can push (``LockBackend.watch``), a forced release or a
graceful release's request makes the heartbeat renew that grant at once, so
its holder hears of it within a round trip instead of up to TTL/3 later. The
periodic renewal stays: a notice that never arrives delays nothing beyond it.
A renewal that finds a graceful release requested (``ReleaseRequested``) keeps
the grant renewed, but only until the operator's wait runs out.

A renewal that hangs (a silent network partition) holds this thread up; the
watchdog (``djlocks.watchdog``) tells the holders whose belief runs out meanwhile.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from djlocks import metrics
from djlocks.exceptions import BackendUnavailable, LockLost, ReleaseRequested
from djlocks.green import green_threads_warning
from djlocks.own_thread import OwnThread
from djlocks.watchdog import watchdog

if TYPE_CHECKING:
    from djlocks.grant import Grant

renew_log = logging.getLogger("djlocks.renew")

RETRY_AFTER_FAILURE = 0.2
#: At interpreter exit, how long (seconds) a renewal under way may take to finish.
EXIT_WAIT = 2.0
#: How many superseded queue entries (released or re-planned grants) may stay beyond as
#: many as there are live ones before the queue is rebuilt without them.
SUPERSEDED_KEPT = 64


class Heartbeat:
    """Schedules renewals of registered grants on a daemon thread."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self.forget_the_parent()

    def forget_the_parent(self) -> None:
        """Start empty: at first, and in a forked child, whose parent's grants are the
        parent's to renew (a forked child never uses them) and whose parent's thread and
        lock states did not come along."""
        self._guard = threading.Lock()  # a plain lock: cheaper to take than the Condition
        self._wake = threading.Condition(self._guard)
        self._queue: list[tuple[float, int, Grant]] = []
        # Each renewed grant -> the order of its one live entry in the queue; an entry
        # with another order was superseded (renew_now) and is skipped.
        self._entries: dict[Grant, int] = {}
        self._unwatch: dict[Grant, Callable[[], None]] = {}
        self._own = OwnThread(self._guard, self._renew_when_due, "djlocks-heartbeat")
        self._warned = False  # of green threads (``green_threads_warning``)
        self._stopping = False
        #: The monotonic time the thread sleeps until: ``math.inf`` until woken,
        #: ``-math.inf`` while it is awake (it reads the queue before it sleeps again).
        #: A renewal planned before it needs the thread woken; a later one does not.
        self._sleeping_until = -math.inf

    def stop(self, wait: float = EXIT_WAIT) -> None:
        """Renew nothing more and end the thread, waiting up to ``wait`` seconds for a
        renewal under way (run at interpreter exit: the thread, a daemon, is then
        not caught inside a store's client when the interpreter finalises, and the
        leases of grants still held end at their TTL)."""
        watchdog.stop()
        with self._guard:
            self._stopping = True
            self._wake.notify()
            thread = self._own.thread
        if thread is not None:
            thread.join(wait)

    def add(self, grant: Grant) -> None:
        """Renew ``grant`` every TTL/3 from now on, and at once when its store pushes news."""
        unwatch = self._watch(grant)
        watchdog.watch(grant)
        with self._guard:
            if unwatch is not None:
                self._unwatch[grant] = unwatch
            self._schedule(grant, min(time.monotonic() + grant.ttl / 3, grant.believe_until()))
            self._ensure_thread()

    def _watch(self, grant: Grant) -> Callable[[], None] | None:
        """Have the store's news of ``grant`` renew it at once; ``None`` if it cannot push.

        Never raises: a watch that fails leaves the periodic renewal, which suffices.
        """
        try:
            return grant.backend.watch(
                grant.name, grant.token, grant.fence, lambda: self.renew_now(grant)
            )
        except Exception:
            renew_log.warning("cannot watch %s for revocations", grant.name, exc_info=True)
            return None

    def renew_now(self, grant: Grant) -> None:
        """Renew ``grant`` at once (its store pushed news of it); nothing once it left."""
        with self._guard:
            if grant in self._entries:
                self._schedule(grant, time.monotonic())

    def discard(self, grant: Grant) -> None:
        """Stop renewing ``grant`` (its release has begun)."""
        self._forget(grant)

    def active(self) -> int:
        """How many grants this process is renewing (tests check it drops to 0)."""
        with self._guard:
            return len(self._entries)

    def _schedule(self, grant: Grant, due: float) -> None:
        """Plan ``grant``'s next renewal at ``due`` (monotonic); call with the guard held."""
        order = next(self._order)
        self._entries[grant] = order
        heapq.heappush(self._queue, (due, order, grant))
        if due < self._sleeping_until:  # the thread would sleep past it: it must re-plan
            self._wake.notify()

    def _forget(self, grant: Grant) -> None:
        watchdog.discard(grant)
        with self._guard:
            self._entries.pop(grant, None)
            unwatch = self._unwatch.pop(grant, None)
            self._drop_superseded()
        if unwatch is not None:
            unwatch()

    def _drop_superseded(self) -> None:
        """Rebuild the queue without its superseded entries once they outnumber the live
        ones (call with the guard held). A released grant's entry would otherwise stay,
        and keep the grant in memory, until its renewal would have fallen due, TTL/3
        later: tens of thousands of grants at a high grant rate. Each live grant has
        one live entry, so the rest are superseded; rebuilding only once they are
        the majority keeps the cost per release constant."""
        if len(self._queue) > 2 * len(self._entries) + SUPERSEDED_KEPT:
            self._queue = [
                entry for entry in self._queue if self._entries.get(entry[2]) == entry[1]
            ]
            heapq.heapify(self._queue)

    def _ensure_thread(self) -> None:
        """Start the thread unless it runs (call with the guard held)."""
        if self._own.thread is None and not self._warned:
            if (warning := green_threads_warning()) is not None:
                renew_log.warning(warning)
            self._warned = True  # the first heartbeat of a process warns, not a restart
        self._own.start_unless_running()

    def _next_due(self) -> tuple[Grant, int] | None:
        """Wait for the next renewal that is due; return its grant and its entry's order,
        or ``None`` once the heartbeat stops.

        A superseded entry (its grant released, or re-planned) is dropped only once it
        falls due, and the thread sleeps until then as for a live one: dropped at once,
        it could leave the queue empty and the thread asleep for good, to be woken by
        the next grant's renewal plan (``_schedule``), which would then cost a wake-up
        per grant whenever this thread runs late (a busy machine)."""
        with self._guard:
            while not self._stopping:
                if self._queue:
                    due, order, grant = self._queue[0]
                    if due <= time.monotonic():
                        heapq.heappop(self._queue)
                        if self._entries.get(grant) == order:
                            return grant, order
                        continue
                    self._sleeping_until = due
                    self._wake.wait(due - time.monotonic())
                else:
                    self._sleeping_until = math.inf
                    self._wake.wait()
                self._sleeping_until = -math.inf  # awake: it reads the queue before sleeping
            return None

    def _renew_when_due(self) -> None:
        while (due := self._next_due()) is not None:
            grant, order = due
            try:
                next_due = self._renew(grant)
            except Exception:  # an on_lost callback or lock_lost receiver that raised
                renew_log.exception("telling the holder of %s of its loss failed", grant.name)
                next_due = None
            if next_due is None:
                self._forget(grant)
                continue
            with self._guard:
                if self._entries.get(grant) == order:  # not re-planned, nor discarded, meanwhile
                    self._schedule(grant, next_due)

    @staticmethod
    def _renew(grant: Grant) -> float | None:
        """Renew ``grant`` once; return when to renew it next, or ``None`` once it is lost."""
        started = time.monotonic()
        if started >= grant.believe_until():
            grant.mark_lost(grant.ran_out_reason(), take_back=grant.held_past_max_hold())
            return None
        try:
            expires_at = grant.backend.renew(grant.name, grant.token, grant.ttl)
        except ReleaseRequested as request:
            grant.release_requested(started, request)
        except LockLost as exc:
            grant.mark_lost(str(exc))
            return None
        except BackendUnavailable as exc:  # its message says what failed and why
            _log_failed_renewal(grant, exc)
            return min(started + RETRY_AFTER_FAILURE, grant.believe_until())
        except Exception:  # a renewal thread must never die with leases to keep alive
            renew_log.exception("renewal of %s failed unexpectedly; retrying", grant.name)
            return min(started + RETRY_AFTER_FAILURE, grant.believe_until())
        else:
            if grant.renewal_failures:
                renew_log.info(
                    "renewal of %s succeeded after %s failed attempt(s)",
                    grant.name,
                    grant.renewal_failures,
                )
                grant.renewal_failures = 0
            grant.renewed(started, expires_at)
            metrics.renewed(grant, time.monotonic() - started)
            if grant.lost_reason is not None:  # the watchdog told of its loss meanwhile
                return None
        # A graceful release's wait may end before the next renewal: be there when it does.
        return min(started + grant.ttl / 3, grant.believe_until())


def _log_failed_renewal(grant: Grant, exc: BackendUnavailable) -> None:
    """Count a failed renewal of ``grant``; only the first of a streak is a warning, the
    retries (every ``RETRY_AFTER_FAILURE`` seconds, until one succeeds or the lease
    runs out) are debug lines: an outage would otherwise log five lines a second for
    each grant held."""
    grant.renewal_failures += 1
    if grant.renewal_failures == 1:
        renew_log.warning(
            "renewal of %s failed; retrying every %s s until it succeeds or the lease runs "
            "out (%.1f s from now): %s",
            grant.name,
            RETRY_AFTER_FAILURE,
            max(0.0, grant.believe_until() - time.monotonic()),
            exc,
        )
    else:
        renew_log.debug(
            "renewal of %s failed again (%s in a row): %s", grant.name, grant.renewal_failures, exc
        )


heartbeat = Heartbeat()
os.register_at_fork(after_in_child=heartbeat.forget_the_parent)
atexit.register(heartbeat.stop)
