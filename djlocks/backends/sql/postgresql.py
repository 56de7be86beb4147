"""What djlocks runs on PostgreSQL: every statement, error code and server query."""

from __future__ import annotations

import functools
import re
import selectors
import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from djlocks.backends.prepared import prepare_where_direct
from djlocks.backends.server_records import HOLDER_COLUMNS, OVERWRITTEN, RecordTables
from djlocks.backends.sql.dialects import HandOver, LeaseDialect, Outcome, counting_ahead

# -- History (djlocks.events) ------------------------------------------------

#: Run once on the history's own connection: its commits need not wait for the WAL
#: flush (the PostgreSQL manual, "Asynchronous Commit"); a crash may lose the last events.
HISTORY_SESSION: str | None = "SET synchronous_commit TO off"


#: Run on each lease connection as it opens: its commits wait for the WAL flush even
#: where the server or role defaults to ``synchronous_commit = off``, so that a crash
#: never takes back a grant or a renewal; a stronger level (waiting for standbys) is kept.
LEASE_COMMITS_FLUSHED = (
    "SELECT set_config('synchronous_commit', 'on', false) "
    "WHERE current_setting('synchronous_commit') = 'off'"
)


def unflushed_commit(where: str | None = None) -> str:
    """SQL that lets the statement's transaction commit without waiting for the WAL
    flush (with ``where``, SQL, only where it is true; else the session's level stays
    as it is): ``synchronous_commit`` off for this transaction alone, as ``SET LOCAL``
    would (the PostgreSQL manual, "Asynchronous Commit"; ``set_config`` with
    ``is_local``). A statement run on its own is its own
    transaction, so this needs no round trip of its own; place it where the statement
    evaluates it once its rows are known (a ``RETURNING`` list, the outer select). Such
    a commit is visible at once. A server crash within about three times
    ``wal_writer_delay`` can undo it, but never a later commit that waited for the
    flush: the WAL is written in order. For writes a crash may undo (a release that
    hands nothing over), never for a grant, a renewal or a cool-down."""
    value = (
        "'off'"
        if where is None
        else f"CASE WHEN {where} THEN 'off' ELSE current_setting('synchronous_commit') END"
    )
    return f"set_config('synchronous_commit', {value}, true)"


def copy_rows(
    cursor: Any, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]
) -> None:
    """Insert ``rows`` (values in ``columns`` order) into ``table`` with one ``COPY ...
    FROM STDIN`` on a psycopg ``cursor`` (the PostgreSQL manual, "COPY"; psycopg's
    ``Cursor.copy``): the server parses one statement for them all and the driver
    quotes nothing, several times cheaper for the client than a multi-row ``INSERT``.
    """
    with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


#: A new name's first fence: the server's clock in microseconds since the epoch. A
#: name that ``djlocks sweep`` removed after it was idle starts again above every
#: fence it had (fences rise by one per grant, far slower than the clock).
FIRST_FENCE = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint"


# -- Lease rows (djlocks.backends.lease) ------------------------------------

#: A lease waiter hears of releases on a channel of its own: this prefix and the
#: backend pid of its listening session (``waiter_channel``), which its queue row
#: names (``connection_id``); the payload is its ticket, followed for a hand-over's
#: heir by what it was handed (``waiter_notice``). Only the waiters a release
#: concerns are woken: the heir of a hand-over, else the name's first ``slot_limit``.
WAITER_CHANNEL = "djlocks_lease_"
#: NOTIFY channel of forced releases and graceful releases' requests, which the holders
#: listen on; the payload is "<name_key> <fence>".
LEASE_REVOKED = "djlocks_revoked"


def waiter_channel(session: int) -> str:
    """The channel the lease waiters listening on the server session ``session``
    (its backend pid) hear on."""
    return f"{WAITER_CHANNEL}{session}"


def session_id(connection: Any) -> int:
    """The backend pid of a psycopg ``connection``'s server session, known to the driver
    since it connected (no round trip)."""
    return int(connection.info.backend_pid)


def read_notices(connection: Any) -> None:
    """Read and drop the notices that the idle listening session of a psycopg
    ``connection`` received (no round trip)."""
    for _ in connection.notifies(timeout=0):
        pass


