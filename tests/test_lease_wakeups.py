"""SQLite lease waiters are woken by a datagram on their host, not found by their polls.

The polls are made 30 s long here, so a waiter that gets in sooner was woken."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from djlocks import Lock, LockLost, Semaphore
from djlocks.backends import backends
from djlocks.backends.lease.store import SLOTS
from djlocks.backends.lease.wakeups import HostWakeups
from djlocks.keys import table_key

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="not applicable: PostgreSQL and MariaDB wake waiters in the server (the sqlite run)",
    ),
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(120),
]

#: Seconds: far longer than any wake-up takes.
NEVER = 30


@pytest.fixture
def polls_never(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr("djlocks.backends.lease.queue.NOTIFIED_POLL", NEVER)
    with override_settings(DJLOCKS={**settings.DJLOCKS, "POLL_INTERVAL": NEVER}):
        yield


def waiting(name: str, limit: int, got: threading.Semaphore, leave: threading.Event) -> None:
    """Wait for ``name`` (a lock, or a semaphore of ``limit``), count the grant in
    ``got``, hold it until ``leave``."""
    side = Lock(name, timeout=NEVER) if limit == 1 else Semaphore(name, limit=limit, timeout=NEVER)
    with side:
        got.release()
        leave.wait(NEVER)


class Waiters:
    """``count`` threads waiting for ``name`` (a lock, or a semaphore of ``limit``), each
    counting its grant in ``got`` and holding it until ``leave()``."""

    def __init__(self, name: str, limit: int, count: int) -> None:
        self.got, self._leave = threading.Semaphore(0), threading.Event()
        self._threads = [
            threading.Thread(target=waiting, args=(name, limit, self.got, self._leave))
            for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(backends["default"].waiters(name)) < count:
            assert time.monotonic() < deadline, "the waiters never queued"
            time.sleep(0.01)

    def leave(self) -> None:
        self._leave.set()
        for thread in self._threads:
            thread.join(NEVER)


def test_datagrams_reach_only_the_waiter_they_name() -> None:
    wakeups = HostWakeups("/a/database.sqlite3")
    first, second = wakeups.open(1), wakeups.open(2)
    assert first is not None and second is not None
    try:
        wakeups.wake([1, 3])  # 3 has no socket: skipped
        assert HostWakeups.wait(first, 1.0)
        assert not HostWakeups.wait(second, 0.05)
        assert not HostWakeups.wait(first, 0.05), "a wake-up is consumed"
        other = HostWakeups("/another.sqlite3").open(1)
        assert other is not None, "one namespace per file"
        other.close()
    finally:
        first.close()
        second.close()


@pytest.mark.usefixtures("polls_never")
def test_a_release_wakes_the_head_of_the_queue() -> None:
    holder = Lock("wake:lock")
    holder.acquire()
    waiters = Waiters("wake:lock", 1, 1)
    holder.release()
    assert waiters.got.acquire(timeout=10), "the waiter slept on: nobody woke it"
    waiters.leave()


@pytest.mark.usefixtures("polls_never")
def test_each_release_of_a_semaphore_slot_wakes_a_waiter_in() -> None:
    holders = [Semaphore("wake:sem", limit=2) for _ in range(2)]
    for holder in holders:
        holder.acquire()
    waiters = Waiters("wake:sem", 2, 3)
    for holder in holders:
        holder.release()
        assert waiters.got.acquire(timeout=10), "a freed slot's waiter slept on"
    assert not waiters.got.acquire(timeout=0.2), "two slots, two waiters in"
    waiters.leave()
    assert waiters.got.acquire(timeout=10), "the third gets in when they leave"


@pytest.mark.usefixtures("polls_never")
def test_a_forced_release_wakes_the_waiters() -> None:
    holder = Lock("wake:forced")
    holder.acquire()
    waiters = Waiters("wake:forced", 1, 1)
    assert backends["default"].force_release("wake:forced") == 1
    assert waiters.got.acquire(timeout=10), "the waiter slept on after the forced release"
    waiters.leave()
    with pytest.raises(LockLost):
        holder.release()


@pytest.mark.usefixtures("polls_never")
def test_a_slot_left_free_by_a_waiter_reaches_the_next_one() -> None:
    """A waiter that leaves the queue without a slot may leave one free (it was woken,
    then timed out); it wakes the name's next waiters (``_wake_next``)."""
    holder = Lock("wake:left")
    holder.acquire()
    waiters = Waiters("wake:left", 1, 1)
    store = backends["default"]
    store._run(  # type: ignore[attr-defined]
        lambda db: store._execute(  # type: ignore[attr-defined]
            db, f"UPDATE {SLOTS} SET token = NULL, expires_at = NULL WHERE name_key = %s",
            (table_key("wake:left"),),
        )
    )  # fmt: skip
    store._wake_next(table_key("wake:left"), 1)  # type: ignore[attr-defined]
    assert waiters.got.acquire(timeout=10), "the next waiter slept on"
    waiters.leave()
    with pytest.raises(LockLost):
        holder.release()
