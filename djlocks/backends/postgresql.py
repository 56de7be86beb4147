"""PostgreSQL advisory locks: ``djlocks.backends.postgresql.AdvisoryLockBackend``.

Session-level advisory locks (PostgreSQL manual, "Advisory Locks" and
"Advisory Lock Functions") on the one-``bigint`` key of ``djlocks.keys``.
A blocking acquire is ``pg_advisory_lock`` under ``lock_timeout`` (set in the
same statement with ``set_config``), so the wait happens in the server; a
time-out is the server's ``lock_not_available`` (55P03), unless the server granted
the lock as the time-out fired (then it is a grant: ``_granted_anyway``). Holders and waiters
come from ``pg_locks`` joined with ``pg_stat_activity``; a waiter's identity
is its ``application_name``. Forced release is ``pg_terminate_backend`` of
exactly the session that ``pg_locks`` shows holding the key.

Each session sets server-side TCP keep-alives (idle 10 s, then 3 probes 5 s
apart), so the server frees the locks of a client host that vanished
silently within about 25 s, and turns ``idle_session_timeout`` and
``idle_in_transaction_session_timeout`` off for itself: a held lock is never
dropped for idleness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import DatabaseError

from djlocks.backends.base import WaiterInfo
from djlocks.backends.described import owner_described
from djlocks.backends.prepared import prepare_where_direct
from djlocks.backends.session import Key, Session, SessionBackend
from djlocks.backends.session.inspection import Holding
from djlocks.backends.session_deadlocks import Wait
from djlocks.backends.sql import postgresql
from djlocks.backends.sql.postgresql import ADVISORY_HELD, ADVISORY_WAITING, LOCK_KEY
from djlocks.exceptions import LockDeadlock
from djlocks.keys import advisory_key

KEEPALIVE = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
}
NO_IDLE_LIMITS = ("idle_session_timeout", "idle_in_transaction_session_timeout")


class AdvisoryLockBackend(SessionBackend):
    """Locks and semaphores on PostgreSQL session-level advisory locks."""

    vendor = "postgresql"
    #: PostgreSQL's lock manager queues waiters for a lock in arrival order.
    serves_waiters_in_order = True
    try_sql = "pg_try_advisory_lock(%s)"
    give_back_sql = postgresql.UNLOCK_KEY
    #: Fences come from a sequence, in the granting statement (``sql.postgresql``).
    fences_in_grant = True

    def key(self, name: str, slot: int | str | None = None) -> int:
        return advisory_key(name, slot)

    def _prepare(self, session: Session) -> None:
        """Keep-alives, no idle limits, durable commits; and, if the server crashed
        since the fence sequence was last marked, move the sequence past every value it
        may hand out again (``sql.postgresql.AFTER_A_CRASH``) before any grant."""
        from djlocks.backends.libpq import DirectStatements  # psycopg, not psycopg2: checked

        prepares = prepare_where_direct(session.wrapper)
        session.direct = DirectStatements(session.wrapper.connection, prepares)
        settings = {
            **KEEPALIVE,
            **dict.fromkeys(NO_IDLE_LIMITS, "0"),
            **postgresql.FENCE_SESSION_SETTINGS,
        }
        marked = session.execute(
            "SELECT "
            + ", ".join("set_config(%s, %s, false)" for _ in settings)
            + f", {postgresql.CRASH_MARKER_PRESENT}",
            [part for setting in settings.items() for part in setting],
        )[-1]
        if not marked:
            session.execute(postgresql.AFTER_A_CRASH)

    def _connection_id(self, session: Session) -> int:
        return int(session.execute("SELECT pg_backend_pid()")[0])

    def _take(
        self,
        session: Session,
        key: Key,
        seconds: float | None,
        identity: str,
        fenced: bool = True,
        releasing: Key | None = None,
    ) -> int | None:
        params: tuple[object, ...] = (key,)
        if seconds != 0:
            params = (postgresql.application_name(identity), postgresql.lock_timeout(seconds), key)
        if releasing is not None:
            params += (releasing,)
        if fenced:
            params += (identity.removeprefix("djlocks"),)
        taking = postgresql.taking(seconds != 0, fenced, releasing is not None)
        try:
            with session.wrapper.wrap_database_errors:
                granted = session.direct.value(taking, params)
        except DatabaseError as exc:
            state = postgresql.sqlstate(exc)
            if state == postgresql.LOCK_NOT_AVAILABLE:
                return self._granted_anyway(session, key, identity, fenced, releasing)
            if state == postgresql.DEADLOCK_DETECTED:
                raise LockDeadlock(f"PostgreSQL detected a deadlock: {exc}") from exc
            raise
        return _fence_of(granted, fenced)

    def _granted_anyway(
        self, session: Session, key: Key, identity: str, fenced: bool, releasing: Key | None
    ) -> int | None:
        """After a wait's ``lock_timeout``: the grant, if the server granted the key as
        the time-out fired (``sql.postgresql.granted_anyway``), else ``None``. Without
        this, the session would hold a key its caller was told it did not get."""
        params: tuple[object, ...] = (key,) if releasing is None else (key, releasing, key)
        if fenced:
            params += (identity.removeprefix("djlocks"),)
        granting = postgresql.granted_anyway(fenced, releasing is not None)
        return _fence_of(session.execute(granting, params)[-1], fenced)

    def _attempt(
        self,
        session: Session,
        granting: str,
        params: Sequence[object],
        columns: tuple[str, ...],
        identity: str,
    ) -> tuple[tuple[Any, ...], int | None]:
        """``granting`` with the fence issued by the same statement (``fenced_grant``)."""
        row = session.execute(
            postgresql.fenced_grant(granting, columns),
            (*params, identity.removeprefix("djlocks")),
        )
        fence = row[len(columns)]
        return tuple(row[: len(columns)]), None if fence is None else int(fence)

    def _give_back(self, session: Session, key: Key) -> bool:
        with session.wrapper.wrap_database_errors:
            return bool(session.direct.value(postgresql.UNLOCKING, (key,)) == "t")

    def _holds(self, session: Session, key: Key) -> bool:
        return bool(session.execute(f"SELECT {postgresql.HELD_HERE}", (key,))[0])

    def _kill(self, session: Session, connection_id: int, key: Key | None) -> int:
        if key is None:
            return int(
                bool(session.execute("SELECT pg_terminate_backend(%s, 5000)", (connection_id,))[0])
            )
        # Check and kill in one statement: only the session that holds the key now.
        return int(
            session.execute(
                f"SELECT {postgresql.terminated('l.pid')} FROM pg_locks l "
                f"WHERE {ADVISORY_HELD} AND l.pid = %s AND {LOCK_KEY} = %s",
                (connection_id, key),
            )[0]
        )

    def _live_keys(self, session: Session, keys: Sequence[Key]) -> dict[Key, int]:
        if not keys:
            return {}
        rows = session.fetchall(
            f"SELECT {LOCK_KEY}, l.pid FROM pg_locks l "
            f"WHERE {ADVISORY_HELD} AND {LOCK_KEY} = ANY(%s)",
            (list(keys),),
        )
        return {int(key): int(pid) for key, pid in rows}

    def _holding_sessions(self, session: Session, keys: Sequence[Key]) -> dict[Key, Holding]:
        if not keys:
            return {}
        rows = session.fetchall(
            f"SELECT {LOCK_KEY}, l.pid, a.application_name, a.state_change FROM pg_locks l "
            f"JOIN pg_stat_activity a ON a.pid = l.pid "
            f"WHERE {ADVISORY_HELD} AND {LOCK_KEY} = ANY(%s)",
            (list(keys),),
        )
        return {int(key): Holding(int(pid), who, since) for key, pid, who, since in rows}

    def _waits(self, session: Session) -> list[Wait]:
        rows = session.fetchall(
            f"SELECT l.pid, a.application_name, a.query_start, {LOCK_KEY}, h.pid, "
            f"ha.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            f"JOIN pg_locks h ON h.locktype = 'advisory' AND h.granted "
            f"AND h.database IS NOT DISTINCT FROM l.database AND h.classid = l.classid "
            f"AND h.objid = l.objid AND h.objsubid = l.objsubid "
            f"LEFT JOIN pg_stat_activity ha ON ha.pid = h.pid "
            f"WHERE {ADVISORY_WAITING}"
        )
        return [
            Wait(int(pid), owner_described(who), since, int(key), int(holder), owner_described(by))
            for pid, who, since, key, holder, by in rows
        ]

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        names = self._waited_names(name)
        with self._side_session() as side:
            rows = side.fetchall(
                f"SELECT {LOCK_KEY}, a.application_name, a.query_start FROM pg_locks l "
                f"JOIN pg_stat_activity a ON a.pid = l.pid WHERE {ADVISORY_WAITING} "
                f"ORDER BY a.query_start, a.pid"
            )
        return self._as_waiters([(names.get(int(key)), app, since) for key, app, since in rows])


def _fence_of(granted: str | None, fenced: bool) -> int | None:
    """What ``_take`` returns for the last column of ``taking`` or ``granted_anyway``."""
    if granted is None:
        return None
    return postgresql.issued_fence(granted) if fenced else 0
