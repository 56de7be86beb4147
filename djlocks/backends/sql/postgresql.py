"""What djlocks runs on PostgreSQL: every statement, error code and server query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from djlocks.backends.server_records import HOLDER_COLUMNS, OVERWRITTEN, RecordTables
from djlocks.backends.sql.dialects import LeaseDialect

# -- History (djlocks.events) ------------------------------------------------

#: Run once on the history's own connection: its commits need not wait for the WAL
#: flush (the PostgreSQL manual, "Asynchronous Commit"); a crash may lose the last events.
HISTORY_SESSION: str | None = "SET synchronous_commit TO off"

# -- Lease rows (djlocks.backends.lease) ------------------------------------

#: NOTIFY channel of freed slots; the payload is the name's ``name_key``.
LEASE_RELEASED = "djlocks_lease"
#: NOTIFY channel of forced releases and graceful releases' requests, which the holders
#: listen on; the payload is "<name_key> <fence>".
LEASE_REVOKED = "djlocks_revoked"


def lease_notifying(update: str, waiters: bool, holders: bool) -> str:
    """Make an ``UPDATE`` of lease rows also tell, in the same round trip, the
    ``waiters`` (``LEASE_RELEASED``) when it freed slots and the ``holders``
    (``LEASE_REVOKED``) when it took grants away or asked them back.

    The statement still reports one row per grant it changed.
    """
    notices = [f"pg_notify('{LEASE_RELEASED}', name_key)"] if waiters else []
    notices += [f"pg_notify('{LEASE_REVOKED}', name_key || ' ' || fence)"] if holders else []
    return (
        f"WITH changed AS ({update} RETURNING name_key, fence) "
        f"SELECT {', '.join(notices)} FROM changed"
    )


LEASE = LeaseDialect(
    now="statement_timestamp()",
    plus_seconds="statement_timestamp() + %s * interval '1 second'",
    for_update=" FOR UPDATE",
    returning=True,
    fence_increment="fence = fence + 1",
    begin="BEGIN",
    seconds_param=float,
    notifying=lease_notifying,
)


def listen(channel: str) -> str:
    """Start receiving ``channel``'s notifications on this connection."""
    return f"LISTEN {channel}"


def unlisten(channel: str) -> str:
    """Stop receiving ``channel``'s notifications, so an idle connection never holds
    back the server's notification queue."""
    return f"UNLISTEN {channel}"


# -- Fences and holders of server-held locks (djlocks.backends.server_records) ------


def register_name(cursor: Any, tables: RecordTables, params: Sequence[object]) -> None:
    """Make sure the name (key, name, limit) has a fence row, fence 0 if new."""
    cursor.execute(
        f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence) "
        f"VALUES (%s, %s, %s, 0) ON CONFLICT (name_key) "
        f"DO UPDATE SET slot_limit = EXCLUDED.slot_limit",
        params,
    )


def record_grant(
    cursor: Any,
    tables: RecordTables,
    fence_params: Sequence[object],
    holder_params: Sequence[object],
) -> int:
    """Issue the name's next fence and write the slot's holder row in one statement
    (a CTE feeds the new fence into the holder row); return the fence."""
    overwrite = ", ".join(f"{column} = EXCLUDED.{column}" for column in OVERWRITTEN)
    values = "%s, %s, %s, %s, %s, issued.fence, %s, statement_timestamp(), %s, %s, %s, %s"
    cursor.execute(
        f"WITH issued AS ("
        f" INSERT INTO {tables.fence} (name_key, name, slot_limit, fence)"
        f" VALUES (%s, %s, %s, 1) ON CONFLICT (name_key) DO UPDATE"
        f" SET fence = {tables.fence}.fence + 1, slot_limit = EXCLUDED.slot_limit"
        f" RETURNING fence) "
        f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) SELECT {values} FROM issued "
        f"ON CONFLICT (name_key, slot) DO UPDATE SET {overwrite} RETURNING fence",
        (*fence_params, *holder_params),
    )
    return int(cursor.fetchone()[0])


# -- Server sessions: who waits, who holds, killing a session -------------------

#: The signed bigint key of an advisory lock row of ``pg_locks`` (alias ``l``).
LOCK_KEY = "((l.classid::bigint << 32) | l.objid::bigint)"
#: ``pg_locks`` rows (alias ``l``) of granted single-key advisory locks (the
#: PostgreSQL manual, "pg_locks": ``objsubid`` 1 is a bigint key).
ADVISORY_HELD = "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
#: ``pg_locks`` rows (alias ``l``) of sessions waiting for a single-key advisory lock.
ADVISORY_WAITING = "l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 1"
#: SQLSTATEs: lock_not_available (a lock_timeout ran out), deadlock_detected,
#: query_canceled (``pg_cancel_backend`` or the driver's cancel).
LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED, QUERY_CANCELED = "55P03", "40P01", "57014"
#: The longest ``application_name`` the server keeps (NAMEDATALEN - 1 bytes).
APPLICATION_NAME_LENGTH = 63


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error wrapped by Django (``None`` for other errors)."""
    return getattr(exc.__cause__, "sqlstate", None)


def lock_timeout(seconds: float | None) -> str:
    """``seconds`` (``None``: no limit) as a ``lock_timeout`` setting, at least 1 ms."""
    return "0" if seconds is None else f"{max(1, round(seconds * 1000))}ms"


def application_name(description: str) -> str:
    """``description`` cut to what ``application_name`` keeps."""
    return description[:APPLICATION_NAME_LENGTH]


def terminated(pid: str) -> str:
    """SQL counting the sessions ``pid`` (an SQL expression) that
    ``pg_terminate_backend`` ended, waiting up to 5 s for each to go."""
    return f"count(*) FILTER (WHERE pg_terminate_backend({pid}, 5000))"
