"""Fault catalogue items for the lease backends (rows in the database,
keys in Redis), with real processes.

Workers are started (tests/workers.py) and talk to the same real test database
and Redis.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from django.db import connection

from djlocks import Lock, Semaphore, db_lock
from djlocks.backends import backends
from djlocks.stress import StressPlan, run_stress
from tests.processes import finished, resume, runlocked
from tests.test_reliability import LEASES
from tests.workers import CONTEXT, start_worker

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(240)]


@pytest.fixture(params=LEASES)
def backend(request: pytest.FixtureRequest) -> str:
    """The alias of a lease backend: rows in the test database, or keys in Redis (and in
    a Redis Cluster where the run started one)."""
    alias: str = request.param
    return alias


def _get(queue: Any, timeout: float = 60) -> Any:
    try:
        return queue.get(timeout=timeout)
    except Empty:
        pytest.fail(f"no report from a worker within {timeout} s")


@pytest.mark.catalogue("exact-counter", "sqlite-processes")
def test_exact_counter_under_contention(backend: str) -> None:
    result = run_stress(StressPlan(backend, processes=8, iterations=200), timeout=180)
    assert result.errors == []
    assert (result.counter, result.overlaps, result.max_concurrent) == (1600, 0, 1)
    assert result.fences_increase and result.ok


@pytest.mark.catalogue("semaphore-limit")
def test_semaphore_never_exceeds_limit_and_reaches_it(backend: str) -> None:
    # Holds of 30 ms against acquisitions of a few ms: with 12 contenders all
    # three slots are in use together many times over, even on a loaded 2-core
    # machine (with 3 ms holds a CI run once peaked at 2).
    plan = StressPlan(backend, processes=12, iterations=12, limit=3, hold_ms=30, name="t2")
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok
    assert result.max_concurrent == 3


@pytest.mark.catalogue("semaphore-limit")
def test_semaphore_with_two_holders_killed_leaks_no_slot(backend: str) -> None:
    plan = StressPlan(
        backend, processes=6, iterations=10, limit=3, hold_ms=3, ttl=1.5, name="t2k", kill=2
    )
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok, result
    assert result.counter == result.expected == 6 * 10 - 2 * 5
    # No slot leaked: the dead holders' slots come free by themselves within the
    # TTL (each slot is its own lease), and then all three can be held at once again.
    semaphore = Semaphore("t2k", limit=3, ttl=5, backend=backend)
    for _ in range(3):
        assert semaphore.acquire(timeout=1.5 + 1.0)
    for _ in range(3):
        semaphore.release()


@pytest.mark.catalogue("paused-lease-holder")
def test_paused_holder_is_fenced_and_its_late_release_fails(backend: str) -> None:
    report = CONTEXT.Queue()
    go = CONTEXT.Event()
    from tests.workers import hold_without_renewal_then_release

    worker = start_worker(hold_without_renewal_then_release, "t7", 1.0, report, go, backend)
    _, old_fence = _get(report)
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        with db_lock("t7", ttl=10, timeout=10, backend=backend) as grant:
            assert grant.fence > old_fence
            os.kill(worker.pid, signal.SIGCONT)
            go.set()
            outcome = _get(report)
            assert outcome[0] == "lost", outcome
            grant.check()  # the late release did not free the new holder's grant
    finally:
        resume(worker.pid)
        worker.join(10)


def test_a_grant_after_a_long_wait_gets_its_full_lease(backend: str) -> None:
    """The lease counts from the request that made it, not from the start of the wait."""
    holder = Lock("tlong", ttl=1, backend=backend).acquire_grant()
    assert holder is not None
    timer = threading.Timer(1.5, holder.release)  # past the waiter's TTL
    timer.start()
    with db_lock("tlong", ttl=1, timeout=10, backend=backend) as grant:
        assert grant.believed
        time.sleep(1.2)  # renewed meanwhile
        grant.check()
    timer.join()


@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="not applicable: SQLite's lease store does not hand a slot over in the release",
)
@pytest.mark.parametrize("limit", [1, 2])
def test_a_release_hands_the_slot_to_the_head_of_the_queue(limit: int, tmp_path: Path) -> None:
    """The waiter is stopped (SIGSTOP) when the slot is released: the release alone makes
    it the holder, with the next fence and its own identity, and takes it off the queue;
    woken, it runs its command without claiming anything."""
    name, store = "lease:heir", backends["default"]
    taken = [Semaphore(name, limit=limit, timeout=0) for _ in range(limit)]
    grants = [spec.acquire_grant() for spec in taken]
    started = tmp_path / "started"
    heir = runlocked(name, "--limit", str(limit), "--", "sh", "-c", f"echo ran > {started}")
    try:
        deadline = time.monotonic() + 30
        while not store.waiters(name):
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.05)
        os.kill(heir.pid, signal.SIGSTOP)
        top = max(grant.fence for grant in grants if grant is not None)
        taken[0].release()
        holders = {holder.pid: holder for holder in store.holders(name)}
        assert holders[heir.pid].fence == top + 1
        assert holders[heir.pid].slot == grants[0].slot  # type: ignore[union-attr]
        assert store.waiters(name) == []
    finally:
        os.kill(heir.pid, signal.SIGCONT)
    assert finished(heir) == 0
    assert started.read_text().strip() == "ran"
    for spec in taken[1:]:
        spec.release()
