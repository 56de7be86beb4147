"""``LeaseBackend``: acquire, release, renew and revoke lease rows.

The parts it is made of, one idea each: ``store`` (connections, errors, the
database's dialect from ``djlocks.backends.sql``), ``claims`` (taking a slot
with its fence), ``queue`` (the fair queue of waiters) and ``inspection``
(holders, waiters, cool-downs, the sweep).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta

from django.core.checks import CheckMessage, Error
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import (
    OTHER_DATABASE_HINT,
    AcquireRequest,
    Capabilities,
    GrantRecord,
    unknown_database,
)
from djlocks.backends.dedicated import statement_cursor
from djlocks.backends.driver import driver_messages
from djlocks.backends.lease.inspection import LeaseInspection
from djlocks.backends.lease.queue import LeaseQueue
from djlocks.backends.lease.store import SLOTS, WAITERS, earlier
from djlocks.backends.primary import read_only_messages
from djlocks.backends.sql import as_datetime
from djlocks.backends.sqlite_checks import TESTING_HINT, lease_store_messages
from djlocks.backends.waiting import Abort
from djlocks.exceptions import BackendUnavailable, LockLost, ReleaseRequested
from djlocks.keys import table_key

release_log = logging.getLogger("djlocks.release")
renew_log = logging.getLogger("djlocks.renew")

#: The ticket of a caller that is not queued: every live waiter is ahead of it.
NEWCOMER = 2**62


#: Why a grant ended before its release or renewal, as ``LockLost`` says.
LEASE_RAN_OUT = "its lease ran out without a renewal"
TAKEN_AWAY = "an operator released it by force, or its lease ran out and the slot was taken"


class LeaseBackend(LeaseQueue, LeaseInspection):
    """Locks and semaphores as lease rows in a Django database.

    OPTIONS: ``using`` (database alias; default: where the routers write djlocks'
    tables, ``base.database_alias``).
    Crash release: at the TTL. Waiters queue FIFO in ``djlocks_lease_waiter``;
    the head of the queue polls with back-off, the others poll more slowly.
    """

    forced_release_effect = (
        "its lease is revoked at once and its fence superseded: the next holder gets a "
        "higher fence, so the old holder's fenced writes are refused. On PostgreSQL the "
        "holder hears of it at once (NOTIFY); elsewhere at its next renewal (every TTL/3)"
    )

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Leases with a FIFO queue; revocations are pushed where releases notify (PostgreSQL)."""
        return Capabilities(
            fifo=True,
            semaphores=True,
            cooldowns=True,
            crash_release="ttl",
            history=True,
            graceful_release=True,
            pushes_revocation=self.dialect.notifying is not None,
            shared_between_processes=True,
        )

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; E015 PostgreSQL through psycopg2 (``driver``); when
        Django asks about the database, E014 a read-only server (``primary``); on SQLite,
        E004 and W007 (``sqlite_checks``)."""
        from django.db import connections

        problems = unknown_database(self, self.using) or driver_messages(self.alias, self.using)
        if problems:
            return problems
        try:
            self.dialect  # noqa: B018  (refuses a database it does not support)
        except BackendUnavailable as exc:
            return [Error(str(exc), hint=OTHER_DATABASE_HINT, id="djlocks.E006")]
        if connections[self.using].vendor != "sqlite":
            asked = databases is not None and self.using in databases
            return read_only_messages(self.alias, self.using) if asked else []
        return lease_store_messages(self.alias, connections[self.using], databases)

    # -- acquire -----------------------------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        """Claim a free slot, else (if the deadline allows) wait in the queue. Where this
        process's last release of the name handed its slot to a waiter, a wait queues
        at once: others most likely still wait, and a newcomer's claim, which yields to
        every live waiter, would cost a round trip to fail. Were the queue empty by
        then, the head of it claims the free slot and leaves the queue: two round trips
        more than a newcomer's claim."""
        key = table_key(request.name)
        self._refuse_inside_sqlite_transaction()
        may_wait = deadline is None or time.monotonic() < deadline
        with ExitStack() as arrival:
            # Where operations take turns (SQLite), the claim and the place in the queue
            # are one turn: nobody releases and claims again in between.
            arrival.enter_context(self._turn())
            if not (may_wait and key in self._contended_names):
                grant = self._claim(request, key, NEWCOMER, arrival)
                if grant is not None or (deadline is not None and time.monotonic() >= deadline):
                    return grant
            grant = self._wait_in_queue(request, key, deadline, abort, arrival)
        if grant is not None:
            self._queued_grants.add(grant.token)
        return grant

    def _refuse_inside_sqlite_transaction(self) -> None:
        from django.db import connections

        caller = connections[self.using]
        if caller.vendor == "sqlite" and caller.in_atomic_block:
            raise BackendUnavailable(
                "A lease on SQLite cannot be acquired inside transaction.atomic(): the "
                "transaction already holds SQLite's single write lock, so the lease row "
                "could never be written. Acquire the lock first, then open the transaction. "
                "Django's TestCase runs every test in a transaction: " + TESTING_HINT
            )

    # -- release, renew, check ---------------------------------------------

    def release(self, name: str, token: str, cooldown: float) -> None:
        """Free the slot (or hold it back for ``cooldown`` seconds). Without a cool-down,
        where the store hands over (``LeaseDialect.hand_over``), a name nobody waits
        for is freed by one plain ``UPDATE``, and otherwise the slot goes to the head
        of the queue in the same round trip.

        A waiter that queues while that ``UPDATE`` runs (after it looked at the queue)
        is neither handed the slot nor woken: its claim finds the slot free, at once
        if its claim waited on the slot's row lock, else at its next poll
        (``NOTIFIED_POLL``). Nobody barges in meanwhile: a claim never passes a
        live waiter. A grant this process got by waiting in the queue goes straight
        to the hand-over: others most likely still wait. A release that handed the
        slot to a waiter has this process's next acquire of the name queue at once
        (``acquire``)."""
        hands_over = not cooldown and self.dialect.hand_over is not None
        handed = False
        if hands_over and self._queued_grants.forget(token):
            released = 0
        else:
            released = self._release_plainly(token, cooldown, only_if_nobody_waits=hands_over)
        if released != 1 and hands_over:
            released, handed, _ = self._hand_over(token)
        if released == 1:
            remember = self._contended_names.add if handed else self._contended_names.forget
            remember(table_key(name))
            release_log.debug("released %s", name)
            return
        expired = self._run(
            lambda db: self._execute(
                db,
                f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL WHERE token = %s",
                (token,),
            )
        )
        reason = LEASE_RAN_OUT if expired else TAKEN_AWAY
        raise LockLost(f"The grant of {name!r} had ended before release: {reason}.")

    def _release_plainly(self, token: str, cooldown: float, *, only_if_nobody_waits: bool) -> int:
        """Free the grant ``token``'s slot, held back for ``cooldown`` seconds, by one
        ``UPDATE`` that also wakes the waiters where the store can; with
        ``only_if_nobody_waits``, only if no live waiter queues for the name, and
        without waiting for the log flush where the store lets a transaction choose
        (``LeaseDialect.returning_unflushed``). How many slots it freed."""
        d = self.dialect
        update = (
            f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL, "
            f"cooldown_until = {d.plus_seconds} WHERE token = %s AND expires_at > {d.now}"
        )
        if only_if_nobody_waits:  # never with a cool-down, which must outlive a crash
            update += (
                f" AND NOT EXISTS (SELECT 1 FROM {WAITERS} w "
                f"WHERE w.name_key = {SLOTS}.name_key AND w.expires_at > {d.now})"
                f"{d.returning_unflushed}"
            )
        else:
            update = self._notifying(update, waiters=True, holders=False)
        params = (d.seconds_param(cooldown), token)
        return self._run(lambda db: self._execute_freeing(db, update, params))

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """Extend the lease ``ttl`` seconds from the database's now; raise ``LockLost`` if
        it ended, and ``ReleaseRequested`` (after extending it no further than the
        operator's wait) while an operator asks for it back."""
        d = self.dialect

        def extend(db: BaseDatabaseWrapper) -> tuple[int, datetime | None]:
            sql = (
                f"UPDATE {SLOTS} SET expires_at = {d.plus_seconds} "
                f"WHERE token = %s AND expires_at > {d.now} AND release_by IS NULL"
            )
            params = (d.seconds_param(ttl), token)
            with statement_cursor(db) as cursor:
                if d.returning:
                    cursor.execute(sql + " RETURNING expires_at", params)
                    row = cursor.fetchone()
                    return (0, None) if row is None else (1, as_datetime(row[0], db))
                cursor.execute(sql, params)
                estimate = datetime.now(UTC) + timedelta(seconds=ttl)  # wall clock ok
                return int(cursor.rowcount), estimate

        renewed, expires_at = self._run(extend)
        if renewed == 1:
            renew_log.debug("renewed %s until %s", name, expires_at)
            return expires_at
        standing = self._run(lambda db: self._extend_to_release_by(db, name, token, ttl))
        if isinstance(standing, ReleaseRequested):
            raise standing
        if standing:  # a claim cleared release_by between the two statements: not this grant's
            raise BackendUnavailable(f"The renewal of {name!r} raced with a claim; retry.")
        raise LockLost(f"The lease on {name!r} could not be renewed: {self._why_ended(token)}.")

    def _why_ended(self, token: str) -> str:
        """Why the grant ``token`` is not live: its row still holds the token (the lease
        ran out, and nobody has taken the slot since) or not (``TAKEN_AWAY``)."""
        row = self._run(
            lambda db: self._outcome(db, f"SELECT 1 FROM {SLOTS} WHERE token = %s", (token,))[0]
        )
        return TAKEN_AWAY if row is None else LEASE_RAN_OUT

    def _extend_to_release_by(
        self, db: BaseDatabaseWrapper, name: str, token: str, ttl: float
    ) -> bool | ReleaseRequested:
        """Renew a grant an operator asked for back, no further than its ``release_by``;
        then say where it stands (``_standing``)."""
        d = self.dialect
        until = d.seconds_param(ttl)
        self._execute(
            db,
            f"UPDATE {SLOTS} SET expires_at = {earlier('release_by', d.plus_seconds)} "
            f"WHERE token = %s AND expires_at > {d.now} AND release_by IS NOT NULL",
            (until, until, token),
        )
        return self._standing(db, name, token)

    def _standing(self, db: BaseDatabaseWrapper, name: str, token: str) -> bool | ReleaseRequested:
        """False if the grant ``token`` ended, True if it is live, or the
        ``ReleaseRequested`` to raise while an operator asks for it back."""
        now = self.dialect.now
        with statement_cursor(db) as cursor:
            cursor.execute(
                f"SELECT release_by IS NOT NULL, expires_at, {now} FROM {SLOTS} "
                f"WHERE token = %s AND expires_at > {now}",
                (token,),
            )
            row = cursor.fetchone()
        if row is None or not row[0]:
            return row is not None
        expires_at, store_now = as_datetime(row[1], db), as_datetime(row[2], db)
        left = max(0.0, (expires_at - store_now).total_seconds())
        return ReleaseRequested(
            f"An operator asked for the grant of {name!r} back: its lease ends in "
            f"{left:.1f} s at the latest.",
            left,
            expires_at,
        )

    def is_held(self, name: str, token: str) -> bool:
        """True if the grant is live, False if it ended; raises ``ReleaseRequested``
        while an operator asks for it back."""
        standing = self._run(lambda db: self._standing(db, name, token))
        if isinstance(standing, ReleaseRequested):
            raise standing
        return standing

    # -- operators ---------------------------------------------------------

    def force_release(self, name: str, token: str | None = None) -> int:
        """Revoke the grant ``token`` (or every grant) of ``name``; on PostgreSQL the
        holders and the waiters hear of it at once (NOTIFY)."""
        sql = f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL WHERE name_key = %s"
        params: tuple[str, ...] = (table_key(name),)
        if token is not None:
            sql += " AND token = %s"
            params += (token,)
        else:
            sql += " AND token IS NOT NULL"
        revoking = self._notifying(sql, waiters=True, holders=True)
        return self._run(lambda db: self._execute_freeing(db, revoking, params))

    def request_release(self, name: str, token: str, wait: float) -> int:
        """Cut the lease to end ``wait`` seconds from the database's now at the latest
        and note that end in ``release_by``, which renewals respect (see the base class);
        on PostgreSQL the holder hears of it at once (NOTIFY)."""
        d = self.dialect
        until = d.seconds_param(wait)
        sql = (
            f"UPDATE {SLOTS} SET release_by = {earlier('release_by', d.plus_seconds)}, "
            f"expires_at = {earlier('expires_at', d.plus_seconds)} "
            f"WHERE name_key = %s AND token = %s AND expires_at > {d.now}"
        )
        revoking = self._notifying(sql, waiters=False, holders=True)
        params = (until, until, until, until, table_key(name), token)
        return self._run(lambda db: self._execute(db, revoking, params))

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """On PostgreSQL, ``notice`` is called when a forced release or a graceful
        release's request of this grant is notified; elsewhere the store cannot push."""
        if self.dialect.notifying is None:
            return None
        return self._revocations.watch(f"{table_key(name)} {fence}", notice)

    def close(self) -> None:
        self._revocations.close()
