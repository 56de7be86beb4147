"""The row backend (SELECT ... FOR UPDATE in the caller's transaction) against the real
server: the contract, and the fault catalogue's exact-counter, semaphore-limit,
waiters-in-turn, lost-acquire-reply (through a TCP proxy),
deadlock-victim, forced-release and admin-matches-store on PostgreSQL and MariaDB, and on
SQLite the shape of its one write lock. try-lock-burst, holder-killed and
lock-covers-commit run for every backend in test_reliability.py; cancelled-acquires and
runlocked-supervision in test_contract.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from typing import TypeVar
from urllib.parse import urlencode

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

from djlocks import Lock, LockLost, NotAcquired, Semaphore
from djlocks.backends import backends
from djlocks.backends.row.dialect import ROW_GATE
from djlocks.backends.sql.postgresql import ADVISORY_HELD, LOCK_KEY
from djlocks.backends.waiting import Abort
from djlocks.exceptions import LockDeadlock, NotHeld
from djlocks.inspection import force_release
from djlocks.keys import advisory_key, table_key
from djlocks.models import LockEvent
from djlocks.stress import StressPlan, run_stress
from project.demo.models import FencedCounter
from tests.faults import TcpProxy, free_port
from tests.processes import advisory_lock_process
from tests.test_contract import held_in_another_thread
from tests.workers import CONTEXT, hold_then_report, start_worker

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(240)]
ROW = "row"
T = TypeVar("T")
SQLITE = connection.vendor == "sqlite"
servers_only = pytest.mark.skipif(
    SQLITE, reason="not applicable: SQLite has one write lock, no row locks"
)


@pytest.fixture(autouse=True)
def nothing_left_in_the_server(store: None) -> Iterator[None]:
    yield
    # MariaDB's view of transactions (INNODB_TRX) lags by up to a second, so a
    # grant that just committed may show for that long (see row.mysql).
    deadline = time.monotonic() + 2
    while backends[ROW].holders() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backends[ROW].holders() == [], "a row lock was left"
    assert backends[ROW].waiters() == [], "a waiter was left in the server"


def lock(name: str = "r:job", **options: object) -> Lock:
    return Lock(name, backend=ROW, ttl=3, **options)  # type: ignore[arg-type]


def in_other_thread(attempt: Callable[[], T]) -> T:
    """Run ``attempt()`` in a new thread (its own connection and transaction).

    Returns its result, or raises what it raised.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(attempt())
        except BaseException as exc:
            failure.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    if failure:
        raise failure[0]
    return outcome[0]


def try_elsewhere(name: str = "r:job") -> bool:
    def attempt() -> bool:
        other = lock(name)
        if other.acquire(timeout=0):
            other.release()
            return True
        return False

    return in_other_thread(attempt)


# -- the contract --------------------------------------------------------------


@servers_only
def test_the_row_stays_locked_until_the_callers_transaction_commits() -> None:
    with transaction.atomic():
        with lock() as grant:
            assert grant.expires_at is None
            assert not try_elsewhere(), "held inside the with block"
        assert not try_elsewhere(), "the with block ended, the transaction did not"
        assert backends[ROW].holders("r:job")[0].fence == grant.fence
    assert try_elsewhere(), "free once the transaction committed"


@servers_only
def test_a_full_semaphore_makes_no_other_name_look_busy() -> None:
    """Trying a semaphore whose slots are all held locks no row but its own: on InnoDB
    a range scan would lock the next record of the index, another name's row, until
    the trying transaction ends."""
    full = "r:full"
    after = next(  # a lock whose row comes right after the semaphore's in the index
        name for name in (f"r:after-{n}" for n in range(100)) if table_key(name) > table_key(full)
    )
    with lock(after):
        pass
    with (
        held_in_another_thread(full, ROW, limit=2, ttl=3),
        held_in_another_thread(full, ROW, limit=2, ttl=3),
        transaction.atomic(),
    ):
        assert not Semaphore(full, limit=2, backend=ROW, ttl=3).acquire(timeout=0)
        assert try_elsewhere(after), "the next name looks busy: its row was locked too"


def test_outside_a_transaction_the_with_block_is_the_transaction() -> None:
    FencedCounter.objects.create(name="rolled back", value=0)
    with pytest.raises(RuntimeError), lock():
        assert connection.in_atomic_block
        FencedCounter.objects.filter(name="rolled back").update(value=5)
        raise RuntimeError("the block fails")
    assert not connection.in_atomic_block
    assert FencedCounter.objects.get(name="rolled back").value == 0, "rolled back with the block"
    with lock():
        FencedCounter.objects.filter(name="rolled back").update(value=7)
    assert FencedCounter.objects.get(name="rolled back").value == 7, "committed at the end"
    assert try_elsewhere()