def notifications(connection: Any, seconds: float) -> list[Any]:
    """The notifications (psycopg ``Notify``) that the listening session of a psycopg
    ``connection`` has received: at once those already there, else those that arrive
    within ``seconds``, perhaps none (also sooner, when the server sent something
    else meanwhile: callers wait again).

    The wait is on the connection's socket (``selectors``), and psycopg then reads
    without waiting (``notifies(timeout=0)``). psycopg's own wait,
    ``notifies(timeout=seconds)``, rounds what is left of it down to whole
    milliseconds and polls the socket without waiting for the last one, again and
    again: measured with psycopg 3.3.9, each call spent about 0.75 ms of CPU at its
    end, so a lease waiter or a revocation listener that waits in slices of 50 ms
    kept about 2 % of a core busy doing nothing.
    """
    heard = list(connection.notifies(timeout=0))
    if heard or seconds <= 0:
        return heard
    with selectors.DefaultSelector() as selector:
        selector.register(connection.fileno(), selectors.EVENT_READ)
        if not selector.select(seconds):
            return []
    return list(connection.notifies(timeout=0))


def waking_first_waiters(waiters: str, name_key: str, limit: str) -> str:
    """SQL (a count) that notifies the first ``limit`` live waiters of the name
    ``name_key``, each on its own channel with its ticket; a waiter queued by an
    older djlocks, with no listening session named, polls instead. ``name_key`` and
    ``limit`` are SQL naming the outer query's columns (qualified: the waiters' table
    has columns of those names)."""
    return (
        f"(SELECT count(pg_notify('{WAITER_CHANNEL}' || w.connection_id, w.id::text)) "
        f"FROM (SELECT id, connection_id FROM {waiters} WHERE name_key = {name_key} "
        f"AND expires_at > statement_timestamp() ORDER BY id LIMIT {limit}) w "
        f"WHERE w.connection_id IS NOT NULL)"
    )


def lease_notifying(update: str, waiters: str, wake: bool, holders: bool) -> str:
    """Make an ``UPDATE`` of lease rows also, in the same round trip, ``wake`` the first
    waiters of each name whose slot it changed (``waking_first_waiters``; ``waiters``
    is their table) and tell the ``holders`` (``LEASE_REVOKED``) when it took grants
    away or asked them back.

    The statement still reports one row per grant it changed.
    """
    notices = (
        [waking_first_waiters(waiters, "changed.name_key", "changed.slot_limit")] if wake else []
    )
    notices += [f"pg_notify('{LEASE_REVOKED}', name_key || ' ' || fence)"] if holders else []
    return (
        f"WITH changed AS ({update} RETURNING name_key, fence, slot_limit) "
        f"SELECT {', '.join(notices)} FROM changed"
    )


