"""The lease backend's access to its database: dedicated connections, errors, the dialect.

Every statement runs on a connection of djlocks' own (``DedicatedConnections``),
in autocommit, never on the request's connection. A lost connection is
replaced and the statement tried once more (every statement is idempotent by
token); contention (a deadlock, SQLite's "database is locked") is told apart
so that a claim can be tried again.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any, NamedTuple, TypeVar

from django.db import DatabaseError, IntegrityError
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import DATABASE_OPTIONS, LockBackend, database_alias
from djlocks.backends.dedicated import DedicatedConnections, statement_cursor
from djlocks.backends.driver import refuse_psycopg2
from djlocks.backends.lease.gate import WriteGate, write_gate
from djlocks.backends.lease.remembered import Remembered
from djlocks.backends.lease.wakeups import HostWakeups
from djlocks.backends.missing_table import missing_table_hint
from djlocks.backends.primary import refuse_read_only
from djlocks.backends.push import PostgresListener
from djlocks.backends.sql import lease_dialect
from djlocks.backends.sql.dialects import LeaseDialect, Outcome
from djlocks.backends.sql.postgresql import LEASE_REVOKED
from djlocks.exceptions import BackendUnavailable
from djlocks.forksafe import fork_safe_lock

SLOTS = "djlocks_lease_slot"
WAITERS = "djlocks_lease_waiter"
CONTENTION_MESSAGES = ("deadlock", "database is locked", "could not serialize", "lock wait timeout")
DEADLOCK_MESSAGES = ("deadlock", "could not serialize")

T = TypeVar("T")
#: Tokens of grants got by waiting that a store remembers, at most (see ``_queued_grants``).
QUEUED_GRANTS_KEPT = 10_000
#: Names whose slot a release handed over that a store remembers, at most (see
#: ``_contended_names``).
CONTENDED_NAMES_KEPT = 1_000
#: Seconds a thread's waking session (the one its waits listen or sleep on) may stay
#: idle before the server closes it: a thread that no longer waits does not keep a
#: server connection for its life, nor (PostgreSQL) a listener that every ``NOTIFY``
#: of the database signals. The thread's next wait opens a new one.
WAKING_SESSION_IDLE = 60
#: Times an idempotent operation that met contention is tried again (see ``_run``).
CONTENTION_RETRIES = 20


class Place(NamedTuple):
    """A waiter's place in the queue: the name's key and the token the waiter queued
    with, which is its alone. A waiter finds its row by its token, never by its ticket
    (the row's ``id``) alone: an enqueue whose reply was lost leaves a ticket the
    waiter never learned, and after a failover to a replica that had not received the
    latest rows (or a restore from a backup) the sequence that issues tickets starts
    again from an older value, so a ticket can be another waiter's."""

    key: str
    token: str


class Contention(BackendUnavailable):
    """A claim met a deadlock, a busy database or a concurrent first use: try again."""


def is_contention(exc: DatabaseError) -> bool:
    text = str(exc).lower()
    return isinstance(exc, IntegrityError) or any(m in text for m in CONTENTION_MESSAGES)


def is_deadlock(exc: DatabaseError) -> bool:
    """A deadlock's victim or a serialization failure: the server ended the statement at
    once, so trying again costs no wait (unlike a lock wait or busy time-out)."""
    text = str(exc).lower()
    return any(m in text for m in DEADLOCK_MESSAGES)


class LeaseStore(LockBackend):
    """The connections and the dialect shared by the lease backend's parts."""

    option_names = DATABASE_OPTIONS

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = database_alias(self.options, "LeaseSlot")
        self._connections = DedicatedConnections(self.using, on_connect=self._prepare)
        self._listeners = DedicatedConnections(self.using, on_connect=self._listen)
        # Per thread: when (monotonic) its waking session last ran a statement; the
        # server's idle limit (WAKING_SESSION_IDLE) counts from then.
        self._waking_session_used = threading.local()
        # (name_key, limit) -> when (monotonic) its rows were last confirmed to exist
        # with that limit
        self._shaped: dict[tuple[str, int], float] = {}
        self._dialect: LeaseDialect | None = None
        self._host_wakeups: HostWakeups | None = None
        self._write_gate: WriteGate | None = None
        # Tokens of grants this process got by waiting in the queue: their release
        # hands the slot over without first trying the plain release that only frees
        # a name nobody waits for.
        self._queued_grants = Remembered(QUEUED_GRANTS_KEPT)
        # Keys of the names whose last release by this process handed the slot to a
        # waiter: its next acquire of one queues at once (``LeaseBackend.acquire``).
        self._contended_names = Remembered(CONTENDED_NAMES_KEPT)
        # Holders hear of forced releases here (PostgreSQL), once one is watched.
        self._revocations = PostgresListener(self.using, LEASE_REVOKED)
        # Places in the queue this process could not give up (see LeaseQueue._leave_queue).
        self._abandoned: list[Place] = []
        self._abandoned_guard = fork_safe_lock()

    def _prepare(self, wrapper: BaseDatabaseWrapper) -> None:
        refuse_read_only(wrapper, self.alias)
        for statement in self.dialect.session_setup:
            with wrapper.cursor() as cursor:
                cursor.execute(statement)
        if self.dialect.opened is not None:
            self.dialect.opened(wrapper)

    def _listen(self, wrapper: BaseDatabaseWrapper) -> None:
        """Prepare a waiter's waking session as it opens: the server closes it once it
        has been idle for ``WAKING_SESSION_IDLE`` seconds (``LeaseDialect.idle_limit``);
        on PostgreSQL it hears, from now on, the releases that concern its waits
        (``LeaseDialect.listening``), so a wait costs no ``LISTEN`` of its own."""
        dialect = self.dialect
        statements = [] if dialect.idle_limit is None else [dialect.idle_limit(WAKING_SESSION_IDLE)]
        if dialect.listening is not None and dialect.session_id is not None:
            statements.append(dialect.listening(dialect.session_id(wrapper.connection)))
        with wrapper.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
        self._waking_session_ran()

    def _waking_session_ran(self) -> None:
        """This thread's waking session has just run a statement (its idle time restarts),
        or was found closed and let go (its replacement restarts it as it opens)."""
        self._waking_session_used.at = time.monotonic()

    def _waking_session_due(self) -> float:
        """When (``time.monotonic()``) this thread's waking session must next run a
        statement, so that the server does not close it as idle: half of
        ``WAKING_SESSION_IDLE`` after its last one."""
        used: float = getattr(self._waking_session_used, "at", 0.0)
        return used + WAKING_SESSION_IDLE / 2

    @property
    def dialect(self) -> LeaseDialect:
        """This database's SQL fragments; ``BackendUnavailable`` for a database
        the lease backend does not support (or reaches through psycopg2: ``driver``)."""
        if self._dialect is None:
            from django.db import connections

            vendor = connections[self.using].vendor
            refuse_psycopg2(self.alias, self.using)
            try:
                self._dialect = lease_dialect(vendor)
            except ValueError as exc:
                raise BackendUnavailable(
                    f"The lease backend supports SQLite, PostgreSQL and MySQL/MariaDB, "
                    f"not {vendor!r} (database alias {self.using!r})."
                ) from exc
        return self._dialect

    def _run(self, operation: Callable[[BaseDatabaseWrapper], T], *, retry: bool = True) -> T:
        """Run ``operation`` on this thread's dedicated connection.

        When ``retry`` (every such operation here is idempotent by token), a lost
        connection is replaced and the operation tried once more, and a deadlock's
        victim is tried again after a moment, up to ``CONTENTION_RETRIES`` times.
        Contention then raises ``Contention``, other database errors
        ``BackendUnavailable``.
        """
        reconnects, contended = (1, CONTENTION_RETRIES) if retry else (0, 0)
        while True:
            try:
                wrapper = self._connections.get()
                with wrapper.wrap_database_errors, self._turn():
                    return operation(wrapper)
            except DatabaseError as exc:
                if contended and is_deadlock(exc):
                    contended -= 1
                    time.sleep(secrets.randbelow(2000) / 1_000_000)
                    continue
                if is_contention(exc):
                    raise Contention(str(exc)) from exc
                self._connections.discard()
                if reconnects:
                    reconnects -= 1
                    continue
                raise BackendUnavailable(
                    f"djlocks backend {self.alias!r} could not use database "
                    f"{self.using!r}: {exc}.{missing_table_hint(exc)}"
                ) from exc

    def _turn(self) -> AbstractContextManager[None]:
        """This thread's turn at the store, where its operations take turns
        (``LeaseDialect.write_gate``); else nothing to wait for."""
        if not self.dialect.write_gate:
            return nullcontext()
        if self._write_gate is None:
            from django.db import connections

            self._write_gate = write_gate(str(connections[self.using].settings_dict["NAME"]))
        return self._write_gate.turn()

    def _execute(self, db: BaseDatabaseWrapper, sql: str, params: Sequence[object]) -> int:
        """Run one statement (``%s`` placeholders); the number of rows it changed, or
        returned (``_outcome``)."""
        return self._outcome(db, sql, params)[1]

    def _outcome(self, db: BaseDatabaseWrapper, sql: str, params: Sequence[object]) -> Outcome:
        """Run one statement (``%s`` placeholders) on the dedicated connection ``db``:
        without a cursor where the store can (``LeaseDialect.run_at_once``), else on the
        connection's cursor (``statement_cursor``)."""
        run_at_once = self.dialect.run_at_once
        if run_at_once is not None:
            return run_at_once(db.connection, sql, params)
        with statement_cursor(db) as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone() if cursor.description else None
            return row, int(cursor.rowcount), int(cursor.lastrowid or 0)

    @property
    def host_wakeups(self) -> HostWakeups | None:
        """The wake-ups of this database's waiters through the operating system, where
        the releaser learns whom to wake (``LeaseDialect.returning_heads``)."""
        if self.dialect.returning_heads is None:
            return None
        if self._host_wakeups is None:
            from django.db import connections

            self._host_wakeups = HostWakeups(str(connections[self.using].settings_dict["NAME"]))
        return self._host_wakeups

    def _execute_freeing(
        self, db: BaseDatabaseWrapper, update: str, params: Sequence[object]
    ) -> int:
        """Run ``update``, which frees slots, and wake the first waiters of their names on
        this host where the store returns them (``host_wakeups``); the rows it changed."""
        wakeups, returning_heads = self.host_wakeups, self.dialect.returning_heads
        if wakeups is None or returning_heads is None:
            return self._execute(db, update, params)
        with statement_cursor(db) as cursor:
            cursor.execute(returning_heads(update, SLOTS, WAITERS), params)
            rows = cursor.fetchall()  # all of them: the statement ends, and commits
        wakeups.wake(int(ticket) for (heads,) in rows if heads for ticket in heads.split(","))
        return len(rows)

    def _notifying(self, update: str, *, waiters: bool, holders: bool) -> str:
        """``update``, which also wakes the ``waiters`` and tells the ``holders`` in the
        same round trip where the database can (``LeaseDialect.notifying``)."""
        notifying = self.dialect.notifying
        return update if notifying is None else notifying(update, WAITERS, waiters, holders)


@contextmanager
def transaction(db: BaseDatabaseWrapper, begin: str) -> Iterator[None]:
    """A transaction on the dedicated connection ``db``, which is otherwise in autocommit."""
    with statement_cursor(db) as cursor:
        cursor.execute(begin, ())
        try:
            yield
        except BaseException:
            with suppress(Exception):  # a connection that failed: its own error goes on
                cursor.execute("ROLLBACK", ())
            raise
        cursor.execute("COMMIT", ())


def earlier(column: str, moment: str) -> str:
    """SQL for the earlier of ``column`` (a moment or NULL) and ``moment`` (SQL that
    takes one parameter, such as ``LeaseDialect.plus_seconds``, given twice)."""
    return f"CASE WHEN {column} IS NOT NULL AND {column} < {moment} THEN {column} ELSE {moment} END"