@servers_only
def test_the_blocks_own_exception_survives_a_connection_that_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder's connection is terminated (a forced release) and the server cannot
    be reached again when the block raises: the caller sees its own exception, not
    the failed rollback's, and the next acquire reconnects."""
    with pytest.raises(RuntimeError, match="the block fails"), lock("r:gone"):
        in_other_thread(
            lambda: force_release(backends[ROW].holders("r:gone"), reason="t", operator="ops")
        )
        monkeypatch.setitem(connection.settings_dict, "PORT", str(free_port()))
        raise RuntimeError("the block fails")
    monkeypatch.undo()
    assert not connection.in_atomic_block
    with lock("r:gone") as grant:
        assert grant.fence is not None
    assert try_elsewhere("r:gone")


@pytest.mark.catalogue("two-handles", backend=ROW)
def test_a_second_handle_waits_and_times_out_leaving_the_transaction_usable() -> None:
    with lock():

        def bounded_wait() -> tuple[bool, float, int]:
            # On SQLite the caller's own IMMEDIATE transaction could not even
            # begin while another holds the write lock: let djlocks open it.
            with contextlib.nullcontext() if SQLITE else transaction.atomic():
                began = time.monotonic()
                got = lock().acquire(timeout=0.3)
                waited = time.monotonic() - began
                usable = FencedCounter.objects.count()  # the transaction still works
            return got, waited, usable

        got, waited, usable = in_other_thread(bounded_wait)
        assert got is False and usable == 0
        assert 0.25 <= waited < 2.5, waited  # MySQL counts lock waits in whole seconds
        with pytest.raises(NotAcquired):
            in_other_thread(lambda: lock(timeout=0).__enter__())


def test_fences_rise_and_a_rolled_back_grant_never_gets_its_fence_again() -> None:
    fences = []
    for attempt in range(3):
        try:
            with transaction.atomic(), lock() as grant:
                fences.append(grant.fence)
                if attempt == 1:
                    raise ValueError("roll this transaction back")
        except ValueError:
            pass
    if SQLITE:  # the fence is written in the transaction itself (see row.sqlite)
        assert fences[2] == fences[1] > fences[0]
    else:
        assert fences == sorted(fences) and len(set(fences)) == 3


@servers_only
def test_a_semaphore_gives_its_slots_and_no_more() -> None:
    with transaction.atomic():
        slots = [Semaphore("r:pool", limit=3, backend=ROW) for _ in range(3)]
        grants = [slot.acquire_grant() for slot in slots]
        assert sorted(grant.slot for grant in grants if grant) == [0, 1, 2]
        assert not in_other_thread(
            lambda: Semaphore("r:pool", limit=3, backend=ROW).acquire(timeout=0.2)
        )
        assert len(backends[ROW].holders("r:pool")) == 3
        for slot in slots:
            slot.release()


@pytest.mark.skipif(not SQLITE, reason="SQLite only: the other databases have row locks")
def test_on_sqlite_a_semaphore_is_refused_and_the_lock_is_the_write_lock() -> None:
    with pytest.raises(ValueError, match="one write lock"):
        Semaphore("r:pool", limit=2, backend=ROW).acquire()
    with lock("r:one"):
        assert not try_elsewhere("r:another"), "any name: the database has one writer"
    assert backends[ROW].holders() == []  # documented: invisible on SQLite


def test_bad_uses_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="cool-down needs a lease backend"):
        lock(cooldown=5).acquire()
    with pytest.raises(TypeError, match="async code"):
        asyncio.run(lock().__aenter__())
    grant = lock().acquire_grant()
    assert grant is not None
    with pytest.raises(NotHeld, match="thread that acquired it"):
        in_other_thread(grant.release)
    grant.release()


# -- the fault catalogue -------------------------------------------------------


@pytest.mark.catalogue("exact-counter", backend=ROW)
def test_exact_counter_under_contention_8_processes() -> None:
    result = run_stress(StressPlan(ROW, processes=8, iterations=100), timeout=180)
    assert result.errors == []
    assert (result.counter, result.overlaps, result.max_concurrent) == (800, 0, 1)
    assert result.ok
    if not SQLITE:
        assert result.fences_increase


@pytest.mark.catalogue("semaphore-limit", backend=ROW)
@servers_only
def test_semaphore_never_exceeds_limit_and_reaches_it() -> None:
    plan = StressPlan(ROW, processes=12, iterations=12, limit=3, hold_ms=30, name="r:t2")
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok, result
    assert result.max_concurrent == 3


