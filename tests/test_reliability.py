"""RELIABILITY.md catalogue items that run the same way on every backend.

Each test is parametrised over ``BACKENDS``, the backends configured for the
database DJLOCKS_DB picks: a new backend joins by being listed there. The
measured bounds go to docs/reliability.md (``make reliability``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
from django.db import connection

from djlocks import db_lock
from djlocks.backends import backends
from project.demo.models import FencedCounter
from tests.workers import CONTEXT, hold_then_report, read_modify_write, start_worker

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(240)]

#: Backends whose grants are leases: a dead holder's grant lasts until its TTL.
LEASES = ["default", "redis"]
#: Backends whose grants the server ends with the holder's session or transaction.
SERVER_HELD = ["row"] if connection.vendor == "sqlite" else ["session", "row"]
BACKENDS = LEASES + SERVER_HELD
#: On SQLite the row lock's fence is written in the holder's transaction, which the
#: kill rolls back, so the next grant gets the same fence (documented in row_sqlite).
FENCE_ROLLED_BACK = {"row"} if connection.vendor == "sqlite" else set()
#: Seconds: the lease of the item 5 holder, and how often item 5 is repeated.
CRASH_TTL, CRASH_ROUNDS = 1.5, 3


@pytest.mark.catalogue(5, 26)
@pytest.mark.parametrize("backend", BACKENDS)
def test_5_a_sigkilled_holder_frees_the_name_within_g4(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """G4: a session or row lock is free in under 1 s; a lease at its TTL (its last
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


@pytest.mark.catalogue(19)
@pytest.mark.parametrize("backend", BACKENDS)
def test_19_the_lock_covers_the_commit(backend: str) -> None:
    """4 workers x 50 read-modify-writes, each in ``transaction.atomic()`` under the
    lock (a row lock inside the transaction, any other around it): none is lost."""
    assert _counted_by_four_workers(f"covered:{backend}", "c19", backend) == 200


@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="not applicable: SQLite's IMMEDIATE transactions serialise every writer",
)
def test_19_the_negative_control_without_a_lock_loses_updates() -> None:
    """Item 19's control: the same workload with no lock loses updates, so the
    test above could fail."""
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
