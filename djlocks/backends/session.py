"""Session locks: the database server holds the lock for as long as a session lives.

``GET_LOCK`` (MySQL/MariaDB) and ``pg_advisory_lock`` (PostgreSQL) belong to
the server session that took them, and the server frees them the moment that
session ends, so a crashed holder can never leak one. The subclasses in
``djlocks.backends.mysql`` and ``djlocks.backends.postgresql`` give the SQL;
this module gives the rules that keep them honest:

* Every grant has its own connection, opened and owned by djlocks:
  never the request's or the caller's transaction's, never shared by two
  holders (both servers let one session take the same lock twice, so two
  holders on one connection would both get in), never used after ``fork()``.
  A released grant's connection goes back to a per-process idle list.
* A blocking acquire waits inside the server; if the caller gives up while
  the server may still grant (an abort, an error), the connection is killed
  from another connection and discarded: whatever it was granted dies with it.
* Fences and identity live in two small tables (``djlocks.models``), written
  right after the grant; whether a grant is live is always the server's
  word (``IS_USED_LOCK``, ``pg_locks``), never the table's.
* The heartbeat's renewal is a keep-alive that asks the server whether this
  session still holds the key: a killed or timed-out session is reported
  ``LockLost`` within one heartbeat (TTL/3).
* A pooler that shares server sessions between clients (PgBouncer in
  transaction or statement pooling mode) is refused before the first grant:
  through it, a lock would belong to whichever client the pooler hands that
  server session to next. It is recognised by what it does: two djlocks
  connections that are open at once are given the same server session.
* A semaphore is N slot keys. One statement tries them all (a ``CASE``,
  which stops at the first slot it gets, so it takes at most one). If all are
  taken the caller waits in the server for the name's gate key, behind the
  other waiters. The gate's holder waits in the server too, on the slot whose
  holder was granted longest ago (the lowest fence in the holder rows: with
  similar hold times, the next slot to come free), for at most ``SLOT_WAIT``
  seconds at a time before it tries them all again. So a slot passes to the
  next waiter as soon as its holder releases it, with no polling, while a
  slot held for long cannot hold up the others' hand-offs by more than
  ``SLOT_WAIT``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import threading
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import (
    OTHER_DATABASE_HINT,
    Abort,
    AcquireRequest,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    seconds_left,
    unknown_database,
)
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.push import ClosedSockets
from djlocks.backends.server_records import (
    SESSION_TABLES,
    known_names,
    record_grant,
    register_name,
)
from djlocks.backends.session_deadlocks import (
    Holders,
    Owner,
    Wait,
    is_victim,
    owner_of,
    watched,
)
from djlocks.exceptions import BackendUnavailable, LockDeadlock, LockLost
from djlocks.keys import GATE, table_key

acquire_log = logging.getLogger("djlocks.acquire")

MAX_SLOTS = 9999  # slot keys end in /0 ... /9999 and must fit GET_LOCK's 64 characters
#: Seconds the gate's holder waits on one slot before it tries every slot again.
SLOT_WAIT = 0.02

Key = int | str


@dataclass
class Session:
    """One dedicated server session and its id (``CONNECTION_ID()``, ``pg_backend_pid()``)."""

    wrapper: BaseDatabaseWrapper
    connection_id: int
    pid: int = field(default_factory=os.getpid)
    guard: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def cursor(self) -> Iterator[Any]:
        """A driver cursor whose errors arrive as Django's ``DatabaseError`` subclasses."""
        with self.wrapper.wrap_database_errors, closing(self.wrapper.create_cursor()) as cursor:
            yield cursor

    def execute(self, sql: str, params: Sequence[object] = ()) -> Any:
        """Run one statement; return its first row (``None`` if it returned none)."""
        with self.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone() if cursor.description else None

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[Any]:
        with self.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def close(self) -> None:
        if self.pid == os.getpid():  # never touch a session inherited through fork()
            with contextlib.suppress(Exception):
                self.wrapper.close()


@dataclass
class _Held:
    session: Session
    key: Key


