"""The lease backend: locks and semaphore slots as rows that expire.

Tables (``djlocks.models``): ``djlocks_lease_slot`` holds one row per slot of a
name (``limit`` rows, created on first use); ``djlocks_lease_waiter`` holds one
row per waiting process, its ``id`` being its ticket in the FIFO queue.

Every decision "free or expired?" is taken inside one SQL statement with the
database's clock (``statement_timestamp()`` on PostgreSQL, ``UTC_TIMESTAMP(6)``
on MySQL/MariaDB, ``strftime('%Y-%m-%d %H:%M:%f', 'now')`` on SQLite). Release
and renewal are compare-and-act on the grant's random token.

* A lock (limit 1) is claimed by one ``UPDATE`` that also issues the fence
  (``fence = fence + 1``) and refuses to pass a live waiter of the queue.
* A semaphore slot, the first use of a name and any disagreement about the
  limit go through a short transaction that locks the name's slot rows
  (``SELECT ... FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``), so the fence is
  one more than the largest fence of any slot of the name.
* A forced release clears the grant's token; a graceful release's request sets
  ``release_by`` (the operator's wait), past which renewals no longer extend
  the lease. On PostgreSQL both ``NOTIFY`` the holders (``REVOKED``), whose
  process listens (``push.PostgresListener``) and renews at once.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, IntegrityError, ProgrammingError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.dateparse import parse_datetime

from djlocks.backends.base import (
    OTHER_DATABASE_HINT,
    Abort,
    AcquireRequest,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    unknown_database,
)
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.push import PostgresListener
from djlocks.backends.sqlite_checks import TESTING_HINT, lease_store_messages
from djlocks.conf import djlocks_settings
from djlocks.events import Kind, events
from djlocks.exceptions import AlreadyHeld, BackendUnavailable, LockLost, ReleaseRequested
from djlocks.keys import table_key

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from djlocks.models import LeaseSlot

acquire_log = logging.getLogger("djlocks.acquire")
release_log = logging.getLogger("djlocks.release")
renew_log = logging.getLogger("djlocks.renew")

SLOTS = "djlocks_lease_slot"
WAITERS = "djlocks_lease_waiter"
CHANNEL = "djlocks_lease"  # PostgreSQL NOTIFY channel; the payload is the name_key
#: PostgreSQL NOTIFY channel of forced releases and graceful releases' requests, which
#: the holders listen on; the payload is "<name_key> <fence>" (see ``watch``).
REVOKED = "djlocks_revoked"
NOTIFIED_POLL = 0.025  # seconds; where releases notify, polling is only the fallback
SHAPE_RECHECK = 1.0  # seconds between checks that a lock's rows exist with limit 1
NEWCOMER = 2**62  # the ticket of a caller that is not queued: every live waiter is ahead
HEAD_POLL_MIN = 0.001  # seconds; the head of the queue polls from here ...
HEAD_POLL_MAX = 0.004  # ... backing off to here
QUEUE_POLL_STEP = 0.005  # a waiter k places behind the next-in-line polls every k steps
CLAIM_RETRIES = 20
HOLDER_FIELDS = [
    "name",
    "slot",
    "limit",
    "host",
    "pid",
    "thread",
    "label",
    "acquired_at",
    "expires_at",
    "fence",
    "token",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Dialect:
    """The few SQL fragments that differ between databases."""

    now: str
    plus_seconds: str  # the store's now plus one %s parameter, see seconds_param
    for_update: str
    returning: bool
    fence_increment: str  # sets fence to fence + 1 and makes it readable
    begin: str  # starts a transaction that serialises the claims of one name

    seconds_param: Callable[[float], object]  # seconds as plus_seconds's parameter
    notifies: bool = False  # releases wake waiters through LISTEN/NOTIFY


DIALECTS = {
    "postgresql": Dialect(
        now="statement_timestamp()",
        plus_seconds="statement_timestamp() + %s * interval '1 second'",
        for_update=" FOR UPDATE",
        returning=True,
        fence_increment="fence = fence + 1",
        begin="BEGIN",
        seconds_param=float,
        notifies=True,
    ),
    "mysql": Dialect(
        now="UTC_TIMESTAMP(6)",
        plus_seconds="UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND",
        for_update=" FOR UPDATE",
        returning=False,
        # MySQL/MariaDB have no UPDATE ... RETURNING: LAST_INSERT_ID(expr) hands the
        # new value back in the OK packet (cursor.lastrowid), in the same round trip.
        fence_increment="fence = LAST_INSERT_ID(fence + 1)",
        begin="START TRANSACTION",
        seconds_param=lambda seconds: round(seconds * 1_000_000),
    ),
    "sqlite": Dialect(
        now="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')",
        plus_seconds="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)",
        for_update="",
        returning=True,
        fence_increment="fence = fence + 1",
        # SQLite has no row locks: IMMEDIATE takes the database's write lock up front.
        begin="BEGIN IMMEDIATE",
        seconds_param=lambda seconds: f"+{seconds:.3f} seconds",
    ),
}

CONTENTION_MESSAGES = ("deadlock", "database is locked", "could not serialize", "lock wait timeout")


class _Contention(BackendUnavailable):
    """A claim met a deadlock, a busy database or a concurrent first use: try again."""


def _is_contention(exc: DatabaseError) -> bool:
    text = str(exc).lower()
    return isinstance(exc, IntegrityError) or any(m in text for m in CONTENTION_MESSAGES)


def _as_datetime(value: object) -> datetime | None:
    moment = value if value is None or isinstance(value, datetime) else parse_datetime(str(value))
    if moment is not None and moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment


class LeaseBackend(LockBackend):
    """Locks and semaphores as lease rows in a Django database.

    OPTIONS: ``using`` (database alias, default ``"default"``).
    Crash release: at the TTL. Waiters queue FIFO in ``djlocks_lease_waiter``;
    the head of the queue polls with back-off, the others poll more slowly.
    """

    forced_release_effect = (
        "its lease is revoked at once and its fence superseded: the next holder gets a "
        "higher fence, so the old holder's fenced writes are refused. On PostgreSQL the "
        "holder hears of it at once (NOTIFY); elsewhere at its next renewal (every TTL/3)"
    )
    releases_gracefully = True

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using: str = self.options.get("using", "default")
        self._connections = DedicatedConnections(self.using, on_connect=self._prepare)
        self._listeners = DedicatedConnections(self.using)
        # name_key -> when (monotonic) its rows were last confirmed to be a lock's
        self._lock_shaped: dict[str, float] = {}
        self._dialect: Dialect | None = None
        self._revocations = PostgresListener(self.using, REVOKED)  # listens once watched

    # -- connections -------------------------------------------------------

    @staticmethod
    def _prepare(wrapper: BaseDatabaseWrapper) -> None:
        if wrapper.vendor == "mysql":
            # Fewer gap locks, so concurrent claims deadlock less often.
            with wrapper.cursor() as cursor:
                cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")

    @property
    def dialect(self) -> Dialect:
        if self._dialect is None:
            from django.db import connections

            vendor = connections[self.using].vendor
            if vendor not in DIALECTS:
                raise BackendUnavailable(
                    f"The lease backend supports SQLite, PostgreSQL and MySQL/MariaDB, "
                    f"not {vendor!r} (database alias {self.using!r})."
                )
            self._dialect = DIALECTS[vendor]
        return self._dialect

    def _run(self, operation: Callable[[BaseDatabaseWrapper], T], *, retry: bool = True) -> T:
        """Run ``operation`` on this thread's dedicated connection.

        A lost connection is replaced and the operation tried once more when
        ``retry`` (every operation here is idempotent by token); other
        database errors become ``BackendUnavailable``.
        """
        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                wrapper = self._connections.get()
                with wrapper.wrap_database_errors:
                    return operation(wrapper)
            except DatabaseError as exc:
                if _is_contention(exc):
                    raise _Contention(str(exc)) from exc
                self._connections.discard()
                if attempt + 1 < attempts:
                    continue
                hint = (
                    " Have the djlocks migrations been applied (manage.py migrate djlocks)?"
                    if isinstance(exc, ProgrammingError)
                    else ""
                )
                raise BackendUnavailable(
                    f"djlocks backend {self.alias!r} could not use database "
                    f"{self.using!r}: {exc}.{hint}"
                ) from exc
        raise AssertionError("unreachable")

    # -- acquire -----------------------------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        key = table_key(request.name)
        self._refuse_inside_sqlite_transaction()
        grant = self._claim(request, key, NEWCOMER)
        if grant is not None or (deadline is not None and time.monotonic() >= deadline):
            return grant
        return self._wait_in_queue(request, key, deadline, abort)

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

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; on SQLite, E004 and W007 (``sqlite_checks``)."""
        from django.db import connections

        problems = unknown_database(self, self.using)
        if problems:
            return problems
        try:
            self.dialect  # noqa: B018  (refuses a database it does not support)
        except BackendUnavailable as exc:
            return [Error(str(exc), hint=OTHER_DATABASE_HINT, id="djlocks.E006")]
        if connections[self.using].vendor != "sqlite":
            return []
        return lease_store_messages(self.alias, connections[self.using], databases)

    def _wait_in_queue(
        self,
        request: AcquireRequest,
        key: str,
        deadline: float | None,
        abort: Abort | None,
    ) -> GrantRecord | None:
        waiter_ttl = float(djlocks_settings()["WAITER_TTL"])
        slow_poll = float(djlocks_settings()["POLL_INTERVAL"])
        ticket = self._run(lambda db: self._enqueue(db, request, key, waiter_ttl))
        acquire_log.debug("queued for %s as ticket %s", request.name, ticket)
        listening = self._listen()
        refresh_at = time.monotonic() + waiter_ttl / 3
        head_poll = HEAD_POLL_MIN
        try:
            while True:
                ahead = self._run(lambda db: self._count_ahead(db, key, ticket))
                if ahead < request.limit:
                    grant = self._claim(request, key, ticket)
                    if grant is not None:
                        return grant
                    pause = NOTIFIED_POLL if listening else head_poll
                    head_poll = min(head_poll * 1.5, HEAD_POLL_MAX)
                else:
                    # The next in line polls as often as the head, so it notices at
                    # once when it moves up; everyone further back polls less often.
                    behind = ahead - request.limit
                    pause = (
                        HEAD_POLL_MAX if behind == 0 else min(slow_poll, QUEUE_POLL_STEP * behind)
                    )
                    head_poll = HEAD_POLL_MIN
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
            self._run(lambda db: self._dequeue(db, ticket))

    def _listen(self) -> bool:
        """Start hearing releases (PostgreSQL); False where the store cannot notify."""
        if not self.dialect.notifies:
            return False
        try:
            with closing(self._listeners.get().create_cursor()) as cursor:
                cursor.execute(f"LISTEN {CHANNEL}", ())
        except DatabaseError:
            acquire_log.warning("LISTEN failed; falling back to polling", exc_info=True)
            self._listeners.discard()
            return False
        return True

    def _unlisten(self) -> None:
        """Stop hearing releases, so an idle connection never holds back the notify queue."""
        try:
            with closing(self._listeners.get().create_cursor()) as cursor:
                cursor.execute(f"UNLISTEN {CHANNEL}", ())
        except DatabaseError:
            self._listeners.discard()

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

    def _claim(self, request: AcquireRequest, key: str, ticket: int) -> GrantRecord | None:
        """Try once to take a slot; clean up by token if the outcome is unknown."""
        token = secrets.token_hex(16)
        try:
            for _ in range(CLAIM_RETRIES):
                sent = time.monotonic()  # the lease cannot start before the claim is sent
                try:
                    if request.limit == 1:
                        grant = self._run(
                            lambda db: self._claim_lock(db, request, key, ticket, token),
                            retry=False,
                        )
                        # A miss means "busy" once the rows are known to be a lock's;
                        # the shape is re-checked now and then, in case it changed.
                        confirmed = self._lock_shaped.get(key, -SHAPE_RECHECK)
                        if grant is not None or time.monotonic() - confirmed < SHAPE_RECHECK:
                            return grant and replace(grant, requested_at=sent)
                    grant = self._run(
                        lambda db: self._claim_slot(db, request, key, ticket, token),
                        retry=False,
                    )
                    if request.limit == 1:
                        self._lock_shaped[key] = time.monotonic()
                    return grant and replace(grant, requested_at=sent)
                except _Contention:
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
        with closing(db.create_cursor()) as cursor:
            if d.returning:
                cursor.execute(sql + " RETURNING fence, expires_at", params)
                row = cursor.fetchone()
                if row is None:
                    return None
                return GrantRecord(token, 0, int(row[0]), _as_datetime(row[1]))
            cursor.execute(sql, params)
            if cursor.rowcount != 1:
                return None
            estimate = datetime.now(UTC) + timedelta(seconds=request.ttl)  # wall clock ok
            return GrantRecord(token, 0, int(cursor.lastrowid), estimate)

    def _claim_slot(
        self,
        db: BaseDatabaseWrapper,
        request: AcquireRequest,
        key: str,
        ticket: int,
        token: str,
    ) -> GrantRecord | None:
        d = self.dialect
        ident = request.identity
        with _transaction(db, d.begin), closing(db.create_cursor()) as cursor:
            cursor.execute(
                f"SELECT id, slot, slot_limit, fence, "
                f"(token IS NULL OR expires_at <= {d.now}), "
                f"(cooldown_until IS NULL OR cooldown_until <= {d.now}) "
                f"FROM {SLOTS} WHERE name_key = %s ORDER BY slot{d.for_update}",
                (key,),
            )
            rows: Sequence[Sequence[Any]] = cursor.fetchall()
            if not rows:
                cursor.executemany(
                    f"INSERT INTO {SLOTS} (name_key, name, slot, slot_limit, fence, host, thread, "
                    f"label) VALUES (%s, %s, %s, %s, 0, '', '', '')",
                    [(key, request.name, slot, request.limit) for slot in range(request.limit)],
                )
                rows = [(None, slot, request.limit, 0, True, True) for slot in range(request.limit)]
                created = True
            else:
                created = False
            limit = int(rows[0][2])
            if limit != request.limit and all(row[4] for row in rows):
                rows = self._reshape(cursor, request, key, rows)
            elif limit != request.limit:
                raise AlreadyHeld.limit_mismatch(request.name, limit, request.limit)
            cursor.execute(
                f"SELECT COUNT(*) FROM {WAITERS} WHERE name_key = %s "
                f"AND expires_at > {d.now} AND id < %s",
                (key, ticket),
            )
            ahead = int(cursor.fetchone()[0])
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
            expires_at = _as_datetime(cursor.fetchone()[0])
        if created:
            acquire_log.info("created %s slot(s) for %s", request.limit, request.name)
        return GrantRecord(token, slot, fence, expires_at)

    def _reshape(
        self, cursor: Any, request: AcquireRequest, key: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...]]:
        """Give an unheld name ``request.limit`` slots; fences continue from the largest."""
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

    # -- the waiters' queue ------------------------------------------------

    def _enqueue(
        self, db: BaseDatabaseWrapper, request: AcquireRequest, key: str, waiter_ttl: float
    ) -> int:
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
            if db.vendor == "postgresql":
                cursor.execute(sql + " RETURNING id", params)
                return int(cursor.fetchone()[0])
            cursor.execute(sql, params)
            return int(cursor.lastrowid)

    def _count_ahead(self, db: BaseDatabaseWrapper, key: str, ticket: int) -> int:
        with closing(db.create_cursor()) as cursor:
            cursor.execute(
                f"SELECT COUNT(*) FROM {WAITERS} WHERE name_key = %s "
                f"AND expires_at > {self.dialect.now} AND id < %s",
                (key, ticket),
            )
            return int(cursor.fetchone()[0])

    def _refresh_waiter(self, db: BaseDatabaseWrapper, ticket: int, waiter_ttl: float) -> None:
        self._execute(
            db,
            f"UPDATE {WAITERS} SET expires_at = {self.dialect.plus_seconds} WHERE id = %s",
            (self.dialect.seconds_param(waiter_ttl), ticket),
        )

    def _dequeue(self, db: BaseDatabaseWrapper, ticket: int) -> None:
        self._execute(db, f"DELETE FROM {WAITERS} WHERE id = %s", (ticket,))

    @staticmethod
    def _execute(db: BaseDatabaseWrapper, sql: str, params: Sequence[object]) -> int:
        with closing(db.create_cursor()) as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

    # -- release, renew, check ---------------------------------------------

    def release(self, name: str, token: str, cooldown: float) -> None:
        d = self.dialect
        sql = (
            f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL, "
            f"cooldown_until = {d.plus_seconds} WHERE token = %s AND expires_at > {d.now}"
        )
        released = self._run(
            lambda db: self._execute(
                db,
                _notifying(sql, d, waiters=True, holders=False),
                (d.seconds_param(cooldown), token),
            )
        )
        if released == 1:
            release_log.debug("released %s", name)
            return
        expired = self._run(
            lambda db: self._execute(
                db,
                f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL WHERE token = %s",
                (token,),
            )
        )
        reason = "its lease expired" if expired else "it was released by force or taken over"
        raise LockLost(f"The grant of {name!r} had ended before release: {reason}.")

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
            with closing(db.create_cursor()) as cursor:
                if d.returning:
                    cursor.execute(sql + " RETURNING expires_at", params)
                    row = cursor.fetchone()
                    return (0, None) if row is None else (1, _as_datetime(row[0]))
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
        raise LockLost(f"The lease on {name!r} could not be renewed: it had already ended.")

    def _extend_to_release_by(
        self, db: BaseDatabaseWrapper, name: str, token: str, ttl: float
    ) -> bool | ReleaseRequested:
        """Renew a grant an operator asked for back, no further than its ``release_by``;
        then say where it stands (``_standing``)."""
        d = self.dialect
        until = d.seconds_param(ttl)
        self._execute(
            db,
            f"UPDATE {SLOTS} SET expires_at = {_earlier('release_by', d.plus_seconds)} "
            f"WHERE token = %s AND expires_at > {d.now} AND release_by IS NOT NULL",
            (until, until, token),
        )
        return self._standing(db, name, token)

    def _standing(self, db: BaseDatabaseWrapper, name: str, token: str) -> bool | ReleaseRequested:
        """False if the grant ``token`` ended, True if it is live, or the
        ``ReleaseRequested`` to raise while an operator asks for it back."""
        now = self.dialect.now
        with closing(db.create_cursor()) as cursor:
            cursor.execute(
                f"SELECT release_by IS NOT NULL, expires_at, {now} FROM {SLOTS} "
                f"WHERE token = %s AND expires_at > {now}",
                (token,),
            )
            row = cursor.fetchone()
        if row is None or not row[0]:
            return row is not None
        expires_at, store_now = _as_datetime(row[1]), _as_datetime(row[2])
        assert expires_at is not None and store_now is not None
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

    # -- introspection and forced release ----------------------------------

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        from djlocks.models import LeaseSlot

        live = LeaseSlot.objects.using(self.using).filter(
            token__isnull=False, expires_at__gt=_db_now(self.using)
        )
        if name is not None:
            live = live.filter(key=table_key(name))
        return self._holders_in(live.order_by("name", "slot"))

    def _holders_in(self, rows: QuerySet[LeaseSlot]) -> list[HolderInfo]:
        """The grants of slot rows (read as plain tuples: the dashboard reads thousands)."""
        return [
            HolderInfo(
                name=name,
                backend=self.alias,
                slot=slot,
                limit=limit,
                host=host,
                pid=pid or 0,
                thread=thread,
                label=label,
                since=acquired or expires,
                expires_at=expires,
                fence=fence,
                token=token or "",
            )
            for name, slot, limit, host, pid, thread, label, acquired, expires, fence, token in (
                rows.values_list(*HOLDER_FIELDS)
            )
        ]

    def names(self) -> list[tuple[str, int]]:
        from djlocks.models import LeaseSlot

        known = LeaseSlot.objects.using(self.using).values_list("name", "limit").distinct()
        return list(known.order_by("name"))

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        from djlocks.models import LeaseWaiter

        live = LeaseWaiter.objects.using(self.using).filter(expires_at__gt=_db_now(self.using))
        if name is not None:
            live = live.filter(key=table_key(name))
        positions: dict[str, int] = {}
        waiting = []
        for row in live.order_by("name", "id"):
            position = positions.get(row.key, 0)
            positions[row.key] = position + 1
            waiting.append(
                WaiterInfo(
                    name=row.name,
                    backend=self.alias,
                    position=position,
                    host=row.host,
                    pid=row.pid,
                    thread=row.thread,
                    label=row.label,
                    since=row.since,
                )
            )
        return waiting

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        from djlocks.models import LeaseSlot

        cooling = LeaseSlot.objects.using(self.using).filter(cooldown_until__gt=_db_now(self.using))
        if name is not None:
            cooling = cooling.filter(key=table_key(name))
        return [
            CooldownInfo(name=row.name, backend=self.alias, slot=row.slot, until=until)
            for row in cooling.order_by("name", "slot")
            if (until := row.cooldown_until) is not None
        ]

    def sweep(self) -> dict[str, int]:
        """Delete dead waiters' records and clear expired grants' holder details.

        Each expired grant is recorded as an ``expired`` event first. Slot rows
        themselves are kept: each remembers the last fence issued on it, and
        deleting it would let a later grant reuse a fence.
        """
        from djlocks.models import LeaseSlot

        now = self.dialect.now
        dead_waiters = self._run(
            lambda db: self._execute(db, f"DELETE FROM {WAITERS} WHERE expires_at <= {now}", ())
        )
        expired = LeaseSlot.objects.using(self.using).filter(
            token__isnull=False, expires_at__lte=_db_now(self.using)
        )
        ended = self._holders_in(expired)
        events.holders_ended(ended, Kind.EXPIRED, reason="the lease ran out without a release")
        cleared = expired.update(token=None, expires_at=None)
        return {"expired grants": cleared, "dead waiters": dead_waiters}

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        def set_until(db: BaseDatabaseWrapper) -> int:
            until = f"{self.dialect.plus_seconds}" if seconds > 0 else "NULL"
            params = (self.dialect.seconds_param(seconds),) if seconds > 0 else ()
            return self._execute(
                db,
                f"UPDATE {SLOTS} SET cooldown_until = {until} WHERE name_key = %s AND slot = %s",
                (*params, table_key(name), slot),
            )

        if not self._run(set_until):
            raise ValueError(f"{name!r} has no slot {slot} on backend {self.alias!r}.")
        cooling = [c.until for c in self.cooldowns(name) if c.slot == slot]
        return cooling[0] if cooling else None

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
        revoking = _notifying(sql, self.dialect, waiters=True, holders=True)
        return self._run(lambda db: self._execute(db, revoking, params))

    def request_release(self, name: str, token: str, wait: float) -> int:
        """Cut the lease to end ``wait`` seconds from the database's now at the latest
        and note that end in ``release_by``, which renewals respect (see the base class);
        on PostgreSQL the holder hears of it at once (NOTIFY)."""
        d = self.dialect
        until = d.seconds_param(wait)
        sql = (
            f"UPDATE {SLOTS} SET release_by = {_earlier('release_by', d.plus_seconds)}, "
            f"expires_at = {_earlier('expires_at', d.plus_seconds)} "
            f"WHERE name_key = %s AND token = %s AND expires_at > {d.now}"
        )
        revoking = _notifying(sql, d, waiters=False, holders=True)
        params = (until, until, until, until, table_key(name), token)
        return self._run(lambda db: self._execute(db, revoking, params))

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """On PostgreSQL, ``notice`` is called when a forced release or a graceful
        release's request of this grant is notified; elsewhere the store cannot push."""
        if not self.dialect.notifies:
            return None
        return self._revocations.watch(f"{table_key(name)} {fence}", notice)

    def close(self) -> None:
        self._revocations.close()


