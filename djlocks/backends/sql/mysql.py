"""What djlocks runs on MySQL and MariaDB: every statement, error code and server query."""

from __future__ import annotations

import contextlib
import re
import select
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError

from djlocks.backends.server_records import HOLDER_COLUMNS, OVERWRITTEN, RecordTables
from djlocks.backends.sql import giving_back_first
from djlocks.backends.sql.dialects import HandOver, LeaseDialect, Outcome
from djlocks.exceptions import LockDeadlock

# -- History (djlocks.events) ------------------------------------------------

#: Run once on the history's own connection: nothing (durability is server-wide here).
HISTORY_SESSION: str | None = None

#: A new name's first fence: the server's clock in microseconds since the epoch (see
#: ``sql.postgresql.FIRST_FENCE``).
FIRST_FENCE = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))"

# -- Lease rows (djlocks.backends.lease) ------------------------------------


def lease_claiming_free_slot(
    cursor: Any, slots: str, waiters: str, params: Mapping[str, object]
) -> Sequence[Any] | None:
    """Claim a free slot in one round trip: a batch of statements in one transaction
    (djlocks' own connections accept several statements per query) that locks the
    name's slot rows, takes the lowest free slot if more are free than live waiters
    are ahead, with a fence one more than the name's largest, commits, and reads the
    claim back. Returns the slot, its fence and its expiry, or ``None``."""
    now = "UTC_TIMESTAMP(6)"
    name = "name_key = %(key)s AND slot_limit = %(limit)s"
    try:
        cursor.execute(
            f"START TRANSACTION; "
            f"SELECT MAX(fence) INTO @djlocks_top FROM {slots} WHERE {name} FOR UPDATE; "
            f"SELECT MIN(slot), COUNT(*) INTO @djlocks_slot, @djlocks_free FROM {slots} "
            f"WHERE {name} AND (token IS NULL OR expires_at <= {now}) "
            f"AND (cooldown_until IS NULL OR cooldown_until <= {now}); "
            f"SELECT COUNT(*) INTO @djlocks_ahead FROM {waiters} WHERE name_key = %(key)s "
            f"AND expires_at > {now} AND id < %(ticket)s; "
            f"UPDATE {slots} SET token = %(token)s, fence = @djlocks_top + 1, "
            f"acquired_at = {now}, expires_at = {now} + INTERVAL %(ttl)s MICROSECOND, "
            f"cooldown_until = NULL, release_by = NULL, host = %(host)s, pid = %(pid)s, "
            f"thread = %(thread)s, label = %(label)s WHERE name_key = %(key)s "
            f"AND slot = @djlocks_slot AND @djlocks_free > @djlocks_ahead; "
            f"COMMIT; "
            f"SELECT slot, fence, expires_at FROM {slots} WHERE token = %(token)s",
            params,
        )
        while cursor.nextset():  # each statement's result in turn; an error raises here
            if cursor.description:
                row: Sequence[Any] | None = cursor.fetchone()
                return row
    except BaseException:
        with contextlib.suppress(Exception):
            cursor.execute("ROLLBACK")  # a statement failed: the rest did not run
        raise
    raise AssertionError("the batch ended without reading the claim back")


def lease_enqueue(
    cursor: Any, insert: str, params: Sequence[object], waiters: str, now: str
) -> tuple[int, int]:
    """``insert`` (of a waiter row in ``waiters``), then, in the same round trip (a
    batch of two statements), the row's id, its ticket, and how many live waiters of
    the name are ahead of it: MySQL has no ``INSERT ... RETURNING`` (MariaDB's is
    10.5's), and ``LAST_INSERT_ID()`` is the session's last inserted id."""
    cursor.execute(
        f"{insert}; SELECT LAST_INSERT_ID(), (SELECT COUNT(*) FROM {waiters} ahead "
        f"WHERE ahead.name_key = (SELECT name_key FROM {waiters} WHERE id = LAST_INSERT_ID()) "
        f"AND ahead.expires_at > {now} AND ahead.id < LAST_INSERT_ID())",
        params,
    )
    while cursor.nextset():  # the insert's outcome first; an error raises here
        if cursor.description:
            ticket, ahead = cursor.fetchone()
            return int(ticket), int(ahead)
    raise AssertionError("the batch ended without counting the waiters ahead")


#: The heir a hand-over release chose, in the batch's user variables.
HEIR = ("id", "token", "ttl", "host", "pid", "thread", "label", "connection_id")


