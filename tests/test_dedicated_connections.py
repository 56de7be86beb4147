"""Closing djlocks' own connections while other threads still use them
(``backends.reset()``, a test database about to be dropped)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import DatabaseError, connection

from djlocks import Lock, LockLost
from djlocks.backends import aside, backends
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.sql.mysql import released_at_once
from djlocks.backends.sql.postgresql import value_at_once

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


@pytest.mark.skipif(connection.vendor != "postgresql", reason="libpq, through psycopg")
def test_a_statement_sent_straight_through_libpq_gives_its_value_or_none_if_it_failed() -> None:
    """``value_at_once`` (the session lock's unlock): the value as text; ``None`` once the
    server ended the session, so that the caller runs it through a cursor, whose error
    says what happened."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    assert value_at_once(driver, b"SELECT pg_advisory_lock($1)::text", (4242,)) == b""
    assert value_at_once(driver, b"SELECT pg_advisory_unlock($1)", (4242,)) == b"t"
    assert value_at_once(driver, b"SELECT pg_advisory_unlock($1)", (4242,)) == b"f"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [driver.info.backend_pid])
    assert value_at_once(driver, b"SELECT pg_advisory_unlock($1)", (4242,)) is None
    assert value_at_once(None, b"SELECT 1", ()) is None  # closed by Django
    own.discard()


def test_a_session_lock_whose_connection_a_reset_closed_is_lost_at_release() -> None:
    """``backends.reset()`` closes every djlocks connection, a holder's too: the server
    then frees the lock, and the release says it was lost."""
    grant = Lock("dedicated:reset", backend="session").acquire_grant(timeout=0)
    assert grant is not None
    backends.reset()
    with pytest.raises(LockLost):
        grant.release()


@pytest.mark.skipif(connection.vendor != "mysql", reason="mysqlclient's C API wrapper")
def test_a_release_lock_without_a_cursor_says_whether_it_held_or_none_if_it_failed() -> None:
    """``released_at_once`` (the session lock's release on MySQL/MariaDB): whether the
    session held the lock; ``None`` once the server ended the session, so that the
    caller runs it through a cursor, whose error says what happened."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    name = "dedicated:it's"  # quoted as a literal
    with own.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
    assert released_at_once(driver, name) is True
    assert released_at_once(driver, name) is False
    with connection.cursor() as cursor:
        cursor.execute("KILL %s", [driver.thread_id()])
    time.sleep(0.2)  # the server ends the session
    assert released_at_once(driver, name) is None
    assert released_at_once(None, name) is None  # closed by Django
    own.discard()
