"""The session backends' server sessions: one per grant, opened and owned by djlocks.

Never the request's connection or the caller's transaction's, never shared by
two holders (both servers let one session take the same lock twice, so two
holders on one connection would both get in), never used after ``fork()``. A
released grant's session goes back to a per-process idle list, and is closed
once unused for ``IDLE_SESSION_SECONDS``. A pooler that
shares server sessions between clients is refused before the first grant
(``shared_session_problem``). A session that an acquire gave up on is killed
from another session (``_end``), so whatever it was granted dies with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends import aside
from djlocks.backends.base import DATABASE_OPTIONS, LockBackend, database_alias
from djlocks.backends.dedicated import DedicatedConnections, ended_by_the_server
from djlocks.backends.driver import refuse_psycopg2
from djlocks.backends.missing_table import missing_table_hint
from djlocks.backends.primary import refuse_read_only
from djlocks.exceptions import BackendUnavailable
from djlocks.forksafe import fork_safe_lock
from djlocks.written import WrittenNames

acquire_log = logging.getLogger("djlocks.acquire")

#: Seconds an idle session may go unused before a check-in closes it.
IDLE_SESSION_SECONDS = 60.0
#: A server lock key: a string (GET_LOCK) or a 64-bit integer (advisory locks).
Key = int | str


@dataclass
class Session:
    """One dedicated server session and its id (``CONNECTION_ID()``, ``pg_backend_pid()``).

    Its statements go through one driver cursor, kept for the session's life: a
    session runs one statement at a time (its holder's, or ``guard``'s holder's).
    """

    wrapper: BaseDatabaseWrapper
    connection_id: int
    pid: int = field(default_factory=os.getpid)
    guard: threading.Lock = field(default_factory=threading.Lock)
    #: When it was last checked in, idle (``time.monotonic()``).
    idle_since: float = 0.0
    #: The vendor's way to run its grant and release statements without the driver's
    #: cursor, set by the backend's ``_prepare`` (PostgreSQL: ``libpq.DirectStatements``).
    direct: Any = field(default=None, repr=False)
    _kept: Any = field(default=None, repr=False)

    @contextlib.contextmanager
    def cursor(self) -> Iterator[Any]:
        """The driver cursor, whose errors arrive as Django's ``DatabaseError`` subclasses."""
        with self.wrapper.wrap_database_errors:
            yield self._driver_cursor()

    def execute(self, sql: str, params: Sequence[object] = ()) -> Any:
        """Run one statement that returns rows; return its first row (``None`` if none)."""
        cursor = self._driver_cursor()
        with self.wrapper.wrap_database_errors:
            cursor.execute(sql, params)
            return cursor.fetchone()

    def run(self, sql: str, params: Sequence[object] = ()) -> None:
        """Run one statement that returns no rows (``SET ...``)."""
        cursor = self._driver_cursor()
        with self.wrapper.wrap_database_errors:
            cursor.execute(sql, params)

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[Any]:
        cursor = self._driver_cursor()
        with self.wrapper.wrap_database_errors:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def _driver_cursor(self) -> Any:
        if self._kept is None:
            with self.wrapper.wrap_database_errors:
                self._kept = self.wrapper.create_cursor()
        return self._kept

    def close(self) -> None:
        if self.pid == os.getpid():  # never touch a session inherited through fork()
            with contextlib.suppress(Exception):
                self.wrapper.close()


@dataclass
class Held:
    """A live grant of this process: its session and the key the server holds for it."""

    session: Session
    key: Key


class SessionStore(LockBackend):
    """Opening, lending and ending the dedicated sessions of one database alias.

    ``OPTIONS``: ``using``, the Django database alias whose settings the
    dedicated connections copy (default: where the routers write djlocks' tables,
    ``base.database_alias``).
    """

    #: The Django ``connection.vendor`` of the server (``"mysql"``, ``"postgresql"``).
    vendor: str

    option_names = DATABASE_OPTIONS

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.using = database_alias(self.options, "SessionHolder")
        self._idle: list[Session] = []
        self._held: dict[str, Held] = {}
        self._guard = fork_safe_lock()
        self._pid = os.getpid()
        self._unshared_in_pid = 0  # the process in which sessions were seen to be unshared
        self._registered = WrittenNames()  # (name, limit) known to the store
        #: A semaphore's slot-trying statements, by shape (``SessionClaims._slot_trying``).
        self._slot_statements: dict[tuple[int, int, bool, bool], str] = {}

    @abstractmethod
    def key(self, name: str, slot: int | str | None = None) -> Key:
        """The server's key for a lock (``slot=None``), a semaphore slot, or its gate."""

    @abstractmethod
    def _prepare(self, session: Session) -> None:
        """Configure a new session (keep-alives, time-outs)."""

    @abstractmethod
    def _connection_id(self, session: Session) -> int: ...

    @abstractmethod
    def _kill(self, session: Session, connection_id: int, key: Key | None) -> int:
        """From ``session``, end the session ``connection_id`` (only if it holds ``key``)."""

    def _checkout(self) -> Session:
        while (session := self._idle_session()) is not None:
            # A session the server ended while it was idle (a restart, an administrator's
            # kill, its idle time-out) held nothing: closed, and the next one tried.
            if not ended_by_the_server(session.wrapper.connection):
                return session
            session.close()
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
        refuse_psycopg2(self.alias, self.using)
        wrapper = DedicatedConnections.new_wrapper(self.using)
        try:
            wrapper.ensure_connection()
            refuse_read_only(wrapper, self.alias)
            session = Session(wrapper, 0)
            self._prepare(session)
            session.connection_id = self._connection_id(session)
        except BackendUnavailable:
            wrapper.close()
            raise
        except DatabaseError as exc:
            with contextlib.suppress(Exception):
                wrapper.close()
            raise BackendUnavailable(
                f"djlocks backend {self.alias!r} could not open a session on database "
                f"{self.using!r}: {exc}.{missing_table_hint(exc)}"
            ) from exc
        return session

    def _idle_session(self) -> Session | None:
        """An idle session of this process, taken out of the idle ones; ``None`` if none."""
        with self._guard:
            if self._pid != os.getpid():  # a forked child: the parent's sessions are not ours
                self._idle, self._held, self._pid = [], {}, os.getpid()
            return self._idle.pop() if self._idle else None

    def _checkin(self, session: Session) -> None:
        """Put ``session`` back among the idle ones, most recently used last, and close
        those idle for longer than ``IDLE_SESSION_SECONDS``: after a burst of holders,
        no more sessions stay open than the traffic since has used."""
        now = time.monotonic()
        with self._guard:
            if session.pid != os.getpid():
                return
            session.idle_since = now
            self._idle.append(session)
            stale = 0
            while now - self._idle[stale].idle_since > IDLE_SESSION_SECONDS:
                stale += 1
            closing, self._idle[:stale] = self._idle[:stale], []
        for old in closing:
            old.close()

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

        aside.start(kill)
