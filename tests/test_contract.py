"""The contract every backend keeps, run against each backend that the test settings
configure for the database DJLOCKS_DB picks, and the in-process backend.

What a test expects follows the backend's declared ``capabilities``, never its
class: a backend without semaphores or cool-downs must refuse them with a clear
error, one that keeps its grants in the caller's transaction must refuse async
code. What only one backend does is tested in that backend's own module.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from djlocks import Lock, LockLost, NotAcquired, NotHeld, Semaphore, async_waits, db_locks
from djlocks.backends import backends
from djlocks.backends.base import Capabilities
from djlocks.backends.push import hung_up
from djlocks.backends.waiting import Abort
from djlocks.grant import HELD_PAST_MAX_HOLD, Grant
from djlocks.inspection import force_release
from djlocks.runlocked import EXIT_CONFLICT, EXIT_LOST
from djlocks.stress import MULTI_SET, StressPlan, run_stress
from tests.processes import manage, wait_for_file
from tests.test_dedicated_connections import ask_the_server

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

#: The backends the test settings configure for this database (the catalogue's columns).
CONFIGURED = list(settings.DJLOCKS["BACKENDS"])
#: ... and the in-process backend, which keeps the same contract within one process.
EVERY = [*CONFIGURED, "locmem"]


@pytest.fixture(params=EVERY)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The alias of the backend under test; the in-process one is added for its tests."""
    alias = str(request.param)
    if alias != "locmem":
        yield alias
        return
    configured = settings.DJLOCKS["BACKENDS"]
    locmem = {"BACKEND": "djlocks.backends.locmem.LocMemBackend"}
    with override_settings(DJLOCKS={**settings.DJLOCKS, "BACKENDS": {**configured, alias: locmem}}):
        yield alias


#: For what the in-process backend cannot show: other processes, server sessions.
shared = pytest.mark.parametrize("backend", CONFIGURED)


def can(alias: str) -> Capabilities:
    return backends[alias].capabilities


@contextlib.contextmanager
def held_in_another_thread(
    name: str, backend: str, limit: int = 1, **options: Any
) -> Iterator[Grant]:
    """A grant of ``name`` held by a new thread until the block ends (a row lock's
    transaction belongs to the thread that took it, so that thread releases it)."""
    granted: queue.Queue[Grant] = queue.Queue()
    done = threading.Event()
    spec = Semaphore(name, limit=limit, backend=backend, **options)

    def hold() -> None:
        try:
            with spec as grant:
                granted.put(grant)
                done.wait(60)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        yield granted.get(timeout=30)
    finally:
        done.set()
        holder.join(30)


def test_a_name_has_one_holder_and_each_grant_a_higher_fence(backend: str) -> None:
    fences = []
    for _ in range(3):
        with held_in_another_thread("contract:one", backend, ttl=5) as grant:
            fences.append(grant.fence)
            assert not Lock("contract:one", backend=backend).acquire(timeout=0)
    assert fences == sorted(set(fences)) and len(fences) == 3


@pytest.mark.catalogue("two-handles")
@shared
def test_a_second_handle_in_the_same_thread_waits_like_anyone_else(backend: str) -> None:
    """Not re-entrant on any backend, although GET_LOCK and advisory locks are re-entrant
    per server session: each grant has a session of its own."""
    first = Lock("contract:twice", backend=backend, ttl=5)
    assert first.acquire(timeout=0)
    try:
        assert not Lock("contract:twice", backend=backend).acquire(timeout=0)
        assert not first.acquire(timeout=0), "the same handle does not re-enter either"
    finally:
        first.release()
    again = Lock("contract:twice", backend=backend)
    assert again.acquire(timeout=0), "free again after the release"
    again.release()


def test_releasing_what_is_not_held_raises_not_held(backend: str) -> None:
    lock = Lock("contract:unheld", backend=backend, ttl=5)
    with pytest.raises(NotHeld):
        lock.release()
    visible = can(backend).forced_release  # row locks on SQLite show no holder to anyone
    with lock:
        assert lock.locked() == visible
    # Row locks on MySQL: InnoDB's transaction table is a cache, so for about a second
    # after the commit the holder can still be shown (docs/backends/row.md).
    deadline = time.monotonic() + 2
    while lock.locked():
        assert time.monotonic() < deadline, "the holder is still shown after its release"
        time.sleep(0.05)
    with pytest.raises(NotHeld):
        lock.release()


