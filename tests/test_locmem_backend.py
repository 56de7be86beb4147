"""The in-process backend and the testing helpers, with real threads.

Most tests run through the ``locmem_locks`` fixture that djlocks ships; the
others through ``use_locmem_backends()`` (as context manager and decorator),
``override_settings`` directly, and a Django ``TestCase``. None of them but
the ``TestCase`` has database access, so a backend that touched the
database would fail them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import TestCase, override_settings
from django.utils import timezone

from djlocks import (
    AlreadyHeld,
    Lock,
    LockLost,
    NotAcquired,
    Semaphore,
    db_lock,
    db_semaphore,
    pytest_plugin,
)
from djlocks.backends import backends
from djlocks.backends.locmem import LocMemBackend
from djlocks.backends.waiting import Abort
from djlocks.conf import djlocks_settings
from djlocks.grant import Grant
from djlocks.heartbeat import heartbeat
from djlocks.inspection import force_release
from djlocks.testing import use_locmem_backends

# The plugin's fixture, as the ``djlocks`` pytest11 entry point provides it once installed.
locmem_locks = pytest_plugin.locmem_locks

LOCMEM = {"BACKEND": "djlocks.backends.locmem.LocMemBackend"}


def assert_nothing_left(store: LocMemBackend, renewing: int = 0) -> None:
    """No live grant or waiter in ``store``; the heartbeat renews ``renewing`` grants."""
    assert store.holders() == [], "a live grant was left"
    assert store.waiters() == [], "a waiter was left"
    assert heartbeat.active() == renewing, "a renewal is still running after the test"


@pytest.fixture
def store(locmem_locks: LocMemBackend) -> Iterator[LocMemBackend]:
    """The ``locmem_locks`` fixture; afterwards no grant, waiter or renewal may be left."""
    renewing = heartbeat.active()  # not 0 only after another test failed
    yield locmem_locks
    assert_nothing_left(locmem_locks, renewing)


def run_together(count: int, work: Callable[[int], None]) -> None:
    """Run ``work(0)`` ... ``work(count - 1)`` in threads lined up by a barrier; re-raise."""
    start = threading.Barrier(count, timeout=10)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            start.wait()
            work(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive(), "a thread is stuck"
    if errors:
        raise errors[0]


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.001)


def in_thread(target: Callable[[], None], name: str = "helper") -> threading.Thread:
    thread = threading.Thread(target=target, name=name)
    thread.start()
    return thread


# -- mutual exclusion ------------------------------------------------------------


def test_the_counter_oracle_loses_updates_without_a_lock() -> None:
    counter = [0]

    def increment(_: int) -> None:
        seen = counter[0]
        time.sleep(0.002)
        counter[0] = seen + 1

    run_together(8, increment)
    assert counter[0] < 8


def test_a_lock_keeps_a_non_atomic_counter_exact_across_8_threads(store: LocMemBackend) -> None:
    counter = [0]
    lock = Lock("counter", timeout=10)

    def increment(_: int) -> None:
        for _ in range(25):
            with lock:
                seen = counter[0]
                time.sleep(random.uniform(0, 0.002))
                counter[0] = seen + 1

    run_together(8, increment)
    assert counter[0] == 8 * 25


def test_a_semaphore_never_grants_more_than_its_limit_and_reaches_it(
    store: LocMemBackend,
) -> None:
    semaphore = Semaphore("pool", limit=3, timeout=10)
    in_use: set[int] = set()
    peak = [0]
    guard = threading.Lock()

    def use(_: int) -> None:
        for _ in range(10):
            with semaphore as grant:
                with guard:
                    assert grant.slot not in in_use, "two holders of one slot"
                    in_use.add(grant.slot)
                    peak[0] = max(peak[0], len(in_use))
                time.sleep(0.002)
                with guard:
                    in_use.remove(grant.slot)

    run_together(8, use)
    assert peak[0] == 3


def try_lock_burst(name: str, count: int) -> list[bool]:
    """``count`` threads try ``name`` at once; winners hold until all have tried."""
    tried = threading.Barrier(count, timeout=10)
    outcomes: list[bool] = []

    def attempt(_: int) -> None:
        lock = Lock(name)
        won = lock.acquire(timeout=0)
        outcomes.append(won)
        tried.wait()
        if won:
            lock.release()

    run_together(count, attempt)
    return outcomes


def test_a_burst_of_try_locks_has_exactly_one_winner(store: LocMemBackend) -> None:
    for round_ in range(10):
        outcomes = try_lock_burst(f"burst:{round_}", 8)
        assert outcomes.count(True) == 1, outcomes


def test_waiters_are_granted_first_come_first_served(store: LocMemBackend) -> None:
    order: list[int] = []
    holder = Lock("fifo")
    assert holder.acquire(timeout=0)

    def take_in_turn(index: int) -> None:
        with Lock("fifo", timeout=10):
            order.append(index)
            time.sleep(0.001)

    threads = []
    for index in range(5):
        threads.append(in_thread(lambda i=index: take_in_turn(i), name=f"waiter-{index}"))
        wait_until(lambda n=index + 1: len(store.waiters("fifo")) == n)
    waiting = store.waiters("fifo")
    assert [w.position for w in waiting] == list(range(5))
    assert [w.thread.split(" (tid")[0] for w in waiting] == [f"waiter-{i}" for i in range(5)]
    holder.release()
    assert Lock("fifo").acquire(timeout=0) is False, "a newcomer passed the queue"
    for thread in threads:
        thread.join(10)
    assert order == list(range(5))


def give_up_as_the_slot_frees(store: LocMemBackend) -> tuple[list[Grant | None], list[float]]:
    """The head waiter is aborted just before the holder releases; return what it got and
    how long the second waited after the release."""
    holder = Lock("move-up")
    assert holder.acquire(timeout=0)
    abort = Abort()
    gave_up: list[Grant | None] = []
    moved_up: list[float] = []
    released = [0.0]

    def take_after_the_first() -> None:
        lock = Lock("move-up", timeout=2)
        if lock.acquire():
            moved_up.append(time.monotonic() - released[0])
            lock.release()

    first = in_thread(lambda: gave_up.append(Lock("move-up").acquire_grant(True, None, abort)))
    wait_until(lambda: len(store.waiters("move-up")) == 1)
    second = in_thread(take_after_the_first)
    wait_until(lambda: len(store.waiters("move-up")) == 2)
    abort.set()
    released[0] = time.monotonic()
    holder.release()
    first.join(2)
    second.join(3)
    return gave_up, moved_up


def test_a_waiter_that_gives_up_at_a_release_lets_the_next_one_move_up(
    store: LocMemBackend,
) -> None:
    for _ in range(20):
        gave_up, moved_up = give_up_as_the_slot_frees(store)
        assert gave_up == [None] and len(moved_up) == 1
        # Its timeout is 2 s: one left asleep would not get in at all, or only then.
        assert moved_up[0] < 1.5, "the second waiter slept on after the first left"


# -- fences, leases, losses ----------------------------------------------------


def test_fences_strictly_increase_and_are_never_reused(store: LocMemBackend) -> None:
    fences = []
    lock = Lock("fenced", timeout=0)
    for _ in range(3):
        with lock as grant:
            fences.append(grant.fence)
    forced = lock.acquire_grant()
    assert forced is not None
    fences.append(forced.fence)
    assert store.force_release("fenced") == 1
    with pytest.raises(LockLost):
        lock.release()
    store.sweep()
    with (
        db_semaphore("fenced", limit=2, timeout=0) as first,
        db_semaphore("fenced", limit=2, timeout=0) as second,
    ):
        fences += [first.fence, second.fence]
    with lock as grant:
        fences.append(grant.fence)
    assert fences == sorted(set(fences)), fences


def test_an_unrenewed_lease_expires_and_the_next_holder_gets_a_higher_fence(
    store: LocMemBackend,
) -> None:
    lost: list[str] = []
    lock = Lock("short", ttl=0.3, renew=False, on_lost=lambda grant, why: lost.append(why))
    old = lock.acquire_grant(timeout=0)
    assert old is not None and old.believed
    assert Lock("short").acquire(timeout=0) is False
    time.sleep(0.35)
    assert store.holders("short") == []
    assert not old.believed
    with pytest.raises(LockLost):
        old.check()
    wait_until(lambda: len(lost) == 1)  # told by check(), or by the watchdog if it was first
    with db_lock("short", timeout=0) as new:
        assert new.fence > old.fence
        with pytest.raises(LockLost):
            lock.release()  # the old grant's release frees nothing of the new one's
        new.check()
        assert [h.token for h in store.holders("short")] == [new.token]


def test_a_waiter_is_granted_as_soon_as_the_lease_it_waits_on_expires(
    store: LocMemBackend,
) -> None:
    lock = Lock("expiring", ttl=0.3, renew=False)
    assert lock.acquire(timeout=0)
    started = time.monotonic()
    with db_lock("expiring", timeout=3):
        waited = time.monotonic() - started
    assert 0.25 <= waited < 2, waited  # woken by the expiry, not by its timeout
    with pytest.raises(LockLost, match="released by force, or its lease expired"):
        lock.release()


def test_renewal_extends_a_live_lease_and_never_reclaims_an_expired_one(
    store: LocMemBackend,
) -> None:
    lock = Lock("renewed", ttl=0.3, renew=False)
    grant = lock.acquire_grant(timeout=0)
    assert grant is not None and grant.expires_at is not None
    extended = store.renew("renewed", grant.token, 0.3)
    assert extended is not None and extended >= grant.expires_at
    time.sleep(0.35)
    with pytest.raises(LockLost):
        store.renew("renewed", grant.token, 60)
    assert not store.is_held("renewed", grant.token)
    assert store.holders("renewed") == []
    with pytest.raises(LockLost, match="its lease expired"):
        lock.release()


def test_a_released_grant_is_not_kept_until_its_renewal_would_have_been_due(
    store: LocMemBackend,
) -> None:
    """The heartbeat plans each grant's renewal TTL/3 ahead; a release must not leave the
    grant in that plan (and in memory) until then, or a high grant rate piles them up."""
    lock = Lock("heartbeat:plan", ttl=600)
    with lock as grant:
        pass
    released = weakref.ref(grant)
    del grant
    for _ in range(1000):
        with lock:
            pass
    gc.collect()
    assert released() is None, "a released grant is still referenced"


def test_a_renewal_that_shortens_the_belief_has_the_holder_told_when_it_ends(
    store: LocMemBackend,
) -> None:
    """A renewal during a graceful release's wait finds a lease shorter than the TTL
    (``Grant.renewed(lasts=...)``): the holder is told it lost the grant when that
    shorter belief ends, not at the TTL it believed before."""
    told = threading.Event()
    lock = Lock("belief:shortened", ttl=30, on_lost=lambda grant, why: told.set())
    grant = lock.acquire_grant(timeout=0)
    assert grant is not None
    time.sleep(0.2)  # the watchdog sleeps until the TTL's belief ends
    grant.renewed(time.monotonic(), None, lasts=0.5)
    assert told.wait(3), "told at the TTL's end, not the shortened belief's"
    with pytest.raises(LockLost):
        grant.release()


def test_a_forced_release_is_seen_by_the_holder(store: LocMemBackend) -> None:
    lost: list[str] = []
    lock = Lock("forced", on_lost=lambda grant, why: lost.append(why))
    grant = lock.acquire_grant(timeout=0)
    assert grant is not None
    assert store.force_release("forced", "not-its-token") == 0
    grant.check()
    [holder] = store.holders("forced")
    assert store.force_release("forced", holder.token) == 1
    assert store.force_release("forced", holder.token) == 0
    with pytest.raises(LockLost):
        grant.check()
    assert len(lost) == 1
    with db_lock("forced", timeout=0) as successor:
        assert successor.fence > grant.fence
        with pytest.raises(LockLost):
            lock.release()
        successor.check()


def test_an_operators_forced_release_writes_no_history_for_it(store: LocMemBackend) -> None:
    """``capabilities.history`` is False: ``force_release`` takes the grant and writes no event
    (this test has no database: an event would fail it)."""
    lock = Lock("forced:quiet")
    grant = lock.acquire_grant(timeout=0)
    assert grant is not None
    audited: list[int] = []
    released = force_release(
        store.holders("forced:quiet"), reason="test", on_released=lambda h: audited.append(h.fence)
    )
    assert [h.fence for h in released] == audited == [grant.fence]
    with pytest.raises(LockLost):
        lock.release()


# -- cool-downs ----------------------------------------------------------------


def test_a_cooldown_keeps_the_name_unavailable_then_frees_it(store: LocMemBackend) -> None:
    with db_lock("cool", cooldown=0.3, timeout=0):
        pass
    released = time.monotonic()
    assert Lock("cool").acquire(timeout=0) is False
    [cooling] = store.cooldowns("cool")
    assert cooling.slot == 0
    assert timezone.now() < cooling.until <= timezone.now() + timedelta(seconds=0.3)
    with db_lock("cool", timeout=3):
        waited = time.monotonic() - released
    assert 0.25 <= waited < 2, waited  # woken by the cool-down's end, not by its timeout
    assert store.cooldowns() == []


def test_set_cooldown_lengthens_and_clears_a_cooldown_and_wakes_waiters(
    store: LocMemBackend,
) -> None:
    with db_lock("operated", timeout=0):
        pass
    until = store.set_cooldown("operated", 0, 30)
    assert until is not None and [c.until for c in store.cooldowns("operated")] == [until]
    granted: list[Grant | None] = []
    waiter = in_thread(lambda: granted.append(Lock("operated", timeout=5).acquire_grant()))
    wait_until(lambda: len(store.waiters("operated")) == 1)
    cleared = time.monotonic()
    assert store.set_cooldown("operated", 0, 0) is None
    waiter.join(10)
    assert time.monotonic() - cleared < 2, "woken by the clearing, not by its 5 s timeout"
    assert granted[0] is not None
    granted[0].release()
    with pytest.raises(ValueError, match="no slot 1"):
        store.set_cooldown("operated", 1, 5)
    with pytest.raises(ValueError):
        store.set_cooldown("unknown", 0, 5)


# -- waiting and giving up ------------------------------------------------------


def test_abort_ends_a_wait_promptly(store: LocMemBackend) -> None:
    with db_lock("aborted", timeout=0):
        abort = Abort()
        outcomes: list[Grant | None] = []
        waiter = in_thread(
            lambda: outcomes.append(Lock("aborted").acquire_grant(True, None, abort))
        )
        wait_until(lambda: len(store.waiters("aborted")) == 1)
        aborted = time.monotonic()
        abort.set()
        waiter.join(10)
        assert outcomes == [None] and time.monotonic() - aborted < 2  # it had no timeout
        assert store.waiters("aborted") == []
        assert Lock("aborted").acquire_grant(True, None, abort) is None  # already set


def test_a_cancelled_async_acquire_leaves_nothing(store: LocMemBackend) -> None:
    async def cancel_a_waiter() -> None:
        async def wait_for_it() -> None:
            async with Lock("async"):
                pass

        with db_lock("async", timeout=0):
            task = asyncio.ensure_future(wait_for_it())
            while not store.waiters("async"):
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_a_waiter())


def test_timeout_zero_tries_once_and_a_timeout_waits_that_long(store: LocMemBackend) -> None:
    with db_lock("once", timeout=0):
        started = time.monotonic()
        assert Lock("once").acquire(timeout=0) is False
        assert Lock("once").acquire(blocking=False) is False
        with pytest.raises(NotAcquired), db_lock("once", timeout=0):
            pass
        assert time.monotonic() - started < 0.5  # none waited: that lasts till a release
        started = time.monotonic()
        assert Lock("once").acquire(timeout=0.2) is False
        assert 0.2 <= time.monotonic() - started < 2


def test_a_limit_mismatch_raises_already_held_while_the_name_is_held(
    store: LocMemBackend,
) -> None:
    with db_semaphore("sized", limit=2, timeout=0) as first:
        with pytest.raises(AlreadyHeld, match="limit=2"):
            db_semaphore("sized", limit=3, timeout=0).acquire()
        with pytest.raises(AlreadyHeld):
            Lock("sized").acquire(timeout=0)
    with db_semaphore("sized", limit=3, timeout=0) as resized:
        assert resized.fence > first.fence
    assert store.names() == [("sized", 3)]


# -- what the store reports ----------------------------------------------------


def test_holders_waiters_names_and_cooldowns_describe_the_store(store: LocMemBackend) -> None:
    before = timezone.now()
    semaphore = Semaphore("report", limit=2, ttl=30, label="nightly report")
    first, second = semaphore.acquire_grant(timeout=0), semaphore.acquire_grant(timeout=0)
    assert first is not None and second is not None
    with db_lock("idle", timeout=0, cooldown=30):
        pass
    done = threading.Event()

    def wait_in_queue() -> None:
        with Semaphore("report", limit=2, timeout=5, label="queued"):
            done.wait(5)

    queued = in_thread(wait_in_queue)
    wait_until(lambda: len(store.waiters()) == 1)

    holders = store.holders("report")
    assert [(h.name, h.backend, h.slot, h.limit) for h in holders] == [
        ("report", "default", 0, 2),
        ("report", "default", 1, 2),
    ]
    assert [h.fence for h in holders] == [first.fence, second.fence]
    for holder in holders:
        assert (holder.label, holder.pid) == ("nightly report", os.getpid())
        assert holder.thread.startswith("MainThread")
        assert before <= holder.since <= timezone.now()
        assert holder.expires_at is not None and holder.expires_at.utcoffset() == timedelta(0)
        assert timezone.now() < holder.expires_at <= timezone.now() + timedelta(seconds=30)
    assert store.holders() == holders
    [waiter] = store.waiters()
    assert (waiter.name, waiter.position, waiter.label, waiter.pid) == (
        "report",
        0,
        "queued",
        os.getpid(),
    )
    assert store.names() == [("idle", 1), ("report", 2)]
    assert [(c.name, c.slot) for c in store.cooldowns()] == [("idle", 0)]
    assert store.cooldowns("report") == []

    first.release()
    wait_until(lambda: not store.waiters())
    [taken] = [h for h in store.holders("report") if h.label == "queued"]
    assert taken.slot == 0 and taken.fence > second.fence
    done.set()
    queued.join(2)
    second.release()


def test_sweep_forgets_expired_grants_and_ended_cooldowns_but_not_fences(
    store: LocMemBackend,
) -> None:
    lock = Lock("swept", ttl=0.3, renew=False)
    grant = lock.acquire_grant(timeout=0)
    assert grant is not None
    with db_lock("cooled", cooldown=0.3, timeout=0):
        pass
    assert store.sweep() == {"expired grants": 0, "ended cool-downs": 0}
    time.sleep(0.35)
    assert store.sweep() == {"expired grants": 1, "ended cool-downs": 1}
    assert store.sweep() == {"expired grants": 0, "ended cool-downs": 0}
    assert store.names() == [("cooled", 1), ("swept", 1)]
    with pytest.raises(LockLost):
        lock.release()
    with db_lock("swept", timeout=0) as successor:
        assert successor.fence > grant.fence


# -- the testing helpers ---------------------------------------------------------


def test_the_fixture_puts_every_alias_on_a_locmem_backend(locmem_locks: LocMemBackend) -> None:
    assert locmem_locks is backends["default"]
    aliases = {*settings.DJLOCKS["BACKENDS"], "default"}
    assert set(backends.aliases()) == aliases
    assert all(isinstance(backends[alias], LocMemBackend) for alias in aliases)
    assert len({id(backends[alias]) for alias in aliases}) == len(aliases), "one store per alias"
    assert djlocks_settings()["TTL"] == settings.DJLOCKS["TTL"], "other keys are kept"


def test_use_locmem_backends_starts_and_ends_with_fresh_stores() -> None:
    for _ in range(2):
        with use_locmem_backends():
            store = backends["default"]
            assert isinstance(store, LocMemBackend) and store.names() == []
            with db_lock("fresh", timeout=0) as grant:
                assert grant.fence == 1
                on_row = Lock("fresh", backend="row")
                assert on_row.acquire(timeout=0) is True, "each alias has its own store"
                on_row.release()
            assert store.names() == [("fresh", 1)]
    assert not isinstance(backends["default"], LocMemBackend)


@use_locmem_backends()
def test_use_locmem_backends_as_a_function_decorator() -> None:
    store = backends["default"]
    assert isinstance(store, LocMemBackend)
    with db_semaphore("decorated", limit=2, timeout=0) as grant:
        assert grant.fence == 1
    assert_nothing_left(store)


def test_use_locmem_backends_refuses_to_decorate_other_classes() -> None:
    class NotATestCase:
        pass

    with pytest.raises(TypeError, match=r"unittest\.TestCase"):
        use_locmem_backends()(NotATestCase)


def test_override_settings_with_locmem_backends_directly() -> None:
    configured = {"BACKENDS": {"default": LOCMEM, "other": LOCMEM}, "TTL": 5}
    with override_settings(DJLOCKS=configured):
        store, other = backends["default"], backends["other"]
        assert isinstance(store, LocMemBackend) and isinstance(other, LocMemBackend)
        with (
            db_lock("shared", timeout=0) as here,
            db_lock("shared", backend="other", timeout=0) as there,
        ):
            assert here.ttl == there.ttl == 5
            assert [h.backend for h in store.holders() + other.holders()] == ["default", "other"]
        assert_nothing_left(store)
        assert_nothing_left(other)


@use_locmem_backends()
class LocMemInsideATestCase(TestCase):
    """The point of the backend: locks inside a test's transaction, on SQLite too."""

    def test_locks_and_semaphores_inside_the_test_transaction(self) -> None:
        self.assertTrue(connection.in_atomic_block)
        with db_lock("in-transaction", timeout=0) as grant:
            User.objects.create(username="written-under-a-lock")
            self.assertEqual(grant.fence, 1)
        with (
            db_semaphore("in-transaction:pool", limit=2, timeout=0) as first,
            db_semaphore("in-transaction:pool", limit=2, timeout=0) as second,
        ):
            self.assertEqual({first.slot, second.slot}, {0, 1})
            self.assertFalse(db_semaphore("in-transaction:pool", limit=2).acquire(timeout=0))
        self.assertTrue(User.objects.filter(username="written-under-a-lock").exists())
        store = backends["default"]
        assert isinstance(store, LocMemBackend)
        assert_nothing_left(store)

    def test_each_test_gets_fresh_stores(self) -> None:
        with db_lock("in-transaction", timeout=0) as grant:
            self.assertEqual(grant.fence, 1)
