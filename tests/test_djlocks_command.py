"""``manage.py djlocks list|show|release|sweep`` against the real store."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from djlocks import Lock, LockLost, Semaphore
from djlocks.backends import backends
from djlocks.management.commands.djlocks import SWEEP_LOCK
from djlocks.models import LeaseWaiter
from djlocks.signals import lock_lost
from tests.faults import free_port
from tests.processes import finished, manage
from tests.workers import CONTEXT, start_worker, wait_in_line

pytestmark = pytest.mark.usefixtures("store")


def djlocks(*args: str) -> str:
    out = StringIO()
    call_command("djlocks", *args, stdout=out)
    return out.getvalue()


def test_list_json_is_the_stores_truth() -> None:
    lock = Lock("cmd:lock", ttl=30, label="nightly import")
    semaphore = Semaphore("cmd:sem", limit=3, ttl=30)
    with Lock("cmd:cool", cooldown=30):
        pass
    report = CONTEXT.Queue()
    with lock, semaphore, semaphore:
        waiter = start_worker(wait_in_line, "cmd:lock", "in line", report)
        deadline = time.monotonic() + 20
        while not backends["default"].waiters("cmd:lock"):
            assert time.monotonic() < deadline, "the worker never queued"
            time.sleep(0.05)
        document = json.loads(djlocks("list", "--json"))
        store = backends["default"]
        assert [(h["name"], h["slot"], h["fence"], h["label"]) for h in document["holders"]] == [
            (h.name, h.slot, h.fence, h.label) for h in store.holders()
        ]
        assert len(document["holders"]) == 3
        assert all("token" not in h for h in document["holders"]), "tokens stay secret"
        assert [(w["name"], w["label"], w["position"]) for w in document["waiters"]] == [
            ("cmd:lock", "in line", 0)
        ]
        assert [(c["name"], c["slot"]) for c in document["cooldowns"]] == [("cmd:cool", 0)]
    assert report.get(timeout=20)[0] == "in line"
    waiter.join(20)
    assert waiter.exitcode == 0


def test_show_tells_one_name_in_detail() -> None:
    with Lock("cmd:shown", ttl=30, label="report run") as grant:
        shown = djlocks("show", "cmd:shown")
        assert "cmd:shown" in shown and "report run" in shown and f"fence {grant.fence}" in shown
        assert "cmd:other" not in djlocks("show", "cmd:shown")
    assert "is free" in djlocks("show", "cmd:shown")


def test_release_by_fence_takes_only_that_grant() -> None:
    semaphore = Semaphore("cmd:pool", limit=2, ttl=30, renew=False)
    first, second = semaphore.acquire_grant(), semaphore.acquire_grant()
    assert first is not None and second is not None
    lost: list[str] = []

    def note(grant: object, reason: str, **kwargs: object) -> None:
        lost.append(reason)

    lock_lost.connect(note)
    try:
        output = djlocks("release", "cmd:pool", "--holder", str(second.fence), "--yes")
        assert "Released 1 grant" in output
        assert [h.fence for h in backends["default"].holders("cmd:pool")] == [first.fence]
        with pytest.raises(LockLost):
            second.check()
        assert lost, "the lock_lost signal tells the holder"
    finally:
        lock_lost.disconnect(note)
    first.release()
    with pytest.raises(LockLost):
        second.release()


def test_release_without_yes_and_without_a_terminal_releases_nothing() -> None:
    with Lock("cmd:kept", ttl=30):
        with pytest.raises(CommandError, match="--yes") as refused:
            djlocks("release", "cmd:kept")
        assert refused.value.returncode == 2
        assert len(backends["default"].holders("cmd:kept")) == 1


def test_releasing_a_free_name_says_so() -> None:
    with pytest.raises(CommandError, match="Nobody holds 'cmd:free'"):
        djlocks("release", "cmd:free", "--yes")


def test_unknown_backend_is_a_usage_error() -> None:
    with pytest.raises(CommandError, match="configured: default") as refused:
        djlocks("list", "--backend", "nowhere")
    assert refused.value.returncode == 2


def test_sweep_removes_expired_grants_and_dead_waiters() -> None:
    lapsed = Lock("cmd:lapsed", ttl=0.3, renew=False)
    grant = lapsed.acquire_grant()
    assert grant is not None
    long_ago = timezone.now() - timedelta(hours=1)
    LeaseWaiter.objects.create(
        key="0" * 64, name="cmd:dead", pid=1, since=long_ago, expires_at=long_ago
    )
    time.sleep(0.4)
    assert "default: 1 expired grants, 1 dead waiters" in djlocks("sweep").splitlines()
    assert not LeaseWaiter.objects.exists()
    with pytest.raises(LockLost):
        grant.release()
    assert "default: 0 expired grants, 0 dead waiters" in djlocks("sweep").splitlines()


def test_a_periodic_sweep_sweeps_again_and_again_while_its_lock_is_free() -> None:
    with pytest.raises(CommandError, match="more than 0"):
        djlocks("sweep", "--every", "0")
    another = Lock(SWEEP_LOCK, ttl=30)
    assert another.acquire(timeout=0)
    sweeper = manage("djlocks", "sweep", "--every", "0.2", stdout=subprocess.PIPE)
    try:
        assert sweeper.stdout is not None
        ready, _, _ = select.select([sweeper.stdout], [], [], 1.5)
        assert not ready, "it swept while another process held the sweep's lock"
        another.release()
        sweeps = 0
        for line in sweeper.stdout:
            sweeps += line.startswith("history:")
            if sweeps == 2:
                break
        assert sweeps == 2
    finally:
        sweeper.send_signal(signal.SIGTERM)  # a sweep under way ends, and releases its lock
        sweeper.communicate(timeout=30)
    assert sweeper.returncode == 0, "stopped between sweeps, not killed"


def test_django_s_common_options_may_follow_the_subcommand() -> None:
    """``manage.py djlocks list --settings S -v 2`` as Django users type it."""
    listed = manage("djlocks", "list", "--settings", "project.settings", "-v", "2", "--traceback")
    assert finished(listed) == 0


@pytest.mark.skipif(
    connection.vendor == "sqlite", reason="not applicable: an SQLite database is a file here"
)
@pytest.mark.parametrize("checks", [["--skip-checks"], []])
def test_a_database_that_is_down_is_exit_status_69_with_a_message(checks: list[str]) -> None:
    """Nothing listens on the database's port: each subcommand says so in a message,
    with and without Django's own system checks first (under Django 6 on MySQL they
    reach the database)."""
    environment = {**os.environ, "DJLOCKS_DB_PORT": str(free_port())}
    for arguments in (["list"], ["show", "down:x"], ["release", "down:x", "--yes"]):
        process = manage("djlocks", *arguments, *checks, env=environment, stderr=subprocess.PIPE)
        _, said = process.communicate(timeout=60)
        assert process.returncode == 69, (arguments, said)
        assert "Traceback" not in said, said
