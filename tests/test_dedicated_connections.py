"""Closing djlocks' own connections while other threads still use them
(``backends.reset()``, a test database about to be dropped)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections

from djlocks import Lock, LockLost
from djlocks.backends import aside, backends
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.sql.mysql import run_at_once, value_at_once
from tests.faults import interrupted_after
from tests.processes import fork_beside_threads

pytestmark = [
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        connection.vendor == "sqlite", reason="SQLite has no statement that waits in a server"
    ),
]

#: A statement that waits in the server for the seconds it is given.
SLEEPS = {"postgresql": "SELECT pg_sleep(%s)", "mysql": "SELECT SLEEP(%s)"}
SLEEP = SLEEPS.get(connection.vendor, "")


class ServerSleep:
    """A statement that sleeps ``seconds`` in the server, on a dedicated connection of
    the thread that calls it; ``outcome`` gets ``None`` or the error it ended with."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.outcome: list[object] = []
        self.running = threading.Event()

    def __call__(self) -> None:
        own = DedicatedConnections("default")
        try:
            with own.cursor() as cursor:
                self.running.set()
                cursor.execute(SLEEP, [self.seconds])
            self.outcome.append(None)
        except DatabaseError as exc:
            self.outcome.append(exc)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's connection lock")
def test_closing_every_connection_first_cancels_a_statement_another_thread_runs() -> None:
    """psycopg frees a connection's state at close(): closing it under a running
    statement crashed a test run. The statement is cancelled and ends first."""
    sleep = ServerSleep(30)
    thread = threading.Thread(target=sleep)
    thread.start()
    assert sleep.running.wait(10)
    time.sleep(0.3)  # inside pg_sleep
    began = time.monotonic()
    DedicatedConnections.close_all()
    thread.join(10)
    assert time.monotonic() - began < 5
    assert len(sleep.outcome) == 1 and "canceling statement" in str(sleep.outcome[0])


def test_a_reset_waits_for_a_statement_ended_from_the_side() -> None:
    """A thread that kills or cancels an aborted wait's statement uses a connection of
    its own; ``backends.reset()`` lets it finish before closing every connection."""
    sleep = ServerSleep(0.5)
    aside.start(sleep)
    assert sleep.running.wait(10)
    backends.reset()
    assert sleep.outcome == [None], "reset() closed the connection under the statement"


def test_a_session_lock_whose_connection_a_reset_closed_is_lost_at_release() -> None:
    """``backends.reset()`` closes every djlocks connection, a holder's too: the server
    then frees the lock, and the release says it was lost."""
    grant = Lock("dedicated:reset", backend="session").acquire_grant(timeout=0)
    assert grant is not None
    backends.reset()
    with pytest.raises(LockLost):
        grant.release()


