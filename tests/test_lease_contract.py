"""The lease backend's contract, on the database picked by DJLOCKS_DB."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection, connections

from djlocks import AlreadyHeld, Lock, LockLost, NotAcquired, NotHeld, db_lock, db_semaphore
from djlocks.backends import backends
from djlocks.backends.lease.backend import NEWCOMER
from djlocks.backends.lease.wakeups import HostWakeups
from djlocks.exceptions import BackendUnavailable
from djlocks.signals import lock_lost

pytestmark = pytest.mark.usefixtures("store")


@pytest.mark.catalogue("two-handles", backend="default")
def test_lock_is_exclusive_and_fences_strictly_increase() -> None:
    fences = []
    for _ in range(5):
        with db_lock("contract:fence", timeout=1) as grant:
            fences.append(grant.fence)
            assert grant.expires_at is not None
            grant.check()
            assert Lock("contract:fence").acquire(timeout=0) is False
    assert fences == sorted(set(fences)) and len(fences) == 5


def test_threading_lock_semantics() -> None:
    lock = Lock("contract:handle", ttl=5)
    assert lock.acquire(timeout=0) is True
    assert lock.locked()
    # Not re-entrant: a second acquire through the same handle waits like anyone else.
    assert lock.acquire(blocking=False) is False
    lock.release()
    with pytest.raises(NotHeld):
        lock.release()
    assert not lock.locked()


def test_context_manager_raises_not_acquired_on_timeout() -> None:
    with db_lock("contract:busy", timeout=0):
        started = time.monotonic()
        with pytest.raises(NotAcquired), db_lock("contract:busy", timeout=0.3):
            pass
        assert time.monotonic() - started >= 0.3


def test_semaphore_grants_exactly_limit_slots_each_its_own() -> None:
    semaphore = db_semaphore("contract:sem", limit=3, ttl=5)
    grants = [semaphore.__enter__() for _ in range(3)]
    assert sorted(g.slot for g in grants) == [0, 1, 2]
    assert len({g.fence for g in grants}) == 3
    assert semaphore.acquire(timeout=0) is False
    holders = backends["default"].holders("contract:sem")
    assert [(h.slot, h.limit) for h in holders] == [(0, 3), (1, 3), (2, 3)]
    for _ in grants:
        semaphore.release()
    assert backends["default"].holders("contract:sem") == []


def test_limit_mismatch_is_detected_while_held() -> None:
    with (
        db_semaphore("contract:mismatch", limit=2, timeout=0),
        pytest.raises(AlreadyHeld, match="limit=2"),
    ):
        db_semaphore("contract:mismatch", limit=3, timeout=0).acquire()


def test_limit_may_change_once_nobody_holds_the_name() -> None:
    with db_semaphore("contract:resize", limit=2, timeout=0) as first:
        pass
    with db_semaphore("contract:resize", limit=4, timeout=0) as second:
        assert second.fence > first.fence
    with db_lock("contract:resize", timeout=0) as third:
        assert third.fence > second.fence


def test_cooldown_keeps_the_name_unavailable_for_its_duration() -> None:
    with db_lock("contract:cooldown", cooldown=1.0, timeout=0):
        pass
    released = time.monotonic()
    assert Lock("contract:cooldown").acquire(timeout=0) is False
    with db_lock("contract:cooldown", timeout=3):
        assert time.monotonic() - released >= 0.9


def test_heartbeat_renews_past_the_ttl() -> None:
    # Renewals every 0.5 s: one may come up to about a second late and still be in time.
    with db_lock("contract:renew", ttl=1.5, timeout=0) as grant:
        first_expiry = grant.expires_at
        time.sleep(2.5)  # well past the TTL
        grant.check()
        assert grant.believed
        assert grant.expires_at is not None and first_expiry is not None
        assert grant.expires_at > first_expiry
        assert Lock("contract:renew").acquire(timeout=0) is False


def test_unrenewed_lease_expires_and_the_holder_is_told() -> None:
    seen: list[str] = []

    def on_signal(sender: object, *, reason: str, **kwargs: object) -> None:
        seen.append(reason)

    lock_lost.connect(on_signal)
    try:
        lock = Lock("contract:expire", ttl=0.5, renew=False)
        grant = lock.__enter__()
        time.sleep(0.7)
        assert not grant.believed
        with pytest.raises(LockLost):
            grant.check()
        # Someone else may take it now; the late release must not free their grant.
        with db_lock("contract:expire", timeout=0) as newer:
            assert newer.fence > grant.fence
            with pytest.raises(LockLost):
                lock.release()
            newer.check()
        assert seen, "lock_lost was not sent"
    finally:
        lock_lost.disconnect(on_signal)


@pytest.mark.catalogue("renewal", backend="default")
def test_renewal_never_reclaims_an_expired_grant() -> None:
    lock = Lock("contract:reclaim", ttl=0.4, renew=False)
    grant = lock.__enter__()
    time.sleep(0.6)
    with pytest.raises(LockLost):
        backends["default"].renew(grant.name, grant.token, 30)
    assert backends["default"].holders("contract:reclaim") == []
    with pytest.raises(LockLost):
        lock.release()


def test_forced_release_is_seen_by_the_holder() -> None:
    lost: list[str] = []
    lock = Lock("contract:forced", ttl=5, on_lost=lambda grant, reason: lost.append(reason))
    grant = lock.__enter__()
    assert backends["default"].force_release("contract:forced") == 1
    with pytest.raises(LockLost):
        grant.check()
    assert lost
    with pytest.raises(LockLost):
        lock.release()


def test_decorator_names_the_lock_after_the_function() -> None:
    calls = []

    @db_lock(timeout=0)
    def sync_users() -> str:
        holders = backends["default"].holders()
        calls.append([h.name for h in holders])
        return "done"

    assert sync_users() == "done"
    assert calls == [
        [f"{__name__}.test_decorator_names_the_lock_after_the_function.<locals>.sync_users"]
    ]


def test_waiters_are_listed_with_their_identity() -> None:
    holder = Lock("contract:queue", ttl=5)
    holder.acquire()
    done = threading.Event()

    def wait() -> None:
        with Lock("contract:queue", ttl=5, label="the waiter", timeout=5):
            pass
        done.set()

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 5
    while not backends["default"].waiters("contract:queue") and time.monotonic() < deadline:
        time.sleep(0.01)
    [waiter] = backends["default"].waiters("contract:queue")
    assert (waiter.position, waiter.label) == (0, "the waiter")
    holder.release()
    assert done.wait(5)
    thread.join()


@pytest.mark.catalogue("cancelled-acquires", backend="default")
def test_async_with_and_cancelled_acquires_leave_nothing() -> None:
    async def scenario() -> None:
        async with db_lock("contract:async", ttl=5, timeout=1) as grant:
            assert grant.fence >= 1
            for _ in range(20):
                waiter = asyncio.ensure_future(db_lock("contract:async", ttl=5).__aenter__())
                await asyncio.sleep(0.005)
                waiter.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter
        async with db_lock("contract:async", timeout=0):
            pass

    asyncio.run(scenario())


@pytest.mark.catalogue("lost-wake-up", backend="default")
def test_a_cut_notification_path_costs_at_most_a_poll(
    bounds: Callable[[str, float], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session the waiter is woken on is ended in the server (PostgreSQL: its
    LISTEN session; MySQL: the session it waits on, which its queue row names; on
    SQLite the release's datagram is lost); the holder's release then never reaches
    it, and the waiter still gets the lock within its fallback poll."""
    if connection.vendor == "sqlite":
        monkeypatch.setattr(HostWakeups, "wake", lambda self, tickets: None)
    holder = Lock("l:wake", ttl=30)
    holder.acquire()
    granted_at: list[float] = []

    def wait() -> None:
        waiter = Lock("l:wake", ttl=30)
        if waiter.acquire(timeout=20):
            granted_at.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 10
    while not backends["default"].waiters("l:wake"):
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.02)
    while connection.vendor != "sqlite" and not _end_the_wake_up_session():
        # the waiter's session may not have started its wait yet
        assert time.monotonic() < deadline, "no wake-up session to end"
    time.sleep(0.2)  # the waiter finds its session gone and falls back to polling
    released = time.monotonic()
    holder.release()
    thread.join(30)
    assert granted_at, "the waiter never got the lock"
    waited = granted_at[0] - released
    assert waited < 2, waited  # its poll; unpolled, it would wait out its 20 s timeout
    bounds("waiter granted after a release it could not hear", waited)


