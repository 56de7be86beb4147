"""Fault catalogue items that run the same way on every backend.

Each test is parametrised over ``BACKENDS``, the backends configured for the
database DJLOCKS_DB picks: a new backend joins by being listed there. The
measured bounds go to docs/reliability.md (``make reliability``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import pytest
from django.conf import settings
from django.db import connection

from djlocks import db_lock, forksafe
from djlocks.backends import backends
from djlocks.exceptions import LockLost, NotHeld
from djlocks.grant import Grant
from djlocks.inspection import force_release
from project.demo.models import FencedCounter
from tests.faults import TcpProxy
from tests.processes import fork_beside_threads, resume
from tests.test_session_backends import kill_session
from tests.workers import (
    CONTEXT,
    acquired_in_another_thread,
    hold_and_watch,
    hold_then_report,
    obey,
    read_modify_write,
    seconds_until_lost,
    start_worker,
    try_once,
    wait_in_line,
)

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(240)]

#: The Redis Cluster backend, where the run started a cluster (tests/redis_cluster.py).
CLUSTER = [alias for alias in settings.DJLOCKS["BACKENDS"] if alias == "redis-cluster"]
#: Backends whose grants are leases: a dead holder's grant lasts until its TTL.
LEASES = ["default", "redis", *CLUSTER]
#: Backends whose grants the server ends with the holder's session or transaction.
SERVER_HELD = ["row"] if connection.vendor == "sqlite" else ["session", "row"]
BACKENDS = LEASES + SERVER_HELD
#: Backends whose waiters queue (the row backend's are in tests/test_row_backend.py).
QUEUEING = LEASES if connection.vendor == "sqlite" else [*LEASES, "session"]
#: Backends whose store is a server on the network, whose replies a TCP proxy can lose
#: (Redis: tests/test_redis_backend.py; more on row locks: tests/test_row_backend.py).
NETWORKED = [] if connection.vendor == "sqlite" else ["default", "session", "row"]
#: Backends whose holders a heartbeat checks and that an operator can release by force
#: (a row lock's holder learns it at its commit: tests/test_row_backend.py).
FORCEABLE = LEASES if connection.vendor == "sqlite" else [*LEASES, "session"]
#: Backends with something a forked child could inherit: a session, a connection pool.
FORKABLE = ["redis"] if connection.vendor == "sqlite" else ["redis", "session"]
#: On SQLite the row lock's fence is written in the holder's transaction, which the
#: kill rolls back, so the next grant gets the same fence (documented in row.sqlite).
FENCE_ROLLED_BACK = {"row"} if connection.vendor == "sqlite" else set()
#: Seconds: the lease of the SIGKILLed holder, and how often that test is repeated.
CRASH_TTL, CRASH_ROUNDS = 1.5, 3


@pytest.mark.catalogue("try-lock-burst")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_try_lock_burst_has_exactly_one_winner(backend: str) -> None:
    """20 processes released together by a barrier each try once (``timeout=0``):
    one wins, 19 are told no, and none gets an error."""
    barrier, report, settled = CONTEXT.Barrier(20), CONTEXT.Queue(), CONTEXT.Event()
    workers = [start_worker(try_once, "c3", barrier, report, settled, backend) for _ in range(20)]
    outcomes = sorted(report.get(timeout=60)[0] for _ in workers)
    settled.set()
    for worker in workers:
        worker.join(30)
    assert outcomes.count("won") == 1 and outcomes.count("lost") == 19, outcomes


@pytest.mark.catalogue("waiters-in-turn")
@pytest.mark.parametrize("backend", QUEUEING)
def test_waiters_progress_one_at_a_time_in_order_where_promised(backend: str) -> None:
    """Three queued waiters are served one by one after the holder's release, with
    rising fences; a newcomer cannot barge in while they wait. The order is the
    queue's everywhere but MySQL, whose GET_LOCK serves waiters in no set order."""
    holder = db_lock("c4", ttl=30, backend=backend)
    holder.acquire()
    report = CONTEXT.Queue()
    workers = []
    for position, label in enumerate(["first", "second", "third"]):
        workers.append(start_worker(wait_in_line, "c4", label, report, backend))
        deadline = time.monotonic() + 30
        while len(backends[backend].waiters("c4")) <= position:
            assert time.monotonic() < deadline, "a waiter never queued"
            time.sleep(0.02)
    assert not db_lock("c4", backend=backend).acquire(timeout=0), "a newcomer barged in"
    holder.release()
    served = [report.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
    fences = [fence for _, fence in served]
    assert fences == sorted(fences) and len(set(fences)) == 3
    labels = [label for label, _ in served]
    if backend == "session" and connection.vendor == "mysql":
        assert sorted(labels) == ["first", "second", "third"]
    else:
        assert labels == ["first", "second", "third"]


@pytest.mark.catalogue("holder-killed", "sqlite-processes")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sigkilled_holder_frees_the_name_within_the_crash_release_bound(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """A session or row lock is free in under 1 s; a lease at its TTL (its last
    renewal was at most TTL/3 before the kill), never before. The next fence is higher
    (equal only where the kill rolled the fence back with the holder's transaction)."""
    for round_ in range(CRASH_ROUNDS):
        name = f"c5:{round_}"
        report = CONTEXT.Queue()
        holder = start_worker(hold_then_report, name, CRASH_TTL, report, 60, backend)
        state, pid, dead_fence = report.get(timeout=30)
        assert state == "held"
        os.kill(pid, signal.SIGKILL)
        holder.join(10)
        killed = time.monotonic()
        if backend in LEASES:
            assert not db_lock(name, backend=backend).acquire(timeout=0), "freed before TTL"
        with db_lock(name, timeout=10, backend=backend) as grant:
            freed = time.monotonic() - killed
            assert grant.fence > dead_fence or (
                backend in FENCE_ROLLED_BACK and grant.fence == dead_fence
            )
        limit = CRASH_TTL + 1.0 if backend in LEASES else 1.0
        assert freed < limit, f"the name was free {freed:.3f} s after the kill"
        assert not [h for h in backends[backend].holders(name) if h.pid == pid]
        bounds(f"SIGKILLed holder's name free after (leases: TTL {CRASH_TTL} s)", freed)


@pytest.mark.catalogue("lock-covers-commit")
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lock_covers_the_commit(backend: str) -> None:
    """4 workers x 50 read-modify-writes, each in ``transaction.atomic()`` under the
    lock (a row lock inside the transaction, any other around it): none is lost."""
    assert _counted_by_four_workers(f"covered:{backend}", "c19", backend) == 200


@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="not applicable: SQLite's IMMEDIATE transactions serialise every writer",
)
def test_without_a_lock_the_same_workload_loses_updates() -> None:
    """The control of the test above: the same workload with no lock loses updates,
    so that test could fail."""
    assert _counted_by_four_workers("uncovered", None) < 200


def _counted_by_four_workers(counter: str, lock_name: str | None, backend: str = "row") -> int:
    """The final value of ``counter`` after 4 workers each added 1 to it 50 times."""
    FencedCounter.objects.create(name=counter, value=0)
    report = CONTEXT.Queue()
    workers = [
        start_worker(read_modify_write, counter, 50, lock_name, report, backend) for _ in range(4)
    ]
    for _ in workers:
        assert report.get(timeout=120)[0] == "done"
    for worker in workers:
        worker.join(20)
    return FencedCounter.objects.get(name=counter).value


@pytest.mark.catalogue("forked-child")
@pytest.mark.parametrize("backend", FORKABLE)
def test_a_forked_child_never_uses_its_parents_grant(backend: str) -> None:
    """The child can neither release nor check the parent's grant (``NotHeld``, no
    I/O), does not get in through the parent's session, does not renew the parent's
    grant, and takes locks of its own; the parent holds on throughout."""
    with db_lock("c17", backend=backend, ttl=3) as grant:
        child = fork_beside_threads()
        if child == 0:
            os._exit(_what_a_forked_child_may_do(grant, backend))
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "see the child's report above"
        grant.check()
        assert not acquired_in_another_thread(db_lock("c17", backend=backend))


def _what_a_forked_child_may_do(grant: Grant, backend: str) -> int:
    """Run in a forked child; the exit status says what went wrong (0: nothing)."""
    signal.alarm(CHILD_SECONDS)  # a child that hangs dies of SIGALRM and fails the test
    try:
        for forbidden in (grant.release, grant.check):
            try:
                forbidden()
            except NotHeld:
                continue
            return 10
        if db_lock(grant.name, backend=backend).acquire(timeout=0):
            return 11  # got in beside the parent: through its session?
        with db_lock("c17:child", backend=backend, ttl=1.5):
            time.sleep(0.7)  # the child's heartbeat runs (every 0.5 s), for its own grant only
        # The parent's connections, dropped by the child, are collected: that must not
        # say goodbye to the server on the sockets the parent still uses.
        gc.collect()
        return 0
    except BaseException:
        traceback.print_exc()
        return 12


#: Seconds a forked child may run before SIGALRM ends it (its default action kills it).
CHILD_SECONDS = 30


@pytest.mark.catalogue("forked-child")
@pytest.mark.parametrize("backend", FORKABLE)
def test_a_forked_child_finds_every_guard_unlocked(backend: str) -> None:
    """fork() copies a lock as it is: a guard that another thread of the parent held
    at that moment would stay locked in the child forever. Here another thread holds
    every one of djlocks' guards (connections, history, listeners, the backends' own)
    while the parent forks; the child still takes and releases a lock."""
    with db_lock("fork:warm-up", backend=backend, ttl=3):  # start the listeners
        pass
    guards = list(forksafe._every_lock)
    holding, done = threading.Event(), threading.Event()

    def hold_every_guard() -> None:
        with contextlib.ExitStack() as stack:
            for guard in guards:
                stack.enter_context(guard)
            holding.set()
            done.wait(60)

    holder = threading.Thread(target=hold_every_guard)
    holder.start()
    try:
        assert holding.wait(10)
        child = fork_beside_threads()
        if child == 0:
            signal.alarm(CHILD_SECONDS)
            try:
                with db_lock("fork:guards", backend=backend, timeout=5, ttl=3):
                    pass
            except BaseException:
                traceback.print_exc()
                os._exit(12)
            os._exit(0)
        _, status = os.waitpid(child, 0)
    finally:
        done.set()
        holder.join(10)
    assert os.waitstatus_to_exitcode(status) == 0, "the child hung or failed (see above)"


BUSY_AT_EXIT = """
import sys, threading, django
django.setup()
from djlocks.backends.dedicated import DedicatedConnections
connections, running = DedicatedConnections("default"), threading.Semaphore(0)
def query_forever():
    while True:
        with connections.get().cursor() as cursor:
            running.release()
            cursor.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL "
                           "SELECT i + 1 FROM n WHERE i < 2000) SELECT count(*) FROM n")
            cursor.fetchall()
for _ in range(4):
    threading.Thread(target=query_forever, daemon=True).start()
for _ in range(400):
    running.acquire()
sys.exit(0)
"""


def test_a_process_exits_cleanly_while_its_threads_still_run_statements() -> None:
    """Daemon threads (the heartbeat, a user's workers) may be inside a statement on
    djlocks' connections when the interpreter exits: nothing closes a connection
    under them (on SQLite under Python 3.12 that was a segmentation fault, 8 times in 8)."""
    for _ in range(3):
        exited = subprocess.run(
            [sys.executable, "-c", BUSY_AT_EXIT], capture_output=True, text=True, timeout=60
        )
        assert exited.returncode == 0, exited.stderr[-3000:]


@pytest.mark.catalogue("late-acquire-reply", "lost-acquire-reply", "lost-release-reply")
@pytest.mark.parametrize("backend", NETWORKED)
def test_late_and_lost_replies_leave_no_orphan_and_free_nothing_newer(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder in another process talks to the server through a TCP proxy.
    8 (leases): its acquire's replies come later than its TTL: it does not believe,
    and nothing of it stays. 9: the acquire is applied and its reply lost, then the
    connection fails: the grant ends (at its TTL, or with its session), never two
    holders. 10: the release is applied and its reply lost: the retried release
    raises LockLost and leaves the newer holder's grant alone."""
    ttl = 1.0
    proxy = TcpProxy(int(connection.settings_dict["PORT"]))
    orders, report = CONTEXT.Queue(), CONTEXT.Queue()
    with monkeypatch.context() as patched:
        patched.setenv("DJLOCKS_DB_PORT", str(proxy.port))
        holder = start_worker(obey, "c9", backend, ttl, orders, report)

    def order(what: str) -> str:
        orders.put(what)
        return str(report.get(timeout=60))

    def order_then_lose_the_reply(what: str) -> str:
        proxy.drop_replies = True
        orders.put(what)
        time.sleep(1.0)  # the request reaches the server; the reply goes nowhere
        proxy.cut()
        proxy.heal()
        return str(report.get(timeout=60))

    try:
        assert (order("acquire"), order("release")) == ("held", "released")  # connected
        if backend in LEASES:
            proxy.reply_delay = 1.2
            assert order("acquire") == "not acquired", "a grant that came too late is believed"
            proxy.heal()
            time.sleep(ttl)
            assert backends[backend].holders("c9") == []
        assert order_then_lose_the_reply("acquire") == "BackendUnavailable"
        assert len(backends[backend].holders("c9")) <= 1
        began = time.monotonic()
        with db_lock("c9", backend=backend, timeout=5):
            assert time.monotonic() - began < ttl + 1.0, "the orphan outlived its TTL"
        assert order("acquire") == "held"
        assert order_then_lose_the_reply("release") in ("BackendUnavailable", "LockLost")
        with db_lock("c9", backend=backend, timeout=5) as newer:
            assert order("release") == "LockLost", "a retried release freed a newer grant"
            newer.check()
    finally:
        orders.put("stop")
        holder.join(20)
        proxy.close()


@pytest.mark.catalogue("forced-release")
@pytest.mark.parametrize("backend", FORCEABLE)
def test_a_holder_learns_of_a_forced_release_within_a_heartbeat(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """After a forced release the holder's heartbeat (every TTL/3) finds the grant gone
    and says so (``on_lost``), naming a forced release as a cause; its own release
    then raises LockLost."""
    ttl = 1.5
    lost_at: list[float] = []
    reasons: list[str] = []

    def lost(_: Grant, reason: str) -> None:
        reasons.append(reason)
        lost_at.append(time.monotonic())

    grant = db_lock("c23", backend=backend, ttl=ttl, on_lost=lost).acquire_grant()
    assert grant is not None
    began = time.monotonic()
    assert len(force_release(backends[backend].holders("c23"))) == 1
    learned = seconds_until_lost(lost_at, began)
    assert learned < ttl / 3 + 0.3, learned
    bounds(f"holder learns of a forced release after (TTL {ttl} s)", learned)
    assert "by force" in reasons[0], reasons
    with pytest.raises(LockLost):
        grant.release()


#: Seconds: the lease of the paused holders below.
PAUSE_TTL = 1.5


@pytest.mark.catalogue("paused-lease-holder")
@pytest.mark.parametrize("backend", LEASES)
def test_a_holder_paused_past_its_ttl_learns_it_lost_when_it_resumes(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """SIGSTOP past the TTL, another process takes the name: on SIGCONT the old
    holder's heartbeat, overdue, renews at once, finds the lease gone and says so."""
    _resumed_holder_learns(backend, bounds, end_the_grant=lambda: time.sleep(PAUSE_TTL + 0.3))


@pytest.mark.catalogue("paused-session-holder", backend="session")
@pytest.mark.skipif(connection.vendor == "sqlite", reason="no session backend on SQLite")
def test_a_paused_holder_whose_session_was_killed_learns_it_lost_when_it_resumes(
    bounds: Callable[[str, float], None],
) -> None:
    """SIGSTOP, then an administrator kills the holder's session: on SIGCONT its
    heartbeat's next keep-alive finds the session gone and says so."""

    def kill() -> None:
        (holder,) = backends["session"].holders("c-paused")
        kill_session(holder.connection_id or 0)

    _resumed_holder_learns("session", bounds, end_the_grant=kill)


def _resumed_holder_learns(
    backend: str, bounds: Callable[[str, float], None], end_the_grant: Callable[[], None]
) -> None:
    report = CONTEXT.Queue()
    worker = start_worker(hold_and_watch, "c-paused", PAUSE_TTL, report, backend)
    old_fence = report.get(timeout=30)
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        end_the_grant()
        with db_lock("c-paused", backend=backend, ttl=10, timeout=5) as grant:
            assert grant.fence > old_fence
            resumed = time.monotonic()
            os.kill(worker.pid, signal.SIGCONT)
            learned = report.get(timeout=10) - resumed
            grant.check()
        assert learned < PAUSE_TTL / 3 + 0.3, learned
        bounds(f"paused holder learns it lost after it resumes (TTL {PAUSE_TTL} s)", learned)
    finally:
        resume(worker.pid)
        worker.kill()
        worker.join(10)
