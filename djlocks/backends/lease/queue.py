"""The lease backend's fair queue: one ``djlocks_lease_waiter`` row per waiting process.

A waiter's row ``id`` is its ticket: a claim never passes a live waiter with a
smaller ticket, so waiters are served first come, first served, and a
newcomer cannot barge in. The row expires unless its waiter refreshes it
(``WAITER_TTL``), so a killed waiter holds nobody back for long. Only the
waiters that a free slot could serve poll, with back-off; the others poll
more slowly the further back they are. On PostgreSQL a release ``NOTIFY``s
only the waiters it concerns, each on the channel of its listening session
(``LISTEN``ed once, as the session opens); on MySQL a waiter sleeps in the server and the
release that hands it a slot ends the sleep (``KILL QUERY``); on SQLite a
release sends the first waiters a datagram on their host (``lease.wakeups``).
Polling is only the fallback for a lost wake-up there.

Where the store hands over (``LeaseDialect.hand_over``: PostgreSQL, MySQL), a
release without a cool-down gives the freed slot to the head of the queue in
the same round trip, under the token the waiter queued with. The woken waiter
only reads its grant, one round trip and no commit; on PostgreSQL it needs none,
since the notice carries the grant. A waiter that leaves the queue without
taking a slot it was handed gives it to the next in line.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, closing
from functools import partial
from typing import Any

from django.db import DatabaseError, Error
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import AcquireRequest, GrantRecord
from djlocks.backends.dedicated import statement_cursor
from djlocks.backends.lease.claims import LeaseClaims
from djlocks.backends.lease.store import SLOTS, WAITERS, Place
from djlocks.backends.lease.wakeups import HostWakeups
from djlocks.backends.push import hung_up
from djlocks.backends.sql import as_datetime, postgresql, sqlite
from djlocks.backends.sql.dialects import HandOver
from djlocks.backends.sql.postgresql import HandedOver
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
        arrival: ExitStack,
    ) -> GrantRecord | None:
        """Queue for a slot and wait for it until ``deadline``; ``arrival`` (the caller's
        turn at the store, if it takes one) is closed once the place is taken."""
        waiter_ttl = float(djlocks_settings()["WAITER_TTL"])
        slow_poll = float(djlocks_settings()["POLL_INTERVAL"])
        self._leave_abandoned_places()
        heir_token = secrets.token_hex(16)  # what a release hands the slot over with
        self._catch_up()
        sleeper = self._sleeper()
        # A hand-over found this waiter's row queued, so its statement, whose start
        # its lease counts from, began after this moment: the heir's belief in a
        # lease that a notice hands over counts from here.
        queued_at = time.monotonic()
        ticket, counted, served = self._run(
            self._enqueuing(request, key, waiter_ttl, heir_token, sleeper)
        )
        arrival.close()
        if served is not None:
            return served  # a release served its first enqueue, whose reply was lost
        assert ticket is not None
        ahead: int | None = counted  # None: to be counted again
        acquire_log.debug("queued for %s as ticket %s", request.name, ticket)
        # PostgreSQL: the waiter's listening session, named in its queue row, hears the
        # release that hands it a slot (``LeaseStore._listen``).
        listening = sleeper is not None and self.dialect.listening is not None
        woken_here = None
        refresh_at = time.monotonic() + waiter_ttl / 3
        head_poll = POLL_MIN
        handed = claimed = at_the_front = False
        try:
            wakeups = self.host_wakeups
            woken_here = None if wakeups is None else wakeups.open(ticket)
            # A release wakes this waiter:
            waking = self.dialect.waking is not None
            woken = listening or woken_here is not None or waking
            while True:
                if ahead is None:  # counted a turn ago
                    ahead, grant = self._run(
                        partial(
                            self._waiting_ahead,
                            request=request,
                            key=key,
                            ticket=ticket,
                            heir_token=heir_token,
                        )
                    )
                    if grant is not None:
                        handed = True
                        return grant
                at_the_front = ahead < request.limit
                if at_the_front:
                    grant = self._claim(request, key, ticket)
                    if grant is not None:
                        claimed = True
                        return grant
                    pause = NOTIFIED_POLL if woken else head_poll
                    head_poll = min(head_poll * 1.5, POLL_MAX)
                elif woken:
                    pause = slow_poll  # the release that makes this waiter next wakes it
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
                queued = True
                if now >= refresh_at:
                    queued = self._run(
                        partial(
                            self._refresh_waiter,
                            ticket=ticket,
                            heir_token=heir_token,
                            waiter_ttl=waiter_ttl,
                        )
                    )
                    refresh_at = now + waiter_ttl / 3
                if listening:  # a wait leaves the listening session idle
                    if now >= self._waking_session_due():
                        self._keep_waking_session()
                    pause = min(pause, max(self._waking_session_due() - now, 0.0))
                if sleeper is not None and queued:
                    sleeper, queued = self._rename_sleeper(ticket, heir_token, sleeper)
                if not queued:  # the place is gone (``_queue_again``): take a new one
                    # A new token: a slot handed to the old one may still bear it, expired.
                    requeue_token = secrets.token_hex(16)
                    sleeper = self._sleeper()
                    queued_at = time.monotonic()
                    requeued, ahead, grant = self._run(
                        partial(
                            self._queue_again,
                            request=request,
                            key=key,
                            waiter_ttl=waiter_ttl,
                            heir_token=heir_token,
                            sleeper=sleeper,
                            next_token=requeue_token,
                        )
                    )
                    if grant is not None:
                        handed = True
                        return grant
                    assert requeued is not None
                    acquire_log.info(
                        "the place of ticket %s for %s was gone; queued again as ticket %s",
                        ticket,
                        request.name,
                        requeued,
                    )
                    ticket, heir_token = requeued, requeue_token
                    if wakeups is not None:
                        if woken_here is not None:
                            woken_here.close()
                        woken_here = wakeups.open(ticket)
                        woken = listening or woken_here is not None or waking
                    continue
                aborted, notice, handed_unread = self._pause(
                    pause, ticket, abort, listening, heir_token, woken_here
                )
                if aborted:
                    return None
                if handed_unread:  # most likely handed: read that grant alone
                    grant = self._run(
                        partial(self._handed_grant, request=request, heir_token=heir_token)
                    )
                    if grant is not None:
                        handed = True
                        return grant
                elif notice is not None and time.monotonic() - queued_at < request.ttl / 3:
                    handed = True  # read from the notice: no round trip
                    return GrantRecord(
                        heir_token, notice.slot, notice.fence, notice.expires_at, None, queued_at
                    )
                ahead = None  # a hint, or queued too long ago to count from: look again
        finally:
            if woken_here is not None:
                woken_here.close()
            if not handed and not self._leave_queue(key, heir_token):
                self._pass_on(heir_token)
            elif woken_here is not None and at_the_front and not claimed:
                self._wake_next(key, request.limit)

    def _leave_queue(self, key: str, heir_token: str) -> bool:
        """Give up the place in the queue of ``key`` that was taken with ``heir_token``;
        True if it was still queued (so nothing was handed over to it), False if it was
        not or if that is unknown. If the store cannot be reached (the error that ended
        the wait, most often), remember it, so that this process's next wait gives it up
        first instead of queueing behind it until it expires (WAITER_TTL)."""
        return bool(self._leave_places([Place(key, heir_token)]))

    def _wake_next(self, key: str, limit: int) -> None:
        """Wake the name's first ``limit`` live waiters on this host (``host_wakeups``):
        a waiter that leaves without a slot may leave one free for them."""
        wakeups = self.host_wakeups
        assert wakeups is not None
        first = sqlite.lease_first_waiters(WAITERS, "%s", "%s")

        def tickets(db: BaseDatabaseWrapper) -> list[int]:
            with statement_cursor(db) as cursor:
                cursor.execute(first, (key, limit))
                return [int(ticket) for (ticket,) in cursor.fetchall()]

        try:
            wakeups.wake(self._run(tickets))
        except BackendUnavailable as exc:
            acquire_log.debug("could not wake the next waiters of %s: %s", key, exc)

    def _hand_over(self, token: str) -> HandOver:
        """Release the grant ``token`` and hand its slot to the head of the queue, in one
        round trip (``LeaseDialect.hand_over``), then wake the heir where that takes a
        second (MySQL's ``KILL QUERY``)."""
        hand_over = self.dialect.hand_over
        assert hand_over is not None

        def release(db: BaseDatabaseWrapper) -> HandOver:
            with statement_cursor(db) as cursor:
                return hand_over(cursor, SLOTS, WAITERS, token)

        done = self._run(release)
        if done.wake is not None:
            self._wake(done.wake)
        return done

    def _wake(self, session: int) -> None:
        """End the sleep of the waiter on the server session ``session``
        (``LeaseDialect.wake``)."""

        wake = self.dialect.wake
        assert wake is not None

        def end_the_sleep(db: BaseDatabaseWrapper) -> None:
            with statement_cursor(db) as cursor:
                wake(cursor, session)

        try:
            self._run(end_the_sleep, retry=False)
        except BackendUnavailable as exc:
            acquire_log.debug("could not wake the waiter on session %s: %s", session, exc)

    def _pass_on(self, heir_token: str) -> None:
        """Release the slot a release may have handed over with ``heir_token`` while
        this waiter left without it, so that the next in line gets it at once."""
        if self.dialect.hand_over is None:
            return
        try:
            self._hand_over(heir_token)
        except BackendUnavailable as exc:
            acquire_log.warning("could not pass on a slot handed over (%s); its TTL ends it", exc)

    def _leave_abandoned_places(self) -> None:
        with self._abandoned_guard:
            places, self._abandoned = self._abandoned, []
        if places:
            self._leave_places(places)

    def _leave_places(self, places: list[Place]) -> int | None:
        """Delete ``places`` in one statement and return how many were still there, or
        remember them (at most ``ABANDONED_KEPT``: older ones have expired by the time
        the store is back) and return ``None``."""
        try:
            return self._run(lambda db: self._delete_places(db, places))
        except BackendUnavailable:
            with self._abandoned_guard:
                self._abandoned = [*self._abandoned, *places][-ABANDONED_KEPT:]
            return None

    def _delete_places(self, db: BaseDatabaseWrapper, places: list[Place]) -> int:
        """Delete the rows of ``places`` in one statement; how many there were."""
        matching = " OR ".join(["(name_key = %s AND token = %s)"] * len(places))
        return self._execute(
            db,
            f"DELETE FROM {WAITERS} WHERE {matching}",
            [part for place in places for part in place],
        )

    def _pause(
        self,
        seconds: float,
        ticket: int,
        abort: Abort | None,
        listening: bool,
        heir_token: str,
        woken_here: socket.socket | None,
    ) -> tuple[bool, HandedOver | None, bool]:
        """Sleep up to ``seconds``, less if a release notifies this waiter's ``ticket``
        on its listening session (a slot of the name freed, or handed to this waiter),
        or hands this waiter a slot with ``heir_token`` where that wakes it
        (``LeaseDialect.waking``), or sends a wake-up to ``woken_here``
        (``lease.wakeups``). Returns whether it was aborted; the slot that a
        hand-over's notice says was handed to this waiter, if one did; and whether a
        hand-over woke it without saying what it handed (``LeaseDialect.waking``)."""
        if self.dialect.waking is not None:
            aborted, woken = self._sleep_in_the_server(seconds, abort, heir_token)
            return aborted, None, woken
        if woken_here is not None:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0 and not (abort and abort.is_set()):
                if HostWakeups.wait(
                    woken_here, left if abort is None else min(left, NOTIFIED_POLL)
                ):
                    break
            return abort is not None and abort.is_set(), None, False
        if listening:
            end = time.monotonic() + seconds
            try:
                connection = self._listeners.get().connection
                while (left := end - time.monotonic()) > 0 and not (abort and abort.is_set()):
                    heard = postgresql.notifications(connection, min(left, 0.05))
                    notices = [postgresql.waiter_notice(note.payload) for note in heard]
                    mine = [notice[1] for notice in notices if notice and notice[0] == ticket]
                    if mine:  # not a past wait's
                        handed = [h for h in mine if h is not None and h.token == heir_token]
                        return abort is not None and abort.is_set(), next(iter(handed), None), False
            except Exception as exc:  # the server ended the session, most often: one line
                acquire_log.warning(
                    "listening for releases failed: %s",
                    exc,
                    exc_info=acquire_log.isEnabledFor(logging.DEBUG),
                )
                self._listeners.discard()
            return abort is not None and abort.is_set(), None, False
        if abort is not None:
            return abort.wait(seconds), None, False
        time.sleep(seconds)
        return False, None, False

    def _sleep_in_the_server(
        self, seconds: float, abort: Abort | None, heir_token: str
    ) -> tuple[bool, bool]:
        """Sleep on this thread's sleeping session, the one the waiter's queue row names
        (``_sleeper``), until a hand-over wakes it or ``seconds`` pass; with an
        ``abort``, in slices of ``NOTIFIED_POLL`` seconds, so that an abort is seen as
        soon. A session that fails is replaced at the next sleep, and this one is
        slept locally. Returns whether it was aborted, and whether a hand-over woke it
        (or had already handed this waiter a slot)."""
        waking, session_id = self.dialect.waking, self.dialect.session_id
        assert waking is not None and session_id is not None
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not (abort and abort.is_set()):
            nap = left if abort is None else min(left, NOTIFIED_POLL)
            try:
                lease_session = session_id(self._connections.get().connection)
                sleeper = self._listeners.get()
                with sleeper.wrap_database_errors, closing(sleeper.create_cursor()) as cursor:
                    woken = waking(cursor, SLOTS, heir_token, lease_session, nap)
                self._waking_session_ran()
                if woken:
                    return abort is not None and abort.is_set(), True
            except DatabaseError as exc:  # the server is down, most often: one line
                acquire_log.warning(
                    "sleeping in the server failed: %s",
                    exc,
                    exc_info=acquire_log.isEnabledFor(logging.DEBUG),
                )
                self._listeners.discard()
                if abort is not None:
                    return abort.wait(left), False
                time.sleep(left)
        return abort is not None and abort.is_set(), False

    def _catch_up(self) -> None:
        """Before a wait, make sure that this thread's waking session is live and will
        stay so for a while: read what it received while idle, with no round trip
        (notices of past waits, on PostgreSQL, which no wait needs; the server's
        hang-up, on Linux), and if it has been idle for half its idle limit
        (``WAKING_SESSION_IDLE``), have it run a statement. A session the server closed
        (that limit, a restart, a kill) is replaced, so that the new wait's queue row
        names a live one."""
        if self.dialect.session_id is None:
            return
        read_notices = self.dialect.read_notices
        try:
            wrapper = self._listeners.get()
            with wrapper.wrap_database_errors:
                if read_notices is not None:
                    read_notices(wrapper.connection)
                ended = hung_up(wrapper.connection.fileno())
        except Error:
            ended = True
        if ended:
            self._listeners.discard()
        elif time.monotonic() >= self._waking_session_due():
            self._keep_waking_session()

    def _keep_waking_session(self) -> None:
        """Run a statement on this thread's waking session, so that the server does not
        close it as idle (``WAKING_SESSION_IDLE``): a PostgreSQL wait leaves it idle. One
        that failed (the server closed it) is replaced at its next use, and a wait under
        way names the new one in its queue row (``_rename_sleeper``)."""
        try:
            with self._listeners.cursor() as cursor:
                cursor.execute("SELECT 1")
        except Error:
            self._listeners.discard()
        finally:
            self._waking_session_ran()  # or let go: either way, not tried again at once

    def _rename_sleeper(self, ticket: int, heir_token: str, sleeper: int) -> tuple[int, bool]:
        """The session this thread's wait is woken on now, and whether its place is still
        queued: if the session its queue row (``ticket``, ``heir_token``) names
        (``sleeper``) failed and was replaced during the wait, the row is made to name
        the new one, so that a release wakes the waiter again. A session fails when
        the server restarts or fails over, which can lose the place too
        (``_queue_again``)."""
        current = self._sleeper()
        if current is None or current == sleeper:
            return sleeper, True
        renamed = self._run(
            lambda db: self._execute(
                db,
                f"UPDATE {WAITERS} SET connection_id = %s WHERE id = %s AND token = %s",
                (current, ticket, heir_token),
            )
        )
        return current, renamed > 0

    def _sleeper(self) -> int | None:
        """The server session this thread's waits sleep on (``_sleep_in_the_server``)
        or listen on (``LeaseStore._listen``), where a release wakes them; ``None``
        elsewhere, or if it cannot be opened."""
        session_id = self.dialect.session_id
        if session_id is None:
            return None
        try:
            return session_id(self._listeners.get().connection)
        except DatabaseError:
            self._listeners.discard()
            return None

    def _enqueuing(
        self,
        request: AcquireRequest,
        key: str,
        waiter_ttl: float,
        heir_token: str,
        sleeper: int | None,
    ) -> Callable[[BaseDatabaseWrapper], tuple[int | None, int, GrantRecord | None]]:
        """``_enqueue`` as an operation for ``_run``, which tries it once more on a new
        connection when the first one failed; returns ``_enqueue``'s ticket and count,
        and ``None``, or, on a retry, ``(None, 0, grant)`` when a release had already
        handed the first try's row a slot.

        That first try may have written its row before its reply was lost. A second
        row would be counted ahead of the waiters behind it until ``WAITER_TTL``, and
        once the waiter held a slot under its token, a release could hand that row a
        slot under the same token. So a retry first deletes the first row (found by
        the waiter's token), then reads the slot handed to it, if a release served it
        meanwhile (after the delete, no release can hand it one), and queues again,
        at the back, only if none was. A first try that the server runs still, after
        the retry's delete (held up by a lock for that long), can leave its row
        behind: it expires at ``WAITER_TTL``.
        """
        tries = 0

        def enqueue(db: BaseDatabaseWrapper) -> tuple[int | None, int, GrantRecord | None]:
            nonlocal tries
            tries += 1
            if tries > 1:
                return self._queue_again(
                    db, request, key, waiter_ttl, heir_token, sleeper, heir_token
                )
            ticket, ahead = self._enqueue(db, request, key, waiter_ttl, heir_token, sleeper)
            return ticket, ahead, None

        return enqueue

    def _queue_again(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        waiter_ttl: float,
        heir_token: str,
        sleeper: int | None,
        next_token: str,
    ) -> tuple[int | None, int, GrantRecord | None]:
        """Take a new place at the back of the queue under ``next_token``, after a first
        enqueue whose reply was lost (``_enqueuing``) or a place that is gone: a sweep
        removed it while its waiter stalled past ``WAITER_TTL`` (a pause, a stopped
        process), or the store failed over to a replica that had not received it.
        Without a place, the waiter would go on polling for a slot, unseen in the
        listings, and anyone who queued after it could be served first.
        Deletes whatever row ``heir_token``, the token of the first place, still has,
        then returns the slot a release handed to it meanwhile, if one did (``(None, 0,
        grant)``; after the delete, no release can hand it one), else the new ticket and
        the waiters ahead of it."""
        self._delete_places(db, [Place(key, heir_token)])
        handed = self._handed_grant(db, request, heir_token)
        if handed is not None:
            return None, 0, handed
        ticket, ahead = self._enqueue(db, request, key, waiter_ttl, next_token, sleeper)
        return ticket, ahead, None

    def _enqueue(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        waiter_ttl: float,
        heir_token: str,
        sleeper: int | None,
    ) -> tuple[int, int]:
        """Add the caller's waiter row, with the token, TTL and limit a release hands a
        slot over with, and the session it sleeps on (``sleeper``). Returns its ``id``,
        the ticket, and how many live waiters are ahead of it, counted in the same
        round trip (the dialect's ``enqueue``)."""
        d = self.dialect
        ident = request.identity
        sql = (
            f"INSERT INTO {WAITERS} (name_key, name, host, pid, thread, label, since, "
            f"expires_at, token, ttl, slot_limit, connection_id) "
            f"VALUES (%s, %s, %s, %s, %s, %s, {d.now}, {d.plus_seconds}, %s, %s, %s, %s)"
        )
        params = (
            key,
            request.name,
            ident.host,
            ident.pid,
            ident.thread,
            ident.label,
            d.seconds_param(waiter_ttl),
            heir_token,
            request.ttl,
            request.limit,
            sleeper,
        )
        with statement_cursor(db) as cursor:
            return d.enqueue(cursor, sql, params, WAITERS, d.now)

    def _waiting_ahead(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        ticket: int,
        heir_token: str,
    ) -> tuple[int, GrantRecord | None]:
        """How many live waiters are ahead of ``ticket``, and the grant a release handed
        over with ``heir_token``, if any."""
        with statement_cursor(db) as cursor:
            if self.dialect.hand_over is None:
                return self._count_ahead(cursor, key, ticket), None
            now = self.dialect.now
            sent = time.monotonic()
            cursor.execute(
                f"SELECT (SELECT COUNT(*) FROM {WAITERS} WHERE name_key = %s "
                f"AND expires_at > {now} AND id < %s), {self._handed_columns('s.')} "
                f"FROM (SELECT 1) AS one LEFT JOIN {SLOTS} s "
                f"ON s.token = %s AND s.expires_at > {now}",
                (key, ticket, heir_token),
            )
            ahead, *handed = cursor.fetchone()
        if handed[0] is None:
            return int(ahead), None
        return 0, _handed_record(db, request, heir_token, sent, handed)

    def _handed_grant(
        self, db: BaseDatabaseWrapper, request: AcquireRequest, heir_token: str
    ) -> GrantRecord | None:
        """The grant a release handed over with ``heir_token``, if one did: one look-up
        by the token's unique index, for a waiter that a hand-over woke."""
        sent = time.monotonic()
        handed = self._outcome(
            db,
            f"SELECT {self._handed_columns()} "
            f"FROM {SLOTS} WHERE token = %s AND expires_at > {self.dialect.now}",
            (heir_token,),
        )[0]
        return None if handed is None else _handed_record(db, request, heir_token, sent, handed)

    def _handed_columns(self, table: str = "") -> str:
        """The columns of a handed slot that ``_handed_record`` reads, in its order, of the
        slot table named ``table`` (with its dot; none: the only one)."""
        left = self.dialect.seconds_until.format(f"{table}expires_at")
        return f"{table}slot, {table}fence, {table}expires_at, {left}"

    def _refresh_waiter(
        self, db: BaseDatabaseWrapper, ticket: int, heir_token: str, waiter_ttl: float
    ) -> bool:
        """Keep the place (``ticket``, ``heir_token``) for ``waiter_ttl`` seconds more;
        False if it is gone (``_queue_again``)."""
        return (
            self._execute(
                db,
                f"UPDATE {WAITERS} SET expires_at = {self.dialect.plus_seconds} "
                f"WHERE id = %s AND token = %s",
                (self.dialect.seconds_param(waiter_ttl), ticket, heir_token),
            )
            > 0
        )


def _handed_record(
    db: BaseDatabaseWrapper,
    request: AcquireRequest,
    heir_token: str,
    sent: float,
    handed: Sequence[Any],
) -> GrantRecord:
    """The grant of the slot handed over with ``heir_token``, from its row (slot, fence,
    expiry, seconds left by the store's clock) read from ``db`` by a statement sent at ``sent``
    (monotonic). The lease began when it was handed over, ``ttl - left`` seconds ago by
    the store's clock: the holder's belief counts from that long before ``sent``."""
    slot, fence, expires_at, left = handed
    began = sent - max(0.0, request.ttl - float(left))
    return GrantRecord(heir_token, int(slot), int(fence), as_datetime(expires_at, db), None, began)