class SessionBackend(LockBackend):
    """Shared machinery of the GET_LOCK and advisory-lock backends (see the module docstring).

    ``OPTIONS``: ``using``, the Django database alias whose settings the
    dedicated connections copy (default ``"default"``).
    """

    vendor: str
    forced_release_effect = (
        "its dedicated database connection is terminated, so the server frees the lock at "
        "once; the holder hears of it at once (the server closes that connection), or at "
        "its next keep-alive (every TTL/3)"
    )

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = str(self.options.get("using", "default"))
        self._idle: list[Session] = []
        self._held: dict[str, _Held] = {}
        self._guard = threading.Lock()
        self._pid = os.getpid()
        self._unshared_in_pid = 0  # the process in which sessions were seen to be unshared

    # -- system checks -------------------------------------------------------

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; E006 a database of another vendor; and, when
        Django asks about the database, the server's own settings (``server_messages``)
        and E009 server sessions shared between clients by a pooler."""
        problems = unknown_database(self, self.using)
        if problems:
            return problems
        connection = connections[self.using]
        if connection.vendor != self.vendor:
            return [
                Error(
                    f"djlocks backend {self.alias!r} ({type(self).__name__}) needs a "
                    f"{self.vendor} database, but {self.using!r} is {connection.vendor}.",
                    hint=OTHER_DATABASE_HINT,
                    id="djlocks.E006",
                )
            ]
        if databases is None or self.using not in databases:
            return []
        messages = self.server_messages(connection)
        try:
            problem = self.shared_session_problem()
        except BackendUnavailable:
            return messages  # a server that is down is reported when a lock is taken
        if problem is not None:
            messages.append(
                Error(
                    problem,
                    hint="Session locks need a server session of their own: connect "
                    "directly, or through a PgBouncer pool with pool_mode = session.",
                    id="djlocks.E009",
                )
            )
        return messages

    def server_messages(self, connection: BaseDatabaseWrapper) -> list[CheckMessage]:
        """Check messages about the server's settings, read on ``connection``; none here."""
        return []

    # -- what each server does differently ---------------------------------

    @abstractmethod
    def key(self, name: str, slot: int | str | None = None) -> Key:
        """The server's key for a lock (``slot=None``), a semaphore slot, or its gate."""

    @abstractmethod
    def _prepare(self, session: Session) -> None:
        """Configure a new session (keep-alives, time-outs)."""

    @abstractmethod
    def _connection_id(self, session: Session) -> int: ...

    @abstractmethod
    def _take(self, session: Session, key: Key, seconds: float | None, identity: str) -> bool:
        """Wait up to ``seconds`` (``None``: forever, ``0``: try once) in the server."""

    #: SQL that tries one key (``%s``) once, without waiting, and is true if it got it.
    try_sql: str

    @abstractmethod
    def _give_back(self, session: Session, key: Key) -> bool:
        """Release ``key``; False if this session did not hold it."""

    @abstractmethod
    def _holds(self, session: Session, key: Key) -> bool: ...

    @abstractmethod
    def _kill(self, session: Session, connection_id: int, key: Key | None) -> int:
        """From ``session``, end the session ``connection_id`` (only if it holds ``key``)."""

    @abstractmethod
    def _waits(self, session: Session) -> list[Wait]:
        """Every session waiting for a key, with the session that holds the key."""

    @abstractmethod
    def _live_keys(self, session: Session, keys: Sequence[Key]) -> dict[Key, int]:
        """Which of ``keys`` the server says are held, and by which connection id."""

    def _record(self, session: Session, request: AcquireRequest, slot: int, token: str) -> int:
        """Issue the fence and record the holder's identity; return the fence."""
        with session.cursor() as cursor:
            return record_grant(
                cursor, self.vendor, SESSION_TABLES, request, slot, token, session.connection_id
            )

    def _register(self, session: Session, request: AcquireRequest) -> None:
        """Record the name before waiting, so waiters can be shown by name."""
        with session.cursor() as cursor:
            register_name(cursor, self.vendor, SESSION_TABLES, request)

    # -- sessions ----------------------------------------------------------

    def _checkout(self) -> Session:
        with self._guard:
            if self._pid != os.getpid():  # a forked child: the parent's sessions are not ours
                self._idle, self._held, self._pid = [], {}, os.getpid()
            if self._idle:
                return self._idle.pop()
        session = self._open()
        if self._unshared_in_pid != os.getpid():
            try:
                problem = self.shared_session_problem(session)
            except BaseException:
                session.close()
                raise
            if problem is not None:
                session.close()
                raise ImproperlyConfigured(problem)
            self._unshared_in_pid = os.getpid()
        return session

    def shared_session_problem(self, session: Session | None = None) -> str | None:
        """Why this backend's server sessions are shared between clients, or ``None``.

        A pooler in transaction or statement mode (PgBouncer's ``pool_mode``)
        returns a client's server session to its pool after each transaction,
        so the next client gets it, session locks included: such a pooler is
        refused for session locks. Asks a second connection, opened while
        ``session`` (or a new one) is open, for its server connection id, three
        times in turn: a
        direct connection or a session-mode pool never gives two open clients
        the same id; PgBouncer, which hands out its most recently used server
        connection, gives the second client the first one's.

        Costs one extra connection, once per process (``_checkout`` asks before
        its first session is used). Raises ``BackendUnavailable`` if the
        server cannot be reached.
        """
        first = session if session is not None else self._open()
        second = self._open()
        try:
            for _ in range(3):
                try:
                    ids = (self._connection_id(first), self._connection_id(second))
                except DatabaseError as exc:
                    raise BackendUnavailable(
                        f"djlocks backend {self.alias!r} lost its session on database "
                        f"{self.using!r}: {exc}"
                    ) from exc
                if ids[0] == ids[1] or ids[0] != first.connection_id:
                    return (
                        f"djlocks backend {self.alias!r} reaches its server through a "
                        f"pooler that shares server sessions between clients (PgBouncer "
                        f"in transaction or statement pooling mode?): two djlocks "
                        f"connections open at once on database {self.using!r} were given "
                        f"the same server session ({ids[1]}). A session lock there would "
                        f"be held by whichever client gets that session next. Point "
                        f"OPTIONS['using'] at a database alias that connects to the server "
                        f"directly or through a pool in session mode, or use the lease "
                        f"or row backend, which work through any pooler."
                    )
        finally:
            second.close()
            if session is None:
                first.close()
        return None

    def _open(self) -> Session:
        """Open and configure a new dedicated session."""
        wrapper = DedicatedConnections.new_wrapper(self.using)
        try:
            wrapper.ensure_connection()
            session = Session(wrapper, 0)
            self._prepare(session)
            session.connection_id = self._connection_id(session)
        except DatabaseError as exc:
            with contextlib.suppress(Exception):
                wrapper.close()
            raise BackendUnavailable(
                f"djlocks backend {self.alias!r} could not open a session on database "
                f"{self.using!r}: {exc}"
            ) from exc
        return session

    def _checkin(self, session: Session) -> None:
        with self._guard:
            if session.pid == os.getpid():
                self._idle.append(session)

    @contextlib.contextmanager
    def _side_session(self) -> Iterator[Session]:
        """A session for introspection and kills, returned afterwards unless it failed."""
        session = self._checkout()
        try:
            yield session
        except BaseException:
            session.close()
            raise
        self._checkin(session)

    def _end(self, session: Session) -> None:
        """End ``session`` in the server, then close it, after an acquire went wrong.

        Closing alone is not enough: a client whose connection failed or timed
        out may be gone while its session still waits in the server, which
        notices a vanished client only when it next writes to it (PostgreSQL
        without ``client_connection_check_interval``), so the session would be
        granted the lock and hold it for nobody. It is killed from another
        session; if the server cannot be reached, it ends the session itself
        once it sees the connection closed.
        """
        with contextlib.suppress(BackendUnavailable, DatabaseError), self._side_session() as side:
            self._kill(side, session.connection_id, None)
        session.close()

    def _kill_aside(self, victim: Session) -> None:
        """End ``victim``'s session from another one, in a new thread (see ``Abort``)."""

        def kill() -> None:
            try:
                with self._side_session() as side:
                    self._kill(side, victim.connection_id, None)
            except (BackendUnavailable, DatabaseError):
                acquire_log.warning("could not kill session %s", victim.connection_id)

        threading.Thread(target=kill, name="djlocks-cancel", daemon=True).start()

    # -- acquire -----------------------------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        self._refuse(request)
        session = self._checkout()
        try:
            with abort.cancelling(lambda: self._kill_aside(session)) if abort else _nothing():
                slot = self._claim(session, request, deadline)
            if slot is None:
                self._checkin(session)
                return None
            if abort is not None and abort.is_set():
                session.close()  # granted after the caller gave up: the grant ends with it
                return None
            token = secrets.token_hex(16)
            fence = self._record(session, request, slot, token)
        except DatabaseError as exc:
            self._end(session)  # whatever it may have been granted or still waits for
            if abort and abort.is_set():
                return None
            raise BackendUnavailable(
                f"djlocks backend {self.alias!r} failed while acquiring {request.name!r}: {exc}"
            ) from exc
        except BaseException:
            self._end(session)
            raise
        with self._guard:
            self._held[token] = _Held(session, self._slot_key(request, slot))
        return GrantRecord(token, slot, fence, None)

    def _refuse(self, request: AcquireRequest) -> None:
        if connections[self.using].in_atomic_block:
            raise BackendUnavailable(
                f"{request.name!r}: a session lock taken inside transaction.atomic() would "
                f"be released before the transaction commits, so other processes could "
                f"act on data it has not committed yet (a lock must cover the commit). Take "
                f"the lock outside: `with db_lock(...): with transaction.atomic(): ...`, or "
                f"use the row backend, whose lock ends with the transaction. In tests, "
                f"Django's TestCase runs each test in a transaction: use TransactionTestCase, "
                f"or djlocks.testing.use_locmem_backends()."
            )
        if request.cooldown:
            raise ValueError(
                f"djlocks backend {self.alias!r} holds locks in server sessions, which "
                f"cannot outlive their release: a cool-down needs a lease backend."
            )
        if request.limit > MAX_SLOTS:
            raise ValueError(f"A session semaphore has at most {MAX_SLOTS} slots.")

    def _slot_key(self, request: AcquireRequest, slot: int) -> Key:
        return self.key(request.name) if request.limit == 1 else self.key(request.name, slot)

    def _claim(
        self, session: Session, request: AcquireRequest, deadline: float | None
    ) -> int | None:
        identity = describe(request)
        if request.limit == 1:
            key = self.key(request.name)
            if self._take(session, key, 0, identity):
                return 0
            if seconds_left(deadline) == 0:
                return None
            self._register(session, request)
            return self._wait_watched(session, request, key, deadline, identity)
        slot, _ = self._try_slots(session, request)
        if slot is not None or seconds_left(deadline) == 0:
            return slot
        self._register(session, request)
        gate = self.key(request.name, GATE)
        if not self._take(session, gate, seconds_left(deadline), identity):
            return None
        try:
            return self._wait_for_a_slot(session, request, identity, deadline)
        finally:
            self._give_back(session, gate)

    def _wait_watched(
        self,
        session: Session,
        request: AcquireRequest,
        key: Key,
        deadline: float | None,
        identity: str,
    ) -> int | None:
        """Wait in the server for the lock ``key``, watched for deadlocks (session_deadlocks)."""
        with watched(
            lambda: self._is_deadlock_victim(session.connection_id),
            lambda: self._kill_aside(session),
        ) as victim:
            try:
                granted = self._take(session, key, seconds_left(deadline), identity)
            except DatabaseError:
                if not victim.is_set():
                    raise
                granted = False
        if victim.is_set():
            raise LockDeadlock(
                f"{request.name!r}: this wait would never end. Its holder waits, directly "
                f"or through others, for a session lock that this thread holds. This wait "
                f"was chosen to end it (it began last). Release your locks and try again, "
                f"or take names in one fixed order."
            )
        return 0 if granted else None

    def _is_deadlock_victim(self, connection_id: int) -> bool:
        """Whether the wait of session ``connection_id`` is a deadlock's victim.

        Runs in the watching thread, on a side session (never on a Django
        connection of that thread, which nobody would close).
        """
        with self._side_session() as side:
            waits = self._waits(side)
            holders = sorted({wait.holder for wait in waits})
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
        owners: Holders = {}
        for holder, name, limit, slot, host, pid, thread in rows:
            owner = owner_of(host, pid, thread)
            if owner is not None:
                key = self.key(name) if limit == 1 else self.key(name, slot)
                owners[int(holder), key] = owner
        return is_victim(connection_id, waits, owners)

    def _wait_for_a_slot(
        self, session: Session, request: AcquireRequest, identity: str, deadline: float | None
    ) -> int | None:
        """As the gate's holder: wait in the server on the slot likeliest to come free
        next, ``SLOT_WAIT`` seconds at a time, trying every slot in between."""
        while True:
            slot, oldest = self._try_slots(session, request)
            if slot is not None:
                return slot
            left = seconds_left(deadline)
            if left == 0:
                return None
            wait = SLOT_WAIT if left is None else min(SLOT_WAIT, left)
            if self._take(session, self.key(request.name, oldest), wait, identity):
                return oldest

    def _try_slots(self, session: Session, request: AcquireRequest) -> tuple[int | None, int]:
        """Try every slot in one statement, taking at most one; return it (``None`` if
        all were taken) and the slot granted longest ago (the lowest fence)."""
        first = random.randrange(request.limit)  # spread first tries over the slots
        order = [(first + offset) % request.limit for offset in range(request.limit)]
        tries = " ".join(f"WHEN {self.try_sql} THEN {slot}" for slot in order)
        got, oldest = session.execute(
            f"SELECT CASE {tries} END, (SELECT slot FROM {SESSION_TABLES.holder} "
            f"WHERE name_key = %s AND slot < %s ORDER BY fence LIMIT 1)",
            (
                *(self.key(request.name, slot) for slot in order),
                table_key(request.name),
                request.limit,
            ),
        )
        return got, first if oldest is None else int(oldest)

    # -- release, renew, check ---------------------------------------------

    def release(self, name: str, token: str, cooldown: float) -> None:
        with self._guard:
            held = self._held.pop(token, None)
        if held is None:
            raise LockLost(f"The grant of {name!r} had ended before release: its session ended.")
        with held.session.guard:
            try:
                released = self._give_back(held.session, held.key)
            except DatabaseError as exc:
                held.session.close()
                raise LockLost(
                    f"The grant of {name!r} had ended before release: its session failed ({exc})."
                ) from exc
        if not released:
            held.session.close()
            raise LockLost(
                f"The grant of {name!r} had ended before release: the server no longer "
                f"held it for this session (killed, or released by force)."
            )
        self._checkin(held.session)

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """A keep-alive that also asks the server whether the session still holds the key."""
        if not self.is_held(name, token):
            with self._guard:
                held = self._held.pop(token, None)
            if held is not None:
                held.session.close()
            raise LockLost(f"The session holding {name!r} ended or no longer holds it.")
        return None  # a session grant has no expiry

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """``notice`` is called when the server closes the grant's session (a forced
        release kills it; so does an administrator, or the server's idle time-out)."""
        with self._guard:
            held = self._held.get(token)
        if held is None or not _closed_sockets.supported:
            return None
        return _closed_sockets.watch(token, held.session.wrapper.connection.fileno(), notice)

    def is_held(self, name: str, token: str) -> bool:
        with self._guard:
            held = self._held.get(token)
        if held is None:
            return False
        if not held.session.guard.acquire(timeout=5):
            return True  # busy releasing; the release itself will tell
        try:
            return self._holds(held.session, held.key)
        except DatabaseError:
            return False
        finally:
            held.session.guard.release()

    # -- introspection and forced release ----------------------------------

    def _holder_rows(self, name: str | None) -> list[Any]:
        from djlocks.models import SessionHolder

        rows = SessionHolder.objects.using(self.using).order_by("name", "slot")
        return list(rows if name is None else rows.filter(key=table_key(name)))

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        rows = self._holder_rows(name)
        keys = {self.key(r.name) if r.limit == 1 else self.key(r.name, r.slot): r for r in rows}
        with self._side_session() as side:
            live = self._live_keys(side, list(keys))
        return [
            HolderInfo(
                name=row.name,
                backend=self.alias,
                slot=row.slot,
                limit=row.limit,
                host=row.host,
                pid=row.pid,
                thread=row.thread,
                label=row.label,
                since=row.acquired_at,
                expires_at=None,
                fence=row.fence,
                token=row.token,
                connection_id=row.connection_id,
            )
            for key, row in keys.items()
            if live.get(key) == row.connection_id
        ]

    def force_release(self, name: str, token: str | None = None) -> int:
        """Kill the holder's session, after the server confirms it still holds the key."""
        killed = 0
        with self._side_session() as side:
            for holder in self.holders(name):
                if token is None or holder.token == token:
                    key = self.key(name) if holder.limit == 1 else self.key(name, holder.slot)
                    killed += self._kill(side, holder.connection_id or 0, key)
        return killed

    def names(self) -> list[tuple[str, int]]:
        return known_names(SESSION_TABLES, self.using)

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        return []  # refused at acquire: a session lock cannot outlive its release

    def sweep(self) -> dict[str, int]:
        return {}  # the server frees a dead session's locks; holder rows are rewritten per slot

    def _waited_names(self, name: str | None) -> dict[Key, str]:
        """The keys a waiter of each known name (or of ``name``) may wait on."""
        return {
            key: known
            for known, limit in known_names(SESSION_TABLES, self.using, name)
            for key in self._waited_keys(known, limit)
        }

    def _waited_keys(self, name: str, limit: int) -> list[Key]:
        """A lock's key, or a semaphore's gate and slots (its gate's holder waits on one)."""
        if limit == 1:
            return [self.key(name)]
        return [self.key(name, GATE), *(self.key(name, slot) for slot in range(limit))]

    def _as_waiters(self, rows: Sequence[tuple[str | None, str, datetime]]) -> list[WaiterInfo]:
        return queue_order(self.alias, rows)


