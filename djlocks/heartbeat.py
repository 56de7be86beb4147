"""One background thread per process renews every held grant.

Each grant is renewed every third of its TTL: a lease is extended, a session
lock is checked with the server (see ``LockBackend.renew``). A renewal that the store
refuses marks the grant lost at once; a store that cannot be reached is tried
again until the holder's belief runs out (G2), and then the grant is lost.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time

from djlocks.exceptions import BackendUnavailable, LockLost
from djlocks.grant import Grant

renew_log = logging.getLogger("djlocks.renew")

RETRY_AFTER_FAILURE = 0.2


class Heartbeat:
    """Schedules renewals of registered grants on a daemon thread."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self.forget_the_parent()

    def forget_the_parent(self) -> None:
        """Start empty: at first, and in a forked child, whose parent's grants are the
        parent's to renew (RELIABILITY.md item 17) and whose parent's thread and
        lock states did not come along."""
        self._wake = threading.Condition()
        self._queue: list[tuple[float, int, Grant]] = []
        self._active: set[Grant] = set()
        self._thread: threading.Thread | None = None

    def add(self, grant: Grant) -> None:
        with self._wake:
            self._active.add(grant)
            due = time.monotonic() + grant.ttl / 3
            heapq.heappush(self._queue, (due, next(self._order), grant))
            self._ensure_thread()
            if self._queue[0][2] is grant:  # due before all others: the thread must re-plan
                self._wake.notify()

    def discard(self, grant: Grant) -> None:
        with self._wake:
            self._active.discard(grant)

    def active(self) -> int:
        """How many grants this process is renewing (tests check it drops to 0)."""
        with self._wake:
            return len(self._active)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="djlocks-heartbeat", daemon=True)
            self._thread.start()

    def _next_due(self) -> Grant:
        with self._wake:
            while True:
                while self._queue and self._queue[0][2] not in self._active:
                    heapq.heappop(self._queue)
                if self._queue:
                    delay = self._queue[0][0] - time.monotonic()
                    if delay <= 0:
                        return heapq.heappop(self._queue)[2]
                    self._wake.wait(delay)
                else:
                    self._wake.wait()

    def _run(self) -> None:
        while True:
            grant = self._next_due()
            next_due = self._renew(grant)
            with self._wake:
                if next_due is not None and grant in self._active:
                    heapq.heappush(self._queue, (next_due, next(self._order), grant))
                else:
                    self._active.discard(grant)

    @staticmethod
    def _renew(grant: Grant) -> float | None:
        started = time.monotonic()
        if started >= grant.believe_until():
            grant.mark_lost("its lease ran out before it could be renewed")
            return None
        try:
            expires_at = grant.backend.renew(grant.name, grant.token, grant.ttl)
        except LockLost as exc:
            grant.mark_lost(str(exc))
            return None
        except BackendUnavailable:
            renew_log.warning("renewal of %s failed; retrying", grant.name, exc_info=True)
            return min(started + RETRY_AFTER_FAILURE, grant.believe_until())
        except Exception:  # a renewal thread must never die with leases to keep alive
            renew_log.exception("renewal of %s failed unexpectedly; retrying", grant.name)
            return min(started + RETRY_AFTER_FAILURE, grant.believe_until())
        grant.renewed(started, expires_at)
        return started + grant.ttl / 3


heartbeat = Heartbeat()
os.register_at_fork(after_in_child=heartbeat.forget_the_parent)
