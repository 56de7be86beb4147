"""Faults of what is made of several grants: the writer of a ``db_rwlock`` and a set of
names taken together with ``db_locks``, whose holder is SIGKILLed, paused, or cut off
from its store. Another process gets in within the crash-release bound; a holder cut
off from a lease store is told of its loss before that, a paused one when it resumes."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from djlocks import NotAcquired, db_locks, db_rwlock
from djlocks.backends import backends
from tests.processes import resume
from tests.test_reliability import BACKENDS, LEASES, NETWORKED
from tests.test_rwlock import RW_BACKENDS
from tests.workers import (
    CONTEXT,
    check_cut_off_bounds,
    hold_together_until_lost,
    proxied_worker,
    start_worker,
)

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

#: Seconds: the lease of the holders that die or are cut off below.
TTL = 1.5
#: Backends whose store is a server that a holder can be cut off from.
CUT_OFF = [*NETWORKED, "redis"]


def the_other_side(kind: str, name: str, backend: str, timeout: float) -> Any:
    """What excludes the holder of ``kind``: a reader of the ``db_rwlock`` ``name``, or
    the same set of names, taken from this process within ``timeout`` seconds."""
    if kind == "writer":
        return db_rwlock(name, max_readers=4, backend=backend, ttl=10).read(timeout=timeout)
    names = [f"{name}:a", f"{name}:b", f"{name}:c"]
    return db_locks(names, backend=backend, ttl=10, timeout=timeout)


def gets_in_now(kind: str, name: str, backend: str) -> bool:
    """Whether the other side of ``kind`` gets in at once (and it leaves again)."""
    try:
        with the_other_side(kind, name, backend, 0):
            return True
    except NotAcquired:
        return False


def seconds_until_entered(other: AbstractContextManager[Any], since: float) -> float:
    with other:
        return time.monotonic() - since


@pytest.mark.catalogue("many-holder-killed")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_set_whose_holder_is_killed_is_taken_within_the_crash_release_bound(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    report = CONTEXT.Queue()
    holder = start_worker(hold_together_until_lost, "set", "t-set-killed", backend, TTL, report)
    what, pid = report.get(timeout=30)
    assert what == "held"
    assert not gets_in_now("set", "t-set-killed", backend)
    os.kill(pid, signal.SIGKILL)
    holder.join(10)
    killed = time.monotonic()
    entered = seconds_until_entered(the_other_side("set", "t-set-killed", backend, TTL + 5), killed)
    limit = TTL + 1.0 if backend in LEASES else 1.0
    assert entered < limit, f"the set was taken {entered:.3f} s after its holder's kill"
    bounds(f"a set is taken after its holder's SIGKILL (leases: TTL {TTL} s)", entered)


@pytest.mark.parametrize(
    ("backend", "kind"),
    [
        *(
            pytest.param(alias, "writer", marks=pytest.mark.catalogue("rw-writer-cut-off"))
            for alias in CUT_OFF
            if alias in RW_BACKENDS
        ),
        *(
            pytest.param(alias, "set", marks=pytest.mark.catalogue("many-cut-off"))
            for alias in CUT_OFF
        ),
    ],
)
def test_a_holder_cut_off_from_its_store_is_told_and_the_other_side_gets_in(
    backend: str, kind: str, bounds: Callable[[str, float], None]
) -> None:
    """Leases: a silent partition; the holder hears of its loss when its belief runs
    out, before its leases end at the store and the other side gets in. Session and row
    locks: the connection is cut and the server unreachable; the server ends the
    holder's session, so the other side gets in at once, and the holder hears of its
    loss at its next check."""
    name = f"t-cut-{kind}"
    report = CONTEXT.Queue()
    with proxied_worker(backend, hold_together_until_lost, kind, name, backend, TTL, report) as (
        proxy,
        worker,
    ):
        assert report.get(timeout=30)[0] == "held"
        other = the_other_side(kind, name, backend, TTL + 5)
        assert not gets_in_now(kind, name, backend)
        proxy.cut_off(silent=backend in LEASES)
        cut = time.monotonic()
        entered = seconds_until_entered(other, cut)
        try:
            what, reason, at = report.get(timeout=10)
        except queue.Empty:
            pytest.fail("the cut-off holder was never told of its loss")
    assert what == "lost", reason
    told = at - cut
    check_cut_off_bounds(lease=backend in LEASES, ttl=TTL, other_in=entered, told=told)
    bounds(f"the other side gets in after a {kind}'s holder is cut off (TTL {TTL} s)", entered)
    bounds(f"a cut-off {kind}'s holder is told of its loss", told)
    if backend in LEASES:  # its other leases may outlive the first by a renewal's spacing
        until_no_lease_of(worker.pid, backend, TTL)


def until_no_lease_of(pid: int | None, backend: str, ttl: float) -> None:
    """Wait until no lease of the process ``pid`` is left at the store: each ends within
    ``ttl`` seconds of its last renewal (the test's clean-up checks that none is left)."""
    deadline = time.monotonic() + ttl + 1
    while any(holder.pid == pid for holder in backends[backend].holders()):
        assert time.monotonic() < deadline, f"a lease of pid {pid} outlived its TTL"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("backend", "kind"),
    [
        pytest.param(alias, kind, marks=pytest.mark.catalogue(slug))
        for alias in LEASES
        for kind, slug in (("writer", "rw-writer-paused"), ("set", "many-holder-paused"))
    ],
)
def test_a_holder_paused_past_its_ttl_is_passed_and_told_when_it_resumes(
    backend: str, kind: str, bounds: Callable[[str, float], None]
) -> None:
    """SIGSTOP the holder past its TTL: the other side gets in; on SIGCONT the holder
    is told of its loss at once, while the other side still holds."""
    name = f"t-paused-{kind}"
    report = CONTEXT.Queue()
    holder = start_worker(hold_together_until_lost, kind, name, backend, TTL, report)
    what, pid = report.get(timeout=30)
    assert what == "held"
    os.kill(pid, signal.SIGSTOP)
    try:
        paused = time.monotonic()
        with the_other_side(kind, name, backend, TTL + 5):
            entered = time.monotonic() - paused
            resumed = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            what, reason, at = report.get(timeout=10)
    finally:
        resume(pid)
        holder.kill()
        holder.join(10)
    assert what == "lost", reason
    learned = at - resumed
    assert entered < TTL + 1.0, f"the other side got in after {entered:.3f} s"
    assert learned < TTL / 3 + 0.3, f"the holder was told {learned:.3f} s after it resumed"
    bounds(f"a paused {kind}'s holder is told of its loss after it resumes (TTL {TTL} s)", learned)