def lease_hand_over(cursor: Any, slots: str, waiters: str, token: str) -> HandOver:
    """Release the grant ``token`` and hand its slot to the head of the name's queue,
    in one batch of statements and one transaction (as PostgreSQL's
    ``lease_handing_over`` does in one statement; see its rules), with the server
    session the heir sleeps on to wake with ``KILL QUERY``
    (``lease_sleep_until_handed``).

    The batch reads the clock once, as PostgreSQL's one statement does, so that the
    grant's liveness is judged alike before and after its waits for locks. The name
    is found from the token (a plain read); its slot rows are then locked in slot
    order, as claims lock them, by the statement that reads the name's highest fence
    and checks that the grant is still the releaser's; the heir's queue row is read
    with a locking read, so a waiter that leaves the queue meanwhile is either handed
    the slot (and passes it on) or not considered.
    """
    now = "@djlocks_now"
    mine = f"token = %(token)s AND expires_at > {now}"
    heir = [f"@djlocks_heir_{column}" for column in HEIR]
    # The head of the queue is the heir only if the grant was still the releaser's under
    # the locks and the head queued with a token and with the name's limit.
    chosen = [
        "IF(@djlocks_mine = 1 AND token IS NOT NULL AND slot_limit = @djlocks_limit, id, NULL)"
        if column == "id"
        else column
        for column in HEIR
    ]
    handed = "@djlocks_heir_id IS NOT NULL"
    kept = ", ".join(
        f"{column} = IF({handed}, @djlocks_heir_{column}, {column})"
        for column in ("host", "pid", "thread", "label")
    )
    try:
        cursor.execute(
            f"SET {', '.join(f'{variable} = NULL' for variable in heir)}, "
            f"{now} = UTC_TIMESTAMP(6); "
            f"START TRANSACTION; "
            f"SELECT MAX(name_key) INTO @djlocks_key FROM {slots} WHERE {mine}; "
            f"SELECT MAX(IF({mine}, slot_limit, NULL)), MAX(fence), COALESCE(SUM({mine}), 0) "
            f"INTO @djlocks_limit, @djlocks_top, @djlocks_mine FROM {slots} "
            f"WHERE name_key = @djlocks_key FOR UPDATE; "
            f"SELECT {', '.join(chosen)} INTO {', '.join(heir)} FROM {waiters} "
            f"WHERE name_key = @djlocks_key AND expires_at > {now} "
            f"ORDER BY id LIMIT 1 FOR UPDATE; "
            f"DELETE FROM {waiters} WHERE id = @djlocks_heir_id; "
            f"UPDATE {slots} SET "
            f"fence = IF({handed}, @djlocks_top + 1, fence), "
            f"acquired_at = IF({handed}, {now}, acquired_at), "
            f"expires_at = IF({handed}, {now} + INTERVAL ROUND(@djlocks_heir_ttl * 1000000) "
            f"MICROSECOND, NULL), "
            f"cooldown_until = NULL, release_by = NULL, {kept}, "
            f"token = IF({handed}, @djlocks_heir_token, NULL) "
            f"WHERE token = %(token)s AND expires_at > {now}; "
            f"SET @djlocks_released = ROW_COUNT(); "
            f"COMMIT; "
            f"SELECT @djlocks_released, {handed}, IF({handed}, @djlocks_heir_connection_id, NULL)",
            {"token": token},
        )
        while cursor.nextset():  # each statement's result in turn; an error raises here
            if cursor.description:
                released, handed, session = cursor.fetchone()
                wake = None if session is None else int(session)
                return HandOver(int(released), bool(handed), wake)
    except BaseException:
        with contextlib.suppress(Exception):
            cursor.execute("ROLLBACK")  # a statement failed: the rest did not run
        raise
    raise AssertionError("the batch ended without its outcome")


#: ER_QUERY_INTERRUPTED: what a statement that ``KILL QUERY`` ended raises.
QUERY_INTERRUPTED = 1317


def wake_key(session: int) -> str:
    """The named lock that the lease store's connection ``session`` holds while it is open
    (``WAKE_KEY_TAKEN``), for its thread's sleeping session to wait on."""
    return f"djlocks-wake/{session}"


#: Run on each lease store connection as it opens: it takes its ``wake_key``.
WAKE_KEY_TAKEN = "DO GET_LOCK(CONCAT('djlocks-wake/', CONNECTION_ID()), 0)"