@functools.cache
def lease_handing_over(slots: str, waiters: str) -> str:
    """A lease release that hands the slot to the head of the name's queue in the same
    statement, and wakes the waiters (``NOTIFY``). Three ``%s`` parameters, each the
    released grant's token.

    The name's slot rows are locked first, in slot order (as claims lock them), so
    the heir's fence is one more than the name's largest and two hand-overs never
    share one. The heir is the live waiter with the smallest ticket, and only if the
    released slot is still the releaser's once locked (a forced release that came
    first hands nothing, and leaves the queue as it was) and the heir asked for the
    name's number of slots. Its row leaves the queue, and its token, TTL and
    identity become the slot's. A head queued without a token (an older djlocks) or
    with another limit is handed nothing: it claims the freed slot, or is told of
    the mismatch, as before.
    The heir is notified on its own channel (``waiter_channel``), so only its
    process wakes, with its ticket and the grant it was handed, under the token it
    queued with (``waiter_notice``): it needs no round trip to read it. When nobody
    was handed the slot, the name's first waiters are notified, with their tickets
    alone.
    A release that hands nothing over commits without waiting for the WAL flush
    (``unflushed_commit``): a crash can undo it, and the slot then stays taken until
    its lease runs out, as if the holder had been killed. A hand-over, which grants
    the heir its slot and fence, waits for the flush as every grant does.
    Returns one row per released slot: whether it was handed over.
    """
    now = "statement_timestamp()"
    return (
        f"WITH freed AS (SELECT name_key, slot_limit FROM {slots} "
        f"WHERE token = %s AND expires_at > {now}), "
        f"locked AS (SELECT s.fence, s.token, s.expires_at FROM {slots} s "
        f"JOIN freed USING (name_key) ORDER BY s.slot FOR UPDATE OF s), "
        f"top AS (SELECT max(fence) AS fence FROM locked), "
        f"mine AS (SELECT 1 FROM locked WHERE token = %s AND expires_at > {now}), "
        f"heir AS (DELETE FROM {waiters} WHERE token IS NOT NULL "
        f"AND slot_limit = (SELECT slot_limit FROM freed) AND EXISTS (SELECT 1 FROM mine) "
        f"AND id = (SELECT w.id FROM {waiters} w JOIN freed USING (name_key) "
        f"WHERE w.expires_at > {now} ORDER BY w.id LIMIT 1) "
        f"RETURNING id, token, ttl, host, pid, thread, label, connection_id), "
        f"changed AS (UPDATE {slots} s SET token = heir.token, "
        f"fence = CASE WHEN heir.token IS NULL THEN s.fence ELSE top.fence + 1 END, "
        f"acquired_at = CASE WHEN heir.token IS NULL THEN s.acquired_at ELSE {now} END, "
        f"expires_at = {now} + heir.ttl * interval '1 second', "
        f"cooldown_until = NULL, release_by = NULL, "
        f"host = COALESCE(heir.host, s.host), pid = COALESCE(heir.pid, s.pid), "
        f"thread = COALESCE(heir.thread, s.thread), label = COALESCE(heir.label, s.label) "
        f"FROM top LEFT JOIN heir ON true "
        f"WHERE s.token = %s AND s.expires_at > {now} "
        f"RETURNING s.name_key, s.slot_limit, s.token, s.slot, s.fence, s.expires_at, "
        f"heir.id, heir.connection_id) "
        f"SELECT CASE WHEN changed.id IS NULL "
        f"THEN {waking_first_waiters(waiters, 'changed.name_key', 'changed.slot_limit')} "
        f"WHEN changed.connection_id IS NULL THEN 0 "
        f"ELSE (SELECT count(*) FROM pg_notify('{WAITER_CHANNEL}' || changed.connection_id, "
        f"concat_ws(' ', changed.id, changed.token, changed.slot, changed.fence, "
        f"extract(epoch FROM changed.expires_at)))) END, changed.id IS NOT NULL, "
        f"{unflushed_commit(where='changed.id IS NULL')} FROM changed"
    )


class HandedOver(NamedTuple):
    """What a hand-over's notice tells its heir (``lease_handing_over``): the grant's
    token (the one the heir queued with), its slot, its fence and its expiry (aware,
    UTC)."""

    token: str
    slot: int
    fence: int
    expires_at: datetime


def waiter_notice(payload: str) -> tuple[int, HandedOver | None] | None:
    """The ticket that a lease waiter's notice names and, if the notice is a
    hand-over's, what it handed (``HandedOver``; ``None`` for a notice that only
    wakes, with the ticket alone, as every notice of an older djlocks). ``None`` for
    a payload that is neither: anyone who can connect may ``NOTIFY`` any channel."""
    fields = payload.split()
    try:
        if len(fields) == 1:
            return int(fields[0]), None
        if len(fields) == 5:
            ticket, token, slot, fence, expires = fields
            expires_at = datetime.fromtimestamp(float(expires), UTC)
            return int(ticket), HandedOver(token, int(slot), int(fence), expires_at)
    except (ValueError, OverflowError, OSError):
        pass
    return None


