"""Connections that djlocks opens and owns, one per thread and process.

A lock's statements never run on the connection Django uses for the request
or the caller's transaction: a caller's rollback cannot undo a grant, and
Django closing or recycling its connections cannot touch ours. A connection
is never used across ``fork()``: a child process opens its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar, TypeVar

from django.db import InterfaceError, OperationalError, connections
from django.db.backends.base.base import NO_DB_ALIAS, BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.backends.utils import CursorWrapper
from django.dispatch import receiver

from djlocks import background
from djlocks.backends.push import hung_up
from djlocks.forksafe import fork_safe_lock

OnConnect = Callable[[BaseDatabaseWrapper], None]
#: The settings that tell database servers apart.
SERVER_KEYS = ("ENGINE", "HOST", "PORT")
release_log = logging.getLogger("djlocks.release")
#: Seconds ``close_all()`` waits, per connection, for another thread's statement to end.
CLOSE_WAIT = 5.0
T = TypeVar("T")


class DedicatedConnections(threading.local):
    """A private ``DatabaseWrapper`` for the database alias ``using``, per thread.

    ``close_all()`` closes the connections of every thread (the heartbeat's and
    those of worker threads included), e.g. before the database is dropped.
    """

    def __init__(self, using: str, on_connect: OnConnect | None = None) -> None:
        with self._every_thread_guard:
            self._instances.add(self)
        self.using = using
        self.on_connect = on_connect
        self._wrapper: BaseDatabaseWrapper | None = None
        self._thread_end: _ThreadEnd | None = None
        self._pid = 0

    _every_thread: ClassVar[weakref.WeakSet[BaseDatabaseWrapper]] = weakref.WeakSet()
    _instances: ClassVar[weakref.WeakSet[DedicatedConnections]] = weakref.WeakSet()
    _every_thread_guard: ClassVar[threading.Lock] = fork_safe_lock()

    @classmethod
    def new_wrapper(cls, using: str) -> BaseDatabaseWrapper:
        """A private, not yet connected ``DatabaseWrapper`` for the alias ``using``.

        Django's own machinery configures it (``OPTIONS``, time zone, init
        commands). On MySQL/MariaDB it also accepts several statements per
        query (``CLIENT.MULTI_STATEMENTS``), so that djlocks can send a batch in
        one round trip; its parameters are always passed separately. It never
        draws from Django's connection pool (``OPTIONS["pool"]``, PostgreSQL): a
        dedicated connection stays open while its thread takes locks, and the
        pool's connections are the project's, for its requests. Sharing between
        threads is allowed because djlocks hands a wrapper from thread to thread
        (never two at once) and ``close_all()`` closes it from another thread.
        """
        template = connections[using]
        settings = dict(template.settings_dict)
        options = {key: value for key, value in settings["OPTIONS"].items() if key != "pool"}
        if template.vendor == "mysql":
            options = _with_multi_statements(options)
        settings["OPTIONS"] = options
        wrapper = type(template)(settings, alias=using)
        wrapper.inc_thread_sharing()
        with cls._every_thread_guard:
            cls._every_thread.add(wrapper)
        return wrapper

    def get(self) -> BaseDatabaseWrapper:
        """Return this thread's open connection, opening it if needed."""
        if self._wrapper is None or self._pid != os.getpid() or _is_stale(self._wrapper):
            self._wrapper = self.new_wrapper(self.using)
            self._pid = os.getpid()
        wrapper = self._wrapper
        if wrapper.connection is None:
            wrapper.ensure_connection()
            # A thread that ends drops its wrapper without closing it: close the
            # driver's connection then, not at some later garbage collection (a Django
            # wrapper refers to itself, so only the collector frees it, while a thread
            # per request could open more connections than the server allows). Not at
            # interpreter exit: the thread may still run a statement on it (see
            # ``BackendHandler.stop_listeners``), and the operating system closes it.
            self._thread_end = _ThreadEnd()
            ending = weakref.finalize(self._thread_end, _close_in, os.getpid(), wrapper.connection)
            ending.atexit = False
            if self.on_connect is not None:
                try:
                    self.on_connect(wrapper)
                except BaseException:
                    self.discard()  # never used unprepared: the next use opens a new one
                    raise
        return wrapper

    @contextlib.contextmanager
    def cursor(self) -> Iterator[CursorWrapper]:
        """A Django cursor on this thread's connection; one that failed is discarded,
        so that the next use reconnects."""
        try:
            with self.get().cursor() as cursor:
                yield cursor
        except (OperationalError, InterfaceError):
            self.discard()
            raise

    def run_idempotent(self, operation: Callable[[CursorWrapper], T]) -> T:
        """Run ``operation`` on a cursor; if the connection failed (it may have been idle
        through a server restart or a network cut), run it once more on a new one.

        Only for operations that are safe to apply twice.
        """
        try:
            with self.cursor() as cursor:
                return operation(cursor)
        except (OperationalError, InterfaceError):
            with self.cursor() as cursor:
                return operation(cursor)

    @classmethod
    def close_all(cls) -> None:
        """Close every dedicated connection this process opened, in every thread."""
        with cls._every_thread_guard:
            wrappers = list(cls._every_thread)
        for wrapper in wrappers:
            _close_when_idle(wrapper)

    @classmethod
    def close_on_server(cls, server: BaseDatabaseWrapper) -> None:
        """Close the connections to any database of ``server``'s engine, host and port."""
        where = [server.settings_dict.get(key) for key in SERVER_KEYS]
        with cls._every_thread_guard:
            wrappers = [
                wrapper
                for wrapper in cls._every_thread
                if [wrapper.settings_dict.get(key) for key in SERVER_KEYS] == where
            ]
        for wrapper in wrappers:
            _close_when_idle(wrapper)

    @classmethod
    def close_this_thread(cls) -> None:
        """Close the connections the calling thread opened (e.g. before the thread ends)."""
        with cls._every_thread_guard:
            instances = list(cls._instances)
        for instance in instances:
            instance.discard()

    def discard_if_ended(self) -> None:
        """Discard this thread's connection if the server ended it while it was idle (a
        restart, an administrator's kill, an idle time-out: its socket hung up), so that
        the next use opens a new one rather than fail where a retry is not safe."""
        wrapper = self._wrapper
        driver = wrapper.connection if wrapper is not None and self._pid == os.getpid() else None
        if driver is not None and ended_by_the_server(driver):
            self.discard()

    def discard(self) -> None:
        """Close and forget this thread's connection (after an error of unknown outcome)."""
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                wrapper.close()