@pytest.mark.catalogue("waiters-in-turn", "admin-matches-store", backend=ROW)
@servers_only
def test_waiters_queue_in_the_server_and_show_with_identity(admin_client: Client) -> None:
    report = CONTEXT.Queue()
    with lock("r:seen", label="nightly import") as grant:
        waiters = []
        for position in range(2):
            waiters.append(start_worker(hold_then_report, "r:seen", 30, report, 0.05, ROW))
            deadline = time.monotonic() + 30
            while len(backends[ROW].waiters("r:seen")) <= position:
                assert time.monotonic() < deadline, "a waiter never showed in the server"
                time.sleep(0.05)
        (holder,) = backends[ROW].holders("r:seen")
        assert (holder.label, holder.fence, holder.slot) == ("nightly import", grant.fence, 0)
        assert holder.connection_id and holder.since
        queue = backends[ROW].waiters("r:seen")
        assert [waiter.pid for waiter in queue] == [worker.pid for worker in waiters]
        query = urlencode({"backend": ROW, "name": "r:seen"})
        page = admin_client.get(reverse("admin:djlocks_name") + "?" + query).content.decode()
        assert "nightly import" in page and str(holder.connection_id) in page
        assert all(str(worker.pid) in page for worker in waiters)
        assert "<td>with its transaction</td>" in page and "with its session" not in page
        listed = StringIO()
        call_command("djlocks", "list", "--backend", ROW, stdout=listed)
        assert "expires with its transaction" in listed.getvalue(), listed.getvalue()
    fences = [report.get(timeout=30) for _ in range(4)]
    held = [fence for event, _pid, fence in fences if event == "held"]
    assert held == sorted(held) and min(held) > grant.fence
    if connection.vendor == "postgresql":  # row lock queues are FIFO there
        assert [pid for event, pid, _ in fences if event == "held"] == [w.pid for w in waiters]
    for worker in waiters:
        worker.join(20)


@servers_only
def test_a_holder_that_waited_for_its_row_is_listed_until_it_ends() -> None:
    """On PostgreSQL a grant that waited took its row lock in a savepoint, under the XID
    of a subtransaction, which pg_locks no longer shows once the savepoint is released.
    (MariaDB lists a holder row younger than a second whose transaction it cannot see
    yet: the listing ends within a second of the release.)"""
    report = CONTEXT.Queue()
    holder = start_worker(hold_then_report, "r:waited", 30, report, 1.0, ROW)
    assert report.get(timeout=30)[0] == "held"
    with lock("r:waited", timeout=20) as grant:
        listed = backends[ROW].holders("r:waited")
        assert [held.token for held in listed] == [grant.token], listed
        grant.check()
    deadline = time.monotonic() + 2
    while backends[ROW].holders("r:waited"):
        assert time.monotonic() < deadline, "the holder is still listed after its release"
        time.sleep(0.05)
    holder.join(20)


@pytest.mark.catalogue("lost-acquire-reply", backend=ROW)
@servers_only
def test_a_lost_acquire_reply_leaves_no_orphan_lock() -> None:
    """The lock is applied, its reply lost, the connection then cut: the server ends
    the transaction, so the row is free at once and nobody else ever held it twice."""
    with transaction.atomic(), lock("r:lost"):
        pass  # the name's rows exist
    proxy = TcpProxy(int(connection.settings_dict["PORT"]))
    outcome: list[object] = []

    def acquire_through_the_proxy() -> None:
        from django.db import connections

        mine = connections["default"]
        mine.settings_dict = {**mine.settings_dict, "PORT": str(proxy.port)}
        try:
            with transaction.atomic():
                mine.cursor().execute("SELECT 1")  # connected through the proxy
                proxy.drop_replies_from = b"FOR UPDATE"  # the locking statement's reply
                outcome.append(lock("r:lost").acquire(timeout=0))
        except Exception as exc:
            outcome.append(exc)
        finally:
            mine.close()

    lost = threading.Thread(target=acquire_through_the_proxy)
    lost.start()
    try:
        assert proxy.dropping.wait(10), "the locking statement never went through the proxy"
        deadline = time.monotonic() + 10
        while in_other_thread(lambda: _try_row("r:lost")):
            assert time.monotonic() < deadline, "the server never applied the lost acquire"
            time.sleep(0.05)
        proxy.cut()
        proxy.heal()  # the network comes back: Django may reconnect to roll back
        lost.join(30)  # a loaded machine can take seconds to fail, reconnect and roll back
        assert outcome and isinstance(outcome[0], Exception), outcome
        cut = time.monotonic()
        while not in_other_thread(lambda: _try_row("r:lost")):
            assert time.monotonic() - cut < 1, "the server did not end the cut transaction"
            time.sleep(0.05)
    finally:
        proxy.close()
        lost.join(10)


def _try_row(name: str) -> bool:
    """Whether this thread could take ``name`` now (and give it back at once)."""
    attempt = lock(name)
    with transaction.atomic():
        if not attempt.acquire(timeout=0):
            return False
        attempt.release()
    return True


