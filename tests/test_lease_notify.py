"""PostgreSQL lease waiters each hear on a channel of their own: a release notifies only
the waiters it concerns, not every process that waits for any name."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from djlocks import Lock, LockLost
from djlocks.backends import backends
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.lease.store import SLOTS, WAITERS
from djlocks.backends.sql.postgresql import notifications, waiter_channel, waiter_notice
from djlocks.grant import BELIEF_MARGIN, Grant
from djlocks.keys import table_key
from tests.test_lease_wakeups import NEVER, Waiters, polls_never  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="not applicable: only PostgreSQL notifies lease waiters (the postgresql run)",
    ),
    pytest.mark.usefixtures("store", "polls_never"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def eavesdropper() -> Iterator[DedicatedConnections]:
    """A connection of the test's own, to listen on the waiters' channels."""
    listener = DedicatedConnections("default")
    yield listener
    listener.discard()


def queued(name: str) -> list[tuple[int, int]]:
    """The name's waiters, first in line first: (ticket, listening session)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, connection_id FROM {WAITERS} WHERE name_key = %s ORDER BY id",
            (table_key(name),),
        )
        return [(int(ticket), int(session)) for ticket, session in cursor.fetchall()]


def heard(
    listener: DedicatedConnections, sessions: list[int], action: Callable[[], object]
) -> list[tuple[str, str]]:
    """Listen on the channels of ``sessions``, run ``action()``, and return what was
    notified on them within a second: (channel, payload)."""
    wrapper = listener.get()
    with wrapper.cursor() as cursor:
        for session in sessions:
            cursor.execute(f"LISTEN {waiter_channel(session)}")
    action()
    notes = wrapper.connection.notifies(timeout=1.0)
    return [(note.channel, note.payload) for note in notes]


@pytest.mark.parametrize("release", ["released", "released by force"])
def test_a_release_notifies_only_the_first_waiter(
    release: str, eavesdropper: DedicatedConnections
) -> None:
    """Two waiters queue behind a holder, on two listening sessions. The release (a
    hand-over) and a forced release (which frees the slot for the head of the queue)
    each notify the first waiter alone, with its ticket; it then holds the lock (its
    polls are 30 s apart: it heard the notice)."""
    name = f"l:notify:{release}"
    holder = Lock(name, ttl=30)
    held = holder.acquire_grant()
    assert held is not None
    waiters = Waiters(name, limit=1, count=2)
    try:
        (first, first_session), (second, second_session) = queued(name)
        assert first_session != second_session
        action: Callable[[], object] = holder.release
        if release != "released":
            action = lambda: backends["default"].force_release(name)  # noqa: E731
        notes = heard(eavesdropper, [first_session, second_session], action)
        assert [channel for channel, _ in notes] == [waiter_channel(first_session)]
        ticket, handed = waiter_notice(notes[0][1])
        assert ticket == first
        if release == "released":  # a hand-over's notice carries what it handed
            assert handed is not None
            assert (handed.slot, handed.fence) == (0, held.fence + 1)
            assert handed.expires_at > timezone.now() + timedelta(seconds=20)
        else:
            assert handed is None, "a forced release hands nothing over"
        assert waiters.got.acquire(timeout=10), "the first waiter never got the lock"
        assert [ticket for ticket, _ in queued(name)] == [second]
    finally:
        waiters.leave()
        if release != "released":
            with pytest.raises(LockLost):
                holder.release()


