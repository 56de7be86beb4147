"""The session a lease waiter is woken on (PostgreSQL: it listens; MySQL: it waits in
the server) is closed by the server once it has been idle for ``WAKING_SESSION_IDLE``
seconds, so a thread that no longer waits does not keep it; a wait longer than that
keeps it, and the thread's next wait after it closed opens a new one, with no
warning and no lost wake-up (the waiters' polls are 30 s apart here)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import connection

from djlocks import Lock
from djlocks.backends.lease.store import WAITERS
from djlocks.keys import table_key
from tests.test_lease_wakeups import NEVER, polls_never  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.skipif(
        connection.vendor == "sqlite",
        reason="not applicable: SQLite waiters have no waking session (the database runs)",
    ),
    pytest.mark.usefixtures("store", "polls_never"),
    pytest.mark.timeout(120),
]

#: Seconds of idleness after which the server closes a waking session, in these tests
#: (a whole number: MySQL's ``wait_timeout`` counts whole seconds).
IDLE = 2


@pytest.fixture(autouse=True)
def short_idle_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("djlocks.backends.lease.store.WAKING_SESSION_IDLE", IDLE)


def waking_session(name: str) -> int:
    """The session the name's one waiter is woken on, as its queue row names it."""
    deadline = time.monotonic() + 10
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT connection_id FROM {WAITERS} WHERE name_key = %s",
                (table_key(name),),
            )
            row = cursor.fetchone()
        if row is not None:
            return int(row[0])
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.01)


def is_open(session: int) -> bool:
    """Whether the server session ``session`` is still connected."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (session,))
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (session,)
            )
        return bool(cursor.fetchone()[0])


def test_a_waking_session_lives_through_a_long_wait_and_closes_once_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wait of three idle limits keeps its waking session and hears the release on it;
    once the thread stops waiting the server closes the session; the thread's next wait
    opens a new one and hears the release there too."""
    name = "l:waking:idle"
    holder = Lock(name, ttl=30)
    holder.acquire()
    granted: list[float] = []
    first_done, go_again = threading.Event(), threading.Event()

    def wait_twice() -> None:
        lock = Lock(name, ttl=30, timeout=NEVER)
        with lock:
            granted.append(time.monotonic())
        first_done.set()
        go_again.wait(NEVER)
        with lock:
            granted.append(time.monotonic())

    caplog.set_level(logging.WARNING, logger="djlocks")
    thread = threading.Thread(target=wait_twice)
    thread.start()
    try:
        first = waking_session(name)
        time.sleep(3 * IDLE)
        assert waking_session(name) == first, "the long wait's session was replaced"
        assert is_open(first), "the server closed the session of a wait under way"
        released = time.monotonic()
        holder.release()
        assert first_done.wait(10), "the waiter never heard the release"
        assert granted[0] - released < 5

        holder.acquire()
        deadline = time.monotonic() + 10 * IDLE
        while is_open(first):
            assert time.monotonic() < deadline, "the idle waking session stayed open"
            time.sleep(0.1)
        time.sleep(0.2)  # the server lists a session as gone just before it hangs up
        go_again.set()
        second = waking_session(name)
        assert second != first and is_open(second)
        released = time.monotonic()
        holder.release()
        thread.join(NEVER)
        assert len(granted) == 2, "the second wait never heard the release"
        assert granted[1] - released < 5
    finally:
        go_again.set()
        thread.join(NEVER)
    assert not [record.getMessage() for record in caplog.records]


def test_short_waits_keep_their_waking_session(caplog: pytest.LogCaptureFixture) -> None:
    """A thread that waits often, each wait shorter than the idle limit, keeps one waking
    session for longer than that limit: the idle time counts from its last statement,
    and the thread keeps it from running out (on PostgreSQL a wait runs none)."""
    name = "l:waking:short"
    rounds = 3 * IDLE * 2  # half a second each: three idle limits in all
    holder = Lock(name, ttl=30)
    held = [threading.Event() for _ in range(rounds)]
    done = threading.Semaphore(0)
    sessions: list[int] = []

    def wait_each_round() -> None:
        lock = Lock(name, ttl=30, timeout=NEVER)
        for round_held in held:
            round_held.wait(NEVER)
            with lock:
                pass
            done.release()

    caplog.set_level(logging.WARNING, logger="djlocks")
    thread = threading.Thread(target=wait_each_round)
    thread.start()
    try:
        for round_held in held:
            holder.acquire()
            round_held.set()
            sessions.append(waking_session(name))
            time.sleep(0.2)
            holder.release()
            assert done.acquire(timeout=10), "the waiter never heard the release"
            time.sleep(0.3)
    finally:
        for round_held in held:
            round_held.set()
        thread.join(NEVER)
    assert not [record.getMessage() for record in caplog.records]
    assert len(set(sessions)) == 1, "the waking session was closed between short waits"