def test_a_timeout_is_waited_out_and_a_with_block_raises_not_acquired(backend: str) -> None:
    with held_in_another_thread("contract:busy", backend, ttl=5):
        began = time.monotonic()
        assert not Lock("contract:busy", backend=backend).acquire(timeout=0.4)
        assert 0.35 <= time.monotonic() - began < 3
        with pytest.raises(NotAcquired), Lock("contract:busy", backend=backend, timeout=0):
            pass


def test_a_semaphore_grants_its_limit_of_slots_or_is_refused(backend: str) -> None:
    if not can(backend).semaphores:
        with pytest.raises(ValueError, match="emaphore"):
            Semaphore("contract:sem", limit=3, backend=backend).acquire(timeout=0)
        return
    grants: list[Grant] = []
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            grants.append(
                stack.enter_context(held_in_another_thread("contract:sem", backend, limit=3, ttl=5))
            )
        assert sorted(grant.slot for grant in grants) == [0, 1, 2]
        assert len({grant.fence for grant in grants}) == 3
        assert not Semaphore("contract:sem", limit=3, backend=backend).acquire(timeout=0)
        holders = backends[backend].holders("contract:sem")
        assert sorted((h.slot, h.limit) for h in holders) == [(0, 3), (1, 3), (2, 3)]


def test_a_cooldown_holds_the_name_back_or_is_refused(backend: str) -> None:
    lock = Lock("contract:cool", backend=backend, ttl=5, cooldown=2)
    if not can(backend).cooldowns:
        with pytest.raises(ValueError, match="cool-down"):
            lock.acquire(timeout=0)
        assert backends[backend].holders("contract:cool") == []
        return
    with lock:
        pass
    assert not Lock("contract:cool", backend=backend).acquire(timeout=0)
    assert backends[backend].cooldowns("contract:cool"), "the cool-down is shown"
    held_back = r"cool-down \(a release.s cooldown\) holds back 1 of its"
    with (
        pytest.raises(NotAcquired, match=held_back),
        Lock("contract:cool", backend=backend, timeout=0),
    ):
        pass
    later = Lock("contract:cool", backend=backend)
    assert later.acquire(timeout=5), "free once the cool-down is over"
    later.release()


def test_an_async_call_held_back_by_a_cooldown_is_told_so(backend: str) -> None:
    """The cool-down is read off the event loop (there the lease backend's reads were
    refused, and the message lost it)."""
    if not can(backend).cooldowns or can(backend).in_caller_transaction:
        return  # no cool-downs (the test above), or no async acquires
    with Lock("contract:cool-async", backend=backend, ttl=5, cooldown=5):
        pass

    @Lock("contract:cool-async", backend=backend, timeout=0)
    async def job() -> None:
        raise AssertionError("ran while held back")

    with pytest.raises(NotAcquired, match="holds back 1 of its released slot"):
        asyncio.run(job())


def test_a_sweep_removes_idle_names_and_one_that_comes_back_gets_higher_fences(
    backend: str,
) -> None:
    """Names nothing holds or cools down on, last granted longer ago than the idle
    time, leave the store; a name that comes back starts above every fence it had."""
    store, visible = backends[backend], can(backend).forced_release  # SQLite's row locks hide
    with Lock("idle:once", backend=backend, ttl=5) as first:
        pass
    if can(backend).semaphores:
        with Semaphore("idle:sem", limit=2, backend=backend, ttl=5) as sem_first:
            pass
    if can(backend).cooldowns:
        with Lock("idle:cooling", backend=backend, ttl=5, cooldown=30):
            pass
    with contextlib.ExitStack() as kept:
        if visible:
            kept.enter_context(held_in_another_thread("idle:held", backend, ttl=5))
        time.sleep(1.2)  # MySQL's row locks show a holder for up to a second after it ended
        swept = store.sweep(idle_names=0.5)
        left = {name for name, _ in store.names()}
    assert swept["idle names"] == 1 + can(backend).semaphores
    assert {"idle:once", "idle:sem"}.isdisjoint(left)
    assert ("idle:held" in left) == visible, "a held name stays, though granted long ago"
    assert ("idle:cooling" in left) == can(backend).cooldowns, "a cooling name stays"
    # This process still believes it created their rows: it finds them gone, and
    # creates them again, at once (not after a lock wait of the server's: InnoDB's is
    # 50 s, and the read that found them gone may lock what the insert needs).
    began = time.monotonic()
    with Lock("idle:once", backend=backend, ttl=5, timeout=5) as again:
        assert again.fence > first.fence
        store.holders()  # written (an advisory lock's records are, in the background)
    if can(backend).semaphores:
        with Semaphore("idle:sem", limit=2, backend=backend, ttl=5, timeout=5) as slot:
            assert slot.fence > sem_first.fence
    came_back = time.monotonic() - began
    assert came_back < 10, f"the swept names took {came_back:.1f} s to come back"
    assert "idle:once" in {name for name, _ in store.names()}