@functools.cache
def claiming_free_slot(slots: str, waiters: str) -> tuple[str, tuple[str, ...]]:
    """The statement of ``lease_claiming_free_slot``, with ``%s`` placeholders, and the
    names of its parameters in their order."""
    now = "statement_timestamp()"
    return positional(
        f"WITH locked AS (SELECT slot, fence, (token IS NULL OR expires_at <= {now}) "
        f"AND (cooldown_until IS NULL OR cooldown_until <= {now}) AS free "
        f"FROM {slots} WHERE name_key = %(key)s AND slot_limit = %(limit)s "
        f"ORDER BY slot FOR UPDATE), "
        f"chosen AS (SELECT min(slot) AS slot, count(*) AS free FROM locked WHERE free), "
        f"ahead AS (SELECT count(*) AS waiting FROM {waiters} WHERE name_key = %(key)s "
        f"AND expires_at > {now} AND id < %(ticket)s) "
        f"UPDATE {slots} SET token = %(token)s, "
        f"fence = (SELECT max(fence) FROM locked) + 1, acquired_at = {now}, "
        f"expires_at = {now} + %(ttl)s * interval '1 second', cooldown_until = NULL, "
        f"release_by = NULL, host = %(host)s, pid = %(pid)s, thread = %(thread)s, "
        f"label = %(label)s FROM chosen, ahead "
        f"WHERE {slots}.name_key = %(key)s AND {slots}.slot = chosen.slot "
        f"AND chosen.free > ahead.waiting "
        f"RETURNING {slots}.slot, {slots}.fence, {slots}.expires_at"
    )


def lease_claiming_free_slot(
    cursor: Any, slots: str, waiters: str, params: Mapping[str, object]
) -> Sequence[Any] | None:
    """Claim a free slot in one ``UPDATE``, on the cursor's connection through libpq
    (``run_at_once``): its CTE locks the name's slot rows in slot order, the lowest
    free slot is taken if more are free than live waiters are ahead, with a fence one
    more than the name's largest. Returns the slot, its fence and its expiry (as
    text), or ``None``."""
    claiming, names = claiming_free_slot(slots, waiters)
    return run_at_once(cursor.connection, claiming, [params[name] for name in names])[0]


#: A named placeholder, ``%(name)s``.
NAMED_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its named placeholders (``%(name)s``) made ``%s`` ones, and their
    names in order (a name used twice is there twice)."""
    return NAMED_PLACEHOLDER.sub("%s", sql), tuple(NAMED_PLACEHOLDER.findall(sql))


def lease_hand_over(cursor: Any, slots: str, waiters: str, token: str) -> HandOver:
    """Release the grant ``token`` and hand its slot over (``lease_handing_over``) on
    the cursor's connection, through libpq (``run_at_once``); the heir is woken by the
    statement's ``NOTIFY``."""
    handing_over = lease_handing_over(slots, waiters)
    row, released, _ = run_at_once(cursor.connection, handing_over, (token, token, token))
    return HandOver(released, row is not None and row[1] == "t")


def lease_enqueue(
    cursor: Any, insert: str, params: Sequence[object], waiters: str, now: str
) -> tuple[int, int]:
    """Run ``insert``, of a waiter row, on the cursor's connection through libpq
    (``run_at_once``): the row's id, its ticket, and how many live waiters of the name
    are ahead of it (``counting_ahead``), in one statement. It waits for the WAL flush:
    a place that a crash took back would leave its waiter out of the queue, and its
    ticket (from a sequence, which a crash can set back) could be another waiter's."""
    row = run_at_once(cursor.connection, counting_ahead(insert, waiters, now), params)[0]
    assert row is not None, "an INSERT ... RETURNING returns its row"
    return int(row[0]), int(row[1])


#: Each psycopg connection's statements sent through libpq (``run_at_once``). They
#: hold their connection by a weak proxy, so that the entry goes with the connection.
_direct: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def run_at_once(connection: Any, sql: str, params: Sequence[object]) -> Outcome:
    """Run ``sql`` (``%s`` placeholders, no ``%%``) on the psycopg ``connection``
    through libpq (``libpq.DirectStatements``): its first row, values as text. It is
    prepared the first time it runs on a connection that prepares its statements
    (``prepared.prepare_where_direct`` set psycopg's ``prepare_threshold``). Raises
    psycopg's errors; its ``OperationalError`` for a closed connection (``None``)."""
    if connection is None:
        from psycopg import OperationalError

        raise OperationalError("the connection is closed")
    direct = _direct.get(connection)
    if direct is None:
        from djlocks.backends.libpq import DirectStatements  # psycopg, not psycopg2: checked

        prepares = connection.prepare_threshold is not None
        direct = _direct[connection] = DirectStatements(weakref.proxy(connection), prepares)
    row, changed = direct.outcome(sql, params)
    return row, changed, 0