def lease_sleep_until_handed(
    cursor: Any, slots: str, token: str, holder: int, seconds: float
) -> bool:
    """Wait in the server for up to ``seconds``, unless a slot was already handed over
    with ``token``; a hand-over's ``KILL QUERY`` ends the wait early. True unless the
    seconds ran out.

    The wait is ``GET_LOCK`` on the ``wake_key`` that the waiter's own lease
    connection ``holder`` holds, so it is never granted: ``KILL QUERY`` ends such a
    wait at once. (A ``SLEEP()`` would do as a wait, but ``KILL QUERY`` of one can
    hold up both the killer and the sleeper for two seconds when several sessions
    sleep: MariaDB's sleeps share one mutex, which the killer must take.) The check
    and the wait are one statement: a hand-over committed before it began is seen,
    and one committed after it began is followed by its ``KILL QUERY`` while it runs
    (a ``KILL QUERY`` of an idle session does nothing). The session runs nothing else,
    so a late ``KILL QUERY`` ends a wait, never a claim. If the key was free (the
    holding connection is gone), it is given back, and the seconds are slept here.
    """
    key = wake_key(holder)
    try:
        cursor.execute(
            f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {slots} WHERE token = %s "
            f"AND expires_at > UTC_TIMESTAMP(6)) THEN 2 ELSE GET_LOCK(%s, %s) END",
            (token, key, seconds),
        )
        outcome = cursor.fetchone()[0]
    except Exception as exc:
        if exc.args and exc.args[0] == QUERY_INTERRUPTED:
            return True
        raise
    if outcome == 1:
        cursor.execute("DO RELEASE_LOCK(%s)", (key,))
        time.sleep(seconds)
        return False
    return bool(outcome != 0)


#: ER_NO_SUCH_THREAD, ER_KILL_DENIED_ERROR: the session is gone, or this user may not
#: end its statements (another user's, without the CONNECTION ADMIN privilege).
NO_SUCH_SESSION, NOT_YOURS = 1094, 1095


def wake_sleeper(cursor: Any, session: int) -> None:
    """End the sleep of the waiter on ``session`` (``KILL QUERY``). A session that is
    gone, or that this database user may not touch, is left to its poll."""
    try:
        kill_query(cursor, session)
    except Exception as exc:
        if not exc.args or exc.args[0] not in (NO_SUCH_SESSION, NOT_YOURS):
            raise


def session_id(connection: Any) -> int:
    """The server's id of a mysqlclient connection's session (``CONNECTION_ID()``), known
    to the driver since it connected."""
    return int(connection.thread_id())


def run_at_once(
    connection: Any, sql: str, params: Sequence[object], *, interruptible: bool = False
) -> Outcome:
    """Run ``sql`` on a mysqlclient ``connection`` through its wrapper of the C API
    (``query``, or ``send_query`` and ``read_query_result``, then ``store_result``),
    its parameters quoted by the connection (``literal``) as the driver's cursor
    quotes them: a cursor's ``execute`` and ``fetchone`` cost about 350 Python
    bytecodes more, a tenth of a lock's acquire and release. Its first row (``None``
    if it returned none), the rows it matched (Django's connections count matched
    rows, not changed ones), and the value ``LAST_INSERT_ID(expr)`` set.

    ``interruptible``: wait for the reply on the socket (``poll``), so that Ctrl-C or
    a signal's handler interrupts a long ``GET_LOCK`` (the C API's ``query`` would not
    return before the server replied). The statement then still runs: end the
    session. Otherwise the wait is the C API's, as a cursor's is: a statement that
    waits on a row lock is never left to commit behind its interrupted caller.

    Raises mysqlclient's errors (wrap the call in Django's ``wrap_database_errors``),
    its ``OperationalError`` for a connection that is closed (``connection`` ``None``:
    closed by Django), as a cursor would: mysqlclient's own ``InterfaceError`` for it is
    no ``DatabaseError``."""
    try:
        if connection is None:
            raise _closed()
        query = sql.encode(connection.encoding) % tuple(map(connection.literal, params))
        if interruptible:
            connection.send_query(query)
            replied = select.poll()
            replied.register(connection.fileno(), select.POLLIN)
            replied.poll()
            connection.read_query_result()
        else:
            connection.query(query)
        result = connection.store_result()
        rows = result.fetch_row() if result is not None else ()
        return (rows[0] if rows else None), connection.affected_rows(), connection.insert_id()
    except _interface_error() as exc:
        raise _closed() from exc