def _notifying(update: str, dialect: Dialect, *, waiters: bool, holders: bool) -> str:
    """Make an ``UPDATE`` of grants also tell, in the same round trip (PostgreSQL NOTIFY),
    the ``waiters`` (``CHANNEL``, the name_key) when it freed slots, and the ``holders``
    (``REVOKED``, "<name_key> <fence>") when it took grants away or asked them back.

    The statement still reports one row per grant it changed.
    """
    if not dialect.notifies:
        return update
    notices = [f"pg_notify('{CHANNEL}', name_key)"] if waiters else []
    notices += [f"pg_notify('{REVOKED}', name_key || ' ' || fence)"] if holders else []
    return (
        f"WITH changed AS ({update} RETURNING name_key, fence) "
        f"SELECT {', '.join(notices)} FROM changed"
    )


def _earlier(column: str, moment: str) -> str:
    """SQL for the earlier of ``column`` (a moment or NULL) and ``moment`` (SQL that
    takes one parameter, such as ``Dialect.plus_seconds``, given twice)."""
    return f"CASE WHEN {column} IS NOT NULL AND {column} < {moment} THEN {column} ELSE {moment} END"


@contextmanager
def _transaction(db: BaseDatabaseWrapper, begin: str) -> Iterator[None]:
    """A transaction on the dedicated connection ``db``, which is otherwise in autocommit."""
    with closing(db.create_cursor()) as cursor:
        cursor.execute(begin, ())
        try:
            yield
        except BaseException:
            cursor.execute("ROLLBACK", ())
            raise
        cursor.execute("COMMIT", ())


def _db_now(using: str) -> datetime:
    """The database's current time (UTC), for introspection queries."""
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {DIALECTS[connections[using].vendor].now}", ())
        moment = _as_datetime(cursor.fetchone()[0])
    assert moment is not None
    return moment
