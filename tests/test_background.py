"""The history's background writer against the real database: a release does not wait
for its events, the events follow, the synchronous setting waits for each, the process
writes what it handed over before it exits, and a bad setting is refused."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import connection, connections
from django.db.backends.base.base import NO_DB_ALIAS
from django.utils import timezone

from djlocks import background, db_lock
from djlocks.backends.dedicated import _close_before_a_database_is_dropped
from djlocks.background import BackgroundWriter
from djlocks.conf import SYNCHRONOUS
from djlocks.events import _event, events
from djlocks.models import LockEvent
from tests.workers import ENDS_LIKE_A_PROGRAM, start_worker, take_and_release

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]
SQLITE = connection.vendor == "sqlite"


def release_in_a_thread(name: str) -> threading.Thread:
    """Take and release ``name`` on the lease backend in a new thread, which then ends."""

    def take_and_release() -> None:
        try:
            with db_lock(name, timeout=10):
                pass
        finally:
            connections.close_all()

    worker = threading.Thread(target=take_and_release)
    worker.start()
    return worker


@pytest.fixture
def history_table_locked() -> Iterator[threading.Event]:
    """Another session holds ``djlocks_event`` locked (no write gets in) until the test
    sets the event it is given, or 60 s pass."""
    locked, unlock = threading.Event(), threading.Event()

    def hold() -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                if other.vendor == "postgresql":
                    cursor.execute("BEGIN")
                    cursor.execute("LOCK TABLE djlocks_event IN EXCLUSIVE MODE")
                else:
                    cursor.execute("LOCK TABLES djlocks_event WRITE")
                locked.set()
                unlock.wait(60)
                cursor.execute("COMMIT" if other.vendor == "postgresql" else "UNLOCK TABLES")
        finally:
            other.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    try:
        yield unlock
    finally:
        unlock.set()
        holder.join(30)


@pytest.mark.skipif(SQLITE, reason="not applicable: SQLite locks the whole database, not a table")
def test_a_release_does_not_wait_for_its_history(history_table_locked: threading.Event) -> None:
    """While no event can be written, a release still returns; its events follow once
    the table is free again."""
    worker = release_in_a_thread("hw:quick")
    worker.join(30)
    assert not worker.is_alive(), "the release waited for its history"
    assert not events.flush(0.5), "the events were written while the table was locked"
    history_table_locked.set()
    assert events.flush(30)
    kinds = sorted(LockEvent.objects.filter(name="hw:quick").values_list("kind", flat=True))
    assert kinds == ["acquired", "released"]


@pytest.mark.skipif(SQLITE, reason="not applicable: SQLite locks the whole database, not a table")
def test_synchronous_history_is_written_before_the_release_returns(
    settings: Any, history_table_locked: threading.Event
) -> None:
    settings.DJLOCKS = {**settings.DJLOCKS, "EVENTS_WRITER": SYNCHRONOUS}
    worker = release_in_a_thread("hw:sync")
    worker.join(1.0)
    assert worker.is_alive(), "the release returned before its history was written"
    history_table_locked.set()
    worker.join(30)
    kinds = sorted(LockEvent.objects.filter(name="hw:sync").values_list("kind", flat=True))
    assert kinds == ["acquired", "released"], "written before the release returned"


def test_a_process_writes_its_history_before_it_exits() -> None:
    worker = start_worker(take_and_release, "hw:exit", 200, context=ENDS_LIKE_A_PROGRAM)
    worker.join(60)
    assert worker.exitcode == 0
    released = LockEvent.objects.filter(name="hw:exit", kind="released").count()
    assert released == 200, "events handed to the writer were lost at exit"


def test_a_full_queue_makes_the_caller_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``QUEUE_RECORDS`` waiting records, ``submit`` writes on the caller's thread:
    nothing is dropped, the caller is slowed to the store's pace instead."""
    monkeypatch.setattr("djlocks.background.QUEUE_RECORDS", 2)
    blocked, written = threading.Event(), []

    def write(batch: list[Any]) -> None:
        if threading.current_thread().name == "djlocks-history":
            blocked.wait(30)
        written.append((threading.current_thread().name, list(batch)))

    writer: BackgroundWriter[str] = BackgroundWriter(write, "djlocks-history")
    writer.submit(["a", "b"])
    writer.submit(["c"])
    assert written == [("MainThread", ["c"])], "the caller wrote what did not fit"
    blocked.set()
    assert writer.flush(10)
    assert written[1] == ("djlocks-history", ["a", "b"])