LEASE = LeaseDialect(
    now="statement_timestamp()",
    plus_seconds="statement_timestamp() + %s * interval '1 second'",
    for_update=" FOR UPDATE",
    returning=True,
    enqueue=lease_enqueue,
    fence_increment="fence = fence + 1",
    first_fence=FIRST_FENCE,
    begin="BEGIN",
    seconds_param=float,
    notifying=lease_notifying,
    claim_free_slot=lease_claiming_free_slot,
    hand_over=lease_hand_over,
    session_id=session_id,
    listening=lambda session: f"LISTEN {waiter_channel(session)}",
    read_notices=read_notices,
    idle_limit=lambda seconds: f"SET idle_session_timeout = {seconds * 1000}",
    # run_at_once reads moments as text: in the format Django's parse_datetime reads.
    session_setup=("SET DateStyle TO ISO", LEASE_COMMITS_FLUSHED),
    opened=prepare_where_direct,
    seconds_until="EXTRACT(EPOCH FROM {} - statement_timestamp())",
    run_at_once=run_at_once,
    returning_unflushed=f" RETURNING {unflushed_commit()}",
)


# -- Fences and holders of server-held locks (djlocks.backends.server_records) ------


def register_name(cursor: Any, tables: RecordTables, params: Sequence[object]) -> None:
    """Make sure the name (key, name, limit) has a fence row (``FIRST_FENCE`` if new),
    marked used now: a sweep keeps it for the idle time at least."""
    cursor.execute(
        f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at) "
        f"VALUES (%s, %s, %s, {FIRST_FENCE}, statement_timestamp()) ON CONFLICT (name_key) "
        f"DO UPDATE SET slot_limit = EXCLUDED.slot_limit, used_at = EXCLUDED.used_at",
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
        f" INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at)"
        f" VALUES (%s, %s, %s, {FIRST_FENCE}, statement_timestamp()) ON CONFLICT (name_key)"
        f" DO UPDATE SET fence = {tables.fence}.fence + 1, slot_limit = EXCLUDED.slot_limit,"
        f" used_at = EXCLUDED.used_at"
        f" RETURNING fence) "
        f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) SELECT {values} FROM issued "
        f"ON CONFLICT (name_key, slot) DO UPDATE SET {overwrite} RETURNING fence",
        (*fence_params, *holder_params),
    )
    return int(cursor.fetchone()[0])


# -- Fences issued in the locking statement (djlocks.backends.postgresql) -----------

#: The sequence that issues the advisory-lock backend's fences (migration 0006). Its
#: values rise for every name at once, so each name's fences rise too.
FENCE_SEQUENCE = "djlocks_session_fence_seq"
#: An ``UNLOGGED`` table of at most one row. PostgreSQL empties unlogged tables in crash
#: recovery (and a promoted standby starts with them empty) but keeps them across a clean
#: shutdown (the manual, "CREATE TABLE": UNLOGGED). Empty means: the sequence may have
#: gone back since it last had a row.
CRASH_MARKER = "djlocks_session_fence_guard"
#: How far the sequence jumps after a crash. ``nextval`` writes its WAL record 32 values
#: ahead and the caller's commit flushes it, but a value read by another session before
#: that flush (a non-logging call commits without flushing) can come back after a crash.
#: Such values are at most 33 per server connection, and PostgreSQL allows fewer than
#: 2**18 connections: the jump clears them all.
CRASH_GAP = 1 << 24
#: Run on each new session: commits flush the WAL (whatever the server's default), and
#: the crash marker is read in the same round trip (see ``AFTER_A_CRASH``).
FENCE_SESSION_SETTINGS = {"synchronous_commit": "on"}
CRASH_MARKER_PRESENT = f"EXISTS (SELECT 1 FROM {CRASH_MARKER})"
#: Run when the marker is missing: one session marks and moves the sequence past every
#: value it may repeat, in one durable commit; any other waits on the marker's key and
#: then does nothing. Every session that can issue a fence after a crash is new (crash
#: recovery ends them all), so each one passes here before its first grant.
AFTER_A_CRASH = (
    f"WITH marked AS (INSERT INTO {CRASH_MARKER} VALUES (true) ON CONFLICT DO NOTHING "
    f"RETURNING 1) SELECT setval('{FENCE_SEQUENCE}', nextval('{FENCE_SEQUENCE}') + "
    f"{CRASH_GAP}) FROM marked"
)
#: The holder's ``application_name`` starts with this and its fence (``djlocks#42 ...``).
HOLDER_PREFIX = "djlocks#"