def test_many_names_are_taken_together_or_not_at_all(backend: str) -> None:
    names = ["multi:c", "multi:a", "multi:b"]
    with (
        held_in_another_thread("multi:b", backend, ttl=5),
        pytest.raises(NotAcquired),
        db_locks(names, backend=backend, ttl=5, timeout=0.3),
    ):
        pass
    with Lock("multi:a", backend=backend, ttl=5, timeout=0):
        pass  # free: the set gave back what it had taken (nor re-entrant, were it held)
    together = db_locks([*names, "multi:a"], backend=backend, ttl=5, timeout=5)
    assert together.names == ["multi:a", "multi:b", "multi:c"], "sorted, each once"
    with together as grants:
        assert sorted(grants) == ["multi:a", "multi:b", "multi:c"]
        assert all(isinstance(grant.fence, int) for grant in grants.values())
        if can(backend).forced_release:  # SQLite's row locks show no holder
            held = {h.name for h in backends[backend].holders() if h.name.startswith("multi:")}
            assert held == set(grants)
    with pytest.raises(ValueError, match="at least one"):
        db_locks([], backend=backend)
    with pytest.raises(TypeError, match="list of names"):
        db_locks("multi:a", backend=backend)


@shared
def test_sets_taken_in_opposite_orders_never_deadlock(backend: str) -> None:
    """Each thread asks for the same two names, in the opposite order, many times and
    with no time-out: taken one by one as asked, they would soon wait for each other
    forever."""
    done: list[str] = []

    def take(names: list[str]) -> None:
        try:
            for _ in range(10):
                with db_locks(names, backend=backend, ttl=5):
                    time.sleep(0.005)
            done.append(names[0])
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=take, args=(names,))
        for names in (["order:x", "order:y"], ["order:y", "order:x"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(done) == ["order:x", "order:y"], "a thread is still waiting"


@pytest.mark.strength
@shared
def test_the_strength_test_of_many_names_at_once_holds_its_oracles(backend: str) -> None:
    """Processes take two of four names together, at random: one holder per name at a
    time, no lost update, rising fences, and no name left held."""
    plan = StressPlan(backend, processes=4, iterations=25, hold_ms=1, name="multi", mode="multi")
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok, result
    assert result.counter == result.expected == 4 * 25 * MULTI_SET


def test_the_idle_time_of_names_is_checked_where_it_is_set() -> None:
    with pytest.raises(CommandError, match="at least 120 seconds"):
        call_command("djlocks", "sweep", "--idle-names", "5")
    out = io.StringIO()
    call_command("djlocks", "sweep", "--idle-names", "120", stdout=out)
    assert "idle names" in out.getvalue()


@shared
def test_more_tasks_wait_than_the_event_loops_executor_has_threads(backend: str) -> None:
    """Async waits run in djlocks' own threads: 8 tasks take one name in turn while the
    loop's default executor, where their releases run, has 2 threads. (When the waits
    ran there, they took both, the holder's release waited for a thread, and every
    wait ran out its time.)"""
    lock = Lock("contract:tasks", backend=backend, timeout=10, ttl=30)

    async def in_turn() -> tuple[list[object], float]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))

        async def one() -> None:
            async with lock:
                await asyncio.sleep(0.02)

        began = time.monotonic()
        outcomes = await asyncio.gather(*(one() for _ in range(8)), return_exceptions=True)
        return outcomes, time.monotonic() - began

    if can(backend).in_caller_transaction:
        with pytest.raises(TypeError, match="transaction"):
            asyncio.run(lock.aacquire(timeout=0))
        return
    outcomes, took = asyncio.run(in_turn())
    assert outcomes == [None] * 8
    assert took < 8, f"8 holds of 20 ms took {took:.1f} s"


