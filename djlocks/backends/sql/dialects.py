"""The shapes of the vendor modules' answers: what differs between databases, per family.

Each vendor module (``sql.postgresql``, ``sql.mysql``, ``sql.sqlite``) fills
these in once; the families read them through ``djlocks.backends.sql``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from django.db.backends.base.base import BaseDatabaseWrapper

#: What one statement gave (``LeaseDialect.run_at_once``, or a cursor where the store
#: has none): its first row (``None`` if it returned none; values as the driver reads
#: them, as text on PostgreSQL), the number of rows it returned or changed, and the
#: last insert id (the value MySQL's ``LAST_INSERT_ID(expr)`` set; 0 on PostgreSQL).
Outcome = tuple[Sequence[Any] | None, int, int]


class HandOver(NamedTuple):
    """What a release that hands over did (``LeaseDialect.hand_over``)."""

    #: Slots it released: 1, or 0 if the grant had already ended.
    released: int
    #: Whether it handed the slot to the head of the queue.
    handed: bool
    #: The heir's server session to wake (MySQL's ``KILL QUERY``), or ``None``: nobody
    #: to wake, or the statement woke the heir itself (PostgreSQL's ``NOTIFY``).
    wake: int | None = None


@dataclass(frozen=True)
class LeaseDialect:
    """The SQL fragments of the lease rows (``djlocks.backends.lease``) on one database.

    Every moment is the database's own clock, so expiry is judged by one clock.
    """

    #: The store's now, as SQL.
    now: str
    #: The store's now plus one ``%s`` parameter (made by ``seconds_param``).
    plus_seconds: str
    #: Appended to a ``SELECT`` that must lock the rows it reads; empty on SQLite.
    for_update: str
    #: ``UPDATE``/``INSERT ... RETURNING`` exists; else the driver's ``lastrowid``.
    returning: bool
    #: Runs the ``INSERT`` of a waiter row (``(cursor, insert, params, waiters table,
    #: now) -> (ticket, ahead)``) and, in the same round trip, counts the live waiters
    #: of the name ahead of it.
    enqueue: Callable[[Any, str, Sequence[object], str, str], tuple[int, int]]
    #: Sets ``fence`` to ``fence + 1`` and makes the new value readable.
    fence_increment: str
    #: The fence a new name's slot rows start at: the store's clock in microseconds.
    first_fence: str
    #: Starts a transaction that serialises the claims of one name.
    begin: str
    #: Seconds as ``plus_seconds``'s parameter.
    seconds_param: Callable[[float], object]
    #: Makes an ``UPDATE`` of grants also wake the waiters and tell the holders in the
    #: same round trip (PostgreSQL ``NOTIFY``): ``(update, waiters table, wake the
    #: waiters, tell the holders) -> SQL``; ``None`` where the store cannot notify.
    notifying: Callable[[str, str, bool, bool], str] | None = None
    #: SQL that a waiter's listening session runs once, as it opens, to hear the
    #: releases that concern its waits: ``(its server session's id) -> SQL``
    #: (PostgreSQL ``LISTEN`` on a channel of its own); ``None`` where waiters do not
    #: listen.
    listening: Callable[[int], str] | None = None
    #: Reads and drops what a listening session (``listening``) received while it was
    #: idle, with no round trip: ``(driver connection) -> None``. ``None`` where
    #: waiters do not listen.
    read_notices: Callable[[Any], object] | None = None
    #: SQL that the session a waiter is woken on (``listening`` or ``waking``) runs once,
    #: as it opens, so that the server closes it after that many seconds idle:
    #: ``(seconds) -> SQL`` (PostgreSQL ``idle_session_timeout``, MySQL
    #: ``wait_timeout``). ``None`` where waiters have no such session.
    idle_limit: Callable[[int], str] | None = None
    #: Runs on each dedicated connection as it opens.
    session_setup: tuple[str, ...] = ()
    #: Makes an ``UPDATE`` that frees slots (``(update, slots, waiters) -> SQL``) also
    #: return, per slot it changed, the tickets of the name's first ``slot_limit`` live
    #: waiters (comma-separated, or NULL), whom the releaser wakes through the
    #: operating system (``lease.wakeups``: SQLite, whose processes share one host);
    #: ``None`` where releases wake waiters otherwise.
    returning_heads: Callable[[str, str, str], str] | None = None
    #: Whether each lease operation of this host first waits for its turn at a file
    #: lock beside the database (``lease.gate``: SQLite, whose write lock lets a
    #: process that found it taken sleep while the releaser claims again).
    write_gate: bool = False
    #: Called with each dedicated connection (its Django wrapper) as it opens, after
    #: ``session_setup``.
    opened: Callable[[BaseDatabaseWrapper], object] | None = None
    #: Claims a free semaphore slot in one round trip, for rows that exist with the
    #: request's limit: ``(cursor, slots, waiters, params) -> (slot, fence, expires_at)``
    #: or ``None`` if none was taken (``lease.claims._claim_free_slot`` names the
    #: ``params``); ``None`` where a transaction of several round trips claims it.
    claim_free_slot: (
        Callable[[Any, str, str, Mapping[str, object]], Sequence[Any] | None] | None
    ) = None
    #: Releases the grant ``token`` and hands the freed slot to the head of the queue,
    #: fence and all, in one round trip: ``(cursor, slots, waiters, token) ->
    #: HandOver``; ``None`` where a waiter claims a freed slot.
    hand_over: Callable[[Any, str, str, str], HandOver] | None = None
    #: Where a waiter sleeps in the server and a hand-over ends the sleep (MySQL's
    #: ``KILL QUERY``): ``(cursor, slots, heir token, the waiter's lease session,
    #: seconds)`` sleeps until the slot is handed over with the token, or is woken, or
    #: the seconds run out; True unless the seconds ran out. ``None`` where waiters
    #: are not woken that way.
    waking: Callable[[Any, str, str, int, float], bool] | None = None
    #: Ends the sleep of the waiter on a server session: ``(cursor, session)``.
    wake: Callable[[Any, int], None] | None = None
    #: The server's id of the session of a driver connection, with no round trip: the
    #: session a waiter sleeps on (``waking``) or listens on (``listening``), which its
    #: queue row names, and the waiter's lease session.
    session_id: Callable[[Any], int] | None = None
    #: SQL for the seconds from the store's now until ``{}`` (a moment).
    seconds_until: str = "{}"
    #: Runs one statement (``%s`` placeholders) on a dedicated connection's driver
    #: connection without a cursor: ``(driver connection, sql, params) -> Outcome``.
    #: A cursor's ``execute`` and fetch cost 350 (mysqlclient) to 750 (psycopg) Python
    #: bytecodes more, as much as the rest of a lease statement's work in djlocks.
    #: Raises the driver's errors. ``None`` where a cursor runs every statement.
    run_at_once: Callable[[Any, str, Sequence[object]], Outcome] | None = None
    #: A ``RETURNING`` clause that lets an ``UPDATE`` commit without waiting for the
    #: server's log flush: for a release a crash may undo (its slot then stays taken
    #: until the lease runs out). Empty where a transaction cannot choose (MySQL's
    #: ``innodb_flush_log_at_trx_commit`` and SQLite's ``synchronous`` are set per
    #: server or connection), and every commit waits.
    returning_unflushed: str = ""


def enqueue_returning(
    cursor: Any, insert: str, params: Sequence[object], waiters: str, now: str
) -> tuple[int, int]:
    """``insert`` (of a waiter row in ``waiters``) with ``RETURNING``: the row's id, its
    ticket, and how many live waiters of the name are ahead of it, in one statement
    (``counting_ahead``)."""
    cursor.execute(counting_ahead(insert, waiters, now), params)
    ticket, ahead = cursor.fetchone()
    return int(ticket), int(ahead)


def counting_ahead(insert: str, waiters: str, now: str) -> str:
    """``insert`` (of a waiter row in ``waiters``) returning the row's id and how many
    live waiters of the name are ahead of it (``now`` is the store's now, as SQL)."""
    return (
        f"{insert} RETURNING id, (SELECT COUNT(*) FROM {waiters} ahead "
        f"WHERE ahead.name_key = {waiters}.name_key "
        f"AND ahead.expires_at > {now} AND ahead.id < {waiters}.id)"
    )
