"""Session backends (GET_LOCK on MariaDB, advisory locks on PostgreSQL) against the
real server: the contract, crash release, forced release, identity, interoperation
with the mysql and psql clients, the lock covering the commit, and a PgBouncer in
transaction pooling mode refused (cancellation, cool-downs and runlocked are in
test_contract.py).

They run in the postgresql and mysql runs of `make test` (CI runs all three);
SQLite has no session locks, so the sqlite run does not collect them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from urllib.parse import urlencode

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test import Client
from django.urls import reverse

from djlocks import Grant, Lock, LockLost, Semaphore, recent
from djlocks.backends import backends
from djlocks.backends.server_records import holder_records
from djlocks.backends.session import Key, SessionBackend, claims
from djlocks.backends.session import connections as session_connections
from djlocks.backends.sql import mysql
from djlocks.backends.sql.postgresql import (
    ADVISORY_WAITING,
    CRASH_GAP,
    CRASH_MARKER,
    FENCE_SEQUENCE,
    LOCK_KEY,
)
from djlocks.events import events
from djlocks.exceptions import BackendUnavailable, LockDeadlock, LockError
from djlocks.inspection import force_release
from djlocks.keys import GATE
from djlocks.runlocked import EXIT_UNAVAILABLE
from djlocks.stress import StressPlan, current_database_names, manage_command, run_stress
from tests.faults import PgBouncer, TcpProxy
from tests.processes import advisory_lock_process, manage, resume
from tests.test_dedicated_connections import server_sessions
from tests.workers import (
    CONTEXT,
    acquired_in_another_thread,
    hold_without_renewal_then_release,
    seconds_until_lost,
    start_worker,
    wait_in_line,
)

pytestmark = [
    pytest.mark.usefixtures("store"),
    pytest.mark.skipif(
        connection.vendor == "sqlite",
        reason="not applicable: SQLite has no session locks (run by the mysql and postgresql runs)",
    ),
]
SESSION = "session"


@pytest.fixture(autouse=True)
def nothing_left_in_the_server(store: None) -> Iterator[None]:
    yield
    assert backends[SESSION].holders() == [], "a session grant was left"
    assert backends[SESSION].waiters() == [], "a waiter was left in the server"


def lock(name: str = "s:job", **options: object) -> Lock:
    return Lock(name, backend=SESSION, ttl=3, **options)  # type: ignore[arg-type]


@pytest.mark.catalogue("two-handles", backend=SESSION)
def test_two_handles_in_one_process_exclude_each_other() -> None:
    with lock() as grant:
        assert grant.expires_at is None
        assert not lock().acquire(timeout=0), "same thread, second handle"
        assert not acquired_in_another_thread(lock()), "another thread"
    again = lock()
    assert again.acquire(timeout=0), "free again after release"
    again.release()


def test_fences_rise_and_timeouts_are_honoured() -> None:
    fences = []
    for _ in range(3):
        with lock() as grant:
            fences.append(grant.fence)
    assert fences == sorted(fences) and len(set(fences)) == 3
    with lock():
        began = time.monotonic()
        assert not lock().acquire(timeout=0.4)
        assert 0.35 <= time.monotonic() - began < 2


def test_a_free_lock_costs_one_try_and_a_contended_one_is_waited_for_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An acquire first tries the key with the cheaper statement, which names no waiter
    and sets no time-out; once a try of this process found the key taken, its next
    acquires wait in the server at once for ``recent.CONTENDED_FOR`` seconds, with no
    failed try each."""
    backend = backends[SESSION]
    took: list[bool] = []  # per statement that took the key: whether it could wait
    take = type(backend)._take

    def noting(
        self: SessionBackend,
        session: object,
        key: Key,
        seconds: float | None,
        *rest: object,
        **options: object,
    ) -> int | None:
        took.append(seconds != 0)
        return take(self, session, key, seconds, *rest, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(type(backend), "_take", noting)
    name = "s:try-first"
    with lock(name):
        assert took == [False], "a free lock: one try"
        took.clear()
        assert not lock(name).acquire(timeout=0.2)
        assert took == [False, True], "taken: tried, then waited for"
        took.clear()
        assert not lock(name).acquire(timeout=0.2)
        assert took == [True], "found taken lately: waited for at once"
    time.sleep(recent.CONTENDED_FOR)
    took.clear()
    with lock(name):
        assert took == [False], "not contended any more: tried first again"


def assert_free_within_a_second(name: str) -> None:
    """A killed holder's session ends, and the server frees its lock at once."""
    began = time.monotonic()
    survivor = lock(name)
    assert survivor.acquire(timeout=5)
    assert time.monotonic() - began < 1
    survivor.release()


@pytest.mark.catalogue("paused-session-holder", backend=SESSION)
def test_a_paused_holder_keeps_its_lock_until_the_server_kills_its_session() -> None:
    """SIGSTOP alone frees nothing (a session lock has no lease); an administrator's
    kill of the session does, and the woken holder learns it lost, never success."""
    report, go = CONTEXT.Queue(), CONTEXT.Event()
    worker = start_worker(hold_without_renewal_then_release, "s:paused", 3, report, go, SESSION)
    state, old_fence = report.get(timeout=30)
    assert state == "held" and worker.pid is not None
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        assert not lock("s:paused").acquire(timeout=1.0), "a pause alone freed a session lock"
        (holder,) = backends[SESSION].holders("s:paused")
        kill_session(holder.connection_id)
        with lock("s:paused", timeout=5) as grant:
            assert grant.fence > old_fence
            os.kill(worker.pid, signal.SIGCONT)
            go.set()
            state, said = report.get(timeout=30)
            assert state == "lost", said
            grant.check()  # the woken holder's release freed nothing of ours
    finally:
        resume(worker.pid)
        go.set()
        worker.join(20)


def kill_session(connection_id: int) -> None:
    """End a server session as an administrator would, not through djlocks."""
    if connection.vendor == "postgresql":
        sql = "SELECT pg_terminate_backend(%s)"
    else:
        sql = "KILL CONNECTION %s"
    with connection.cursor() as cursor:
        cursor.execute(sql, [connection_id])


@pytest.mark.catalogue("client-timeout", backend=SESSION)
def test_a_waiter_whose_connection_failed_is_ended_in_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter (another process, connected through a TCP proxy) waits in the server;
    its connection fails. The server may not notice while it waits, so djlocks ends
    that session: it is no longer a waiter, and nobody holds the name for it later."""
    proxy = TcpProxy(int(connection.settings_dict["PORT"]))
    try:
        with lock("s:gave-up"):
            report = CONTEXT.Queue()
            with monkeypatch.context() as patched:
                patched.setenv("DJLOCKS_DB_PORT", str(proxy.port))
                waiter = start_worker(wait_in_line, "s:gave-up", "doomed", report, SESSION)
            deadline = time.monotonic() + 20
            while not backends[SESSION].waiters("s:gave-up"):
                assert time.monotonic() < deadline, "the waiter never showed in the server"
                time.sleep(0.05)
            cut = time.monotonic()
            proxy.cut()
            waiter.join(20)
            assert waiter.exitcode not in (0, None), "the waiter's acquire did not fail"
            while backends[SESSION].waiters("s:gave-up"):
                assert time.monotonic() - cut < 2, "the server still waits for a lost client"
                time.sleep(0.05)
    finally:
        proxy.close()
    assert backends[SESSION].holders("s:gave-up") == []
    with lock("s:gave-up", timeout=0):
        pass


@pytest.mark.catalogue("django-closes-connections", backend=SESSION)
def test_django_closing_its_connections_leaves_the_lock_held() -> None:
    """Django closes and recycles its own connections (end of request, CONN_MAX_AGE 0
    or 60, health checks, close_all); the lock lives on djlocks' own and stays held."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections, connections

    saved = dict(connection.settings_dict)
    with lock("s:django") as grant:
        try:
            for max_age in (0, 60):
                connection.settings_dict.update(CONN_MAX_AGE=max_age, CONN_HEALTH_CHECKS=True)
                connection.ensure_connection()
                request_started.send(sender=None)
                request_finished.send(sender=None)
                close_old_connections()
                grant.check()
            connections.close_all()
        finally:
            connection.settings_dict.clear()
            connection.settings_dict.update(saved)
        grant.check()
        assert [h.fence for h in backends[SESSION].holders("s:django")] == [grant.fence]
        assert not acquired_in_another_thread(lock("s:django"))


@pytest.mark.catalogue("server-idle-timeout", backend=SESSION)
def test_a_server_idle_limit_never_drops_a_held_lock_silently(
    bounds: Callable[[str, float], None],
) -> None:
    """With the server's idle limit at 1 s for new sessions, a lock held idle for 2.5 s
    (no heartbeat) stays held: djlocks lifts the limit for its own sessions. A session
    the server ends anyway is reported lost within one heartbeat (TTL/3)."""
    with server_idle_limit_of_one_second():
        backends.reset()  # sessions opened from now on
        idle = Lock("s:idle", backend=SESSION, ttl=10, renew=False)
        with idle as grant:
            time.sleep(2.5)
            grant.check()
            assert not acquired_in_another_thread(lock("s:idle"))
    lost_at: list[float] = []
    ttl = 1.5
    killed = Lock(
        "s:killed", backend=SESSION, ttl=ttl, on_lost=lambda *_: lost_at.append(time.monotonic())
    ).acquire_grant()
    assert killed is not None
    (holder,) = backends[SESSION].holders("s:killed")
    began = time.monotonic()
    kill_session(holder.connection_id)
    learned = seconds_until_lost(lost_at, began)
    assert learned < ttl / 3 + 0.3, learned
    bounds(f"holder learns its killed session ended after (TTL {ttl} s)", learned)
    with pytest.raises(LockLost):
        killed.release()


@contextlib.contextmanager
def server_idle_limit_of_one_second() -> Iterator[None]:
    """New sessions of the test database get a 1 s idle limit, as a strict server would
    (PostgreSQL ``idle_session_timeout`` for the database, MySQL ``wait_timeout``)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            database = connection.ops.quote_name(connection.settings_dict["NAME"])
            cursor.execute(f"ALTER DATABASE {database} SET idle_session_timeout = '1s'")
            restore = f"ALTER DATABASE {database} RESET idle_session_timeout"
        else:
            cursor.execute("SELECT @@GLOBAL.wait_timeout")
            restore = f"SET GLOBAL wait_timeout = {int(cursor.fetchone()[0])}"
            cursor.execute("SET GLOBAL wait_timeout = 1")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(restore)


@pytest.mark.catalogue("deadlock-victim", backend=SESSION)
def test_a_deadlock_between_two_names_has_one_typed_victim() -> None:
    """Two threads each hold one name and wait for the other's, with no time-out:
    within about a second one of them (the one that began waiting last) gets
    LockDeadlock, and the other is granted and proceeds."""
    both_hold_one = threading.Barrier(2)
    outcomes: list[tuple[str, float]] = []
    began = time.monotonic()

    def take(first: str, second: str) -> None:
        try:
            with lock(first):
                both_hold_one.wait(10)
                with lock(second):
                    outcomes.append(("proceeded", time.monotonic() - began))
        except LockDeadlock:
            outcomes.append(("victim", time.monotonic() - began))

    threads = [
        threading.Thread(target=take, args=pair) for pair in (("s:a", "s:b"), ("s:b", "s:a"))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(what for what, _ in outcomes) == ["proceeded", "victim"], outcomes
    assert max(when for _, when in outcomes) < 5, outcomes


@pytest.mark.catalogue("deadlock-victim", backend=SESSION)
def test_a_deadlock_between_two_async_tasks_has_one_typed_victim() -> None:
    """As between threads, between two tasks of one event loop, whose waits run in
    djlocks' threads, whichever is free: a grant and a wait are their task's."""

    async def crossed() -> list[str]:
        both_hold_one = asyncio.Barrier(2)

        async def take(first: str, second: str) -> str:
            try:
                async with lock(first, timeout=20):
                    await both_hold_one.wait()
                    async with lock(second, timeout=20):
                        return "proceeded"
            except LockDeadlock:
                return "victim"

        return await asyncio.gather(take("s:ta", "s:tb"), take("s:tb", "s:ta"))

    began = time.monotonic()
    assert sorted(asyncio.run(crossed())) == ["proceeded", "victim"]
    assert time.monotonic() - began < 10


def test_waits_that_only_look_like_a_cycle_by_process_are_not_deadlocks() -> None:
    """Thread 1 holds A and waits for B; B's holder waits for C, which thread 2 of the
    same process holds and then releases: no cycle of threads, so nobody is a victim."""
    holds_c, b_waits = threading.Event(), threading.Event()
    release_c = threading.Event()
    outcomes: list[str] = []

    def hold_c() -> None:
        with lock("s:c"):
            holds_c.set()
            release_c.wait(10)

    def hold_b_wait_c() -> None:
        with lock("s:b"):
            b_waits.set()
            with lock("s:c", timeout=10):
                outcomes.append("b got c")

    def hold_a_wait_b() -> None:
        try:
            with lock("s:a"), lock("s:b", timeout=10):
                outcomes.append("a got b")
        except LockDeadlock:
            outcomes.append("false victim")

    first = threading.Thread(target=hold_c)
    first.start()
    holds_c.wait(5)
    second = threading.Thread(target=hold_b_wait_c)
    second.start()
    b_waits.wait(5)
    third = threading.Thread(target=hold_a_wait_b)
    third.start()
    time.sleep(2.5)  # past the deadlock check of every wait
    release_c.set()
    for thread in (first, second, third):
        thread.join(20)
    assert sorted(outcomes) == ["a got b", "b got c"]


@pytest.mark.catalogue("forced-release", backend=SESSION)
def test_forced_release_kills_exactly_the_holder_which_learns_it_lost() -> None:
    first, second = lock("s:a"), lock("s:b")
    grant_a, grant_b = first.acquire_grant(), second.acquire_grant()
    assert grant_a is not None and grant_b is not None
    assert len(force_release(backends[SESSION].holders("s:a"))) == 1
    with pytest.raises(LockLost):
        grant_a.check()
    with pytest.raises(LockLost):
        grant_a.release()
    grant_b.check()  # another grant, another session: untouched
    grant_b.release()


def test_holders_and_waiters_come_from_the_server_with_identity() -> None:
    report = CONTEXT.Queue()
    with lock("s:seen", label="nightly import") as grant:
        waiter = start_worker(wait_in_line, "s:seen", "in line", report, SESSION)
        deadline = time.monotonic() + 20
        while not backends[SESSION].waiters("s:seen"):
            assert time.monotonic() < deadline, "the waiter never showed in the server"
            time.sleep(0.05)
        (holder,) = backends[SESSION].holders("s:seen")
        assert (holder.label, holder.fence, holder.slot) == ("nightly import", grant.fence, 0)
        assert holder.connection_id
        (waiting,) = backends[SESSION].waiters("s:seen")
        assert waiting.label == "in line" and waiting.pid == waiter.pid
    assert report.get(timeout=20)[0] == "in line"
    waiter.join(20)


def test_a_release_interrupted_mid_statement_ends_its_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release interrupted while its statement runs (Ctrl-C, a task's time limit)
    leaves the session mid-statement, perhaps with the unlock not sent: the session is
    closed, so the server frees the lock, and the interruption goes on up."""
    grant = lock("s:interrupted").acquire_grant(timeout=0)
    assert grant is not None

    def interrupted(self: object, session: object, key: object) -> bool:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(type(backends[SESSION]), "_give_back", interrupted)
        with pytest.raises(KeyboardInterrupt):
            grant.release()
    again = lock("s:interrupted")
    assert again.acquire(timeout=5), "the interrupted session kept the lock"
    again.release()


def test_sessions_left_idle_after_a_burst_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads hold at once, then one lock is taken and released after the idle
    limit: the other seven sessions are closed at its check-in, not kept for good."""
    monkeypatch.setattr(session_connections, "IDLE_SESSION_SECONDS", 0.5)
    with lock("s:warm"):
        pass
    holder_records.flush()
    events.flush()  # the process's background writers are connected
    before = server_sessions()
    all_in = threading.Barrier(8)

    def hold(number: int) -> None:
        try:
            with lock(f"s:burst:{number}"):
                all_in.wait(10)
        finally:
            connections.close_all()

    burst = [threading.Thread(target=hold, args=(number,)) for number in range(8)]
    for thread in burst:
        thread.start()
    for thread in burst:
        thread.join(30)
    assert server_sessions() - before >= 7, "the burst's sessions are kept for a while"
    time.sleep(0.6)
    with lock("s:after"):
        pass
    deadline = time.monotonic() + 5  # the server ends a closed session a moment later
    while server_sessions() > before:
        assert time.monotonic() < deadline, "the sessions of the burst are still open"
        time.sleep(0.1)


def test_inside_a_transaction_the_acquire_is_refused() -> None:
    with transaction.atomic(), pytest.raises(BackendUnavailable, match="cover the commit"):
        lock().acquire()


@pytest.mark.catalogue("semaphore-limit", backend=SESSION)
def test_semaphore_strength_test_reaches_the_limit_and_never_passes_it() -> None:
    plan = StressPlan(SESSION, processes=8, iterations=12, limit=3, hold_ms=30)
    result = run_stress(plan, timeout=240)
    assert result.ok, result
    assert result.max_concurrent == 3


@pytest.mark.catalogue("exact-counter", backend=SESSION)
def test_lock_strength_test() -> None:
    result = run_stress(StressPlan(SESSION, processes=8, iterations=50), timeout=240)
    assert result.ok, result


def test_semaphore_slots_are_separate_sessions() -> None:
    semaphore = Semaphore("s:pool", limit=2, backend=SESSION, ttl=3)
    with semaphore as one, semaphore as two:
        assert {one.slot, two.slot} == {0, 1}
        assert not semaphore.acquire(timeout=0)
        assert len(backends[SESSION].holders("s:pool")) == 2


def key_of(name: str) -> str:
    out = subprocess.run(
        [*manage_command(current_database_names()), "djlocks", "key", name, "--backend", SESSION],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def client(sql: str) -> subprocess.Popen[str]:
    """The database's own command-line client, on the test database."""
    settings = connection.settings_dict
    if connection.vendor == "mysql":
        command = ["mysql", "-h", settings["HOST"], "-P", str(settings["PORT"])]
        command += ["-u", settings["USER"], "-N", "-e", sql, settings["NAME"]]
    else:
        command = ["psql", "-h", settings["HOST"], "-p", str(settings["PORT"])]
        command += ["-U", settings["USER"], "-d", settings["NAME"], "-Atc", sql]
    assert shutil.which(command[0]), f"{command[0]} is needed for the interoperation test"
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("name", ["s:interop", "Mixed Case ünïcode name"])
def test_scripts_using_the_database_client_interoperate(name: str) -> None:
    key = key_of(name)
    if connection.vendor == "mysql":
        hold = f"SELECT GET_LOCK('{key}', 5); SELECT SLEEP(2)"
        probe = f"SELECT GET_LOCK('{key}', 0)"
    else:
        hold = f"SELECT pg_advisory_lock({key}); SELECT pg_sleep(2)"
        probe = f"SELECT pg_try_advisory_lock({key})"
    script = client(hold)
    time.sleep(1)
    assert not lock(name).acquire(timeout=0), "the script's lock excludes djlocks"
    script.communicate(timeout=30)
    with lock(name):
        out, _ = client(probe).communicate(timeout=30)
        assert out.split()[-1] in ("0", "f"), "djlocks' lock excludes the script"


def test_list_json_shows_session_holders() -> None:
    from io import StringIO

    with lock("s:listed", label="shown"):
        out = StringIO()
        call_command("djlocks", "list", "--backend", SESSION, "--json", stdout=out)
        (holder,) = json.loads(out.getvalue())["holders"]
        assert holder["label"] == "shown" and holder["connection_id"]


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="not applicable: PgBouncer pools PostgreSQL only"
)
@pytest.mark.catalogue("transaction-pooler", backend=SESSION)
@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_a_pooler_sharing_server_sessions_is_refused(pool_mode: str) -> None:
    """PgBouncer in transaction mode is reported by the check and refused at the first
    acquire, leaving no advisory lock behind; in session mode it is accepted."""
    bouncer = PgBouncer(
        int(connection.settings_dict["PORT"]), connection.settings_dict["USER"], pool_mode
    )
    through_the_bouncer = {**os.environ, "DJLOCKS_DB_PORT": str(bouncer.port)}
    try:
        check = manage(
            "check", "--database", "default", stderr=subprocess.PIPE, env=through_the_bouncer
        )
        _, report = check.communicate(timeout=60)
        run = manage(
            "runlocked",
            "s:pooled",
            "--backend",
            SESSION,
            "--",
            "true",
            stderr=subprocess.PIPE,
            env=through_the_bouncer,
        )
        _, said = run.communicate(timeout=60)
    finally:
        bouncer.stop()
    if pool_mode == "session":
        assert check.returncode == 0 and "djlocks.E009" not in report, report
        assert run.returncode == 0, said
        return
    assert check.returncode != 0 and "djlocks.E009" in report, report
    assert run.returncode == EXIT_UNAVAILABLE and "same server session" in said, said
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND {LOCK_KEY} = %s",
            (backends[SESSION].key("s:pooled"),),
        )
        assert cursor.fetchone()[0] == 0, "an advisory lock was left on the server"