def _with_multi_statements(options: dict[str, Any]) -> dict[str, Any]:
    """mysqlclient ``OPTIONS`` that also allow several statements per query."""
    from MySQLdb.constants import CLIENT  # type: ignore[import-untyped]

    flags = options.get("client_flag", CLIENT.FOUND_ROWS)  # Django's default flags
    return {**options, "client_flag": flags | CLIENT.MULTI_STATEMENTS}


def _detach_in_a_forked_child() -> None:
    """In a forked child, point each inherited djlocks connection's socket descriptor at
    ``/dev/null``. The child never uses them, but closing or collecting one there (its
    finalizer, the driver's own clean-up) would otherwise say goodbye to the server on
    the socket the parent still uses, and the server would end the parent's session:
    a session lock the parent holds would be lost."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for wrapper in list(DedicatedConnections._every_thread):
            with contextlib.suppress(Exception):  # a connection closed already has no socket
                os.dup2(null, wrapper.connection.fileno())
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_detach_in_a_forked_child)


def statement_cursor(db: BaseDatabaseWrapper) -> AbstractContextManager[Any]:
    """A driver cursor (as Django's ``create_cursor()`` makes it) for statements on
    ``db``, one of djlocks' own connections, which one thread uses at a time: ``with
    statement_cursor(db) as cursor:``.

    On the database servers the connection keeps one cursor for all its statements
    (each discards what the one before left unread): making a cursor costs psycopg
    about 250 Python bytecodes, as much again as a lease statement's own work in
    djlocks. On SQLite each use gets a cursor of its own, closed afterwards: a cursor
    with rows left unread keeps its read going, which holds up other processes'
    writes.
    """
    if db.vendor == "sqlite":
        return contextlib.closing(db.create_cursor())
    kept = _kept_cursors.get(db)
    if kept is None or kept[0] is not db.connection:  # none yet, or for a closed one
        kept = (db.connection, db.create_cursor())
        _kept_cursors[db] = kept
    return contextlib.nullcontext(kept[1])


#: Each server connection's kept cursor (``statement_cursor``), with the driver
#: connection it belongs to.
_kept_cursors: weakref.WeakKeyDictionary[BaseDatabaseWrapper, tuple[Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def _close_when_idle(wrapper: BaseDatabaseWrapper) -> None:
    """Close ``wrapper``, which another thread may be using, once no statement runs on it.

    psycopg 3 holds the connection's ``lock`` while a statement runs, and closing
    the connection under it frees what that statement's thread still reads (a
    crash). A statement still running is cancelled (``cancel_safe``, which is
    thread-safe), and the connection is closed once its lock is free, within
    ``CLOSE_WAIT`` seconds in all; a connection still busy then is left open, for
    its thread to finish with, and logged. Django's part, ``wrapper.close()``, then
    forgets the closed connection. mysqlclient has no such lock: djlocks itself runs
    no statement from another thread when ``backends.reset()`` closes (see ``aside``).
    """
    driver = wrapper.connection
    lock = getattr(driver, "lock", None)
    if lock is not None:
        deadline = time.monotonic() + CLOSE_WAIT
        if not lock.acquire(blocking=False):
            if _runs_a_statement(driver):
                with contextlib.suppress(Exception):
                    driver.cancel_safe(timeout=CLOSE_WAIT)
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                release_log.warning(
                    "left a connection open: another thread's statement on it did not end "
                    "within %s s of its cancel",
                    CLOSE_WAIT,
                )
                return
        try:
            with contextlib.suppress(Exception):
                driver.close()
        finally:
            lock.release()
    with contextlib.suppress(Exception):
        wrapper.close()  # Django's part: forget the connection


def _runs_a_statement(driver: Any) -> bool:
    """Whether a statement runs on the psycopg connection ``driver`` now (read, without
    its lock, from libpq), so that a cancel cannot end the next one instead."""
    from psycopg import pq

    return bool(driver.pgconn.transaction_status == pq.TransactionStatus.ACTIVE)


class _ThreadEnd:
    """Kept in one thread's slot of ``DedicatedConnections`` and nowhere else, so it is
    freed the moment the thread ends, which runs the finalizer attached to it."""

    __slots__ = ("__weakref__",)


def _close_in(pid: int, connection: object) -> None:
    """Close ``connection`` if this is the process ``pid`` that opened it. A forked child
    frees the slots of its parent's other threads as it starts, before anything else
    runs: closing their connections there would end the parent's sessions."""
    if os.getpid() == pid:
        _close_quietly(connection)