@functools.cache
def fenced_grant(granting: str, columns: tuple[str, ...]) -> str:
    """``granting`` (a one-row ``SELECT`` whose ``granted`` column is ``NULL`` unless the
    server granted) made to issue the grant's fence in the same statement.

    Returns ``columns`` of ``granting``, then the fence (``NULL`` if not granted);
    on a grant, sets the session's ``application_name`` to ``HOLDER_PREFIX``, the
    fence and the text of one more ``%s`` parameter (what ``described.describe``
    writes after ``"djlocks"``), so ``pg_stat_activity`` shows who holds, with which
    fence, from the moment of the grant. ``granting`` runs once (a CTE with volatile
    functions is never inlined: the manual, "WITH Queries").
    """
    kept = ", ".join(f"attempt.{column}" for column in columns)
    return (
        f"WITH attempt AS ({granting}) "
        f"SELECT {kept}, issued.fence, set_config('application_name', COALESCE("
        f"'{HOLDER_PREFIX}' || issued.fence || %s, current_setting('application_name')), "
        f"false) FROM attempt LEFT JOIN LATERAL (SELECT nextval('{FENCE_SEQUENCE}') AS fence "
        f"WHERE attempt.granted IS NOT NULL) issued ON true"
    )


#: SQL that releases one advisory lock (``%s``) of this session: false if it held none.
UNLOCK_KEY = "pg_advisory_unlock(%s)"
#: The statement of a session lock's release.
UNLOCKING = f"SELECT {UNLOCK_KEY}"


@functools.cache
def taking(waits: bool, fenced: bool, releasing: bool = False) -> str:
    """One statement that takes an advisory lock, waiting (under ``lock_timeout``) or
    not; its last column is ``NULL`` unless the server granted.

    Parameters: if ``waits``, the waiter's description (``application_name`` while
    it waits) and the ``lock_timeout``; then the key; if ``releasing``, a key the
    session holds, given back by the same statement once the wait is granted (a
    semaphore's gate: a wait that times out fails before it, and keeps it); if
    ``fenced``, the text after ``"djlocks"`` in the holder's description.
    ``fenced``: on a grant the same statement issues the fence and names the holder
    (as ``fenced_grant`` does, in one flat ``SELECT``, whose columns the server
    computes in order): the last column is then the holder's ``application_name``,
    ``djlocks#<fence> ...``.
    """
    if not waits:
        if releasing:
            raise ValueError("only a wait gives back another key when granted")
        return f"SELECT CASE WHEN pg_try_advisory_lock(%s) THEN {_granted(fenced)} END"
    return (
        "SELECT set_config('application_name', %s, false), "
        "set_config('lock_timeout', %s, false), pg_advisory_lock(%s), "
        f"{f'{UNLOCK_KEY}, ' if releasing else ''}{_granted(fenced)}"
    )


def granted_anyway(fenced: bool, releasing: bool = False) -> str:
    """A statement that completes the grant of a wait that ended in ``lock_timeout``
    although the server granted it: its last column is ``NULL`` unless this session
    holds the key (parameters: the key; if ``releasing``, the key, then the one to
    give back if it holds the first, as ``taking`` would have; then as in ``taking``).

    The lock manager can grant a waiter just as its ``lock_timeout`` fires: the
    statement then fails with ``lock_not_available``, yet the session holds the
    lock, since a session-level advisory lock outlives the statement's error
    (``LockErrorCleanup`` in PostgreSQL's ``proc.c`` keeps a lock granted meanwhile).
    """
    given_back = f"CASE WHEN {HELD_HERE} THEN {UNLOCK_KEY} END, " if releasing else ""
    return f"SELECT {given_back}CASE WHEN {HELD_HERE} THEN {_granted(fenced)} END"


