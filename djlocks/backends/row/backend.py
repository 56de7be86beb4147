"""``RowLockBackend``: row locks held by the caller's transaction (see the package docstring)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import InterfaceError, OperationalError, connections

from djlocks.backends.base import (
    DATABASE_OPTIONS,
    OTHER_DATABASE_HINT,
    AcquireRequest,
    Capabilities,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    database_alias,
    unknown_database,
)
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.idle import remove_idle_records
from djlocks.backends.primary import read_only_messages, refuse_read_only_once
from djlocks.backends.push import hung_up
from djlocks.backends.row.dialect import RowDialect
from djlocks.backends.row.transaction import OwnTransaction
from djlocks.backends.server_records import ROW_TABLES, known_names
from djlocks.backends.waiting import Abort, seconds_left
from djlocks.exceptions import BackendUnavailable, LockDeadlock, LockLost
from djlocks.forksafe import fork_safe_lock
from djlocks.keys import table_key


class RowLockBackend(LockBackend):
    """Locks and semaphores on ``SELECT ... FOR UPDATE`` rows (see the module docstring).

    ``OPTIONS``: ``using``, the Django database alias whose transactions
    hold the locks (default: where the routers write djlocks' tables,
    ``base.database_alias``). PostgreSQL, MySQL 8 and MariaDB
    10.6 or later (``SKIP LOCKED``); SQLite for locks only.
    """

    forced_release_effect = (
        "its database connection is terminated, so its transaction rolls back and the "
        "server frees the row at once; the holder's commit fails and its next check or "
        "release raises LockLost"
    )

    option_names = DATABASE_OPTIONS

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = database_alias(self.options, "RowLock")
        self.side = DedicatedConnections(self.using)
        self._held: dict[str, _Held] = {}  # live grants of this process, by token
        self._guard = fork_safe_lock()

    @property
    def capabilities(self) -> Capabilities:
        """Row locks wait in the server, in no promised order; on SQLite, locks only and
        no history when it shares the database (its one writer is the holder)."""
        from djlocks.conf import events_database

        sqlite = connections[self.using].vendor == "sqlite"
        same_database = events_database() == self.using
        return Capabilities(
            fifo=False,
            semaphores=not sqlite,
            cooldowns=False,
            crash_release="transaction",
            history=not (sqlite and same_database),
            graceful_release=False,
            pushes_revocation=False,
            shared_between_processes=True,
            in_caller_transaction=True,
            forced_release=not sqlite,
            long_holds=not sqlite,
        )

    @cached_property
    def dialect(self) -> RowDialect:
        vendor = connections[self.using].vendor
        if vendor == "postgresql":
            from djlocks.backends.row.postgresql import PostgreSQLRows

            return PostgreSQLRows(self)
        if vendor == "mysql":
            from djlocks.backends.row.mysql import MySQLRows

            return MySQLRows(self)
        if vendor == "sqlite":
            from djlocks.backends.row.sqlite import SQLiteRows

            return SQLiteRows(self)
        raise BackendUnavailable(
            f"djlocks backend {self.alias!r}: row locks need PostgreSQL, MySQL/MariaDB or "
            f"SQLite, and database {self.using!r} is {vendor}."
        )

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; then what the database's dialect finds (W002 on
        SQLite, W003 on MySQL when Django asks about the database) and, when Django
        asks about the database, E014 a read-only server (``primary``)."""
        problems = unknown_database(self, self.using)
        if problems:
            return problems
        try:
            dialect = self.dialect
        except BackendUnavailable as exc:
            return [Error(str(exc), hint=OTHER_DATABASE_HINT, id="djlocks.E006")]
        asked = databases is not None and self.using in databases
        messages = dialect.check_messages(asked)
        return messages + read_only_messages(self.alias, self.using) if asked else messages

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
            refuse_read_only_once(connections[self.using], self.alias)
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
            self._held[token] = _Held(threading.get_ident(), key, claim.slot, self._socket())
        return GrantRecord(token, claim.slot, fence, None, scope=own)

    def _socket(self) -> int | None:
        """The file descriptor of this thread's connection to the server, which holds the
        transaction; ``None`` on SQLite (a file)."""
        connection = connections[self.using]
        if connection.vendor == "sqlite":
            return None
        return int(connection.connection.fileno())

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
        """Ask the server whether the holder's transaction still holds the row; a
        connection the server closed (a forced release, a lost network) ends it at once:
        a transaction does not outlive its connection."""
        with self._guard:
            held = self._held.get(token)
        if held is not None and held.socket is not None and hung_up(held.socket):
            raise LockLost(f"The connection of the transaction holding {name!r} was closed.")
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

    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Nothing to do for dead holders (the server frees a dead transaction's rows,
        and holder rows are rewritten per slot); with ``idle_names`` (seconds), delete
        the rows of names neither held nor waited for whose last grant is older
        (``djlocks.backends.idle``): a lockable row only while no transaction holds it."""
        if idle_names is None:
            return {}
        busy = {table_key(holder.name) for holder in self.holders()}
        busy.update(table_key(waiter.name) for waiter in self.waiters())
        lockable_rows = connections[self.using].vendor != "sqlite"  # SQLite locks none
        removed = remove_idle_records(
            self.using, ROW_TABLES, idle_names, busy, lockable_rows=lockable_rows
        )
        return {"idle names": removed}


@dataclass(frozen=True)
class _Held:
    thread: int
    key: str
    slot: int
    socket: int | None  # the holding connection's file descriptor (None: SQLite)
