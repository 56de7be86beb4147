"""What djlocks runs on MySQL and MariaDB: every statement, error code and server query."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError

from djlocks.backends.server_records import HOLDER_COLUMNS, OVERWRITTEN, RecordTables
from djlocks.backends.sql.dialects import LeaseDialect
from djlocks.exceptions import LockDeadlock

# -- History (djlocks.events) ------------------------------------------------

#: Run once on the history's own connection: nothing (durability is server-wide here).
HISTORY_SESSION: str | None = None

#: A new name's first fence: the server's clock in microseconds since the epoch (see
#: ``sql.postgresql.FIRST_FENCE``).
FIRST_FENCE = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))"

# -- Lease rows (djlocks.backends.lease) ------------------------------------

LEASE = LeaseDialect(
    now="UTC_TIMESTAMP(6)",
    plus_seconds="UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND",
    for_update=" FOR UPDATE",
    returning=False,
    # No UPDATE ... RETURNING: LAST_INSERT_ID(expr) hands the new value back in the
    # OK packet (cursor.lastrowid), in the same round trip.
    fence_increment="fence = LAST_INSERT_ID(fence + 1)",
    first_fence=FIRST_FENCE,
    begin="START TRANSACTION",
    seconds_param=lambda seconds: round(seconds * 1_000_000),
    # Fewer gap locks, so concurrent claims deadlock less often.
    session_setup=("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",),
)


# -- Fences and holders of server-held locks (djlocks.backends.server_records) ------


def register_name(cursor: Any, tables: RecordTables, params: Sequence[object]) -> None:
    """Make sure the name (key, name, limit) has a fence row (``FIRST_FENCE`` if new),
    marked used now: a sweep keeps it for the idle time at least."""
    cursor.execute(
        f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at) "
        f"VALUES (%s, %s, %s, {FIRST_FENCE}, UTC_TIMESTAMP(6)) "
        f"ON DUPLICATE KEY UPDATE slot_limit = VALUES(slot_limit), used_at = VALUES(used_at)",
        params,
    )


def record_grant(
    cursor: Any,
    tables: RecordTables,
    fence_params: Sequence[object],
    holder_params: Sequence[object],
) -> int:
    """Issue the name's next fence and write the slot's holder row; return the fence.

    One batch of statements in a transaction, so one round trip and one commit
    (djlocks' connections allow several statements per query, see
    ``DedicatedConnections``); ``LAST_INSERT_ID(expr)`` carries the new fence
    from the fence row to the holder row (the MySQL manual, "Information Functions").
    """
    overwrite = ", ".join(f"{column} = VALUES({column})" for column in OVERWRITTEN)
    values = "%s, %s, %s, %s, %s, @djlocks_fence, %s, UTC_TIMESTAMP(6), %s, %s, %s, %s"
    try:
        cursor.execute(
            f"START TRANSACTION; "
            f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at) "
            f"VALUES (%s, %s, %s, LAST_INSERT_ID({FIRST_FENCE}), UTC_TIMESTAMP(6)) "
            f"ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), "
            f"slot_limit = VALUES(slot_limit), used_at = VALUES(used_at); "
            f"SET @djlocks_fence = LAST_INSERT_ID(); "
            f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) VALUES ({values}) "
            f"ON DUPLICATE KEY UPDATE {overwrite}; "
            f"COMMIT; "
            f"SELECT @djlocks_fence",
            (*fence_params, *holder_params),
        )
        while cursor.nextset():  # each statement's result in turn; an error raises here
            if cursor.description:
                return int(cursor.fetchone()[0])
    except BaseException:
        with contextlib.suppress(Exception):
            cursor.execute("ROLLBACK")  # a statement failed: the rest did not run
        raise
    raise AssertionError("the batch ended without the fence")


# -- Server sessions: who waits, who holds, killing a session -------------------

#: Seconds; "forever" for GET_LOCK and innodb_lock_wait_timeout (MariaDB refuses a
#: negative GET_LOCK time-out).
FOREVER = 365 * 24 * 3600
#: ER_USER_LOCK_DEADLOCK (MySQL 8), ER_LOCK_DEADLOCK (MariaDB's answer to the same cycle).
DEADLOCK_ERRORS = (3058, 1213)
#: A ``GET_LOCK('key'`` call in a statement of the process list.
WAITING_CALL = re.compile(r"GET_LOCK\('((?:[^'\\]|\\.)*)'")
#: The comment that names a waiting statement's waiter (``sql_comment``).
COMMENT = re.compile(r"/\* (djlocks .*?) \*/", re.DOTALL)


def sql_comment(description: str) -> str:
    """``description`` (``described.describe``) as the ``/* ... */`` comment that names a
    waiting statement in the process list, for a query run with parameters.

    The description holds a label, which is anyone's text: a ``*/`` in it would end
    the comment (it becomes ``* /``), and each ``%`` is doubled because the driver
    formats a query that has parameters with ``%`` (``date +%Y`` would raise).
    ``COMMENT`` reads it back; what follows it is the statement itself.
    """
    return "/* " + description.replace("*/", "* /").replace("%", "%%") + " */"


def connection_id(cursor: Any) -> int:
    """The server's id of the cursor's session (``CONNECTION_ID()``)."""
    cursor.execute("SELECT CONNECTION_ID()")
    return int(cursor.fetchone()[0])


def get_lock(cursor: Any, key: str, seconds: float | None, description: str) -> int | None:
    """``GET_LOCK(key, seconds)`` (``None``: forever) with the waiter named in the process
    list: 1 granted, 0 timed out, ``None`` interrupted or killed (the MySQL manual,
    "Locking Functions"). Raises ``LockDeadlock`` when the server refuses a wait that
    would deadlock (MySQL 8 checks GET_LOCK waits for cycles)."""
    try:
        cursor.execute(
            f"SELECT {sql_comment(description)} GET_LOCK(%s, %s)",
            (key, FOREVER if seconds is None else seconds),
        )
    except DatabaseError as exc:
        if exc.args and exc.args[0] in DEADLOCK_ERRORS:
            raise LockDeadlock(f"MySQL refused a wait that would deadlock: {exc}") from exc
        raise
    granted = cursor.fetchone()[0]
    return None if granted is None else int(granted)


def release_lock(cursor: Any, key: str) -> bool:
    """``RELEASE_LOCK(key)``: False if this session did not hold it."""
    cursor.execute("SELECT RELEASE_LOCK(%s)", (key,))
    return bool(cursor.fetchone()[0] == 1)


def lock_holders(cursor: Any, keys: Sequence[str]) -> dict[str, int]:
    """Which of ``keys`` are held, and by which connection id (``IS_USED_LOCK``), 100
    keys a statement."""
    live: dict[str, int] = {}
    for start in range(0, len(keys), 100):
        chunk = keys[start : start + 100]
        cursor.execute("SELECT " + ", ".join(["IS_USED_LOCK(%s)"] * len(chunk)), tuple(chunk))
        row = cursor.fetchone()
        live.update(
            {key: int(owner) for key, owner in zip(chunk, row, strict=True) if owner is not None}
        )
    return live


def kill_connection(cursor: Any, connection_id: int) -> int:
    """End the session ``connection_id`` (``KILL CONNECTION``): 1, or 0 if it was gone."""
    try:
        cursor.execute("KILL CONNECTION %s", (connection_id,))
    except DatabaseError as exc:
        if "Unknown thread id" in str(exc):
            return 0
        raise
    return 1


def kill_query(cursor: Any, connection_id: int) -> None:
    """End the statement that session ``connection_id`` runs (``KILL QUERY``)."""
    cursor.execute("KILL QUERY %s", (connection_id,))


def waiting_statements(cursor: Any) -> list[tuple[int, str, str, datetime]]:
    """(connection id, waiter's description, statement, waiting since) of every djlocks
    statement in the process list, longest waiting first (needs the PROCESS privilege
    to see other users' sessions). The statement is what follows the description's
    comment: the description holds a label, which is anyone's text."""
    cursor.execute("SELECT UTC_TIMESTAMP(6)")
    now = cursor.fetchone()[0].replace(tzinfo=UTC)
    cursor.execute(
        "SELECT ID, TIME_MS, INFO FROM information_schema.PROCESSLIST "
        "WHERE INFO LIKE %s AND ID <> CONNECTION_ID() ORDER BY TIME_MS DESC, ID",
        ("%/* djlocks %",),
    )
    waiting = []
    for session_id, elapsed_ms, query in cursor.fetchall():
        comment = COMMENT.search(query)
        if comment is not None:
            since = now - timedelta(milliseconds=float(elapsed_ms))
            waiting.append((int(session_id), comment.group(1), query[comment.end() :], since))
    return waiting
