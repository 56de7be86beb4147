"""Readers and writers (``djlocks.db_rwlock``) on every backend that takes semaphores:
readers together, a writer alone, writers preferred, time-outs that leave nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from djlocks import NotAcquired, db_rwlock
from djlocks.backends import backends
from djlocks.rwlock import GATE, RW_PREFIX
from djlocks.stress import StressPlan, run_stress
from tests.test_reliability import BACKENDS, LEASES
from tests.workers import CONTEXT, read_then_report, start_worker

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

#: The row backend cannot give back one of a thread's grants and keep the others.
RW_BACKENDS = [b for b in BACKENDS if b != "row"]
#: Seconds: the lease of the reader killed below.
KILLED_TTL = 1.5


def entered_in_a_thread(
    side: object, entered: threading.Event, leave: threading.Event
) -> threading.Thread:
    """Enter ``side`` (a reader or writer) in a thread, set ``entered``, stay until ``leave``."""

    def body() -> None:
        with side:  # type: ignore[attr-defined]
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=body)
    thread.start()
    return thread


@pytest.mark.parametrize("backend", RW_BACKENDS)
def test_readers_share_a_writer_waits_for_them_and_then_keeps_new_readers_out(
    backend: str,
) -> None:
    rw = db_rwlock("t-rw", max_readers=4, backend=backend, ttl=10)
    first_in, second_in, writer_in, late_in = (threading.Event() for _ in range(4))
    readers_leave, writer_leaves, late_leaves = (threading.Event() for _ in range(3))
    threads = [
        entered_in_a_thread(rw.read(), first_in, readers_leave),
        entered_in_a_thread(rw.read(), second_in, readers_leave),
    ]
    try:
        assert first_in.wait(10) and second_in.wait(10), "two readers at once"
        threads.append(entered_in_a_thread(rw.write(), writer_in, writer_leaves))
        deadline = time.monotonic() + 30
        while not backends[backend].holders(RW_PREFIX + "t-rw" + GATE):
            assert time.monotonic() < deadline, "the writer never took the gate"
            time.sleep(0.02)
        assert not writer_in.is_set(), "the writer waits for the readers"
        threads.append(entered_in_a_thread(rw.read(), late_in, late_leaves))
        assert not late_in.wait(0.5), "a reader arriving after the writer waits for it"
        with pytest.raises(NotAcquired), rw.read(timeout=0.2):
            pass
        readers_leave.set()
        assert writer_in.wait(10), "the writer enters once the readers left"
        assert not late_in.wait(0.3), "and is alone"
        writer_leaves.set()
        assert late_in.wait(10), "the waiting reader enters after the writer"
    finally:
        for event in (readers_leave, writer_leaves, late_leaves):
            event.set()
        for thread in threads:
            thread.join(30)
    assert backends[backend].holders() == []


@pytest.mark.parametrize("backend", RW_BACKENDS)
def test_writers_fences_rise_and_a_time_out_leaves_nothing_held(backend: str) -> None:
    rw = db_rwlock("t-rw-fence", max_readers=3, backend=backend, ttl=10)
    with rw.write() as first:
        pass
    with rw.write() as second:
        assert second.fence > first.fence
    with rw.read():
        writer = rw.write(timeout=0.2)
        assert writer.acquire_grant() is None
        held = backends[backend].holders()
        assert len(held) == 1, "the writer gave back the gate and every slot it had taken"
    assert backends[backend].holders() == []


def test_the_row_backend_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot hold a reader-writer lock"):
        db_rwlock("t", backend="row").read().acquire_grant()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        db_rwlock("t", max_readers=0)
    with pytest.raises(ValueError):
        db_rwlock("x" * 250)


@pytest.mark.strength
@pytest.mark.parametrize("backend", RW_BACKENDS)
def test_the_strength_test_of_readers_and_writers_holds_its_oracles(backend: str) -> None:
    """Processes read or write at random: never a writer with anyone else, no lost
    update, writers' fences rising, nothing held once done."""
    plan = StressPlan(backend, processes=4, iterations=15, hold_ms=1, name="t-rw-stress", mode="rw")
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok, result


@pytest.mark.catalogue("rw-reader-killed")
@pytest.mark.parametrize("backend", RW_BACKENDS)
def test_a_writer_enters_within_the_crash_release_bound_of_a_killed_readers_death(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    report = CONTEXT.Queue()
    reader = start_worker(read_then_report, "t-rw-killed", backend, KILLED_TTL, report)
    report.get(timeout=30)
    writer = db_rwlock("t-rw-killed", max_readers=4, backend=backend, ttl=10)
    assert writer.write(timeout=0).acquire_grant() is None, "a reader is in"
    assert reader.pid is not None
    os.kill(reader.pid, signal.SIGKILL)
    reader.join(10)
    killed = time.monotonic()
    with writer.write(timeout=KILLED_TTL + 5):
        entered = time.monotonic() - killed
    limit = KILLED_TTL + 1.0 if backend in LEASES else 1.0
    assert entered < limit, f"the writer entered {entered:.3f} s after the reader's kill"
    bounds(f"writer enters after a reader's SIGKILL (leases: TTL {KILLED_TTL} s)", entered)