def _granted(fenced: bool) -> str:
    """What ``taking`` and ``granted_anyway`` return on a grant (see ``taking``)."""
    if not fenced:
        return "''"
    return (
        f"set_config('application_name', '{HOLDER_PREFIX}' || nextval('{FENCE_SEQUENCE}') "
        f"|| %s, false)"
    )


def issued_fence(holder: str) -> int:
    """The fence in the holder's ``application_name`` that ``taking`` returns."""
    return int(holder.removeprefix(HOLDER_PREFIX).split(" ", 1)[0])


def record_holders(
    cursor: Any,
    tables: RecordTables,
    holders: Sequence[Sequence[object]],
    names: Sequence[Sequence[object]],
) -> None:
    """Write ``holders`` (rows in ``HOLDER_COLUMNS`` order, at most one per slot) where
    no newer grant's row is already, and raise the fence rows of ``names`` (key, name,
    limit, newest fence; one per name) to their newest fence, in one statement."""
    overwrite = ", ".join(f"{column} = EXCLUDED.{column}" for column in OVERWRITTEN)
    row = "(" + ", ".join(["%s"] * len(HOLDER_COLUMNS.split(","))) + ")"
    cursor.execute(
        f"WITH written AS (INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) "
        f"VALUES {', '.join([row] * len(holders))} ON CONFLICT (name_key, slot) DO UPDATE "
        f"SET {overwrite} WHERE {tables.holder}.fence < EXCLUDED.fence) "
        f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence, used_at) "
        f"VALUES {', '.join(['(%s, %s, %s, %s, statement_timestamp())'] * len(names))} "
        f"ON CONFLICT (name_key) "
        f"DO UPDATE SET fence = GREATEST({tables.fence}.fence, EXCLUDED.fence), "
        f"slot_limit = EXCLUDED.slot_limit, used_at = EXCLUDED.used_at",
        [value for rows in (holders, names) for record in rows for value in record],
    )


# -- Server sessions: who waits, who holds, killing a session -------------------

#: The signed bigint key of an advisory lock row of ``pg_locks`` (alias ``l``).
LOCK_KEY = "((l.classid::bigint << 32) | l.objid::bigint)"
#: ``pg_locks`` rows (alias ``l``) of advisory locks of this database: an advisory lock
#: belongs to one database, ``pg_locks`` shows the whole server's.
THIS_DATABASE = "l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
#: ``pg_locks`` rows (alias ``l``) of granted single-key advisory locks of this database
#: (the PostgreSQL manual, "pg_locks": ``objsubid`` 1 is a bigint key).
ADVISORY_HELD = f"l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND {THIS_DATABASE}"
#: ``pg_locks`` rows (alias ``l``) of this database's sessions waiting for a single-key
#: advisory lock.
#: SQL, true if this session holds the advisory lock of the key ``%s``.
HELD_HERE = (
    f"EXISTS (SELECT 1 FROM pg_locks l WHERE {ADVISORY_HELD} "
    f"AND l.pid = pg_backend_pid() AND {LOCK_KEY} = %s)"
)
ADVISORY_WAITING = (
    f"l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 1 AND {THIS_DATABASE}"
)
#: SQLSTATEs: lock_not_available (a lock_timeout ran out), deadlock_detected,
#: query_canceled (``pg_cancel_backend`` or the driver's cancel).
LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED, QUERY_CANCELED = "55P03", "40P01", "57014"
#: The longest ``application_name`` the server keeps (NAMEDATALEN - 1 bytes).
APPLICATION_NAME_LENGTH = 63


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error wrapped by Django (psycopg 3's ``sqlstate``,
    psycopg2's ``pgcode``; ``None`` for other errors)."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)


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
