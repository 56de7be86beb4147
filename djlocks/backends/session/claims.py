"""How a session backend claims a lock or a semaphore slot, waiting in the server.

A lock is one key: tried once, then waited for in the server, watched for
deadlocks between names (``session_deadlocks``). The try is the cheaper statement
(it names no waiter and sets no time-out): a free lock costs one round trip. A
key that a try of this process found taken in the last ``CONTENDED_FOR`` seconds
is waited for at once instead, so a lock that stays contended costs no failed
try per acquire. A try takes nothing from the server's waiters: PostgreSQL's lock
manager and MySQL's metadata locks grant a released lock to the waiter it goes to
before the release returns. A semaphore is N slot keys.
One statement tries them all (a ``CASE``, which stops at the first slot it
gets, so it takes at most one). If all are taken the caller waits in the
server for the name's gate key, behind the other waiters. The gate's holder
waits in the server too, on the slot whose holder was granted longest ago (the
lowest fence in the holder rows: with similar hold times, the next slot to
come free), for at most ``SLOT_WAIT`` seconds at a time before it tries them
all again. So a slot passes to the next waiter as soon as its holder releases
it, with no polling, while a slot held for long cannot hold up the others'
hand-offs by more than ``SLOT_WAIT``. The statement that takes the slot also
gives the gate back, so the next waiter's turn starts without another round trip.
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import DatabaseError

from djlocks.backends.base import AcquireRequest
from djlocks.backends.described import describe
from djlocks.backends.server_records import (
    SESSION_TABLES,
    holder_records,
    record_grant,
    register_name,
)
from djlocks.backends.session.connections import Key, Session, SessionStore
from djlocks.backends.session_deadlocks import Holders, Wait, is_victim, owner_of, watched
from djlocks.backends.sql import giving_back_first
from djlocks.backends.waiting import seconds_left
from djlocks.exceptions import LockDeadlock
from djlocks.keys import GATE, table_key
from djlocks.recent import CONTENDED_FOR, Recent

#: Seconds the gate's holder waits on one slot before it tries every slot again.
SLOT_WAIT = 0.02


class SessionClaims(SessionStore):
    """Taking a key in the server, and recording the grant's fence and holder."""

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        #: Lock keys a try found taken lately: their acquires wait at once (``_claim``).
        self._contended = Recent(CONTENDED_FOR)

    @abstractmethod
    def _take(
        self,
        session: Session,
        key: Key,
        seconds: float | None,
        identity: str,
        fenced: bool = True,
        releasing: Key | None = None,
    ) -> int | None:
        """Wait up to ``seconds`` (``None``: forever, ``0``: try once) in the server for
        ``key``; ``None`` if not granted, else the grant's fence (see ``_attempt``).
        ``fenced=False`` (a semaphore's gate) issues no fence. ``releasing``: a key the
        session holds (the gate), given back by the same statement if and only if it
        grants ``key``; only with a wait (``seconds`` not 0)."""

    #: SQL that tries one key (``%s``) once, without waiting, and is true if it got it.
    try_sql: str
    #: SQL that gives back one key (``%s``) the session holds; ``NULL`` only when
    #: nobody held it (``sql.giving_back_first``).
    give_back_sql: str

    #: Whether the server issues each grant's fence in the granting statement itself
    #: (``_attempt``), so ``_record`` writes the holder row in the background; else
    #: ``_record`` issues the fence with a durable write (``server_records``). A vendor
    #: whose servers differ sets it in ``_prepare``, before a session's first grant.
    fences_in_grant = False

    def _attempt(
        self,
        session: Session,
        granting: str,
        params: Sequence[object],
        columns: tuple[str, ...],
        identity: str,
    ) -> tuple[tuple[Any, ...], int | None]:
        """Run ``granting``, a one-row ``SELECT`` of ``columns`` whose first, ``granted``,
        is ``NULL`` unless the server granted; return its row and the fence: ``None`` if
        not granted, else the one the statement issued (``fences_in_grant``) or 0."""
        row = tuple(session.execute(granting, params))
        return row, None if row[0] is None else 0

    def _slot_taken(self, slot: int) -> str:
        """What the slot-trying statement's ``granted`` column is when it takes ``slot``
        (SQL): the slot number, unless the vendor's ``_attempt`` reads more there."""
        return str(slot)

    @abstractmethod
    def _give_back(self, session: Session, key: Key) -> bool:
        """Release ``key``; False if this session did not hold it."""

    @abstractmethod
    def _holds(self, session: Session, key: Key) -> bool:
        """Whether ``session`` still holds ``key`` (the heartbeat's keep-alive asks)."""

    @abstractmethod
    def _waits(self, session: Session) -> list[Wait]:
        """Every session waiting for a key, with the session that holds the key."""

    def _record(
        self, session: Session, request: AcquireRequest, slot: int, token: str, fence: int
    ) -> int:
        """Record the holder's identity and return the grant's fence: ``fence``, issued
        with the grant, whose row the background writer adds; else a new one, issued
        and recorded with one durable write."""
        if self.fences_in_grant:
            self._register(session, request)  # the server's view can name the holder
            # The holder row shows when the grant began, by the wall clock (in UTC:
            # the writer's thread converts it).
            now = time.time()  # wall clock ok
            grant = (request, slot, token, fence, session.connection_id, now)
            holder_records.submit((self.using, self.vendor, SESSION_TABLES, grant))
            return fence
        with session.cursor() as cursor:
            return record_grant(
                cursor, self.vendor, SESSION_TABLES, request, slot, token, session.connection_id
            )

    def _register(self, session: Session, request: AcquireRequest) -> None:
        """Record the name, so its waiters and holders can be shown by name from the
        server's own view: once per name and limit in this process, before its first
        wait or grant (a durable write)."""
        if (request.name, request.limit) in self._registered:
            return
        with session.cursor() as cursor:
            register_name(cursor, self.vendor, SESSION_TABLES, request)
        self._registered.add((request.name, request.limit))

    def _claim(
        self, session: Session, request: AcquireRequest, deadline: float | None
    ) -> tuple[int, int] | None:
        """Take a lock or a slot, waiting in the server until ``deadline``; return the
        slot and the fence issued with it (see ``_attempt``), or ``None``."""
        identity = describe(request)
        if request.limit == 1:
            key = self.key(request.name)
            if seconds_left(deadline) == 0 or key not in self._contended:
                fence = self._take(session, key, 0, identity)
                if fence is not None:
                    return 0, fence
                self._contended.add(key)
                if seconds_left(deadline) == 0:
                    return None
            self._register(session, request)  # a wait may be granted at once all the same
            return self._wait_watched(session, request, key, deadline, identity)
        slot, _, fence = self._try_slots(session, request, identity, None)
        if slot is not None and fence is not None:
            return slot, fence
        if seconds_left(deadline) == 0:
            return None
        self._register(session, request)
        gate = self.key(request.name, GATE)
        if self._take(session, gate, seconds_left(deadline), identity, fenced=False) is None:
            return None
        # A grant gives the gate back in its own statement; an error ends the session.
        claimed = self._wait_for_a_slot(session, request, identity, deadline, gate)
        if claimed is None:
            self._give_back(session, gate)
        return claimed

    def _wait_watched(
        self,
        session: Session,
        request: AcquireRequest,
        key: Key,
        deadline: float | None,
        identity: str,
    ) -> tuple[int, int] | None:
        """Wait in the server for the lock ``key``, watched for deadlocks (session_deadlocks)."""
        with watched(
            lambda: self._is_deadlock_victim(session.connection_id),
            lambda: self._kill_aside(session),
        ) as watch:
            try:
                fence = self._take(session, key, seconds_left(deadline), identity)
            except DatabaseError:
                if not watch.victim:
                    raise
                fence = None
        if watch.victim:
            raise LockDeadlock(
                f"{request.name!r}: this wait would never end. Its holder waits, directly "
                f"or through others, for a session lock that this thread (or async task) "
                f"holds. This wait was chosen to end it (it began last). Release your locks "
                f"and try again, or take names in one fixed order."
            )
        return None if fence is None else (0, fence)

    def _is_deadlock_victim(self, connection_id: int) -> bool:
        """Whether the wait of session ``connection_id`` is a deadlock's victim.

        Runs in the watching thread, on a side session (never on a Django
        connection of that thread, which nobody would close).
        """
        with self._side_session() as side:
            waits = self._waits(side)
            holders = sorted({wait.holder for wait in waits if wait.holder_owner is None})
            rows = (
                side.fetchall(
                    f"SELECT connection_id, name, slot_limit, slot, host, pid, thread "
                    f"FROM {SESSION_TABLES.holder} "
                    f"WHERE connection_id IN ({', '.join(['%s'] * len(holders))})",
                    holders,
                )
                if holders
                else []
            )
        owners: Holders = {
            (wait.holder, wait.key): wait.holder_owner for wait in waits if wait.holder_owner
        }
        for holder, name, limit, slot, host, pid, thread in rows:
            owner = owner_of(host, pid, thread)
            if owner is not None:
                key = self.key(name) if limit == 1 else self.key(name, slot)
                owners[int(holder), key] = owner
        return is_victim(connection_id, waits, owners)

    def _wait_for_a_slot(
        self,
        session: Session,
        request: AcquireRequest,
        identity: str,
        deadline: float | None,
        gate: Key,
    ) -> tuple[int, int] | None:
        """As the gate's holder: wait in the server on the slot likeliest to come free
        next, ``SLOT_WAIT`` seconds at a time, trying every slot in between. The
        statement that takes a slot also gives back the ``gate``, so the next waiter
        starts its turn one round trip sooner; ``None`` (the gate still held) if the
        deadline passed."""
        while True:
            slot, oldest, fence = self._try_slots(session, request, identity, gate)
            if slot is not None and fence is not None:
                return slot, fence
            left = seconds_left(deadline)
            if left == 0:
                return None
            wait = SLOT_WAIT if left is None else min(SLOT_WAIT, left)
            key = self.key(request.name, oldest)
            fence = self._take(session, key, wait, identity, releasing=gate)
            if fence is not None:
                return oldest, fence

    def _try_slots(
        self, session: Session, request: AcquireRequest, identity: str, releasing: Key | None
    ) -> tuple[int | None, int, int | None]:
        """Try every slot in one statement, taking at most one; return it (``None`` if
        all were taken), the slot granted longest ago (the lowest fence) and the fence
        issued with the grant (see ``_attempt``). ``releasing``: a key the session holds
        (the gate), given back by the same statement if it takes a slot."""
        first = random.randrange(request.limit)  # spread first tries over the slots
        order = [(first + offset) % request.limit for offset in range(request.limit)]
        keys = [self.key(request.name, slot) for slot in order]
        (got, oldest), fence = self._attempt(
            session,
            self._slot_trying(request.limit, first, releasing is not None),
            (
                *(
                    keys
                    if releasing is None
                    else [param for key in keys for param in (key, releasing)]
                ),
                table_key(request.name),
                request.limit,
            ),
            ("granted", "oldest"),
            identity,
        )
        return got, first if oldest is None else int(oldest), fence

    def _slot_trying(self, limit: int, first: int, releasing: bool) -> str:
        """The statement of ``_try_slots`` for ``limit`` slots tried from ``first`` on,
        made once per shape (it changes only with these and ``fences_in_grant``)."""
        shape = (limit, first, releasing, self.fences_in_grant)
        statement = self._slot_statements.get(shape)
        if statement is None:
            order = [(first + offset) % limit for offset in range(limit)]
            taken = {slot: self._slot_taken(slot) for slot in order}
            if releasing:
                given_back = self.give_back_sql
                taken = {slot: giving_back_first(given_back, sql) for slot, sql in taken.items()}
            tries = " ".join(f"WHEN {self.try_sql} THEN {taken[slot]}" for slot in order)
            statement = (
                f"SELECT CASE {tries} END AS granted, (SELECT slot FROM {SESSION_TABLES.holder} "
                f"WHERE name_key = %s AND slot < %s ORDER BY fence LIMIT 1) AS oldest"
            )
            self._slot_statements[shape] = statement
        return statement
