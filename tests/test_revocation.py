"""A forced release reaches the holder at once where the store can push (PostgreSQL
NOTIFY, Redis pub/sub), else at its next renewal; a graceful release asks the holder
to give its grant back and frees the slot only when it has, or when the wait ends;
runlocked never lets its command outlive the lease. Real stores and processes
throughout: a private redis-server where the test stops one."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from djlocks import Lock, LockLost, ReleaseRequested
from djlocks.backends import backends
from djlocks.backends.base import HolderInfo
from djlocks.backends.locmem import LocMemBackend
from djlocks.backends.redis import RedisBackend
from djlocks.backends.sql.postgresql import LEASE_REVOKED
from djlocks.grant import RELEASE_REQUESTED, Grant
from djlocks.inspection import force_release, request_release
from djlocks.kinds import Kind
from djlocks.models import LockEvent
from djlocks.runlocked import EXIT_LOST
from djlocks.stress import current_database_names, manage_command
from djlocks.testing import use_locmem_backends
from tests.processes import alive, finished, manage, runlocked, wait_for_file, wait_until_dead
from tests.test_redis_backend import PrivateRedis, free_port

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

#: The lease backends: the lease rows (``default``) and Redis.
LEASES = ["default", "redis"]
#: Backends whose holders an operator can release by force and that learn it unasked:
#: the leases and, where the database has them, session locks.
FORCEABLE = LEASES if connection.vendor == "sqlite" else [*LEASES, "session"]
#: Seconds: the at-once bound where the store pushes the news to the holder. A tenth
#: of the next heartbeat (``ttl_for``: 10 s away), so that only a push passes it, and
#: ten times what it takes on an idle machine, where a session holder's hang-up watcher
#: (a poll every 50 ms) or a notice is the push: the full suite on 2 cores once took
#: 152 ms for a session lock.
AT_ONCE = 1.0


def pushes(backend: str) -> bool:
    """Whether ``backend``'s store tells a holder of a forced release at once: Redis
    and PostgreSQL publish it; a session lock's server closes the holder's connection."""
    return backend in ("redis", "session") or connection.vendor == "postgresql"


def ttl_for(backend: str) -> float:
    """A TTL whose heartbeat (TTL/3) could not pass for a push where the store pushes,
    and short enough to wait for where it does not."""
    return 30.0 if pushes(backend) else 1.5


class Holder:
    """A grant of ``name`` held in this process, with what its ``on_lost`` heard."""

    def __init__(self, name: str, backend: str, ttl: float) -> None:
        self.heard: list[tuple[float, str]] = []
        self.told = threading.Event()
        lock = Lock(name, backend=backend, ttl=ttl, on_lost=self._on_lost)
        grant = lock.acquire_grant(timeout=0)
        assert grant is not None
        self.grant: Grant = grant

    def _on_lost(self, grant: Grant, reason: str) -> None:
        self.heard.append((time.monotonic(), reason))
        self.told.set()

    def reasons(self) -> list[str]:
        return [reason for _, reason in self.heard]

    def heard_after(self, began: float) -> float:
        """Seconds from ``began`` (monotonic) until ``on_lost`` was first called."""
        assert self.told.wait(10), "the holder never heard"
        return self.heard[0][0] - began


def holders_of(name: str, backend: str) -> list[HolderInfo]:
    return backends[backend].holders(name)


@pytest.mark.catalogue("revocation-reaches-holder", "forced-release")
@pytest.mark.parametrize("backend", FORCEABLE)
def test_a_forced_release_reaches_the_holders_on_lost_at_once(
    backend: str, bounds: Callable[[str, float], None]
) -> None:
    """Within ``AT_ONCE`` where the store pushes (the lease backend on PostgreSQL,
    Redis, a session lock), though the next renewal is 10 s away; within one heartbeat
    (TTL/3) elsewhere (the lease backend on SQLite and MySQL)."""
    ttl = ttl_for(backend)
    holder = Holder("rv:forced", backend, ttl)
    taken = holders_of("rv:forced", backend)
    began = time.monotonic()
    assert len(force_release(taken)) == 1
    learned = holder.heard_after(began)
    bounds(f"holder's on_lost after a forced release (TTL {ttl:g} s)", learned)
    if pushes(backend):
        assert learned < AT_ONCE, learned
    else:
        assert learned < ttl / 3 + 0.3, learned
    assert not holder.grant.believed
    with pytest.raises(LockLost):
        holder.grant.release()


@pytest.mark.parametrize("backend", LEASES)
def test_a_graceful_release_frees_the_slot_only_after_the_holder_released_it(
    backend: str,
) -> None:
    """The holder hears the request (``on_lost`` with RELEASE_REQUESTED, ``check()``
    raises ReleaseRequested), winds down while the slot stays held, releases without
    an error; only then does the waiter get the slot."""
    holder = Holder("rv:graceful", backend, ttl_for(backend))
    released_at: list[float] = []

    def wind_down_then_release() -> None:
        assert holder.told.wait(10), "the holder never heard the request"
        with pytest.raises(ReleaseRequested):
            holder.grant.check()
        assert holder.grant.believed, "still held while it winds down"
        time.sleep(0.5)
        released_at.append(time.monotonic())
        holder.grant.release()

    winding = threading.Thread(target=wind_down_then_release)
    winding.start()
    assert len(request_release(holders_of("rv:graceful", backend), wait=30)) == 1
    with Lock("rv:graceful", backend=backend, timeout=10) as successor:
        acquired = time.monotonic()
        assert successor.fence > holder.grant.fence
    winding.join(10)
    assert released_at and acquired >= released_at[0]
    assert holder.reasons() == [RELEASE_REQUESTED]


@pytest.mark.parametrize("backend", LEASES)
def test_a_graceful_release_frees_the_slot_when_the_wait_ends(backend: str) -> None:
    """A holder that does not give the grant back keeps it until the wait ends, never
    after; it stops believing before the next holder gets it, and learns it lost."""
    holder = Holder("rv:stubborn", backend, ttl_for(backend))
    # Where the store cannot push, the holder hears at its next renewal: a wait of a
    # TTL or more ends after any belief it had before it heard.
    wait = 1.0 if pushes(backend) else ttl_for(backend) + 0.5
    asked = time.monotonic()
    assert len(request_release(holders_of("rv:stubborn", backend), wait=wait)) == 1
    assert holder.told.wait(10)
    with Lock("rv:stubborn", backend=backend, timeout=10) as successor:
        acquired = time.monotonic()
        assert successor.fence > holder.grant.fence
    assert acquired - asked >= wait * 0.95, "freed before the wait ended"
    assert holder.grant.believe_until() <= acquired, "two holders believed at once"
    assert not holder.grant.believed
    assert holder.reasons()[0] == RELEASE_REQUESTED
    with pytest.raises(LockLost):
        holder.grant.release()


@pytest.mark.parametrize("backend", LEASES)
def test_a_graceful_release_from_the_command_line_waits_for_the_holder(backend: str) -> None:
    """``djlocks release NAME --graceful --wait S`` asks, waits until the holder released,
    and records who asked and why."""
    holder = Holder("rv:cli", backend, ttl_for(backend))

    def release_when_told() -> None:
        if holder.told.wait(10):
            holder.grant.release()

    threading.Thread(target=release_when_told, daemon=True).start()
    out = StringIO()
    call_command(
        "djlocks",
        "release",
        "rv:cli",
        "--backend",
        backend,
        "--graceful",
        "--wait",
        "20",
        "--yes",
        "--reason",
        "deploy",
        stdout=out,
    )
    assert "Asked 1 holder(s)" in out.getvalue() and "Done after" in out.getvalue()
    assert holders_of("rv:cli", backend) == []
    (event,) = LockEvent.objects.filter(name="rv:cli", kind=Kind.RELEASE_REQUESTED)
    assert event.reason == "deploy" and event.operator and event.fence == holder.grant.fence


def test_wait_without_graceful_and_backends_that_cannot_are_refused() -> None:
    with pytest.raises(CommandError, match="--graceful") as refused:
        call_command("djlocks", "release", "rv:x", "--wait", "5", "--yes")
    assert refused.value.returncode == 2
    with pytest.raises(ValueError, match="more than 0"):
        request_release([], wait=0)
    row_grant = HolderInfo(
        name="rv:row",
        backend="row",
        slot=0,
        limit=1,
        host="elsewhere",
        pid=1,
        thread="main",
        label="",
        since=timezone.now(),
        expires_at=None,
        fence=1,
        token="t",
    )
    with pytest.raises(ValueError, match="cannot ask a holder"):
        request_release([row_grant], wait=5)


@pytest.mark.parametrize("backend", LEASES)
def test_the_admin_offers_a_graceful_release_and_says_which_mode_lets_the_next_waiter_in(
    admin_client: Client, backend: str
) -> None:
    """The confirmation page explains both modes; a graceful POST asks the holder, keeps
    the slot held meanwhile, and is audited (admin log and history) like a forced one."""
    holder = Holder("rv:admin", backend, ttl_for(backend))
    url = release_url("rv:admin", backend, holder.grant.fence)
    page = admin_client.get(url).content.decode()
    assert "may start at once, while the old command may still run" in page
    assert "does not start while the old holder still runs" in page
    answer = admin_client.post(
        url,
        {"fences": str(holder.grant.fence), "mode": "graceful", "wait": "20", "reason": "deploy"},
    )
    assert answer.status_code == 302
    assert holder.told.wait(10) and holder.reasons() == [RELEASE_REQUESTED]
    assert [h.fence for h in holders_of("rv:admin", backend)] == [holder.grant.fence]
    holder.grant.release()
    (entry,) = LogEntry.objects.filter(object_id="rv:admin")
    assert "Graceful release (within 20 s)" in entry.get_change_message()
    (event,) = LockEvent.objects.filter(name="rv:admin", kind=Kind.RELEASE_REQUESTED)
    assert event.operator == "admin" and event.reason == "deploy"


def test_the_admin_offers_no_graceful_release_where_the_backend_cannot(
    admin_client: Client,
) -> None:
    """On a backend that cannot ask a holder (here the in-process one), the page says
    that the next waiter may start while the old command runs, and offers no choice."""
    with use_locmem_backends():
        holder = Holder("rv:admin-mem", "default", 30)
        page = admin_client.get(release_url("rv:admin-mem", "default", holder.grant.fence))
        text = page.content.decode()
        holder.grant.release()
    assert "cannot ask a holder to give its grant back" in text
    assert 'value="graceful"' not in text


def release_url(name: str, backend: str, fence: int) -> str:
    query = urlencode({"backend": backend, "name": name, "fence": fence})
    return reverse("admin:djlocks_release") + "?" + query


class UnwatchableBackend(LocMemBackend):
    """The in-process store, whose push channel fails (as a socket that closed would)."""

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        raise OSError("Bad file descriptor")


def test_a_watch_that_fails_leaves_the_grant_held_and_renewed(settings: Any) -> None:
    """The acquire still hands out its grant (none is leaked), and the heartbeat renews it."""
    settings.DJLOCKS = {
        **settings.DJLOCKS,
        "BACKENDS": {"default": {"BACKEND": f"{__name__}.UnwatchableBackend"}},
    }
    backends.reset()
    try:
        # Renewals every 0.5 s: one may come up to about a second late and still be in time.
        with Lock("rv:unwatchable", ttl=1.5, timeout=0) as grant:
            time.sleep(2.0)  # past its TTL: only renewals keep it
            grant.check()
    finally:
        backends.reset()


# -- runlocked ------------------------------------------------------------------


def stopping_command(tmp_path: Path, on_term: str) -> list[str]:
    """A shell command that writes its pid, then loops; on SIGTERM it runs ``on_term``."""
    pid_file = tmp_path / "pid"
    return [
        "sh",
        "-c",
        f"trap '{on_term}' TERM; echo $$ > {pid_file}; while :; do sleep 0.05; done",
    ]


def now_into(path: Path) -> str:
    """Shell that writes the wall clock (seconds) into ``path``."""
    return f'python3 -c "import time; print(time.time())" > {path}'


def wait_until_listening(backend: str) -> None:
    """Wait until another process listens for revocations on ``backend``'s store."""

    def listeners() -> int:
        store = backends[backend]
        if isinstance(store, RedisBackend):
            return int(store.redis().pubsub_numsub(store.revocations)[0][1])
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query = %s",
                [f"LISTEN {LEASE_REVOKED}"],
            )
            return int(cursor.fetchone()[0])

    deadline = time.monotonic() + 30
    while not listeners():
        assert time.monotonic() < deadline, "runlocked never listened for revocations"
        time.sleep(0.02)