@pytest.mark.skipif(connection.vendor != "mysql", reason="mysqlclient's C API wrapper")
@pytest.mark.parametrize("interruptible", [True, False], ids=["wait", "try"])
def test_a_statement_without_a_cursor_gives_its_value_or_raises_the_drivers_error(
    interruptible: bool,
) -> None:
    """``value_at_once`` (the session lock's grant and release on MySQL/MariaDB), waiting
    for the reply on the socket or in the C API: the value, parameters quoted as the
    cursor quotes them (a ``%`` doubled in the SQL, a quote in a parameter); the
    driver's errors once the server ended the session or Django closed the
    connection."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    name = "dedicated:it's 100%"
    taking = "SELECT /* 50%% off */ GET_LOCK(%s, %s)"
    assert value_at_once(driver, taking, (name, 0), interruptible=interruptible) == 1
    assert (
        value_at_once(driver, "SELECT RELEASE_LOCK(%s)", (name,), interruptible=interruptible) == 1
    )
    nobody = value_at_once(driver, "SELECT RELEASE_LOCK(%s)", (name,), interruptible=interruptible)
    assert nobody is None  # nobody held it
    assert (
        value_at_once(driver, "SELECT 1 FROM DUAL WHERE %s", (False,), interruptible=interruptible)
        is None
    )
    with connection.cursor() as cursor:
        cursor.execute("KILL %s", [driver.thread_id()])
    time.sleep(0.2)  # the server ends the session
    with pytest.raises(DatabaseError), connection.wrap_database_errors:
        value_at_once(driver, "SELECT RELEASE_LOCK(%s)", (name,), interruptible=interruptible)
    with pytest.raises(DatabaseError, match="closed"), connection.wrap_database_errors:
        value_at_once(None, "SELECT 1", (), interruptible=interruptible)
    own.discard()


@pytest.mark.skipif(connection.vendor != "mysql", reason="mysqlclient's C API wrapper")
def test_a_change_without_a_cursor_gives_the_rows_it_matched_and_its_last_insert_id() -> None:
    """``run_at_once`` (the lease's claim and release on MySQL/MariaDB): an ``UPDATE``
    gives no row, the rows it matched (changed or not, as Django's connections count
    them) and the value ``LAST_INSERT_ID(expr)`` set, which is the claim's fence; a
    ``SELECT`` its first row, typed by the driver."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    run_at_once(driver, "CREATE TEMPORARY TABLE dedicated_counts (n BIGINT)", ())
    assert run_at_once(driver, "INSERT INTO dedicated_counts VALUES (%s), (%s)", (5, 7))[1] == 2
    bump = "UPDATE dedicated_counts SET n = LAST_INSERT_ID(n + 1) WHERE n = %s"
    assert run_at_once(driver, bump, (7,)) == (None, 1, 8)
    assert run_at_once(driver, bump, (99,))[:2] == (None, 0)
    same = "UPDATE dedicated_counts SET n = n WHERE n > %s"
    assert run_at_once(driver, same, (0,))[1] == 2  # matched, though nothing changed
    first = "SELECT n, NULL FROM dedicated_counts WHERE n > %s ORDER BY n"
    assert run_at_once(driver, first, (0,))[:2] == ((5, None), 2)
    assert run_at_once(driver, first, (100,))[:2] == (None, 0)
    own.discard()


@pytest.mark.skipif(connection.vendor != "mysql", reason="mysqlclient's C API wrapper")
def test_a_get_lock_wait_without_a_cursor_can_be_interrupted_by_a_signal() -> None:
    """The wait for the reply is on the socket in Python, so a signal's handler runs
    during a long ``GET_LOCK`` and may end it (Ctrl-C's KeyboardInterrupt)."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    name = "dedicated:interrupted"
    with connection.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
        try:
            with interrupted_after(0.3):
                value_at_once(driver, "SELECT GET_LOCK(%s, %s)", (name, 30), interruptible=True)
        finally:
            own.discard()  # its GET_LOCK still waits in the server: the session ends
            cursor.execute("SELECT RELEASE_LOCK(%s)", [name])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="Django pools PostgreSQL's")
def test_holders_never_take_a_connection_from_djangos_pool() -> None:
    """With ``OPTIONS["pool"]`` of one connection, threads that hold a session lock and a
    lease leave it to the project: a request's query gets it at once. (The setting is
    the alias's, shared by every thread's connection, and set only while the test runs:
    this thread's connection, opened before, must not close meanwhile.)"""
    options = connection.settings_dict["OPTIONS"]
    options["pool"] = {"min_size": 0, "max_size": 1, "timeout": 2}
    holding, done = threading.Barrier(3), threading.Event()
    queried: list[object] = []
    failed: list[Exception] = []

    def hold(alias: str) -> None:
        try:
            with Lock(f"pool:{alias}", backend=alias, timeout=5):
                holding.wait(10)
                done.wait(10)
        except Exception as exc:
            failed.append(exc)
            holding.abort()

    def request() -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT 1")
                queried.append(cursor.fetchone())
        except Exception as exc:  # a DatabaseError; ImproperlyConfigured without psycopg-pool
            queried.append(exc)
        finally:
            connections.close_all()  # back to the pool

    holders = [threading.Thread(target=hold, args=(alias,)) for alias in ("session", "default")]
    try:
        for thread in holders:
            thread.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            holding.wait(10)
        assert failed == [], "the holders drew from the pool, which has one connection"
        asking = threading.Thread(target=request)
        asking.start()
        asking.join(10)
        assert queried == [(1,)], "a holder took the pool's only connection"
    finally:
        done.set()
        for thread in holders:
            thread.join(10)
        try:
            connection.close_pool()  # while the option says there is one
        finally:
            del options["pool"]


def ask_the_server(wrapper: Any, postgresql: str, mysql: str) -> int:
    """The number a query answers on the Django connection ``wrapper``: ``postgresql``'s
    on PostgreSQL, else ``mysql``'s."""
    with wrapper.cursor() as cursor:
        cursor.execute(postgresql if wrapper.vendor == "postgresql" else mysql)
        return int(cursor.fetchone()[0])


def server_sessions() -> int:
    """How many sessions the database server has open on the test database."""
    return ask_the_server(
        connection,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()",
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE()",
    )


def test_a_thread_that_ends_closes_its_connection_at_once() -> None:
    """Ten threads take a lease each and end, with the garbage collector off: their
    connections close as each thread ends (a Django wrapper refers to itself, so waiting
    for the collector let a server with a thread per request run out of connections)."""

    def take_one(number: int) -> None:
        try:
            with Lock(f"ended-thread:{number}", ttl=5):
                pass
        finally:
            connections.close_all()  # Django's own connection of the thread

    with Lock("ended-thread:warm", ttl=5):
        pass  # the process's background writers are connected
    before = server_sessions()
    gc.disable()
    try:
        for number in range(10):
            thread = threading.Thread(target=take_one, args=(number,))
            thread.start()
            thread.join(30)
        deadline = time.monotonic() + 5  # the server ends a closed session a moment later
        while server_sessions() - before > 2:
            assert time.monotonic() < deadline, "the ended threads' connections are open"
            time.sleep(0.1)
    finally:
        gc.enable()


def test_a_forked_child_leaves_the_connections_of_its_parents_threads_open() -> None:
    """A forked child frees the slots of its parent's other threads as it starts: the
    connection of such a thread must stay open in the parent, and its session alive."""
    own = DedicatedConnections("default")
    ready, done = threading.Event(), threading.Event()
    sessions: list[object] = []

    def keep_a_connection() -> None:
        for moment in (ready, None):
            with own.cursor() as cursor:
                cursor.execute("SELECT 1")
                sessions.append(cursor.fetchone())
            if moment is not None:
                moment.set()
                done.wait(30)

    thread = threading.Thread(target=keep_a_connection)
    thread.start()
    try:
        assert ready.wait(10)
        child = fork_beside_threads()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
    finally:
        done.set()
        thread.join(10)
    assert sessions == [(1,), (1,)], "the child ended the session of its parent's thread"