def test_a_listening_session_ended_while_idle_is_replaced_before_the_next_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thread's listening session outlives its wait; if the server ends it while it is
    idle (an idle time-out, a restart), the thread's next wait queues with a new one,
    found before the wait (no listening fails during it, nothing is logged), and hears
    the release (its polls are 30 s apart)."""
    caplog.set_level(logging.WARNING, logger="djlocks")
    name = "l:notify:idle"
    holder = Lock(name, ttl=30)
    holder.acquire()
    first_done, go_again = threading.Event(), threading.Event()
    granted_at: list[float] = []

    def wait_twice() -> None:
        lock = Lock(name, ttl=30, timeout=NEVER)
        with lock:  # the first wait opens this thread's listening session
            pass
        first_done.set()
        go_again.wait(NEVER)
        with lock:
            granted_at.append(time.monotonic())

    thread = threading.Thread(target=wait_twice)
    thread.start()
    try:
        _wait_until_queued(name, 1)
        holder.release()
        assert first_done.wait(10), "the first wait never ended"
        holder.acquire()
        assert _end_idle_listeners() >= 1
        time.sleep(0.2)  # the server lists a session as gone just before it hangs up
        go_again.set()
        _wait_until_queued(name, 1)
        release_and_see_it_heard(holder, thread, granted_at)
    finally:
        go_again.set()
        thread.join(NEVER)
    assert not [record.getMessage() for record in caplog.records]


def release_and_see_it_heard(
    holder: Lock, waiter: threading.Thread, granted_at: list[float]
) -> None:
    """Release ``holder``; the thread ``waiter`` must then get the lock (and append the
    moment to ``granted_at``) within 5 s: its polls are 30 s apart, so it heard it."""
    released = time.monotonic()
    holder.release()
    waiter.join(20)
    assert granted_at, "the waiter never heard the release"
    assert granted_at[0] - released < 5


def _wait_until_queued(name: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(queued(name)) < count:
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.01)


def _end_idle_listeners() -> int:
    """End the idle listening sessions of lease waiters on this database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
            "FROM pg_stat_activity WHERE query LIKE 'LISTEN djlocks_lease%%' "
            "AND state = 'idle' AND datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_a_listening_session_ended_during_a_wait_is_replaced_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server ends a waiter's listening session while it waits: the waiter opens a
    new one, names it in its queue row, and hears the release on it (its polls are
    30 s apart). It says so in one line, without a traceback (but at DEBUG)."""
    caplog.set_level(logging.WARNING, logger="djlocks.acquire")
    name = "l:notify:during"
    holder = Lock(name, ttl=30)
    holder.acquire()
    granted_at: list[float] = []

    def wait() -> None:
        with Lock(name, ttl=30, timeout=NEVER):
            granted_at.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        _wait_until_queued(name, 1)
        [(_, ended)] = queued(name)
        assert _end_idle_listeners() >= 1
        deadline = time.monotonic() + 10
        while queued(name)[0][1] == ended:
            assert time.monotonic() < deadline, "the queue row still names the ended session"
            time.sleep(0.01)
        release_and_see_it_heard(holder, thread, granted_at)
    finally:
        thread.join(NEVER)
    said = [r for r in caplog.records if "listening for releases failed: " in r.getMessage()]
    assert said and not any(record.exc_info for record in said), said


def test_notifications_returns_what_arrived_or_waits_for_the_first(
    eavesdropper: DedicatedConnections,
) -> None:
    """``notifications`` (the waiters' and the revocation listener's wait): what arrived
    already comes back at once; else the first to arrive ends the wait; else nothing
    once the time is up."""
    listening = eavesdropper.get()
    with listening.cursor() as cursor:
        cursor.execute("LISTEN djlocks_test_channel")
    with connection.cursor() as cursor:
        cursor.execute("NOTIFY djlocks_test_channel, 'before'")
    time.sleep(0.1)
    began = time.monotonic()
    assert [note.payload for note in notifications(listening.connection, 5)] == ["before"]
    assert time.monotonic() - began < 1

    def later() -> None:
        time.sleep(0.2)
        with connection.cursor() as cursor:
            cursor.execute("NOTIFY djlocks_test_channel, 'during'")
        connection.close()  # this thread's connection

    notifying = threading.Thread(target=later)
    notifying.start()
    began = time.monotonic()
    assert [note.payload for note in notifications(listening.connection, 5)] == ["during"]
    assert 0.15 < time.monotonic() - began < 3
    notifying.join()

    began = time.monotonic()
    assert notifications(listening.connection, 0.3) == []
    assert time.monotonic() - began >= 0.25


def heir_of(name: str, ttl: float) -> tuple[threading.Thread, list[Grant | None], float]:
    """A thread that waits for ``name`` (a lease of ``ttl`` seconds) and files its grant;
    and the moment its queue row was seen, which is after it queued."""
    granted: list[Grant | None] = []
    heir = threading.Thread(target=lambda: granted.append(Lock(name, ttl=ttl).acquire_grant()))
    heir.start()
    deadline = time.monotonic() + 10
    while not queued(name):
        assert time.monotonic() < deadline, "the heir never queued"
        time.sleep(0.01)
    return heir, granted, time.monotonic()


def test_the_heir_holds_what_the_notice_handed_and_believes_it_from_its_queueing() -> None:
    """The heir of a hand-over takes its grant from the notice, without asking the
    store: its belief counts from when it queued (before the hand-over began, which
    the lease counts from), not from the hand-over as a read-back would."""
    name = "l:notify:heir"
    holder = Lock(name, ttl=30)
    held = holder.acquire_grant()
    assert held is not None
    heir, granted, queued_by = heir_of(name, ttl=6)
    try:
        time.sleep(0.3)  # a read-back would count the lease from the hand-over, later
        holder.release()
        heir.join(10)
        (grant,) = granted
        assert grant is not None, "polls are 30 s apart: the heir heard the notice"
        assert grant.fence == held.fence + 1
        assert grant.believe_until() <= queued_by + 6 * (1 - BELIEF_MARGIN), "read back"
        assert backends["default"].holders(name)[0].fence == grant.fence
        grant.release()
    finally:
        heir.join(10)


def held_up_by(cursor: Any) -> float:
    """The moment (``time.monotonic()``) another session was seen waiting for a row lock
    that ``cursor``'s transaction holds: after that session's statement began."""
    deadline = time.monotonic() + 10
    while True:
        cursor.execute(  # pg_locks, not pg_stat_activity: a transaction keeps a snapshot of it
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid <> pg_backend_pid()"
        )
        if cursor.fetchone()[0]:
            return time.monotonic()
        assert time.monotonic() < deadline, "the hand-over never waited for the slot row"
        time.sleep(0.005)


def test_a_hand_over_held_up_at_the_slot_row_is_not_believed_past_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hand-over waits for the slot row (another transaction locks it); meanwhile
    the heir keeps looking at the queue and finds nothing. The lease counts from when
    the hand-over's statement began, so the heir's belief must count from before
    that, not from its last look. (The holder got its grant by waiting: its release
    is the hand-over itself, with no plain release tried first.)"""
    monkeypatch.setattr("djlocks.backends.lease.queue.NOTIFIED_POLL", 0.025)  # looks
    name = "l:notify:held-up"
    first = Lock(name, ttl=30).acquire_grant()
    assert first is not None
    middle, handed, _ = heir_of(name, ttl=30)
    first.release()
    middle.join(10)
    (held,) = handed
    assert held is not None
    # Long enough that the heir takes the notice's grant (queued less than TTL/3 ago)
    # even on a slow run, not its read-back, which counts from the hand-over's start.
    ttl = 9
    heir, granted, _ = heir_of(name, ttl=ttl)
    releasing = threading.Thread(target=held.release)  # a grant releases from any thread
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT slot FROM {SLOTS} WHERE name_key = %s FOR UPDATE", (table_key(name),)
            )
            began = time.monotonic()
            releasing.start()
            began_by = held_up_by(cursor)  # the hand-over's statement began before this
            time.sleep(max(0.0, began + 0.6 - time.monotonic()))  # the heir looks, every 25 ms
        releasing.join(10)
        heir.join(10)
        (grant,) = granted
        assert grant is not None
        # From its queueing (before ``began``), or read back: from the hand-over's start.
        assert began_by < began + 0.3, (
            f"too slow to tell a belief from the last look: {began_by - began}"
        )
        assert grant.believe_until() <= began_by + ttl * (1 - BELIEF_MARGIN)
        grant.release()
    finally:
        releasing.join(10)
        heir.join(10)