def _interface_error() -> type[Exception]:
    from MySQLdb import InterfaceError  # type: ignore[import-untyped]

    return InterfaceError  # type: ignore[no-any-return]


def _closed() -> Exception:
    from MySQLdb import OperationalError

    return OperationalError(0, "the connection is closed")  # type: ignore[no-any-return]


LEASE = LeaseDialect(
    now="UTC_TIMESTAMP(6)",
    plus_seconds="UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND",
    for_update=" FOR UPDATE",
    returning=False,
    enqueue=lease_enqueue,
    # No UPDATE ... RETURNING: LAST_INSERT_ID(expr) hands the new value back in the
    # OK packet (cursor.lastrowid), in the same round trip.
    fence_increment="fence = LAST_INSERT_ID(fence + 1)",
    first_fence=FIRST_FENCE,
    begin="START TRANSACTION",
    seconds_param=lambda seconds: round(seconds * 1_000_000),
    # Fewer gap locks, so concurrent claims deadlock less often.
    session_setup=("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED", WAKE_KEY_TAKEN),
    claim_free_slot=lease_claiming_free_slot,
    hand_over=lease_hand_over,
    waking=lease_sleep_until_handed,
    wake=wake_sleeper,
    session_id=session_id,
    idle_limit=lambda seconds: f"SET SESSION wait_timeout = {seconds}",
    seconds_until="TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {}) / 1000000",
    run_at_once=run_at_once,
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


def record_holders(
    cursor: Any,
    tables: RecordTables,
    holders: Sequence[Sequence[object]],
    names: Sequence[Sequence[object]],
) -> None:
    """Write ``holders`` (rows in ``HOLDER_COLUMNS`` order, at most one per slot) where
    no newer grant's row is already, and raise the fence rows of ``names`` (key, name,
    limit, newest fence; one per name) to their newest fence: two statements, one
    round trip. MySQL assigns ``ON DUPLICATE KEY UPDATE`` columns left to right, so the
    fence, which the others compare with, comes last."""
    newer = "VALUES(fence) > fence"
    overwrite = ", ".join(
        f"{column} = IF({newer}, VALUES({column}), {column})"
        for column in OVERWRITTEN
        if column != "fence"
    )
    row = "(" + ", ".join(["%s"] * len(HOLDER_COLUMNS.split(","))) + ")"
    cursor.execute(
        f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) "
        f"VALUES {', '.join([row] * len(holders))} "
        f"ON DUPLICATE KEY UPDATE {overwrite}, fence = GREATEST(fence, VALUES(fence)); "
        f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at) "
        f"VALUES {', '.join(['(%s, %s, %s, %s, UTC_TIMESTAMP(6))'] * len(names))} "
        f"ON DUPLICATE KEY UPDATE fence = GREATEST(fence, VALUES(fence)), "
        f"slot_limit = VALUES(slot_limit), used_at = VALUES(used_at)",
        [value for rows in (holders, names) for record in rows for value in record],
    )
    while cursor.nextset():  # the second statement's outcome; an error raises here
        pass


# -- Fences issued in the locking statement (MariaDB: djlocks.backends.mysql) ------

#: The sequence that issues the GET_LOCK backend's fences on MariaDB (migration 0009;
#: MySQL has no sequences). Its values rise for every name at once, so each name's
#: fences rise too.
FENCE_SEQUENCE = "djlocks_session_fence_seq"
#: A ``MEMORY`` table of at most one row. MariaDB empties ``MEMORY`` tables whenever
#: the server starts (the manual, "MEMORY Storage Engine"): empty means the server
#: started since the sequence was last raised to the clock (``after_a_restart``).
RESTART_MARKER = "djlocks_session_fence_guard"
RESTART_MARKER_PRESENT = f"SELECT EXISTS (SELECT 1 FROM {RESTART_MARKER})"


def fenced_slot(slot: int) -> str:
    """What a semaphore's slot-trying ``CASE`` answers when it takes ``slot``: the slot
    and the fence issued in the same statement, as ``"<slot> <fence>"``."""
    return f"CONCAT({slot}, ' ', NEXTVAL({FENCE_SEQUENCE}))"