def wait_for_waiter(name: str, backend: str) -> None:
    deadline = time.monotonic() + 30
    while not backends[backend].waiters(name):
        assert time.monotonic() < deadline, "the second runlocked never queued"
        time.sleep(0.02)


@pytest.mark.catalogue("revocation-reaches-holder", "runlocked-supervision")
@pytest.mark.parametrize("backend", LEASES)
def test_a_forced_release_terminates_a_runlocked_command_at_once(
    backend: str, tmp_path: Path, bounds: Callable[[str, float], None]
) -> None:
    """The operator's release reaches runlocked's command as SIGTERM within a round trip
    where the store pushes, though the next renewal is 20 s away."""
    if not pushes(backend):
        pytest.skip("this store cannot push: its holders hear at their next renewal")
    termed = tmp_path / "termed"
    command = stopping_command(tmp_path, f"{now_into(termed)}; exit 0")
    wrapper = runlocked("rv:cron", "--backend", backend, "--ttl", "60", "--", *command)
    wait_for_file(tmp_path / "pid")
    wait_until_listening(backend)  # runlocked watches its grant once the command runs
    began = time.time()
    assert len(force_release(holders_of("rv:cron", backend))) == 1
    assert finished(wrapper) == EXIT_LOST
    learned = float(wait_for_file(termed)) - began
    bounds("runlocked's command gets SIGTERM after a forced release (TTL 60 s)", learned)
    # The next renewal is 20 s away: a few seconds prove the push on a loaded machine,
    # and the reliability page records the figure measured (tens of milliseconds).
    assert learned < 5.0, learned


