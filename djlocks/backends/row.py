"""Row locks: ``djlocks.backends.row.RowLockBackend``, a lock that ends with the transaction.

``with transaction.atomic(): with db_lock("account:7", backend="row"): ...``
locks a djlocks row with ``SELECT ... FOR UPDATE`` in the caller's own
transaction. The commit or rollback of that transaction unlocks it, so the
lock always covers the commit of what it guards, and a
holder that crashes or loses its connection frees it at once. Releasing early
is impossible by design: leaving the ``with`` block (or ``release()``) ends
the handle's grant, and the row stays locked until the transaction ends. Used
outside a transaction, the ``with`` block (or ``acquire()`` ... ``release()``
in one thread) opens one for its duration: committed at the end, rolled back
if the block raises. The transaction belongs to the acquiring thread, so such
a grant is released from that thread, and ``async with`` is refused.

The dialects (``row_postgresql``, ``row_mysql``, ``row_sqlite``) give the
SQL. Common to all:

* An uncontended acquire is one statement, ``FOR UPDATE SKIP LOCKED`` (which
  neither waits nor fails, so it needs no savepoint); ``timeout=0`` stops
  there. A contended one waits in the server under the database's own lock
  wait limit and ends in ``None`` (``NotAcquired``) with the caller's
  transaction still usable.
* Fences and holder identity are written on djlocks' own connection right
  after the grant (``server_records``): a rolled-back transaction never gets
  its fence handed out again. SQLite, whose one writer is the caller's
  transaction, is the exception (see ``row_sqlite``).
* Holders and waiters are the server's lock state (``pg_locks`` with
  ``pg_stat_activity``; InnoDB's transactions and the process list) joined
  with djlocks' holder rows. Forced release terminates the holder's
  connection: its transaction rolls back.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from types import TracebackType
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import InterfaceError, OperationalError, connections, transaction

from djlocks.backends.base import (
    OTHER_DATABASE_HINT,
    Abort,
    AcquireRequest,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    seconds_left,
    unknown_database,
)
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.row_dialect import RowDialect
from djlocks.backends.server_records import ROW_TABLES, known_names
from djlocks.exceptions import BackendUnavailable, LockDeadlock, LockLost
from djlocks.keys import table_key


class RowLockBackend(LockBackend):
    """Locks and semaphores on ``SELECT ... FOR UPDATE`` rows (see the module docstring).

    ``OPTIONS``: ``using``, the Django database alias whose transactions
    hold the locks (default ``"default"``). PostgreSQL, MySQL 8 and MariaDB
    10.6 or later (``SKIP LOCKED``); SQLite for locks only.
    """

    in_caller_transaction = True
    forced_release_effect = (
        "its database connection is terminated, so its transaction rolls back and the "
        "server frees the row at once; the holder's commit fails and its next check or "
        "release raises LockLost"
    )

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = str(self.options.get("using", "default"))
        self.side = DedicatedConnections(self.using)
        self._held: dict[str, _Held] = {}  # live grants of this process, by token
        self._guard = threading.Lock()

    @property
    def records_history(self) -> bool:  # type: ignore[override]
        """Not on SQLite when the history shares the database: its one writer is the holder."""
        from djlocks.conf import djlocks_settings

        same_database = djlocks_settings()["EVENTS_DATABASE"] == self.using
        return not (same_database and connections[self.using].vendor == "sqlite")

    @cached_property
    def dialect(self) -> RowDialect:
        vendor = connections[self.using].vendor
        if vendor == "postgresql":
            from djlocks.backends.row_postgresql import PostgreSQLRows

            return PostgreSQLRows(self)
        if vendor == "mysql":
            from djlocks.backends.row_mysql import MySQLRows

            return MySQLRows(self)
        if vendor == "sqlite":
            from djlocks.backends.row_sqlite import SQLiteRows

            return SQLiteRows(self)
        raise BackendUnavailable(
            f"djlocks backend {self.alias!r}: row locks need PostgreSQL, MySQL/MariaDB or "
            f"SQLite, and database {self.using!r} is {vendor}."
        )

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; then what the database's dialect finds
        (W002 on SQLite, W003 on MySQL when Django asks about the database)."""
        problems = unknown_database(self, self.using)
        if problems:
            return problems
        try:
            dialect = self.dialect
        except BackendUnavailable as exc:
            return [Error(str(exc), hint=OTHER_DATABASE_HINT, id="djlocks.E006")]
        return dialect.check_messages(databases is not None and self.using in databases)

    # -- acquire, release, renew, check ------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        if request.cooldown:
            raise ValueError(
                f"djlocks backend {self.alias!r} holds locks in transactions, which cannot "
                f"outlive their commit: a cool-down needs a lease backend."
            )
        key = table_key(request.name)
        taken = self._taken_in_this_thread(key)
        if len(taken) >= request.limit:
            self._wait_for_itself(request, deadline, abort)
            return None
        own = None if connections[self.using].in_atomic_block else OwnTransaction(self.using)
        try:
            claim = self.dialect.claim(request, deadline, abort, own, taken)
            if claim is None:
                if own is not None:
                    own.__exit__(None, None, None)
                return None
            token = secrets.token_hex(16)
            fence = self.dialect.record(request, claim, token)
        except BaseException as exc:
            if own is not None:
                own.__exit__(type(exc), exc, exc.__traceback__)
                own.close_if_broken()
            if isinstance(exc, OperationalError | InterfaceError):
                raise BackendUnavailable(
                    f"djlocks backend {self.alias!r} failed while acquiring {request.name!r} "
                    f"(its connection failed; the server ends the transaction, and any row "
                    f"lock with it): {exc}"
                ) from exc
            raise
        with self._guard:
            self._held[token] = _Held(threading.get_ident(), key, claim.slot)
        return GrantRecord(token, claim.slot, fence, None, scope=own)

    def _taken_in_this_thread(self, key: str) -> frozenset[int]:
        """Slots of ``key`` that live grants of this thread hold.

        The server lets a transaction lock its own rows again, so without this
        two handles in one transaction would both get the same slot; they
        must exclude each other as two processes do (handles are not re-entrant).
        """
        me = threading.get_ident()
        with self._guard:
            return frozenset(
                held.slot for held in self._held.values() if held.thread == me and held.key == key
            )

    def _wait_for_itself(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> None:
        """Every slot is held by this thread's own transaction: only the time-out can end it."""
        left = seconds_left(deadline)
        if left is None:
            raise LockDeadlock(
                f"{request.name!r}: every slot is held by grants of this thread's own "
                f"transaction, so waiting for one would never end. Release them first, or "
                f"give a timeout."
            )
        if abort is not None:
            abort.wait(left)
        else:
            time.sleep(left)

    def release(self, name: str, token: str, cooldown: float) -> None:
        """End the handle's grant; the row stays locked until the transaction ends (no I/O)."""
        with self._guard:
            held = self._held.pop(token, None)
        if held is None:
            raise LockLost(f"The grant of {name!r} had ended before release.")

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """Ask the server whether the holder's transaction still holds the row."""
        if not self.is_held(name, token):
            with self._guard:
                self._held.pop(token, None)
            raise LockLost(
                f"The transaction holding {name!r} ended or its connection was terminated."
            )
        return None  # a row lock has no expiry

    def is_held(self, name: str, token: str) -> bool:
        with self._guard:
            if token not in self._held:
                return False
        return self.dialect.is_live(name, token)

    # -- introspection and forced release ----------------------------------

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        return self.dialect.holders(name)

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        return self.dialect.waiters(name)

    def force_release(self, name: str, token: str | None = None) -> int:
        """Terminate the connection of each holder of ``name`` (or of grant ``token``)."""
        return self.dialect.kill(name, token)

    def names(self) -> list[tuple[str, int]]:
        return known_names(ROW_TABLES, self.using)

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        return []  # refused at acquire: a row lock cannot outlive its transaction

    def sweep(self) -> dict[str, int]:
        return {}  # the server frees a dead transaction's rows; holder rows are per slot


@dataclass(frozen=True)
class _Held:
    thread: int
    key: str
    slot: int


class OwnTransaction:
    """The transaction a row grant lives in when the caller had none.

    ``transaction.atomic(using)``, begun by the dialect just before it locks
    (``begin()``) and left at release: a commit, or a rollback when the
    ``with`` block raised. A connection that failed at the commit (terminated
    by a forced release) is ``LockLost``. Leaving it before ``begin()`` does nothing.
    A connection that failed in a transaction djlocks began is closed, as
    Django does at the end of a request, so that the caller's next query (or
    acquire) reconnects: outside requests (a worker, a cron job) Django never would.
    """

    def __init__(self, using: str) -> None:
        self.using = using
        self._atomic: AbstractContextManager[Any] | None = None

    def begin(self) -> None:
        atomic = transaction.atomic(using=self.using)
        atomic.__enter__()
        self._atomic = atomic

    def __enter__(self) -> None:
        self.begin()

    def close_if_broken(self) -> None:
        """Close the connection if it no longer answers (one ``SELECT 1``; failures only).

        Django's ``close_if_unusable_or_obsolete`` would not: the rollback that
        ended the failed transaction cleared its ``errors_occurred`` flag, and
        mysqlclient's rollback on a connection the server has gone from does not fail.
        """
        connection = connections[self.using]
        if connection.connection is not None and not connection.is_usable():
            connection.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        try:
            atomic.__exit__(exc_type, exc, traceback)
        except (OperationalError, InterfaceError) as failure:
            self.close_if_broken()
            if exc_type is not None:
                raise
            raise LockLost(
                f"The transaction that held the row lock could not commit: its connection "
                f"failed or was terminated by a forced release ({failure})."
            ) from failure