def after_a_restart(cursor: Any) -> None:
    """Raise the fence sequence to the server's clock (microseconds since the epoch,
    ``FIRST_FENCE``), then mark it done (``RESTART_MARKER``).

    A sequence stores its next value only when its cache of values runs out, and
    the manual does not say that this write is on disk before the values are handed
    out: after a crash, the sequence may hand out again values it had handed out.
    It never runs ahead of the clock, though: it starts at most there (migration
    0009), rises by one per grant, far slower than the clock's microseconds, and is
    raised to the clock at each start. So every value handed out before the crash is
    below the clock when the server is back, and raising the sequence there clears
    them all, whether or not any write before the crash reached the disk. This holds
    while the server's clock does not go back across a restart (as for the Redis
    backend's fences). ``SETVAL`` takes a literal and never lowers a sequence, so two
    sessions that both find the marker missing both raise it, harmlessly.
    """
    cursor.execute(f"SELECT GREATEST(NEXTVAL({FENCE_SEQUENCE}), {FIRST_FENCE})")
    floor = int(cursor.fetchone()[0])
    cursor.execute(f"SELECT SETVAL({FENCE_SEQUENCE}, {floor})")
    cursor.execute(f"INSERT IGNORE INTO {RESTART_MARKER} VALUES (true)")


def client_addresses(cursor: Any, connection_ids: Sequence[int]) -> dict[int, tuple[str, float]]:
    """The client address (``host:port``) and the seconds since its last statement of
    each of the sessions ``connection_ids`` that still exists, from the process list."""
    if not connection_ids:
        return {}
    cursor.execute(
        f"SELECT ID, HOST, TIME_MS FROM information_schema.PROCESSLIST "
        f"WHERE ID IN ({', '.join(['%s'] * len(connection_ids))})",
        tuple(connection_ids),
    )
    return {int(cid): (str(host), float(ms) / 1000) for cid, host, ms in cursor.fetchall()}


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


def get_lock(
    run: Callable[[str, Sequence[object]], Any],
    key: str,
    seconds: float | None,
    description: str,
    fenced: bool = False,
    releasing: str | None = None,
) -> int | None:
    """``GET_LOCK(key, seconds)`` (``None``: forever) with the waiter named in the process
    list: 1 granted (``fenced``: the fence the same statement issued, see
    ``FENCE_SEQUENCE``), 0 timed out, ``None`` interrupted or killed (the MySQL manual,
    "Locking Functions"). ``releasing``: a key the session holds, given back by the
    same statement if it grants ``key`` (``giving_back_first``). ``run(sql, params)``
    runs the statement and returns its one value, raising Django's exceptions
    (``value_of`` on a Django cursor). Raises ``LockDeadlock`` when the server refuses
    a wait that would deadlock (MySQL 8 checks GET_LOCK waits for cycles)."""
    granted = f"NEXTVAL({FENCE_SEQUENCE})" if fenced else "1"
    if releasing is not None:
        granted = giving_back_first(RELEASE_KEY, granted)
    try:
        granted = run(
            f"SELECT {sql_comment(description)} "
            f"CASE GET_LOCK(%s, %s) WHEN 1 THEN {granted} WHEN 0 THEN 0 END",
            (key, FOREVER if seconds is None else seconds)
            + (() if releasing is None else (releasing,)),
        )
    except DatabaseError as exc:
        if exc.args and exc.args[0] in DEADLOCK_ERRORS:
            raise LockDeadlock(f"MySQL refused a wait that would deadlock: {exc}") from exc
        raise
    return None if granted is None else int(granted)


def value_of(cursor: Any, sql: str, params: Sequence[object]) -> Any:
    """The first value of the first row of ``sql`` run on ``cursor``."""
    cursor.execute(sql, params)
    return cursor.fetchone()[0]


def value_at_once(
    connection: Any, sql: str, params: Sequence[object], *, interruptible: bool
) -> Any:
    """The first value of the first row of ``sql`` (``None`` if it has none), run on a
    mysqlclient ``connection`` without a cursor; ``interruptible``: its wait can be
    interrupted by a signal (``run_at_once``). A statement that returns at once (a
    try, a release) need not be: it then waits in the C API, which a signal does not
    interrupt, for a reply that comes after one round trip."""
    row = run_at_once(connection, sql, params, interruptible=interruptible)[0]
    return row[0] if row else None


#: SQL that releases one named lock (``%s``): 1 if this session held it, 0 if another
#: session holds it, ``NULL`` if nobody does.
RELEASE_KEY = "RELEASE_LOCK(%s)"


def release_lock(cursor: Any, key: str) -> bool:
    """``RELEASE_LOCK(key)``: False if this session did not hold it."""
    cursor.execute(f"SELECT {RELEASE_KEY}", (key,))
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
