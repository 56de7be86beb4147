"""Row locks on MySQL 8 and MariaDB 10.6+ (InnoDB "Locking Reads", ``SKIP LOCKED``).

* Waiting: ``innodb_lock_wait_timeout`` is set for the one waiting statement
  and put back after it (MySQL manual: the limit is in whole seconds, so a
  time-out is rounded up to the next second). A time-out (1205) rolls back
  only that statement, leaving the caller's transaction usable, unless the
  server runs with ``innodb_rollback_on_timeout``, which the system check
  reports. A deadlock (1213) rolls the caller's whole transaction back:
  djlocks raises ``LockDeadlock`` and marks the ``atomic`` block for rollback.
* InnoDB keeps row locks until the transaction ends, even past
  ``ROLLBACK TO SAVEPOINT``, and shows only the locks someone waits for. A
  holder row counts while its connection is in the process list and has an
  InnoDB transaction (``INNODB_TRX``) that began no later than the grant.
  Both need the ``PROCESS`` privilege. ``INNODB_TRX`` is a cache that the
  server refreshes at most every 0.1 s, so a grant younger than 1 s counts
  on its connection alone; ``trx_started`` has whole seconds, so a holder
  that committed and began another transaction on the same connection
  within the second of its grant still shows until that second ends.
* Waiters: the waiting statements in the process list (their comment names
  the waiter); a semaphore's waiters wait in ``GET_LOCK`` on its gate.
* Forced release: ``KILL CONNECTION`` of the holder after the server confirms
  it (between the two, a holder that commits and starts another transaction
  on the same connection could be killed instead: one round trip's window).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

from django.core import checks
from django.core.checks import CheckMessage
from django.db import DatabaseError, connections, transaction

from djlocks.backends.base import AcquireRequest, HolderInfo, WaiterInfo
from djlocks.backends.described import describe, queue_order
from djlocks.backends.row.dialect import ROW_GATE, Claim
from djlocks.backends.row.server import RowsMissing, ServerRowDialect
from djlocks.backends.sql import mysql
from djlocks.exceptions import BackendUnavailable, LockDeadlock
from djlocks.keys import mysql_key, table_key

LOCK_WAIT_TIMEOUT, LOCK_DEADLOCK, QUERY_INTERRUPTED = 1205, 1213, 1317
WAITING_ROW = re.compile(r"name_key = '([0-9a-f]{64})'")


class MySQLRows(ServerRowDialect):
    vendor = "mysql"
    CONNECTION_ID = "CONNECTION_ID()"
    LIVE_HOLDERS = (
        "FROM djlocks_row_holder h JOIN information_schema.PROCESSLIST p "
        "ON p.ID = h.connection_id WHERE (h.acquired_at > UTC_TIMESTAMP(6) - INTERVAL 1 SECOND "
        "OR EXISTS (SELECT 1 FROM information_schema.INNODB_TRX t "
        "WHERE t.trx_mysql_thread_id = h.connection_id "
        "AND t.trx_started <= CONVERT_TZ(h.acquired_at, '+00:00', @@session.time_zone)))"
    )

    def check_messages(self, query: bool) -> list[CheckMessage]:
        """W003: with innodb_rollback_on_timeout a timed-out row lock rolls back the
        caller's whole transaction, not just the waiting statement."""
        if not query:
            return []
        with connections[self.using].cursor() as cursor:
            cursor.execute("SELECT @@GLOBAL.innodb_rollback_on_timeout")
            rolls_back = bool(int(cursor.fetchone()[0]))
        if not rolls_back:
            return []
        return [
            checks.Warning(
                f"djlocks backend {self.alias!r}: innodb_rollback_on_timeout is ON, so a "
                f"row lock that times out rolls the caller's whole transaction back.",
                hint="Turn innodb_rollback_on_timeout off (the default).",
                id="djlocks.W003",
            )
        ]

    def _wait_for_slot(
        self, cursor: Any, request: AcquireRequest, slot: int, seconds: float | None
    ) -> Claim | None:
        wait = mysql.FOREVER if seconds is None else max(1, math.ceil(seconds))
        cursor.execute(
            "SET @djlocks_wait = @@SESSION.innodb_lock_wait_timeout, "
            "SESSION innodb_lock_wait_timeout = %s",
            (wait,),
        )
        try:
            cursor.execute(
                f"SELECT {mysql.sql_comment(describe(request))} slot, CONNECTION_ID() "
                f"FROM djlocks_row_lock "
                f"WHERE name_key = %s AND slot = %s FOR UPDATE",
                (table_key(request.name), slot),
            )
            row = cursor.fetchone()
        except DatabaseError as exc:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = @djlocks_wait")
            self._failed_wait(exc)
            return None
        cursor.execute("SET SESSION innodb_lock_wait_timeout = @djlocks_wait")
        if row is None:
            raise RowsMissing
        return Claim(*row)

    def _failed_wait(self, exc: DatabaseError) -> None:
        """Return quietly for a time-out or a cancel; raise for anything else."""
        code = exc.args[0] if exc.args else None
        if code in (LOCK_WAIT_TIMEOUT, QUERY_INTERRUPTED):
            return
        if code == LOCK_DEADLOCK:
            transaction.set_rollback(True, using=self.using)
            raise LockDeadlock(
                f"MariaDB/MySQL detected a deadlock and rolled the transaction back: {exc}"
            ) from exc
        raise BackendUnavailable(f"djlocks backend {self.alias!r} failed: {exc}") from exc

    def _take_gate(self, cursor: Any, request: AcquireRequest, seconds: float | None) -> bool:
        cursor.execute(
            "SELECT count(*) FROM djlocks_row_lock WHERE name_key = %s",
            (table_key(request.name),),
        )
        if cursor.fetchone()[0] < request.limit:
            raise RowsMissing
        gate = mysql_key(request.name, ROW_GATE)
        run = functools.partial(mysql.value_of, cursor)
        return bool(mysql.get_lock(run, gate, seconds, describe(request)))

    def _give_back_gate(self, cursor: Any, request: AcquireRequest) -> None:
        mysql.release_lock(cursor, mysql_key(request.name, ROW_GATE))

    def _canceller(self) -> Callable[[], None]:
        with connections[self.using].cursor() as cursor:
            caller = mysql.connection_id(cursor)
        side = self.backend.side

        def kill_query() -> None:
            with side.cursor() as kill:
                mysql.kill_query(kill, caller)

        return kill_query

    def _create_rows(self, cursor: Any, key: str, limit: int) -> None:
        cursor.execute(
            "INSERT INTO djlocks_row_lock (name_key, slot) VALUES "
            + ", ".join(["(%s, %s)"] * limit)
            + " ON DUPLICATE KEY UPDATE slot = slot",
            [part for slot in range(limit) for part in (key, slot)],
        )

    def _terminate(self, cursor: Any, holder: HolderInfo) -> int:
        cursor.execute(
            f"SELECT h.connection_id {self.LIVE_HOLDERS} AND h.token = %s", (holder.token,)
        )
        row = cursor.fetchone()
        return 0 if row is None else mysql.kill_connection(cursor, int(row[0]))

    def waiters(self, name: str | None) -> list[WaiterInfo]:
        known = self._known_names(name)
        names = {table_key(each): each for each in known}
        gates = {mysql_key(each, ROW_GATE): each for each in known}
        with self.backend.side.cursor() as cursor:
            statements = mysql.waiting_statements(cursor)
        return queue_order(
            self.alias,
            [
                (_waited_name(statement, names, gates), description, since)
                for _, description, statement, since in statements
            ],
        )


def _waited_name(query: str, names: dict[str, str], gates: dict[str, str]) -> str | None:
    """The name a waiting statement of the process list waits for, if it is one of ours."""
    if "SKIP LOCKED" not in query and (row := WAITING_ROW.search(query)):
        return names.get(row.group(1))
    if gate := mysql.WAITING_CALL.search(query):
        return gates.get(gate.group(1))
    return None
