"""MySQL/MariaDB named locks: ``djlocks.backends.mysql.GetLockBackend``.

``GET_LOCK(key, timeout)`` waits in the server and returns 1 when granted, 0
on time-out (MySQL manual, "Locking Functions"); the lock belongs to the
session, which may hold several, and ends with it. MariaDB treats a negative
time-out as an error, so "forever" is a year, asked again if it runs out.
Keys follow ``djlocks.keys.mysql_key`` (at most 64 characters, case-proof).
Holders are ``IS_USED_LOCK``'s connection ids matched with djlocks' holder
rows; waiters are the ``GET_LOCK`` calls in the process list, whose comment
names them. Forced release checks ``IS_USED_LOCK`` and then runs
``KILL CONNECTION``: between the two, a holder that releases on its own and
reuses its connection for another name could be killed instead (one round
trip's window).

MySQL grants a lock's waiters in no particular order (not FIFO). Each
session sets ``wait_timeout`` to the larger of 60 s and ``DJLOCKS["TTL"]``:
the heartbeat pings every TTL/3, so a live holder is never timed out, and the
server frees the locks of a client that vanished silently within that time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.core import checks
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from djlocks.backends.base import WaiterInfo
from djlocks.backends.described import owner_described
from djlocks.backends.session import Key, Session, SessionBackend
from djlocks.backends.session.inspection import Holding
from djlocks.backends.session_deadlocks import Wait
from djlocks.backends.sql import mysql
from djlocks.conf import djlocks_settings
from djlocks.keys import mysql_key


class GetLockBackend(SessionBackend):
    """Locks and semaphores on MySQL/MariaDB ``GET_LOCK``."""

    vendor = "mysql"
    #: MySQL's manual promises no order among GET_LOCK waiters (MariaDB's neither).
    serves_waiters_in_order = False
    try_sql = "GET_LOCK(%s, 0) = 1"
    give_back_sql = mysql.RELEASE_KEY

    def key(self, name: str, slot: int | str | None = None) -> str:
        return mysql_key(name, slot)

    def server_messages(self, connection: BaseDatabaseWrapper) -> list[CheckMessage]:
        """E007 GET_LOCK under Galera, which does not replicate it; W001 statement-based
        binary logging, for which MySQL marks GET_LOCK unsafe."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SHOW VARIABLES WHERE Variable_name IN ('wsrep_on', 'binlog_format', 'log_bin')"
            )
            variables = {name.lower(): str(value).upper() for name, value in cursor.fetchall()}
        messages: list[CheckMessage] = []
        if variables.get("wsrep_on") == "ON":
            messages.append(
                Error(
                    f"djlocks backend {self.alias!r} uses GET_LOCK on a Galera cluster "
                    f"(wsrep_on=ON), where GET_LOCK is not replicated: two nodes would grant "
                    f"the same lock.",
                    hint="Use the lease backend on Galera.",
                    id="djlocks.E007",
                )
            )
        if variables.get("log_bin") == "ON" and variables.get("binlog_format") == "STATEMENT":
            messages.append(
                checks.Warning(
                    f"djlocks backend {self.alias!r} uses GET_LOCK with "
                    f"binlog_format=STATEMENT; MySQL marks GET_LOCK unsafe for "
                    f"statement-based replication.",
                    hint="Use binlog_format=ROW or MIXED.",
                    id="djlocks.W001",
                )
            )
        return messages

    def _prepare(self, session: Session) -> None:
        """The idle limit; on MariaDB, if the server started since the fence sequence was
        last raised to its clock, raise it (``sql.mysql.after_a_restart``) before any grant."""
        idle_limit = max(60, math.ceil(float(djlocks_settings()["TTL"])))
        session.run("SET SESSION wait_timeout = %s", (idle_limit,))
        self.fences_in_grant = "mariadb" in session.wrapper.connection.get_server_info().lower()
        if self.fences_in_grant and not session.execute(mysql.RESTART_MARKER_PRESENT)[0]:
            with session.cursor() as cursor:
                mysql.after_a_restart(cursor)

    def _connection_id(self, session: Session) -> int:
        with session.cursor() as cursor:
            return mysql.connection_id(cursor)

    def _take(
        self,
        session: Session,
        key: Key,
        seconds: float | None,
        identity: str,
        fenced: bool = True,
        releasing: Key | None = None,
    ) -> int | None:
        """``GET_LOCK``; when granted, the fence issued with it on MariaDB, else 0 (MySQL:
        ``_record`` issues it)."""
        fenced = fenced and self.fences_in_grant
        given_back = None if releasing is None else str(releasing)
        # A try returns at once: only a wait is worth interrupting (``run_at_once``).
        run = functools.partial(self._value, session, interruptible=seconds != 0)
        while True:  # a wait "forever" that ran out after FOREVER seconds waits again
            granted = mysql.get_lock(run, str(key), seconds, identity, fenced, given_back)
            if granted is None:
                raise DatabaseError(f"GET_LOCK({key!r}) failed: it was interrupted or killed.")
            if granted != 0:
                return granted if fenced else 0
            if seconds is not None:
                return None

    def _slot_taken(self, slot: int) -> str:
        return mysql.fenced_slot(slot) if self.fences_in_grant else str(slot)

    def _attempt(
        self,
        session: Session,
        granting: str,
        params: Sequence[object],
        columns: tuple[str, ...],
        identity: str,
    ) -> tuple[tuple[Any, ...], int | None]:
        """On MariaDB, ``granting``'s ``granted`` is ``"<slot> <fence>"`` (``_slot_taken``)."""
        row, fence = super()._attempt(session, granting, params, columns, identity)
        if fence is None or not self.fences_in_grant:
            return row, fence
        slot, issued = str(row[0]).split()
        return (int(slot), *row[1:]), int(issued)

    def _give_back(self, session: Session, key: Key) -> bool:
        released = self._value(
            session, f"SELECT {mysql.RELEASE_KEY}", (str(key),), interruptible=False
        )
        return bool(released == 1)

    def _value(
        self, session: Session, sql: str, params: Sequence[object], *, interruptible: bool
    ) -> Any:
        """The one value of ``sql`` on ``session``, with no cursor (``value_at_once``);
        ``interruptible``: a wait that a signal can interrupt (``run_at_once``)."""
        with session.wrapper.wrap_database_errors:
            connection = session.wrapper.connection
            return mysql.value_at_once(connection, sql, params, interruptible=interruptible)

    def _holds(self, session: Session, key: Key) -> bool:
        return bool(session.execute("SELECT IS_USED_LOCK(%s) = CONNECTION_ID()", (key,))[0] == 1)

    def _kill(self, session: Session, connection_id: int, key: Key | None) -> int:
        with session.cursor() as cursor:
            if key is not None and mysql.lock_holders(cursor, [str(key)]).get(str(key)) != (
                connection_id
            ):
                return 0
            return mysql.kill_connection(cursor, connection_id)

    def _live_keys(self, session: Session, keys: Sequence[Key]) -> dict[Key, int]:
        live: dict[Key, int] = {}
        with session.cursor() as cursor:
            live.update(mysql.lock_holders(cursor, [str(key) for key in keys]))
        return live

    def _holding_sessions(self, session: Session, keys: Sequence[Key]) -> dict[Key, Holding]:
        """On MariaDB, where holder rows are written after the grant, with each holding
        session's client address and last statement from the process list, so that a
        holder whose row is not written yet is still shown."""
        live = self._live_keys(session, keys)
        if not self.fences_in_grant:
            return {key: Holding(cid) for key, cid in live.items()}
        with session.cursor() as cursor:
            clients = mysql.client_addresses(cursor, sorted(set(live.values())))
        now = timezone.now()
        return {
            key: Holding(
                cid, since=now - timedelta(seconds=clients[cid][1]), address=clients[cid][0]
            )
            for key, cid in live.items()
            if cid in clients
        }

    def _waiting_calls(self, session: Session) -> list[tuple[int, str, str, datetime]]:
        """(connection id, key, description, since) of every djlocks ``GET_LOCK`` waiting."""
        with session.cursor() as cursor:
            statements = mysql.waiting_statements(cursor)
        return [
            (session_id, call.group(1), description, since)
            for session_id, description, statement, since in statements
            if (call := mysql.WAITING_CALL.search(statement)) is not None
        ]

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        names = self._waited_names(name)
        with self._side_session() as side:
            calls = self._waiting_calls(side)
        return self._as_waiters([(names.get(key), who, since) for _, key, who, since in calls])

    def _waits(self, session: Session) -> list[Wait]:
        calls = self._waiting_calls(session)
        holders = self._live_keys(session, [key for _, key, _, _ in calls])
        return [
            Wait(waiter, owner_described(who), since, key, holders[key])
            for waiter, key, who, since in calls
            if key in holders
        ]
