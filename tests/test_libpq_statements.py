"""Statements sent straight through libpq (``djlocks.backends.libpq``): the PostgreSQL
session lock's grant and release, on a real server."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psycopg
import pytest
from django.db import DatabaseError, connection

from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.libpq import DirectStatements
from djlocks.backends.sql.postgresql import sqlstate
from tests.faults import interrupted_after

pytestmark = [
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(60),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="libpq is PostgreSQL's"),
]
KEY = 4242


@pytest.fixture(params=[True, False], ids=["prepared", "unprepared"])
def direct(request: pytest.FixtureRequest) -> Iterator[DirectStatements]:
    own = DedicatedConnections("default")
    yield DirectStatements(own.get().connection, prepare=request.param)
    own.discard()


def test_the_last_value_comes_as_text_or_none_and_no_row_is_an_error(
    direct: DirectStatements,
) -> None:
    assert direct.value("SELECT pg_advisory_lock(%s)::text, %s", (KEY, "ü")) == "ü"
    assert direct.value("SELECT pg_advisory_unlock(%s)", (KEY,)) == "t"
    assert direct.value("SELECT pg_advisory_unlock(%s)", (KEY,)) == "f"
    assert direct.value("SELECT 1, NULL::text WHERE %s", (True,)) is None
    with pytest.raises(DatabaseError, match="no row"), connection.wrap_database_errors:
        direct.value("SELECT 1 WHERE %s", (False,))


def test_an_outcome_is_the_first_row_as_text_and_the_rows_returned_or_changed(
    direct: DirectStatements,
) -> None:
    """``outcome`` (the lease store's statements): a command's count and no row, a row
    set's first row and its size; a statement that returns no row is no error."""
    assert direct.outcome("CREATE TEMPORARY TABLE direct_counts (n int)", ()) == (None, 0)
    assert direct.outcome("INSERT INTO direct_counts VALUES (%s), (%s), (%s)", (1, 2, 3)) == (
        None,
        3,
    )
    bump = "UPDATE direct_counts SET n = n + 10 WHERE n > %s"
    assert direct.outcome(bump + " RETURNING n, NULL::text", (2,)) == (["13", None], 1)
    assert direct.outcome(bump, (1,)) == (None, 2)
    assert direct.outcome("SELECT n FROM direct_counts ORDER BY n", ()) == (["1"], 3)
    assert direct.outcome("SELECT n FROM direct_counts WHERE n > %s", (99,)) == (None, 0)


def test_an_error_has_its_sqlstate_and_leaves_the_session_usable(
    direct: DirectStatements,
) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [KEY])
        try:
            waiting = "SELECT set_config('lock_timeout', %s, false), pg_advisory_lock(%s)"
            with pytest.raises(DatabaseError) as raised, connection.wrap_database_errors:
                direct.value(waiting, ("50ms", KEY))
            assert sqlstate(raised.value) == "55P03"  # lock_not_available
            assert direct.value("SELECT %s::int + 1", (1,)) == "2"
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [KEY])


@pytest.mark.parametrize("code", ["DJ001", "23P99", "55P03"])
def test_an_error_is_raised_as_a_cursor_raises_it(direct: DirectStatements, code: str) -> None:
    """The same class (for a SQLSTATE psycopg has no class for, its class's: 23P99 is an
    ``IntegrityError``), message and diagnostics (here a ``RAISE``'s detail and hint)."""
    raising = (
        f"DO $$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = '{code}', "
        "DETAIL = 'the detail', HINT = 'the hint'; END $$"
    )
    with pytest.raises(DatabaseError) as raised, connection.wrap_database_errors:
        direct.outcome(raising, ())
    with pytest.raises(DatabaseError) as by_cursor, connection.cursor() as cursor:
        cursor.execute(raising)
    ours, psycopgs = raised.value.__cause__, by_cursor.value.__cause__
    assert isinstance(ours, psycopg.Error) and isinstance(psycopgs, psycopg.Error)
    assert (type(ours), str(ours)) == (type(psycopgs), str(psycopgs))
    assert ours.sqlstate == code
    diag = ours.diag
    assert (diag.message_primary, diag.message_detail, diag.message_hint) == (
        "refused",
        "the detail",
        "the hint",
    )
    assert direct.value("SELECT %s::int + 1", (1,)) == "2"


def test_a_prepared_statement_deallocated_by_someone_is_prepared_again() -> None:
    """``DEALLOCATE ALL`` (which psycopg sends after a ``ROLLBACK`` on a connection where
    it prepared) costs one failed attempt, not the preparing for good."""
    own = DedicatedConnections("default")
    driver = own.get().connection
    direct = DirectStatements(driver, prepare=True)
    doubling = "SELECT %s::int * 2"
    prepared = "SELECT count(*)::text FROM pg_prepared_statements WHERE statement = %s"
    assert direct.value(doubling, (21,)) == "42"
    driver.execute("DEALLOCATE ALL")
    assert direct.value(doubling, (4,)) == "8"
    assert direct.value(doubling, (5,)) == "10"
    assert direct.value(prepared, ("SELECT $1::int * 2",)) == "1"
    own.discard()


def test_a_session_the_server_ended_or_a_closed_connection_raise(
    direct: DirectStatements,
) -> None:
    pid = direct.value("SELECT pg_backend_pid()", ())
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    with pytest.raises(DatabaseError), connection.wrap_database_errors:
        direct.value("SELECT 1", ())
    with pytest.raises(DatabaseError, match="closed"), connection.wrap_database_errors:
        direct.value("SELECT 1", ())


def test_a_lock_wait_can_be_interrupted_by_a_signal(direct: DirectStatements) -> None:
    """The wait is on the socket in Python, so a signal's handler runs during it and
    may end it (Ctrl-C's KeyboardInterrupt); libpq's own blocking call would not return
    before the server replied. The statement is cancelled before the interruption goes
    on: the connection is free at once, and the wait never gets the lock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [KEY])
        try:
            with interrupted_after(0.3):
                direct.value("SELECT pg_advisory_lock(%s)", (KEY,))
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [KEY])
    time.sleep(0.1)  # a wait still running would have the lock by now
    assert direct.value("SELECT pg_advisory_unlock(%s)", (KEY,)) == "f"


def test_a_session_whose_socket_is_numbered_past_1024_works() -> None:
    """A process with many files open (a threaded server, a Celery worker) gets sockets
    numbered past 1024, where ``select()`` refuses to wait; the wait uses ``poll()``."""
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        own = DedicatedConnections("default")
        driver = own.get().connection
        assert driver.fileno() > 1024
        direct = DirectStatements(driver, prepare=True)
        assert direct.value("SELECT pg_sleep(0.05)::text || %s", ("waited",)) == "waited"
        own.discard()
    finally:
        for file in files:
            os.close(file)