def queue_order(alias: str, rows: Sequence[tuple[str | None, str, datetime]]) -> list[WaiterInfo]:
    """Waiters from (name or None, ``describe`` text, waiting since) in the server's order.

    Rows without a name (not a djlocks name) are left out; positions count per name.
    """
    positions: dict[str, int] = {}
    waiting = []
    for name, description, since in rows:
        if name is None:
            continue
        position = positions[name] = positions.get(name, -1) + 1
        host, pid, label = parse_description(description)
        waiting.append(WaiterInfo(name, alias, position, host, pid, "", label, since))
    return waiting


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


#: Watches the sessions of every session backend of the process (see ``watch``).
_closed_sockets = ClosedSockets()


def describe(request: AcquireRequest) -> str:
    """Who waits, as the server's process list shows it (``parse_description`` reads it):
    ``djlocks <pid>.<thread id>@<host> <label>``. Plain text: MySQL puts it in SQL
    through ``mysql.sql_comment``, PostgreSQL in ``application_name`` as a parameter."""
    who = request.identity
    tid = owner_of(who.host, who.pid, who.thread)
    thread = "" if tid is None else f".{tid[2]}"
    return f"djlocks {who.pid}{thread}@{who.host} {who.label}"


def parse_description(text: str) -> tuple[str, int, str]:
    """(host, pid, label) from ``describe``'s text, perhaps cut short by the server."""
    found = _DESCRIPTION.match(text or "")
    if found is None:
        return "", 0, text or ""
    return found["host"], int(found["pid"]), found["label"]


def owner_described(text: str) -> Owner | None:
    """The owner (host, pid, thread id) of a wait from ``describe``'s text."""
    found = _DESCRIPTION.match(text or "")
    if found is None or found["tid"] is None:
        return None
    return found["host"], int(found["pid"]), int(found["tid"])


_DESCRIPTION = re.compile(
    r"djlocks (?P<pid>\d+)(?:\.(?P<tid>\d+))?@(?P<host>\S+) ?(?P<label>.*)", re.DOTALL
)
