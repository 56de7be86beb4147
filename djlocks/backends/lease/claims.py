"""How the lease backend claims a slot: one statement for a lock, and one round
trip for a semaphore on PostgreSQL and MySQL; a short transaction for a semaphore
on SQLite, the first use of a name or a change of its limit.

A lock (limit 1) is claimed by one ``UPDATE`` that also issues the fence
(``fence = fence + 1``) and refuses to pass a live waiter of the queue. A
semaphore slot's claim locks the name's slot rows (``SELECT ... FOR UPDATE``;
SQLite's ``BEGIN IMMEDIATE``), so the fence is one more than the largest fence
of any slot of the name: on PostgreSQL in one ``UPDATE`` whose CTE locks them, on
MySQL in one batch of statements, elsewhere in a transaction.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import AcquireRequest, GrantRecord, LimitAboveMost
from djlocks.backends.dedicated import statement_cursor
from djlocks.backends.lease.store import (
    SLOTS,
    WAITERS,
    Contention,
    LeaseStore,
    transaction,
)
from djlocks.backends.sql import as_datetime
from djlocks.exceptions import AlreadyHeld, BackendUnavailable

acquire_log = logging.getLogger("djlocks.acquire")

#: Seconds between checks that a lock's rows exist with limit 1.
SHAPE_RECHECK = 1.0
#: Claims tried in a row while they meet a deadlock or a busy database.
CLAIM_RETRIES = 20

#: A one-statement claim: (connection, request, name key, ticket, token, the monotonic
#: moment the claim was sent) -> grant or None.
ClaimStatement = Callable[
    [BaseDatabaseWrapper, AcquireRequest, str, int, str, float], GrantRecord | None
]


#: The most slots a lease semaphore is given (rows that exist already are kept).
MAX_SLOTS = 10_000


def refuse_too_many_slots(request: AcquireRequest) -> None:
    """``LimitAboveMost`` (a ``ValueError``) before a name is given more than
    ``MAX_SLOTS`` slot rows."""
    if request.limit > MAX_SLOTS:
        raise LimitAboveMost(
            f"A lease semaphore has at most {MAX_SLOTS} slots (got {request.limit}): each "
            f"slot is a row, all made at the name's first grant."
        )


class LeaseClaims(LeaseStore):
    """Claiming a slot for a caller whose place in the queue is ``ticket``."""

    def _claim(
        self, request: AcquireRequest, key: str, ticket: int, arrival: ExitStack | None = None
    ) -> GrantRecord | None:
        """Try once to take a slot; clean up by token if the outcome is unknown.
        ``arrival``, the caller's turn at the store if it holds one, ends before a claim
        that met contention is tried again: nobody waits for this one's retries."""
        token = secrets.token_hex(16)
        at_once = self._claim_at_once(request)
        self._connections.discard_if_ended()  # a claim is not retried on a failed connection
        try:
            for _ in range(CLAIM_RETRIES):
                sent = time.monotonic()  # the lease cannot start before the claim is sent
                try:
                    if at_once is not None:
                        grant = self._run(  # runs now, in this turn: B023 does not apply
                            lambda db: at_once(db, request, key, ticket, token, sent),  # noqa: B023
                            retry=False,
                        )
                        # A miss means "busy" once the rows are known to have the
                        # request's limit; the shape is re-checked now and then, in case
                        # it changed.
                        confirmed = self._shaped.get((key, request.limit), -SHAPE_RECHECK)
                        if grant is not None or time.monotonic() - confirmed < SHAPE_RECHECK:
                            return grant
                    grant = self._run(
                        lambda db: self._claim_slot(db, request, key, ticket, token, sent),  # noqa: B023
                        retry=False,
                    )
                    self._shaped[key, request.limit] = time.monotonic()
                    return grant
                except Contention:
                    if arrival is not None:
                        arrival.close()
                    time.sleep(secrets.randbelow(2000) / 1_000_000)
            raise BackendUnavailable(
                f"djlocks backend {self.alias!r}: {CLAIM_RETRIES} claims of "
                f"{request.name!r} in a row met a deadlock or busy database."
            )
        except AlreadyHeld:
            raise
        except BaseException:
            self._discard_token(token)
            raise

    def _claim_at_once(self, request: AcquireRequest) -> ClaimStatement | None:
        """The one-statement claim for the request's rows, once they exist with its
        limit: a lock's everywhere, a semaphore slot's where the store can lock the
        name's rows and claim one of them in one round trip (PostgreSQL, MySQL)."""
        if request.limit == 1:
            return self._claim_lock
        return self._claim_free_slot if self.dialect.claim_free_slot is not None else None

    def _discard_token(self, token: str) -> None:
        try:
            self._run(
                lambda db: self._execute(
                    db,
                    f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL WHERE token = %s",
                    (token,),
                )
            )
        except BackendUnavailable as exc:
            acquire_log.warning(
                "could not clean up token %s (%s); it expires at its TTL", token, exc
            )

    def _claim_lock(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        ticket: int,
        token: str,
        sent: float,
    ) -> GrantRecord | None:
        d = self.dialect
        ident = request.identity
        sql = (
            f"UPDATE {SLOTS} SET token = %s, {d.fence_increment}, acquired_at = {d.now}, "
            f"expires_at = {d.plus_seconds}, release_by = NULL, host = %s, pid = %s, "
            f"thread = %s, label = %s "
            f"WHERE name_key = %s AND slot = 0 AND slot_limit = 1 "
            f"AND (token IS NULL OR expires_at <= {d.now}) "
            f"AND (cooldown_until IS NULL OR cooldown_until <= {d.now}) "
            f"AND NOT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name_key = %s "
            f"AND w.expires_at > {d.now} AND w.id < %s)"
        )
        params = (
            token,
            d.seconds_param(request.ttl),
            ident.host,
            ident.pid,
            ident.thread,
            ident.label,
            key,
            key,
            ticket,
        )
        if d.returning:
            row = self._outcome(db, sql + " RETURNING fence, expires_at", params)[0]
            if row is None:
                return None
            return GrantRecord(token, 0, int(row[0]), as_datetime(row[1], db), requested_at=sent)
        _, claimed, fence = self._outcome(db, sql, params)
        if claimed != 1:
            return None
        estimate = datetime.now(UTC) + timedelta(seconds=request.ttl)  # wall clock ok
        return GrantRecord(token, 0, fence, estimate, requested_at=sent)

    def _claim_free_slot(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        ticket: int,
        token: str,
        sent: float,
    ) -> GrantRecord | None:
        """``_claim_slot`` in one round trip, for rows that exist with the request's
        limit (``LeaseDialect.claim_free_slot``)."""
        claim = self.dialect.claim_free_slot
        assert claim is not None
        ident = request.identity
        params = {
            "key": key,
            "limit": request.limit,
            "ticket": ticket,
            "token": token,
            "ttl": self.dialect.seconds_param(request.ttl),
            "host": ident.host,
            "pid": ident.pid,
            "thread": ident.thread,
            "label": ident.label,
        }
        with statement_cursor(db) as cursor:
            row = claim(cursor, SLOTS, WAITERS, params)
        if row is None:
            return None
        return GrantRecord(
            token, int(row[0]), int(row[1]), as_datetime(row[2], db), requested_at=sent
        )

    def _claim_slot(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        ticket: int,
        token: str,
        sent: float,
    ) -> GrantRecord | None:
        d = self.dialect
        ident = request.identity
        slots = (
            f"SELECT id, slot, slot_limit, fence, (token IS NULL OR expires_at <= {d.now}), "
            f"(cooldown_until IS NULL OR cooldown_until <= {d.now}) "
            f"FROM {SLOTS} WHERE name_key = %s ORDER BY slot{d.for_update}"
        )
        with transaction(db, d.begin), statement_cursor(db) as cursor:
            cursor.execute(slots, (key,))
            rows: Sequence[Sequence[Any]] = cursor.fetchall()
            created = not rows
            if created:
                self._create_slots(cursor, request, key)
                cursor.execute(slots, (key,))
                rows = cursor.fetchall()
            limit = int(rows[0][2])
            if limit != request.limit and all(row[4] for row in rows):
                rows = self._reshape(cursor, request, key, rows)
            elif limit != request.limit:
                raise AlreadyHeld.limit_mismatch(request.name, limit, request.limit)
            ahead = self._count_ahead(cursor, key, ticket)
            free = [row for row in rows if row[4] and row[5]]
            if len(free) <= ahead:
                return None
            slot = int(free[0][1])
            fence = max(int(row[3]) for row in rows) + 1
            cursor.execute(
                f"UPDATE {SLOTS} SET token = %s, fence = %s, acquired_at = {d.now}, "
                f"expires_at = {d.plus_seconds}, cooldown_until = NULL, release_by = NULL, "
                f"host = %s, pid = %s, thread = %s, label = %s WHERE name_key = %s AND slot = %s",
                (
                    token,
                    fence,
                    d.seconds_param(request.ttl),
                    ident.host,
                    ident.pid,
                    ident.thread,
                    ident.label,
                    key,
                    slot,
                ),
            )
            cursor.execute(f"SELECT expires_at FROM {SLOTS} WHERE token = %s", (token,))
            expires_at = as_datetime(cursor.fetchone()[0], db)
        if created:
            acquire_log.info("created %s slot(s) for %s", request.limit, request.name)
        return GrantRecord(token, slot, fence, expires_at, requested_at=sent)

    def _create_slots(self, cursor: Any, request: AcquireRequest, key: str) -> None:
        """Insert a new name's slot rows, their fence at the store's clock in
        microseconds (``first_fence``): a name that a sweep removed starts above
        every fence it had."""
        refuse_too_many_slots(request)
        cursor.execute(f"SELECT {self.dialect.first_fence}", ())
        fence = int(cursor.fetchone()[0])
        cursor.executemany(
            f"INSERT INTO {SLOTS} (name_key, name, slot, slot_limit, fence, host, thread, label) "
            f"VALUES (%s, %s, %s, %s, %s, '', '', '')",
            [(key, request.name, slot, request.limit, fence) for slot in range(request.limit)],
        )

    def _reshape(
        self, cursor: Any, request: AcquireRequest, key: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...]]:
        """Give an unheld name ``request.limit`` slots; fences continue from the largest."""
        refuse_too_many_slots(request)
        fence = max(int(row[3]) for row in rows)
        cursor.execute(
            f"DELETE FROM {SLOTS} WHERE name_key = %s AND slot >= %s", (key, request.limit)
        )
        cursor.execute(
            f"UPDATE {SLOTS} SET slot_limit = %s, fence = %s WHERE name_key = %s",
            (request.limit, fence, key),
        )
        cursor.executemany(
            f"INSERT INTO {SLOTS} (name_key, name, slot, slot_limit, fence, host, thread, label) "
            f"VALUES (%s, %s, %s, %s, %s, '', '', '')",
            [
                (key, request.name, slot, request.limit, fence)
                for slot in range(len(rows), request.limit)
            ],
        )
        acquire_log.info("%s now has %s slot(s)", request.name, request.limit)
        kept = {int(row[1]): row for row in rows}
        return [
            (None, slot, request.limit, fence, True, bool(kept[slot][5]) if slot in kept else True)
            for slot in range(request.limit)
        ]

    def _count_ahead(self, cursor: Any, key: str, ticket: int) -> int:
        """How many live waiters for ``key`` queued before ``ticket``."""
        cursor.execute(
            f"SELECT COUNT(*) FROM {WAITERS} WHERE name_key = %s "
            f"AND expires_at > {self.dialect.now} AND id < %s",
            (key, ticket),
        )
        return int(cursor.fetchone()[0])