def ended_by_the_server(driver: Any) -> bool:
    """Whether the driver connection ``driver`` (psycopg's, mysqlclient's) can no longer
    be used: closed, or its socket hung up by the server (``push.hung_up``, Linux only);
    ``False`` for one without a socket (SQLite's)."""
    if driver is None:
        return True
    socket = getattr(driver, "fileno", None)
    if socket is None:
        return False
    try:
        return hung_up(socket())
    except Exception:  # a closed connection has no socket to ask
        return True


def _close_quietly(connection: object) -> None:
    with contextlib.suppress(Exception):
        connection.close()  # type: ignore[attr-defined]


def _is_stale(wrapper: BaseDatabaseWrapper) -> bool:
    """True if Django's alias now names another database than ``wrapper`` connects to.

    Only a test run changes a database's ``NAME``: to the test database and back, in
    the settings that every thread's Django connection shares (``connections.settings``,
    read here without the per-thread lookup of ``connections[alias]``).
    """
    return bool(wrapper.settings_dict["NAME"] != connections.settings[wrapper.alias]["NAME"])


@receiver(connection_created)
def _close_before_a_database_is_dropped(
    sender: object, connection: BaseDatabaseWrapper, **kwargs: Any
) -> None:
    """Django connects to a server without a database only to create, clone or drop
    one (a test database, at the end of a test run): first let the background writers
    write the records they hold (``background.flush_all``), which belong to that
    database, then close our connections to that server, since PostgreSQL refuses
    ``DROP DATABASE`` while another session uses it. A closed connection reopens,
    to the database its alias then names, when djlocks next needs it.
    """
    if connection.alias == NO_DB_ALIAS:
        background.flush_all()
        DedicatedConnections.close_on_server(connection)


def relaxed_commits(db: BaseDatabaseWrapper) -> None:
    """For records that a database crash may lose (the history, late holder records):
    this connection's commits need not wait for the log flush (the vendor's
    ``HISTORY_SESSION`` statement). Grants and fences keep their durable commits."""
    from djlocks.backends.sql import for_vendor

    try:
        statement = for_vendor(db.vendor).HISTORY_SESSION
    except ValueError:  # a database djlocks keeps no SQL for: its commits stay as they are
        return
    if statement:
        with db.cursor() as cursor:
            cursor.execute(statement)


class RecordWriting:
    """The dedicated connections of a background writer (the history, holder records):
    one ``DedicatedConnections`` per database alias, made on first use, whose
    commits need not wait for the log flush (``relaxed_commits``)."""

    def __init__(self) -> None:
        self._guard = fork_safe_lock()
        self._by_alias: dict[str, DedicatedConnections] = {}

    def __getitem__(self, using: str) -> DedicatedConnections:
        with self._guard:
            if using not in self._by_alias:
                self._by_alias[using] = DedicatedConnections(using, on_connect=relaxed_commits)
            return self._by_alias[using]
