"""Leader election (``djlocks.leadership``) on every backend: one leader at a time,
terms that rise, stepping down, deposition, and a standby taking over from a
leader that died or was paused."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from djlocks import NotAcquired, NotLeader, leadership
from djlocks.backends import backends
from djlocks.fencing import StaleFence, fenced_update
from djlocks.inspection import force_release
from djlocks.leadership import STEPPED_DOWN, Leadership, elected_name, election_name
from djlocks.stress import StressPlan, run_stress
from project.demo.models import FencedCounter
from tests.processes import resume
from tests.test_reliability import BACKENDS, FORCEABLE, LEASES, NETWORKED
from tests.workers import CONTEXT, campaign, check_cut_off_bounds, proxied_worker, start_worker

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

#: Seconds: the lease of the leaders that die or pause below.
LEADER_TTL = 1.5
#: The row backend on SQLite refuses a leadership (its grant holds the one write lock).
ELECTING = [alias for alias in BACKENDS if not (alias == "row" and connection.vendor == "sqlite")]
#: Backends whose store is a server that a leader can be cut off from.
CUT_OFF = [*NETWORKED, "redis"]


def recorded(events: queue.Queue[tuple[Any, ...]], who: str) -> dict[str, Callable[..., None]]:
    """``on_elected`` and ``on_deposed`` callbacks that put what happens in ``events``."""
    return {
        "on_elected": lambda term: events.put((who, "elected", term)),
        "on_deposed": lambda term, reason: events.put((who, "deposed", term, reason)),
    }


@pytest.mark.parametrize("backend", ELECTING)
def test_one_leader_at_a_time_and_the_standby_takes_over_with_a_higher_term(backend: str) -> None:
    events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    first = Leadership("t-lead", backend=backend, ttl=10, **recorded(events, "first")).start()
    second = Leadership("t-lead", backend=backend, ttl=10, **recorded(events, "second"))
    try:
        assert first.wait_until_leader(10)
        term = first.term
        assert term is not None and events.get(timeout=5) == ("first", "elected", term)
        second.start()
        assert not second.wait_until_leader(0.5)
        assert (first.is_leader, second.is_leader, second.term) == (True, False, None)
        assert first.check() == term
        with pytest.raises(NotLeader):
            second.check()
        leader = first.leader()
        assert leader is not None and (leader.pid, leader.fence) == (os.getpid(), term)
        first.stop()
        assert events.get(timeout=5) == ("first", "deposed", term, STEPPED_DOWN)
        assert second.wait_until_leader(10)
        assert second.term is not None and second.term > term
        assert events.get(timeout=5) == ("second", "elected", second.term)
        assert not first.is_leader
    finally:
        first.stop()
        second.stop()
    assert not backends[backend].holders(election_name("t-lead"))


@pytest.mark.parametrize("backend", ELECTING)
def test_the_with_form_waits_to_be_elected_and_steps_down_on_leaving(backend: str) -> None:
    with leadership("t-with", backend=backend) as leader:
        term = leader.check()
        with pytest.raises(NotAcquired), leadership("t-with", backend=backend, timeout=0.2):
            pass
    assert (leader.is_leader, leader.term) == (False, None)
    with pytest.raises(NotLeader):
        leader.check()
    with leadership("t-with", backend=backend, timeout=5) as again:
        assert again.check() > term


@pytest.mark.parametrize("backend", FORCEABLE)
def test_a_forced_release_deposes_the_leader_which_stands_by_and_is_elected_again(
    backend: str,
) -> None:
    events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    leader = Leadership("t-forced", backend=backend, ttl=3, **recorded(events, "leader"))
    leader.start()
    try:
        assert leader.wait_until_leader(10)
        term = leader.term
        events.get(timeout=5)
        force_release(backends[backend].holders(leader.lock.name), reason="leadership test")
        _, what, deposed_term, reason = events.get(timeout=5)[:4]
        assert (what, deposed_term) == ("deposed", term) and reason != STEPPED_DOWN
        assert events.get(timeout=10)[1] == "elected"  # nobody else stands: elected again
        assert leader.term is not None and term is not None and leader.term > term
    finally:
        leader.stop()


def test_bad_names_and_a_second_start_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="at most 240 characters"):
        leadership("x" * 250)
    with pytest.raises(ValueError):
        leadership("")
    with pytest.raises(RuntimeError, match="call start"):
        leadership("t-unstarted").wait_until_leader(0)
    assert elected_name(election_name("beat")) == "beat" and elected_name("beat") is None


@pytest.mark.skipif(connection.vendor != "sqlite", reason="row locks on SQLite only")
def test_the_row_backend_on_sqlite_refuses_a_leadership() -> None:
    with pytest.raises(ValueError, match="cannot hold a leadership"):
        leadership("t-row", backend="row").start()


@pytest.mark.catalogue("leader-killed")
@pytest.mark.parametrize("backend", ELECTING)
def test_a_standby_takes_over_within_one_ttl_of_the_leaders_death(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    report = CONTEXT.Queue()
    worker = start_worker(campaign, "t-killed", backend, LEADER_TTL, report)
    what, pid, dead_term = report.get(timeout=30)
    assert what == "elected"
    events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    standby = Leadership("t-killed", backend=backend, ttl=10, **recorded(events, "standby"))
    standby.start()
    try:
        assert not standby.wait_until_leader(0.2)
        os.kill(pid, signal.SIGKILL)
        worker.join(10)
        killed = time.monotonic()
        assert standby.wait_until_leader(LEADER_TTL + 5)
        took_over = time.monotonic() - killed
        assert standby.term is not None and standby.term > dead_term
    finally:
        standby.stop()
    limit = LEADER_TTL + 1.0 if backend in LEASES else 1.0
    assert took_over < limit, f"the standby took over {took_over:.3f} s after the kill"
    bounds(f"standby leads after the leader's SIGKILL (leases: TTL {LEADER_TTL} s)", took_over)


@pytest.mark.catalogue("leader-paused")
@pytest.mark.parametrize("backend", LEASES)
def test_a_paused_leader_is_replaced_learns_it_was_deposed_and_its_term_is_refused(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """SIGSTOP the leader past its TTL: a standby leads with a higher term and writes;
    on SIGCONT the old leader says it was deposed, and a write in its term is refused."""
    report = CONTEXT.Queue()
    worker = start_worker(campaign, "t-paused", backend, LEADER_TTL, report, False)
    what, pid, old_term = report.get(timeout=30)
    assert what == "elected"
    FencedCounter.objects.create(name="t-paused", value=0, fence=0)
    counter = FencedCounter.objects.filter(name="t-paused")
    os.kill(pid, signal.SIGSTOP)
    try:
        with leadership("t-paused", backend=backend, ttl=10, timeout=LEADER_TTL + 5) as new:
            assert new.term is not None and new.term > old_term
            fenced_update(counter, new.term, value=1)
            resumed = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            deposed = report.get(timeout=10)
            assert deposed[:3] == ("deposed", pid, old_term)
            learned = deposed[4] - resumed
            with pytest.raises(StaleFence):
                fenced_update(counter, old_term, value=99)
            assert new.check() == new.term
        assert counter.get().value == 1
    finally:
        resume(pid)
        worker.kill()
        worker.join(10)
    assert learned < LEADER_TTL / 3 + 0.3, learned
    bounds(f"paused leader learns it was deposed after it resumes (TTL {LEADER_TTL} s)", learned)


@pytest.mark.catalogue("leader-cut-off")
@pytest.mark.parametrize("backend", CUT_OFF)
def test_a_leader_cut_off_from_its_store_is_replaced_and_its_term_is_refused(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """Leases: a silent partition. The leader steps down when its belief runs out, before
    its lease ends at the store and the standby is elected. Session and row locks: its
    connection is cut and the server unreachable. The server ends its session, so the
    standby leads at once, and the old leader hears of it at its next check. Either way
    the new term is higher and a write in the old term is refused."""
    report = CONTEXT.Queue()
    elected: list[float] = []
    FencedCounter.objects.create(name="t-cut", value=0, fence=0)
    counter = FencedCounter.objects.filter(name="t-cut")
    with proxied_worker(backend, campaign, "t-cut", backend, LEADER_TTL, report, False) as (
        proxy,
        _,
    ):
        what, pid, old_term = report.get(timeout=30)
        assert what == "elected"
        standby = Leadership(
            "t-cut", backend=backend, ttl=10, on_elected=lambda _: elected.append(time.monotonic())
        ).start()
        try:
            assert not standby.wait_until_leader(0.2)
            proxy.cut_off(silent=backend in LEASES)
            cut = time.monotonic()
            assert standby.wait_until_leader(LEADER_TTL + 5)
            assert standby.term is not None and standby.term > old_term
            fenced_update(counter, standby.term, value=1)
            deposed = report.get(timeout=10)
            assert deposed[:3] == ("deposed", pid, old_term)
            with pytest.raises(StaleFence):
                fenced_update(counter, old_term, value=99)
            assert standby.check() == standby.term
        finally:
            standby.stop()
    assert counter.get().value == 1
    took_over, stepped_down = elected[0] - cut, deposed[4] - cut
    check_cut_off_bounds(
        lease=backend in LEASES, ttl=LEADER_TTL, other_in=took_over, told=stepped_down
    )
    bounds(f"standby leads after its leader is cut off (leases: TTL {LEADER_TTL} s)", took_over)
    bounds("a cut-off leader steps down", stepped_down)


@pytest.mark.skipif(connection.vendor == "sqlite", reason="no session backend on SQLite")
def test_the_session_backend_shows_standbys_in_line() -> None:
    first = Leadership("t-standbys", backend="session", label="first").start()
    second = Leadership("t-standbys", backend="session", label="second")
    try:
        assert first.wait_until_leader(10)
        second.start()
        deadline = time.monotonic() + 5
        while not first.standbys() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [waiter.label for waiter in first.standbys()] == ["second"]
    finally:
        second.stop()
        first.stop()


@pytest.mark.strength
@pytest.mark.parametrize("backend", ELECTING)
def test_the_strength_test_of_leader_election_holds_its_oracles(backend: str) -> None:
    """Four processes win, lead for one increment and step down, one dying as the leader
    halfway: one leader at a time, no lost update, one leader per term, rising terms."""
    plan = StressPlan(
        backend,
        processes=4,
        iterations=10,
        hold_ms=1,
        ttl=2,
        name="t-stress",
        mode="leader",
        kill=1,
    )
    result = run_stress(plan, timeout=180)
    assert result.errors == [] and result.ok, result
    assert result.counter == result.expected == 3 * 10 + 5


def test_a_leader_stepping_down_hears_on_deposed_while_it_still_holds() -> None:
    """So that its term's work stops before a standby is elected."""
    held_when_deposed: list[bool] = []
    leader = Leadership(
        "t-order",
        on_deposed=lambda term, reason: held_when_deposed.append(
            bool(backends["default"].holders(election_name("t-order")))
        ),
    ).start()
    assert leader.wait_until_leader(10)
    leader.stop()
    assert held_when_deposed == [True]
    assert backends["default"].holders(election_name("t-order")) == []