@pytest.mark.catalogue("deadlock-victim", backend=ROW)
@servers_only
def test_a_deadlock_between_two_names_has_one_typed_victim() -> None:
    both_hold_one = threading.Barrier(2)
    outcomes: list[str] = []

    def take(first: str, second: str) -> None:
        try:
            with transaction.atomic(), lock(first):
                both_hold_one.wait(10)
                with lock(second):
                    outcomes.append("proceeded")
        except LockDeadlock:
            outcomes.append("victim")
        finally:
            connection.close()

    pairs = (("r:a", "r:b"), ("r:b", "r:a"))
    threads = [threading.Thread(target=take, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == ["proceeded", "victim"]


@pytest.mark.catalogue("forced-release", backend=ROW)
@servers_only
def test_forced_release_ends_exactly_the_holders_transaction() -> None:
    def holder(name: str, hold: threading.Event, outcome: list[object]) -> None:
        try:
            with lock(name) as grant:
                outcome.append(grant)
                hold.wait(30)
                with pytest.raises(LockLost):
                    grant.check()
            outcome.append("committed")
        except LockLost:
            outcome.append("lost")
        finally:
            connection.close()

    hold_a, hold_b = threading.Event(), threading.Event()
    outcome_a: list[object] = []
    outcome_b: list[object] = []
    threads = [
        threading.Thread(target=holder, args=("r:a", hold_a, outcome_a)),
        threading.Thread(target=lambda: _hold_plainly("r:b", hold_b, outcome_b)),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while len(backends[ROW].holders()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    released = force_release(backends[ROW].holders("r:a"), reason="stuck", operator="ops")
    assert len(released) == 1
    assert try_elsewhere("r:a"), "free at once"
    hold_a.set()
    hold_b.set()
    for thread in threads:
        thread.join(30)
    assert outcome_a[1:] == ["lost"], "the holder's commit failed: LockLost"
    assert outcome_b[1:] == ["committed"], "another holder is untouched"
    assert LockEvent.objects.filter(name="r:a", kind="forced_release", operator="ops").exists()


def _hold_plainly(name: str, hold: threading.Event, outcome: list[object]) -> None:
    try:
        with lock(name) as grant:
            outcome.append(grant)
            hold.wait(30)
        outcome.append("committed")
    finally:
        connection.close()


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="not applicable: MariaDB decides a GET_LOCK's grant or time-out atomically",
)
def test_a_semaphore_gate_granted_as_its_wait_times_out_is_given_back() -> None:
    """A waiter for a full semaphore queues on the name's gate, a session advisory lock,
    under ``lock_timeout``. Its server process is stopped (in that wait) while the gate
    is handed to it and its time-out runs out; on resuming it sees both. Rolling back
    to the savepoint does not release a session lock: the waiter must give the gate
    back, or its connection keeps every later waiter of the name out."""
    name, limit = "r:gate-race", 2
    gate = advisory_key(name, ROW_GATE)
    held, leave, checked = threading.Semaphore(0), threading.Event(), threading.Event()
    outcome: list[object] = []

    def hold_a_slot() -> None:
        with transaction.atomic(), Semaphore(name, limit=limit, backend=ROW, ttl=3, timeout=5):
            held.release()
            leave.wait(30)
        connection.close()

    def wait(abort: Abort | None, timeout: float) -> None:
        semaphore = Semaphore(name, limit=limit, backend=ROW, ttl=3)
        outcome.append(semaphore.acquire_grant(timeout=timeout, abort=abort))
        checked.wait(30)  # the connection, which would hold a leaked gate, stays open
        connection.close()

    abort = Abort()
    threads = [threading.Thread(target=hold_a_slot) for _ in range(limit)]
    threads.append(threading.Thread(target=wait, args=(abort, 30)))  # holds the gate
    try:
        for thread in threads[:limit]:
            thread.start()
            assert held.acquire(timeout=10)
        threads[-1].start()
        gate_holder, _ = advisory_lock_process([gate], granted=True)
        threads.append(threading.Thread(target=wait, args=(None, 2.0)))
        threads[-1].start()
        waiter, _ = advisory_lock_process([gate], granted=False)
        assert waiter != gate_holder
        os.kill(waiter, signal.SIGSTOP)
        try:
            abort.set()  # the gate's holder gives it back: the server hands it over
            time.sleep(2.5)  # the stopped waiter's lock_timeout runs out
        finally:
            os.kill(waiter, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while len(outcome) < 2:
            assert time.monotonic() < deadline, "a waiter never returned"
            time.sleep(0.02)
        assert outcome == [None, None], "both waits end without a slot"
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT count(*) FROM pg_locks l WHERE {ADVISORY_HELD} AND {LOCK_KEY} = %s",
                (gate,),
            )
            assert cursor.fetchone()[0] == 0, "the gate is still held"
    finally:
        checked.set()
        leave.set()
        for thread in threads:
            thread.join(30)