@pytest.mark.parametrize("backend", LEASES)
def test_a_graceful_release_lets_the_next_runlocked_start_only_after_the_command_ended(
    backend: str, tmp_path: Path
) -> None:
    """The finding: with a waiter queued, an immediate release let it start while the
    old command still ran. --graceful: the old command is asked to stop (SIGTERM), takes
    a second to wind down, and the waiter's command starts only after it ended."""
    ended, started = tmp_path / "ended", tmp_path / "started"
    command = stopping_command(tmp_path, f"sleep 1; {now_into(ended)}; exit 0")
    first = runlocked("rv:job", "--backend", backend, "--ttl", "6", "--", *command)
    wait_for_file(tmp_path / "pid")
    second = runlocked("rv:job", "--backend", backend, "--", "sh", "-c", now_into(started))
    wait_for_waiter("rv:job", backend)
    release = manage(
        "djlocks", "release", "rv:job", "--backend", backend, "--graceful", "--yes",
        stdout=subprocess.PIPE,
    )  # fmt: skip
    output, _ = release.communicate(timeout=60)
    assert release.returncode == 0, output
    assert finished(first) == EXIT_LOST
    assert finished(second) == 0
    assert float(wait_for_file(started)) >= float(wait_for_file(ended))


@pytest.fixture
def stoppable_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own, which it stops (never the shared one)."""
    server = PrivateRedis(tmp_path, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.catalogue("runlocked-supervision", backend="redis")
def test_runlocked_kills_a_command_that_ignores_sigterm_before_its_lease_can_end(
    tmp_path: Path, stoppable_redis: PrivateRedis, bounds: Callable[[str, float], None]
) -> None:
    """Redis stops answering, so renewals fail; the command ignores SIGTERM and
    --kill-after is 600 s: runlocked still SIGKILLs it before its lease could end (at
    most a TTL after the last renewal, so at most a TTL after Redis stopped)."""
    ttl = 6.0
    pid_file, said = tmp_path / "pid", tmp_path / "stderr"
    environment = {
        **os.environ,
        "REDIS_URL": f"redis://127.0.0.1:{stoppable_redis.port}/0",
        "PYTHONFAULTHANDLER": "1",  # a crash of runlocked leaves its tracebacks in `said`
    }
    stubborn = f"trap '' TERM; echo $$ > {pid_file}; sleep 600"
    with said.open("w") as stderr:  # a file: failing renewals log more than a pipe holds
        wrapper = stubborn_runlocked(environment, stderr, ttl, stubborn)
    command = int(wait_for_file(pid_file))
    stoppable_redis.stop()
    stopped = time.monotonic()
    try:
        wait_until_dead(command, timeout=ttl + 5)
        killed_after = time.monotonic() - stopped
        bounds(
            f"a command ignoring SIGTERM killed after Redis stopped (TTL {ttl:g} s)", killed_after
        )
        assert killed_after <= ttl, f"the command outlived its lease: {killed_after:.2f} s"
        assert finished(wrapper) == EXIT_LOST, said.read_text()[-4000:]
        killing = [line for line in said.read_text().splitlines() if "SIGKILL" in line]
        assert killing and "lease" in killing[0], killing
    finally:
        if alive(command):
            os.killpg(command, signal.SIGKILL)
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait(10)


def stubborn_runlocked(
    environment: dict[str, str], stderr: TextIO, ttl: float, script: str
) -> subprocess.Popen[str]:
    """``runlocked rv:stubborn --backend redis --kill-after 600 --ttl TTL -- sh -c SCRIPT``
    in ``environment``, its standard error into ``stderr``."""
    command = [
        *manage_command(current_database_names()),
        "runlocked",
        "rv:stubborn",
        "--backend",
        "redis",
        "--kill-after",
        "600",
        "--ttl",
        str(ttl),
        "--",
        "sh",
        "-c",
        script,
    ]
    return subprocess.Popen(command, env=environment, stderr=stderr, text=True)
