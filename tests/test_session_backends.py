"""Session backends (GET_LOCK on MariaDB, advisory locks on PostgreSQL) against the
real server: the contract, crash release, forced release, identity, interoperation
with the mysql and psql clients, G11, cancellation, runlocked, and a PgBouncer in
transaction pooling mode refused (item 16).

They run in the postgresql and mysql runs of `make test` (CI runs all three);
SQLite has no session locks, so the sqlite run does not collect them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

from djlocks import Lock, LockLost, Semaphore
from djlocks.backends import backends
from djlocks.backends.postgresql import LOCK_KEY
from djlocks.exceptions import BackendUnavailable
from djlocks.inspection import force_release
from djlocks.runlocked import EXIT_CONFLICT, EXIT_LOST, EXIT_UNAVAILABLE
from djlocks.stress import StressPlan, current_database_names, manage_command, run_stress
from tests.faults import PgBouncer
from tests.processes import manage
from tests.workers import CONTEXT, start_worker, wait_in_line

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


@pytest.mark.catalogue(18, backend=SESSION)
def test_two_handles_in_one_process_exclude_each_other() -> None:
    with lock() as grant:
        assert grant.expires_at is None
        assert not lock().acquire(timeout=0), "same thread, second handle"
        outcome: list[bool] = []
        other = threading.Thread(target=lambda: outcome.append(lock().acquire(timeout=0)))
        other.start()
        other.join()
        assert outcome == [False], "another thread"
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


def assert_free_within_a_second(name: str) -> None:
    """A killed holder's session ends, and the server frees its lock at once (G4)."""
    began = time.monotonic()
    survivor = lock(name)
    assert survivor.acquire(timeout=5)
    assert time.monotonic() - began < 1
    survivor.release()


@pytest.mark.catalogue(23, backend=SESSION)
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


def test_inside_a_transaction_the_acquire_is_refused_g11() -> None:
    with transaction.atomic(), pytest.raises(BackendUnavailable, match="G11"):
        lock().acquire()


def test_a_cooldown_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cool-down needs a lease backend"):
        lock(cooldown=5).acquire()


@pytest.mark.catalogue(11, backend=SESSION)
def test_a_cancelled_async_wait_leaves_nothing_behind() -> None:
    async def wait_then_cancel() -> None:
        attempt = asyncio.ensure_future(lock().__aenter__())
        await asyncio.sleep(0.5)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt

    with lock():
        asyncio.run(wait_then_cancel())
    time.sleep(0.3)  # the killed session ends in the server
    after = lock()
    assert after.acquire(timeout=0)
    after.release()


@pytest.mark.catalogue(2, backend=SESSION)
def test_semaphore_strength_test_reaches_the_limit_and_never_passes_it() -> None:
    plan = StressPlan(SESSION, processes=8, iterations=12, limit=3, hold_ms=30)
    result = run_stress(plan, timeout=240)
    assert result.ok, result
    assert result.max_concurrent == 3


@pytest.mark.catalogue(1, backend=SESSION)
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


def runlocked(*args: str) -> subprocess.Popen[str]:
    command = [*manage_command(current_database_names()), "runlocked", "--backend", SESSION]
    return subprocess.Popen([*command, *args], text=True)


@pytest.mark.catalogue(24, backend=SESSION)
def test_runlocked_on_session_locks(tmp_path: Path) -> None:
    with lock("s:cron"):
        assert runlocked("s:cron", "-n", "--", "true").wait(30) == EXIT_CONFLICT
    pid_file = tmp_path / "pid"
    wrapper = runlocked(
        "s:cron",
        "--ttl",
        "1.5",
        "--kill-after",
        "0.5",
        "--",
        "sh",
        "-c",
        f"echo $$ > {pid_file}; exec sleep 300",
    )
    deadline = time.monotonic() + 20
    while not backends[SESSION].holders("s:cron"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(force_release(backends[SESSION].holders("s:cron"))) == 1
    assert wrapper.wait(10) == EXIT_LOST
    # SIGKILL of the wrapper: the server frees the lock at once (its session ends).
    wrapper = runlocked("s:cron", "--", "sleep", "300")
    while not backends[SESSION].holders("s:cron"):
        assert time.monotonic() < deadline + 20
        time.sleep(0.05)
    wrapper.kill()
    wrapper.wait(10)
    assert_free_within_a_second("s:cron")


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="not applicable: PgBouncer pools PostgreSQL only"
)
@pytest.mark.catalogue(16, backend=SESSION)
@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_16_a_pooler_sharing_server_sessions_is_refused(pool_mode: str) -> None:
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
    assert "with its session" in page
    release = reverse("admin:djlocks_release") + "?" + query
    confirm = admin_client.get(release).content.decode()
    assert "connection is terminated" in confirm and str(holder.connection_id) in confirm
    answer = admin_client.post(release, {"fences": str(grant.fence), "reason": "stuck"})
    assert answer.status_code == 302
    with pytest.raises(LockLost):
        grant.check()
    with pytest.raises(LockLost):
        grant.release()
