"""The lease backend's fair queue: one ``djlocks_lease_waiter`` row per waiting process.

A waiter's row ``id`` is its ticket: a claim never passes a live waiter with a
smaller ticket, so waiters are served first come, first served, and a
newcomer cannot barge in. The row expires unless its waiter refreshes it
(``WAITER_TTL``), so a killed waiter holds nobody back for long. Only the
waiters that a free slot could serve poll, with back-off; the others poll
more slowly the further back they are. On PostgreSQL a release ``NOTIFY``s
the waiters (``LISTEN``), and polling is only the fallback for a lost wake-up.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import AcquireRequest, GrantRecord
from djlocks.backends.lease.claims import LeaseClaims
from djlocks.backends.lease.store import WAITERS
from djlocks.backends.sql import postgresql
from djlocks.backends.waiting import POLL_MAX, POLL_MIN, Abort
from djlocks.conf import djlocks_settings
from djlocks.exceptions import BackendUnavailable

acquire_log = logging.getLogger("djlocks.acquire")

#: Seconds between polls where releases notify: polling is only the fallback there.
NOTIFIED_POLL = 0.025
#: Seconds: a waiter k places behind the next in line polls every k steps.
QUEUE_POLL_STEP = 0.005


#: Places in the queue remembered for removal while the store cannot be reached.
ABANDONED_KEPT = 100


class LeaseQueue(LeaseClaims):
    """Waiting in line for a slot."""

    def _wait_in_queue(
        self,
        request: AcquireRequest,
        key: str,
        deadline: float | None,
        abort: Abort | None,
    ) -> GrantRecord | None:
        waiter_ttl = float(djlocks_settings()["WAITER_TTL"])
        slow_poll = float(djlocks_settings()["POLL_INTERVAL"])
        self._leave_abandoned_places()
        ticket = self._run(lambda db: self._enqueue(db, request, key, waiter_ttl))
        acquire_log.debug("queued for %s as ticket %s", request.name, ticket)
        listening = self._listen()
        refresh_at = time.monotonic() + waiter_ttl / 3
        head_poll = POLL_MIN
        try:
            while True:
                ahead = self._run(lambda db: self._waiting_ahead(db, key, ticket))
                if ahead < request.limit:
                    grant = self._claim(request, key, ticket)
                    if grant is not None:
                        return grant
                    pause = NOTIFIED_POLL if listening else head_poll
                    head_poll = min(head_poll * 1.5, POLL_MAX)
                else:
                    # The next in line polls as often as the head, so it notices at
                    # once when it moves up; everyone further back polls less often.
                    behind = ahead - request.limit
                    pause = POLL_MAX if behind == 0 else min(slow_poll, QUEUE_POLL_STEP * behind)
                    head_poll = POLL_MIN
                now = time.monotonic()
                if deadline is not None:
                    if now >= deadline:
                        return None
                    pause = min(pause, deadline - now)
                if now >= refresh_at:
                    self._run(lambda db: self._refresh_waiter(db, ticket, waiter_ttl))
                    refresh_at = now + waiter_ttl / 3
                if self._pause(pause, key, abort, listening):
                    return None
        finally:
            if listening:
                self._unlisten()
            self._leave_queue(ticket)

    def _leave_queue(self, ticket: int) -> None:
        """Give up the place ``ticket``; if the store cannot be reached (the error that
        ended the wait, most often), remember it, so that this process's next wait
        gives it up first instead of queueing behind it until it expires (WAITER_TTL)."""
        self._leave_places([ticket])

    def _leave_abandoned_places(self) -> None:
        with self._abandoned_guard:
            tickets, self._abandoned = self._abandoned, []
        if tickets:
            self._leave_places(tickets)

    def _leave_places(self, tickets: list[int]) -> None:
        """Delete the places ``tickets`` in one statement, or remember them (at most
        ``ABANDONED_KEPT``: older ones have expired by the time the store is back)."""
        marks = ", ".join(["%s"] * len(tickets))
        try:
            self._run(
                lambda db: self._execute(
                    db, f"DELETE FROM {WAITERS} WHERE id IN ({marks})", tickets
                )
            )
        except BackendUnavailable:
            with self._abandoned_guard:
                self._abandoned = [*self._abandoned, *tickets][-ABANDONED_KEPT:]

    def _listen(self) -> bool:
        """Start hearing releases (PostgreSQL); False where the store cannot notify."""
        if self.dialect.notifying is None:
            return False
        try:
            self._on_listener(postgresql.listen(postgresql.LEASE_RELEASED))
        except DatabaseError:
            acquire_log.warning("LISTEN failed; falling back to polling", exc_info=True)
            self._listeners.discard()
            return False
        return True

    def _unlisten(self) -> None:
        """Stop hearing releases, so an idle connection never holds back the notify queue."""
        try:
            self._on_listener(postgresql.unlisten(postgresql.LEASE_RELEASED))
        except DatabaseError:
            self._listeners.discard()

    def _on_listener(self, statement: str) -> None:
        """Run ``statement`` on this thread's listening connection; the driver's errors
        (a server gone, too) arrive as Django's ``DatabaseError``."""
        listener = self._listeners.get()
        with listener.wrap_database_errors, closing(listener.create_cursor()) as cursor:
            cursor.execute(statement, ())

    def _pause(self, seconds: float, key: str, abort: Abort | None, listening: bool) -> bool:
        """Sleep up to ``seconds``, less if a release of ``key`` is notified; True if aborted."""
        if listening:
            end = time.monotonic() + seconds
            try:
                connection = self._listeners.get().connection
                while (left := end - time.monotonic()) > 0 and not (abort and abort.is_set()):
                    # A notification is only a hint: the caller re-checks the store.
                    heard = list(connection.notifies(timeout=min(left, 0.05), stop_after=1))
                    if any(note.payload == key for note in heard):
                        break
            except Exception:
                acquire_log.warning("listening for releases failed", exc_info=True)
                self._listeners.discard()
            return abort is not None and abort.is_set()
        if abort is not None:
            return abort.wait(seconds)
        time.sleep(seconds)
        return False

    def _enqueue(
        self, db: BaseDatabaseWrapper, request: AcquireRequest, key: str, waiter_ttl: float
    ) -> int:
        """Add the caller's waiter row; its ``id``, the ticket."""
        d = self.dialect
        ident = request.identity
        sql = (
            f"INSERT INTO {WAITERS} (name_key, name, host, pid, thread, label, since, expires_at) "
            f"VALUES (%s, %s, %s, %s, %s, %s, {d.now}, {d.plus_seconds})"
        )
        params = (
            key,
            request.name,
            ident.host,
            ident.pid,
            ident.thread,
            ident.label,
            d.seconds_param(waiter_ttl),
        )
        with closing(db.create_cursor()) as cursor:
            if d.returning:
                cursor.execute(sql + " RETURNING id", params)
                return int(cursor.fetchone()[0])
            cursor.execute(sql, params)
            return int(cursor.lastrowid)

    def _waiting_ahead(self, db: BaseDatabaseWrapper, key: str, ticket: int) -> int:
        with closing(db.create_cursor()) as cursor:
            return self._count_ahead(cursor, key, ticket)

    def _refresh_waiter(self, db: BaseDatabaseWrapper, ticket: int, waiter_ttl: float) -> None:
        self._execute(
            db,
            f"UPDATE {WAITERS} SET expires_at = {self.dialect.plus_seconds} WHERE id = %s",
            (self.dialect.seconds_param(waiter_ttl), ticket),
        )