def test_the_admin_shows_the_connection_and_releases_by_killing_it(admin_client: Client) -> None:
    query = urlencode({"backend": SESSION, "name": "s:admin"})
    grant = lock("s:admin", label="pinned report").acquire_grant()
    assert grant is not None
    page = admin_client.get(reverse("admin:djlocks_name") + "?" + query).content.decode()
    (holder,) = backends[SESSION].holders("s:admin")
    assert "pinned report" in page and str(holder.connection_id) in page
    assert "<td>with its session</td>" in page
    release = reverse("admin:djlocks_release") + "?" + query
    confirm = admin_client.get(release).content.decode()
    assert "connection is terminated" in confirm and str(holder.connection_id) in confirm
    answer = admin_client.post(release, {"fences": str(grant.fence), "reason": "stuck"})
    assert answer.status_code == 302
    with pytest.raises(LockLost):
        grant.check()
    with pytest.raises(LockLost):
        grant.release()


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="not applicable: MariaDB decides a GET_LOCK's grant or time-out atomically",
)
@pytest.mark.parametrize("limit", [1, 2])
def test_a_wait_granted_as_its_lock_timeout_fires_is_a_grant(
    limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL can grant a waiter just as its ``lock_timeout`` fires: the statement
    fails, yet the session holds the key. Here the waiter's server process is stopped
    (SIGSTOP, while it sleeps in its lock wait, which holds no shared lock of the
    server) while the key is handed to it and its time-out runs out, so on resuming
    it sees both. The acquire must return that grant, not leave an idle session
    holding it."""
    monkeypatch.setattr(claims, "SLOT_WAIT", WAITED)  # a semaphore's wait: one long one
    name = f"s:timeout-race:{limit}"
    grants = [
        Semaphore(name, limit=limit, backend=SESSION, ttl=3).acquire_grant(timeout=0)
        for _ in range(limit)
    ]
    outcome: list[Grant | None] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(
            Semaphore(name, limit=limit, backend=SESSION, ttl=3).acquire_grant(timeout=WAITED)
        )
    )
    waiter.start()
    try:
        pid, key = advisory_lock_process(
            {_key(name, limit, g.slot) for g in grants if g}, granted=False
        )
        (freed,) = [g for g in grants if g and _key(name, limit, g.slot) == key]
        os.kill(pid, signal.SIGSTOP)
        try:
            releasing = threading.Thread(target=freed.release)
            releasing.start()
            releasing.join(5)
            time.sleep(WAITED + 0.5)  # the waiter's lock_timeout runs out
        finally:
            os.kill(pid, signal.SIGCONT)
        waiter.join(30)
        (grant,) = outcome
        assert grant is not None, "told it was not granted, though its session holds the slot"
        assert grant.slot == freed.slot and grant.fence > freed.fence
        grants.append(grant)
    finally:
        waiter.join(30)
        for held in grants:
            if held is not None:
                with contextlib.suppress(LockError):  # released above, or never granted
                    held.release()
    assert backends[SESSION].holders(name) == [], "a released slot is still held"
    with Semaphore(name, limit=limit, backend=SESSION, ttl=3, timeout=0):
        pass  # every slot free again


#: Seconds the waiter above waits, in one lock wait.
WAITED = 2.0


def _key(name: str, limit: int, slot: int) -> Key:
    """The server's key of a lock (``limit`` 1) or of one semaphore slot."""
    return backends[SESSION].key(name) if limit == 1 else backends[SESSION].key(name, slot)


@pytest.mark.parametrize("freed", ["awaited", "other"])
def test_a_semaphore_waiter_hands_the_gate_on_in_the_statement_that_takes_its_slot(
    freed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter holding a semaphore's gate waits in the server on one slot. Whether
    that slot comes free or another one does (taken when the wait on the first runs
    out and every slot is tried again), the statement that takes a slot gives the gate
    back too, so the next waiter's turn starts one round trip sooner; a waiter that
    times out gives the gate back on its own."""
    monkeypatch.setattr(claims, "SLOT_WAIT", WAITED)
    backend = backends[SESSION]
    given_back: list[object] = []
    give_back = type(backend)._give_back

    def giving_back(self: object, session: object, key: object) -> bool:
        given_back.append(key)
        return give_back(self, session, key)  # type: ignore[arg-type]

    monkeypatch.setattr(type(backend), "_give_back", giving_back)
    name = f"s:gate:{freed}"
    gate = backend.key(name, GATE)
    taken = [Semaphore(name, limit=2, backend=SESSION, ttl=3).acquire_grant() for _ in range(2)]
    grants = [grant for grant in taken if grant is not None]
    assert len(grants) == 2
    outcome: list[Grant | None] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(
            Semaphore(name, limit=2, backend=SESSION, ttl=3).acquire_grant(timeout=30)
        )
    )
    waiter.start()
    try:
        awaited = slot_waited_for(name, grants)
        released = next(g for g in grants if (g.slot == awaited) == (freed == "awaited"))
        released.release()
        waiter.join(30)
        (grant,) = outcome
        assert grant is not None and grant.slot == released.slot
        grants.append(grant)
        assert gate not in given_back, "the gate was given back in a round trip of its own"
        assert not gate_held(gate), "the gate is still held after its holder got a slot"
        assert not Semaphore(name, limit=2, backend=SESSION, ttl=3).acquire(timeout=0.1)
        assert gate in given_back, "a timed-out waiter kept the gate"
        assert not gate_held(gate), "a timed-out waiter left the gate held"
    finally:
        waiter.join(30)
        for held in grants:
            if held is not released:
                held.release()


def slot_waited_for(name: str, grants: list[Grant]) -> int:
    """The slot of ``grants`` whose key a waiter of ``name`` waits for in the server."""
    slots = {_key(name, 2, grant.slot): grant.slot for grant in grants}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waited: list[Key]
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"SELECT {LOCK_KEY} FROM pg_locks l WHERE {ADVISORY_WAITING}")
                waited = [int(key) for (key,) in cursor.fetchall()]
            else:
                waited = [
                    call.group(1)
                    for _, _, statement, _ in mysql.waiting_statements(cursor)
                    if (call := mysql.WAITING_CALL.search(statement)) is not None
                ]
        for key in waited:
            if key in slots:
                return slots[key]
        time.sleep(0.02)
    raise AssertionError(f"nobody waits for a slot of {name!r}")


def gate_held(gate: Key) -> bool:
    """Whether any session holds the semaphore gate ``gate`` (a key)."""
    backend = backends[SESSION]
    assert isinstance(backend, SessionBackend)
    with backend._side_session() as side:
        return bool(backend._live_keys(side, [gate]))


@pytest.mark.skipif(connection.vendor != "postgresql", reason="MariaDB's is the next test")
def test_a_fence_sequence_that_went_back_in_a_crash_is_moved_past_it() -> None:
    """After a crash the sequence may hand out values again that it had handed out
    (those its WAL had not flushed). Crash recovery empties the unlogged marker: the
    next new session moves the sequence past them before its first grant."""
    with lock("s:sequence") as first:
        pass
    with connection.cursor() as cursor:  # what a crash may leave: the sequence behind
        cursor.execute(f"SELECT setval('{FENCE_SEQUENCE}', %s)", (first.fence - 10,))
        cursor.execute(f"TRUNCATE {CRASH_MARKER}")
    backends.reset()  # new sessions, as after a crash
    with lock("s:sequence") as second:
        assert second.fence > first.fence + CRASH_GAP - 10
    backends.reset()
    with lock("s:sequence") as third:  # marked again: no second jump
        assert second.fence < third.fence < second.fence + CRASH_GAP


@pytest.mark.skipif(connection.vendor != "mysql", reason="PostgreSQL's is the previous test")
def test_a_fence_sequence_that_went_back_in_a_restart_is_raised_to_the_clock() -> None:
    """After a crash MariaDB's sequence may hand out values again that it had handed out
    (a cache refill not on disk). Every start empties the MEMORY marker: the next new
    session raises the sequence to the server's clock, which every value handed out
    before is below, before its first grant."""
    with lock("s:sequence") as first:
        pass
    with connection.cursor() as cursor:  # what a crash may leave: the sequence behind
        cursor.execute(f"ALTER SEQUENCE {mysql.FENCE_SEQUENCE} RESTART WITH {first.fence - 10}")
        cursor.execute(f"DELETE FROM {mysql.RESTART_MARKER}")
        cursor.execute(f"SELECT {mysql.FIRST_FENCE}")
        clock = cursor.fetchone()[0]
    backends.reset()  # new sessions, as after a restart
    with lock("s:sequence") as second:
        assert second.fence > max(first.fence, clock)
    backends.reset()
    with lock("s:sequence") as third:  # marked again: no second raise
        assert second.fence < third.fence <= second.fence + MARIADB_SEQUENCE_CACHE


#: Values a MariaDB sequence keeps in memory by default: what a new session may skip.
MARIADB_SEQUENCE_CACHE = 1000


def test_a_holder_whose_record_is_not_written_is_shown_from_the_servers_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder row is written after the grant, in the background; until it is (or if
    it never is), the server's own view shows the holder, marked as such, and a forced
    release still finds it: on PostgreSQL with its fence and identity, on MariaDB with
    its client's address only."""
    monkeypatch.setattr(holder_records, "submit", lambda *args: None)  # a writer that died
    grant = lock("s:unrecorded", label="no record").acquire_grant()
    assert grant is not None
    (holder,) = backends[SESSION].holders("s:unrecorded")
    assert not holder.recorded and holder.token == ""
    if connection.vendor == "postgresql":
        assert (holder.fence, holder.pid, holder.label) == (grant.fence, os.getpid(), "no record")
        assert holder.thread == f"(tid {threading.get_native_id()})"
    else:
        assert holder.fence is None and holder.host.startswith(("127.0.0.1:", "localhost"))
    out = StringIO()
    call_command("djlocks", "list", "--backend", SESSION, stdout=out)
    assert "server's view" in out.getvalue()
    assert len(force_release([holder])) == 1
    with pytest.raises(LockLost):
        grant.release()
    assert backends[SESSION].holders("s:unrecorded") == []