@shared
def test_a_task_cancelled_while_queued_for_a_wait_thread_leaves_at_once(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one wait thread, taken by a task waiting 30 s for a held name, a second
    task queued behind it is cancelled: the cancellation ends at once, not when the
    thread is free, and the queued acquire never runs. (It waited for the thread.)"""
    if can(backend).in_caller_transaction:
        pytest.skip("not applicable: async acquires are refused (the previous test)")
    one_thread = ThreadPoolExecutor(1)
    monkeypatch.setattr(async_waits, "_threads", (os.getpid(), one_thread, one_thread))
    name = "contract:queued-cancel"

    async def cancel_the_queued() -> float:
        first = asyncio.ensure_future(Lock(name, backend=backend, ttl=30).aacquire(timeout=30))
        await asyncio.sleep(0.2)  # the first takes the only wait thread
        queued = asyncio.ensure_future(Lock(name, backend=backend, ttl=30).aacquire())
        await asyncio.sleep(0.2)
        began = time.monotonic()
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(queued, timeout=10)
        took = time.monotonic() - began
        assert queued.cancelled()
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return took

    with Lock(name, backend=backend, ttl=30):
        took = asyncio.run(cancel_the_queued())
    one_thread.shutdown()
    assert took < 10, f"the cancellation waited {took:.1f} s for the wait thread"
    assert backends[backend].waiters(name) == []
    with Lock(name, backend=backend, ttl=30, timeout=0):
        pass


@shared
def test_an_async_acquire_counts_its_time_queued_for_a_wait_thread_as_waiting(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one wait thread, taken for 0.6 s by a task waiting for a held name, a task
    queued behind it for a free name waited that long too, by its grant (which the
    history and the metrics read)."""
    if can(backend).in_caller_transaction:
        pytest.skip("not applicable: async acquires are refused (an earlier test)")
    one_thread = ThreadPoolExecutor(1)
    monkeypatch.setattr(async_waits, "_threads", (os.getpid(), one_thread, one_thread))
    held, free = "contract:queued-held", "contract:queued-free"

    async def queue_behind_a_wait() -> tuple[bool, float]:
        first = asyncio.ensure_future(Lock(held, backend=backend, ttl=30).aacquire(timeout=0.6))
        await asyncio.sleep(0.1)  # the first takes the only wait thread
        async with Lock(free, backend=backend, ttl=30) as grant:
            waited = grant.waited
        return await first, waited

    with Lock(held, backend=backend, ttl=30):
        first, waited = asyncio.run(queue_behind_a_wait())
    one_thread.shutdown()
    assert first is False
    assert waited >= 0.4, f"it waited {waited:.3f} s by its grant"


@shared
def test_tasks_that_hold_a_grant_never_queue_behind_the_waits_for_it(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More tasks than wait threads nest two locks: while the others wait for the outer
    one in every thread, its holder's acquire of the inner one waits in a thread of
    its own, so each task gets both. (Queued behind the waits, that acquire ran only
    once they had timed out: every waiter raised NotAcquired.)"""
    if can(backend).in_caller_transaction:
        pytest.skip("not applicable: async acquires are refused (the previous test)")
    monkeypatch.setattr(async_waits, "ASYNC_WAIT_THREADS", 2)
    monkeypatch.setattr(async_waits, "_threads", None)
    tasks = 4

    async def nested(task: int) -> None:
        outer = Lock("contract:outer", backend=backend, ttl=30, timeout=10)
        inner = Lock(f"contract:inner-{task}", backend=backend, ttl=30, timeout=10)
        async with outer, inner:  # the inner one is asked for once the outer one is held
            await asyncio.sleep(0.01)

    async def all_of_them() -> list[object]:
        return await asyncio.gather(
            *(nested(task) for task in range(tasks)), return_exceptions=True
        )

    try:
        outcomes = asyncio.run(all_of_them())
    finally:
        made = async_waits._threads
        if made is not None:
            for threads in made[1:]:
                threads.shutdown()
    assert outcomes == [None] * tasks


@shared
@pytest.mark.catalogue("cancelled-acquires")
def test_cancelled_waits_leave_nothing_behind(backend: str) -> None:
    """While the name is held: 20 waits ended by an abort from another thread (as a
    signal handler or a time limit ends them), then 20 async waits cancelled (or async
    refused where grants live in the caller's transaction). Afterwards no waiter is
    left, the holder is untouched, and a fresh acquire gets the name at once."""
    rng = random.Random(7)

    def aborted_wait() -> Grant | None:
        abort = Abort()
        timer = threading.Timer(rng.uniform(0, 0.05), abort.set)
        timer.start()
        try:
            return Lock("contract:cancel", backend=backend).acquire_grant(abort=abort)
        finally:
            timer.join()
            connections.close_all()

    async def cancelled_waits() -> None:
        for _ in range(20):
            attempt = asyncio.ensure_future(Lock("contract:cancel", backend=backend).aacquire())
            await asyncio.sleep(rng.uniform(0, 0.05))
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt

    with held_in_another_thread("contract:cancel", backend, ttl=5) as held:
        with ThreadPoolExecutor(1) as elsewhere:
            for _ in range(20):
                assert elsewhere.submit(aborted_wait).result(timeout=30) is None
        if can(backend).in_caller_transaction:
            with pytest.raises(TypeError, match="transaction"):
                asyncio.run(Lock("contract:cancel", backend=backend).aacquire(timeout=0))
        else:
            asyncio.run(cancelled_waits())
        deadline = time.monotonic() + 5  # a killed server session ends a moment later
        while backends[backend].waiters("contract:cancel"):
            assert time.monotonic() < deadline, "a cancelled waiter was left"
            time.sleep(0.05)
        held.check()
    began = time.monotonic()
    fresh = Lock("contract:cancel", backend=backend)
    assert fresh.acquire(timeout=5)
    fresh.release()
    assert time.monotonic() - began < 1


def test_a_forced_release_ends_the_grant_and_its_holder_learns_it(backend: str) -> None:
    lock = Lock("contract:forced", backend=backend, ttl=5)
    if not can(backend).forced_release:
        with lock, pytest.raises(ValueError, match="by force"):
            backends[backend].force_release("contract:forced")
        return
    assert lock.acquire(timeout=0)
    try:
        taken = force_release(backends[backend].holders("contract:forced"), operator="test")
        assert len(taken) == 1
    finally:
        with pytest.raises(LockLost):
            lock.release()
    assert backends[backend].holders("contract:forced") == []


def test_a_grant_held_past_max_hold_is_lost_and_the_next_waiter_gets_it(backend: str) -> None:
    """A holder that hangs while its heartbeat renews: past ``max_hold`` it stops
    believing, hears ``HELD_PAST_MAX_HOLD`` and ``LockLost``, and the store frees the
    slot at once (long before the 30 s TTL would)."""
    if not can(backend).forced_release:
        with pytest.raises(ValueError, match="max_hold"):
            Lock("contract:max-hold", backend=backend, max_hold=0.5).acquire(timeout=0)
        return
    reasons: list[str] = []

    def lost(grant: Grant, reason: str) -> None:  # fails: the grant is taken back all the same
        reasons.append(reason)
        raise RuntimeError("an on_lost callback that fails")

    hung = Lock("contract:max-hold", backend=backend, ttl=30, max_hold=0.5, on_lost=lost)
    granted: queue.Queue[Grant] = queue.Queue()
    released: queue.Queue[str] = queue.Queue()
    done = threading.Event()

    def hang() -> None:  # in a thread of its own: a row lock lives in its transaction
        try:
            grant = hung.acquire_grant(timeout=5)
            assert grant is not None
            granted.put(grant)
            done.wait(60)
            try:
                grant.release()
            except LockLost as exc:
                released.put(str(exc))
        finally:
            connections.close_all()

    holder = threading.Thread(target=hang)
    holder.start()
    try:
        grant = granted.get(timeout=30)
        began = time.monotonic()
        with Lock("contract:max-hold", backend=backend, timeout=10) as successor:
            waited = time.monotonic() - began
            assert successor.fence > grant.fence
        assert 0.3 < waited < 5
        assert not grant.believed
    finally:
        done.set()
        holder.join(30)
    assert HELD_PAST_MAX_HOLD in released.get(timeout=1)
    deadline = time.monotonic() + 10  # the heartbeat tells the holder once it took it back
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons == [HELD_PAST_MAX_HOLD]
    assert grant.token not in {
        held.token for held in backends[backend].holders("contract:max-hold")
    }


def test_max_hold_is_checked_as_it_is_given() -> None:
    for wrong in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_hold"):
            Lock("contract:max-hold", max_hold=wrong)
    with pytest.raises(TypeError, match="max_hold"):
        Lock("contract:max-hold", max_hold="5")  # type: ignore[arg-type]


@shared
@pytest.mark.catalogue("runlocked-supervision")
def test_runlocked_supervises_its_command(backend: str, tmp_path: Path) -> None:
    """``runlocked -n`` exits 75 while the name is held; the command's status is passed
    through; a forced release stops the command (exit 71); a SIGKILLed ``runlocked``
    frees the name within the backend's crash-release bound."""
    command = ["runlocked", "contract:cron", "--backend", backend]
    with held_in_another_thread("contract:cron", backend, ttl=5):
        assert manage(*command, "-n", "--", "true").wait(60) == EXIT_CONFLICT
    assert manage(*command, "--", "sh", "-c", "exit 7").wait(60) == 7
    started = tmp_path / "started"
    running = [*command, "--ttl", "1.5", "--kill-after", "0.5", "--", "sh", "-c"]
    if can(backend).forced_release:
        wrapper = manage(*running, f"echo running > {started}; exec sleep 300")
        wait_for_file(started)
        assert len(force_release(backends[backend].holders("contract:cron"))) == 1
        assert wrapper.wait(10) == EXIT_LOST
        started.unlink()
    wrapper = manage(*running, f"echo running > {started}; exec sleep 300")
    wait_for_file(started)
    wrapper.kill()
    wrapper.wait(10)
    killed = time.monotonic()
    bound = 1.5 + 0.5 if can(backend).crash_release == "ttl" else 1.0
    with Lock("contract:cron", backend=backend, timeout=bound + 5):
        assert time.monotonic() - killed < bound


def server_session_of(wrapper: Any) -> int:
    """The server's id of the session of the Django connection ``wrapper``."""
    return ask_the_server(wrapper, "SELECT pg_backend_pid()", "SELECT CONNECTION_ID()")


@pytest.mark.parametrize(
    "backend", [alias for alias in CONFIGURED if alias in ("default", "session")]
)
def test_the_first_acquire_after_the_server_ended_an_idle_session_is_granted(
    backend: str,
) -> None:
    """An administrator (or a restart) ends djlocks' idle session of this thread: the next
    acquire opens a new one and is granted, as Django reconnects its own connections,
    rather than failing once per thread with ``BackendUnavailable``."""
    store = backends[backend]
    if connections["default"].vendor == "sqlite":
        pytest.skip("not applicable: an SQLite store has no server session to end")
    with Lock("contract:ended", backend=backend, timeout=5):
        pass  # this thread's session exists, idle now
    sessions = store._idle if backend == "session" else None  # type: ignore[attr-defined]
    idle = sessions[-1].wrapper if sessions else store._connections.get()  # type: ignore[attr-defined]
    ended = server_session_of(idle)
    with connections["default"].cursor() as cursor:
        if connections["default"].vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [ended])
        else:
            cursor.execute("KILL CONNECTION %s", [ended])
    deadline = time.monotonic() + 5  # MariaDB's KILL ends the session a moment later
    while not hung_up(idle.connection.fileno()):
        assert time.monotonic() < deadline, "the server never ended the session"
        time.sleep(0.01)
    with Lock("contract:ended", backend=backend, timeout=5) as grant:
        grant.check()
