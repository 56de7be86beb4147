"""Row locks on PostgreSQL (PostgreSQL manual, "Row-Level Locks" and "The Locking Clause").

* Waiting: in a savepoint, ``lock_timeout`` and ``application_name`` are set
  with ``set_config(..., true)`` in the locking statement itself; a time-out
  is ``lock_not_available`` (55P03), rolled back to the savepoint, which also
  restores both settings. After a grant the caller's values are put back.
* Holders: a locked row's ``xmax`` is the locking (sub)transaction's id, and
  that transaction holds an ``ExclusiveLock`` on its own id in ``pg_locks``
  for as long as it lives; a holder row counts while the backend pid it names
  holds the id in the row's ``xmax``. A savepoint rolled back after the lock
  frees the row and ends its sub-transaction, so it drops out too.
* Waiters: the first waiter for a row holds the row's tuple lock (and waits
  for the holder's transaction id), the later ones wait for the tuple lock;
  both appear as ``tuple`` locks on ``djlocks_row_lock`` in ``pg_locks``. A
  semaphore's waiters wait for an advisory lock, the gate.
* Forced release: ``pg_terminate_backend`` of exactly the holding pid, in the
  statement that confirms it holds the row.

The caller's transaction may be ``REPEATABLE READ`` only if the name's rows
existed before its snapshot was taken; otherwise a clear error says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections

from djlocks.backends.base import AcquireRequest, HolderInfo, WaiterInfo
from djlocks.backends.described import describe, queue_order
from djlocks.backends.row.dialect import ROW_GATE, Claim
from djlocks.backends.row.server import RowsMissing, ServerRowDialect
from djlocks.backends.sql import postgresql
from djlocks.backends.sql.postgresql import ADVISORY_WAITING, LOCK_KEY
from djlocks.exceptions import BackendUnavailable, LockDeadlock
from djlocks.keys import advisory_key, table_key

#: Set the wait's settings (transaction-local) and hand back the caller's, in one sub-query.
WAIT_SETTINGS = (
    "(SELECT current_setting('lock_timeout') AS old_timeout, "
    "current_setting('application_name') AS old_name, "
    "set_config('lock_timeout', %s, true), set_config('application_name', %s, true)) AS s"
)


#: The holder's connection holds the XID lock of a transaction now.
IN_A_TRANSACTION = (
    "SELECT 1 FROM pg_locks l WHERE l.locktype = 'transactionid' AND l.granted "
    "AND l.pid = h.connection_id"
)
#: The 64-bit ``xid8`` of the row's locker (``r.xmax``, 32 bits): the one nearest the
#: snapshot's next XID (``n.next``), whose epoch is the one before when the locker's
#: 32 bits are more than 2**31 above the next XID's (assigned before a wrap-around),
#: the one after when more than 2**31 below (assigned after the snapshot, past a wrap).
LOCKER_XID8 = (
    "(SELECT (CASE WHEN x.xid - (n.next & 4294967295) > 2147483648 AND n.next >= 4294967296 "
    "THEN n.next - 4294967296 WHEN (n.next & 4294967295) - x.xid > 2147483648 "
    "THEN n.next + 4294967296 ELSE n.next END >> 32 << 32 | x.xid)::text::xid8 "
    "FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next) n, "
    "(SELECT r.xmax::text::bigint AS xid) x)"
)


class PostgreSQLRows(ServerRowDialect):
    vendor = "postgresql"
    CONNECTION_ID = "pg_backend_pid()"
    #: A holder row is live while its connection's transaction holds the slot's row
    #: lock: the row's ``xmax`` is that transaction's XID or, for a grant that waited
    #: (in a savepoint), its subtransaction's, whose own XID lock PostgreSQL drops at
    #: ``RELEASE SAVEPOINT``; ``pg_xact_status()`` says such a subtransaction is
    #: ``in progress`` until its parent ends.
    LIVE_HOLDERS = (
        "FROM djlocks_row_holder h "
        "JOIN djlocks_row_lock r ON r.name_key = h.name_key AND r.slot = h.slot "
        f"WHERE r.xmax <> '0' AND EXISTS ({IN_A_TRANSACTION} AND (l.transactionid = r.xmax "
        f"OR pg_xact_status({LOCKER_XID8}) = 'in progress'))"
    )

    def _wait_for_slot(
        self, cursor: Any, request: AcquireRequest, slot: int, seconds: float | None
    ) -> Claim | None:
        rows = self._in_savepoint(
            cursor,
            f"SELECT r.slot, pg_backend_pid(), s.old_timeout, s.old_name "
            f"FROM djlocks_row_lock r, {WAIT_SETTINGS} "
            f"WHERE r.name_key = %s AND r.slot = %s FOR UPDATE OF r",
            (
                postgresql.lock_timeout(seconds),
                postgresql.application_name(describe(request)),
                table_key(request.name),
                slot,
            ),
        )
        if rows is None:
            return None
        if not rows:  # the wait's settings may be set: back to the session's own
            cursor.execute(
                "SELECT set_config(name, reset_val, true) FROM pg_settings "
                "WHERE name IN ('lock_timeout', 'application_name')"
            )
            raise RowsMissing
        slot, pid, old_timeout, old_name = rows[0]
        _restore(cursor, old_timeout, old_name)
        return Claim(slot, pid)

    def _rows_unseen(self, request: AcquireRequest) -> BackendUnavailable:
        return BackendUnavailable(
            f"{request.name!r}: the row lock's rows were created after this transaction's "
            f"snapshot (REPEATABLE READ or SERIALIZABLE), so it cannot see them. Take the "
            f"lock before the transaction's first query, or once in any transaction "
            f"beforehand."
        )

    def _take_gate(self, cursor: Any, request: AcquireRequest, seconds: float | None) -> bool:
        cursor.execute(
            "SELECT count(*) FROM djlocks_row_lock WHERE name_key = %s",
            (table_key(request.name),),
        )
        if cursor.fetchone()[0] < request.limit:
            raise RowsMissing
        gate = advisory_key(request.name, ROW_GATE)
        rows = self._in_savepoint(
            cursor,
            f"SELECT s.old_timeout, s.old_name, pg_advisory_lock(%s) FROM {WAIT_SETTINGS}",
            (
                gate,
                postgresql.lock_timeout(seconds),
                postgresql.application_name(describe(request)),
            ),
        )
        if rows is None:
            # Granted as the time-out or cancel fired? Then this session holds the gate,
            # which the rollback to the savepoint does not release: it is the caller's.
            cursor.execute(f"SELECT {postgresql.HELD_HERE}", (gate,))
            return bool(cursor.fetchone()[0])
        _restore(cursor, *rows[0][:2])
        return True

    def _give_back_gate(self, cursor: Any, request: AcquireRequest) -> None:
        cursor.execute("SELECT pg_advisory_unlock(%s)", (advisory_key(request.name, ROW_GATE),))

    def _in_savepoint(self, cursor: Any, sql: str, params: tuple[Any, ...]) -> list[Any] | None:
        """Run a waiting statement in a savepoint; ``None`` if it timed out or was cancelled.

        The failed statement is rolled back to the savepoint, so the caller's
        transaction stays usable. Raises ``LockDeadlock`` for a deadlock.
        """
        connection = connections[self.using]
        savepoint = connection.savepoint()  # transaction.savepoint_create() from Django 6
        assert savepoint is not None  # a row lock is always taken inside an atomic block
        try:
            cursor.execute(sql, params)
            rows = list(cursor.fetchall())
        except DatabaseError as exc:
            connection.savepoint_rollback(savepoint)
            state = postgresql.sqlstate(exc)
            if state in (postgresql.LOCK_NOT_AVAILABLE, postgresql.QUERY_CANCELED):
                return None
            if state == postgresql.DEADLOCK_DETECTED:
                raise LockDeadlock(f"PostgreSQL detected a deadlock: {exc}") from exc
            raise BackendUnavailable(f"djlocks backend {self.alias!r} failed: {exc}") from exc
        connection.savepoint_commit(savepoint)
        return rows

    def _canceller(self) -> Callable[[], None]:
        driver_connection = connections[self.using].connection
        return driver_connection.cancel  # type: ignore[no-any-return]

    def _create_rows(self, cursor: Any, key: str, limit: int) -> None:
        cursor.execute(
            "INSERT INTO djlocks_row_lock (name_key, slot) "
            "SELECT %s, generate_series(0, %s - 1) ON CONFLICT DO NOTHING",
            (key, limit),
        )

    def _terminate(self, cursor: Any, holder: HolderInfo) -> int:
        cursor.execute(
            f"SELECT {postgresql.terminated('h.connection_id::integer')} "
            f"{self.LIVE_HOLDERS} AND h.token = %s",
            (holder.token,),
        )
        return int(cursor.fetchone()[0])

    def waiters(self, name: str | None) -> list[WaiterInfo]:
        gates = {advisory_key(known, ROW_GATE): known for known in self._known_names(name)}
        names = {table_key(known): known for known in gates.values()}
        with self.backend.side.cursor() as cursor:
            cursor.execute(
                f"SELECT r.name_key, NULL, a.application_name, a.query_start, a.pid "
                f"FROM pg_locks l JOIN djlocks_row_lock r "
                f"ON r.ctid = ('(' || l.page || ',' || l.tuple || ')')::tid "
                f"JOIN pg_stat_activity a ON a.pid = l.pid "
                f"WHERE l.locktype = 'tuple' AND l.relation = 'djlocks_row_lock'::regclass "
                f"UNION ALL "
                f"SELECT NULL, {LOCK_KEY}, a.application_name, a.query_start, a.pid "
                f"FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                f"WHERE {ADVISORY_WAITING} AND {LOCK_KEY} = ANY(%s) ORDER BY 4, 5",
                (list(gates),),
            )
            rows = cursor.fetchall()
        return queue_order(
            self.alias,
            [
                (names.get(key) if gate is None else gates.get(gate), description, since)
                for key, gate, description, since, _pid in rows
            ],
        )


def _restore(cursor: Any, old_timeout: str, old_name: str) -> None:
    cursor.execute(
        "SELECT set_config('lock_timeout', %s, true), set_config('application_name', %s, true)",
        (old_timeout, old_name),
    )