def test_an_unknown_writer_is_refused_by_the_checks(settings: Any) -> None:
    settings.DJLOCKS = {**settings.DJLOCKS, "EVENTS_WRITER": "later"}
    (error,) = [m for m in run_checks() if m.id == "djlocks.E010"]
    assert "'background' or 'synchronous'" in error.msg


def test_the_writers_write_before_a_database_is_dropped() -> None:
    """Django connects without a database only to create, clone or drop one (the test
    database, at the end of a test run): the background writers write what they hold
    first, not after the database is gone (which failed, and was logged at exit)."""
    written: list[int] = []

    def write_slowly(records: list[int]) -> None:
        time.sleep(0.2)
        written.extend(records)

    writer = background.start(write_slowly, "djlocks-test-writer")
    writer.submit([1, 2])
    about_to_drop = SimpleNamespace(alias=NO_DB_ALIAS, settings_dict={"ENGINE": "nowhere"})
    _close_before_a_database_is_dropped(sender=None, connection=about_to_drop)
    assert written == [1, 2]


@contextmanager
def history_table_away() -> Iterator[Callable[[], None]]:
    """``djlocks_event`` renamed away (every event write fails as if it were missing)
    until the test calls what it is given, or the block ends."""
    events.flush(10)  # earlier tests' events: not this test's
    table = LockEvent._meta.db_table
    moves = [(table, f"{table}_away"), (f"{table}_away", table)]

    def move_back() -> None:
        if moves:
            with connection.schema_editor() as editor:
                editor.alter_db_table(LockEvent, *moves.pop())

    with connection.schema_editor() as editor:
        editor.alter_db_table(LockEvent, *moves.pop(0))
    try:
        yield move_back
    finally:
        move_back()


def test_a_failed_background_write_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The table is back before the retry: the events are written, nothing is logged."""
    monkeypatch.setattr("djlocks.events.RETRY_PAUSES", (1.0,))
    monkeypatch.setattr("djlocks.background.LINGER", 0.05)
    with history_table_away() as move_back:
        release_in_a_thread("hw:retried").join(30)
        time.sleep(0.5)  # the first write (after background.LINGER) failed
        move_back()
        assert events.flush(10)
    kinds = sorted(LockEvent.objects.filter(name="hw:retried").values_list("kind", flat=True))
    assert kinds == ["acquired", "released"], "the batch was dropped at its first failure"
    assert not warnings_of(caplog)


def test_events_that_cannot_be_written_are_dropped_with_the_fix_in_the_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("djlocks.events.RETRY_PAUSES", (0.05,))
    with history_table_away():
        release_in_a_thread("hw:dropped").join(30)
        assert events.flush(10)
    (warning,) = warnings_of(caplog)
    assert warning.startswith("2 event(s) of hw:dropped not recorded")
    assert "run `manage.py migrate djlocks`" in warning
    assert not LockEvent.objects.filter(name="hw:dropped").exists()


def test_an_event_the_table_refuses_is_dropped_with_no_advice_to_migrate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events.record([_event(at=timezone.now(), kind=None, backend="default", name="hw:refused")])
    (warning,) = warnings_of(caplog)
    assert warning.startswith("1 event(s) of hw:refused not recorded")
    assert "migrate" not in warning, "the table is there: migrating would not help"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings (and worse) the history logged."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "djlocks.events" and r.levelno >= logging.WARNING
    ]