def _end_the_wake_up_session() -> int:
    """End the session a lease waiter is woken on; how many were ended."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN djlocks_lease%%' AND pid <> pg_backend_pid() "
                "AND datname = current_database()"
            )
            return int(cursor.fetchone()[0])
        cursor.execute(
            "SELECT ID FROM information_schema.PROCESSLIST "
            "WHERE INFO LIKE %s AND ID <> CONNECTION_ID()",
            ("%GET_LOCK('djlocks-wake/%",),
        )
        sleepers = [row[0] for row in cursor.fetchall()]
        for session in sleepers:
            cursor.execute("KILL CONNECTION %s", (session,))
        return len(sleepers)


def test_a_missing_table_is_unavailable_with_what_to_run() -> None:
    """A database whose djlocks migrations were not applied: the acquire says to run
    them (the store's error alone names a table, not the fix)."""
    from djlocks.models import LeaseSlot

    table = LeaseSlot._meta.db_table
    with connection.schema_editor() as editor:
        editor.alter_db_table(LeaseSlot, table, f"{table}_away")
    try:
        with pytest.raises(BackendUnavailable) as refused, db_lock("contract:unmigrated"):
            pass
    finally:
        with connection.schema_editor() as editor:
            editor.alter_db_table(LeaseSlot, f"{table}_away", table)
    assert "A djlocks table is missing: run `manage.py migrate djlocks`." in str(refused.value)


def test_after_handing_the_lock_over_a_process_queues_at_once_and_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release that hands the slot to a waiter has the next acquire of the name queue
    without a newcomer's claim; with nobody left to wait for, it still gets the lock."""
    backend = backends["default"]
    if backend.dialect.hand_over is None:
        pytest.skip("not applicable: SQLite's waiters claim a freed slot themselves")
    newcomer_claims: list[int] = []
    claim = type(backend)._claim

    def counting(self: object, request: object, key: str, ticket: int, *rest: object) -> object:
        if ticket == NEWCOMER:
            newcomer_claims.append(ticket)
        return claim(self, request, key, ticket, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(type(backend), "_claim", counting)
    holder = Lock("contract:queue-first", ttl=5)
    assert holder.acquire(timeout=1)
    granted = threading.Event()

    def wait_then_hold() -> None:
        try:
            with db_lock("contract:queue-first", timeout=10):
                granted.set()
                _until_someone_waits_for("contract:queue-first")  # the holder, queued
        finally:
            connections.close_all()  # this thread's, which the look at the queue opened

    waiter = threading.Thread(target=wait_then_hold)
    waiter.start()
    _until_someone_waits_for("contract:queue-first")
    holder.release()  # handed over to the waiter
    assert granted.wait(5)
    claims_before = len(newcomer_claims)
    assert holder.acquire(timeout=5)  # queues; the waiter then hands the lock over
    assert len(newcomer_claims) == claims_before, "it tried a newcomer's claim first"
    waiter.join(5)
    holder.release()  # nobody waits now: a plain release, and the next acquire claims
    assert holder.acquire(timeout=1)
    holder.release()
    assert len(newcomer_claims) == claims_before + 1


def _until_someone_waits_for(name: str) -> None:
    deadline = time.monotonic() + 5
    while not backends["default"].waiters(name):
        assert time.monotonic() < deadline, f"nobody queued for {name!r}"
        time.sleep(0.01)
