"""The heartbeat under the worker models a Django project runs djlocks in.

Each test starts real workers on the test database (``tests/worker_models``):
gunicorn's sync, gthread and gevent workers, uvicorn, a Celery prefork worker,
and holds a lock whose TTL (0.9 s) is much shorter than the work (2.5 s), so
the lease survives only if the heartbeat renews it. Where it cannot (the
holder keeps the GIL in a C call; under gevent, it computes without yielding),
the loss is not silent: the holder learns ``LockLost`` at its release.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import pytest

from djlocks.green import green_threads_warning
from djlocks.kinds import Kind
from djlocks.models import LockEvent
from djlocks.stress import current_database_names
from tests.faults import free_port, wait_for_http
from tests.processes import wait_until_dead
from tests.worker_models.holding import hold

pytestmark = [
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(240),
    pytest.mark.real_workers,
]
#: Those below that depend on the database driver (gevent's cooperation, a forked
#: pool process's connections) run on every database; the others in one leg.
one_database = pytest.mark.one_database

ROOT = Path(__file__).resolve().parent.parent
#: Seconds: the lease, and the work done while holding it.
TTL, WORK = 0.9, 2.5
#: The Celery worker's broker and result store: a database of the test Redis of its own.
CELERY_REDIS_DB = 5


def worker_environment() -> dict[str, str]:
    """A worker's environment: these settings, on this test run's databases."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.worker_models.settings",
        "DJLOCKS_TEST_DATABASES": json.dumps(current_database_names()),
        "PYTHONPATH": str(ROOT),
    }


@contextmanager
def serving(*command: str, log: Path) -> Iterator[str]:
    """Run a web server (``{port}`` in ``command`` becomes a free port) until the block
    ends; yield its base URL."""
    port = free_port()
    with log.open("w") as output:
        server = subprocess.Popen(
            [part.format(port=port) for part in command],
            cwd=ROOT,
            env=worker_environment(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_http(f"http://127.0.0.1:{port}/hold", timeout=60)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(30)


def held(base: str, kind: str, path: str = "hold") -> dict[str, Any]:
    """What holding a lock for ``WORK`` seconds of ``kind`` work did, in a request."""
    query = urlencode({"name": f"worker:{kind}", "ttl": TTL, "seconds": WORK, "kind": kind})
    with urllib.request.urlopen(f"{base}/{path}?{query}", timeout=60) as response:
        result: dict[str, Any] = json.load(response)
    return result


def gunicorn(worker: str) -> list[str]:
    """One gunicorn worker of the class ``worker`` (``--threads`` would make a sync
    worker a gthread one, so only gthread gets threads)."""
    threads = ["--threads", "4"] if worker == "gthread" else []
    python = [sys.executable, "-m", "gunicorn", "tests.worker_models.wsgi"]
    return [*python, "-k", worker, "-w", "1", *threads, "-b", "127.0.0.1:{port}"]


@one_database
@pytest.mark.parametrize("worker", ["sync", "gthread"])
def test_gunicorn_workers_renew_while_a_request_holds_and_a_c_call_is_caught(
    worker: str, tmp_path: Path
) -> None:
    with serving(*gunicorn(worker), log=tmp_path / "gunicorn.log") as base:
        for kind in ("sleep", "spin"):  # the interpreter switches to the heartbeat
            result = held(base, kind)
            assert result["renewed"] and result["lost"] is None, (kind, result)
        stuck = held(base, "c-call")
        assert not stuck["renewed"] and stuck["lost"], stuck


def test_gevent_renews_while_the_holder_yields_and_says_what_starves_it(tmp_path: Path) -> None:
    log = tmp_path / "gunicorn.log"
    with serving(*gunicorn("gevent"), log=log) as base:
        assert held(base, "sleep")["renewed"], "a patched sleep yields to the heartbeat"
        starved = held(base, "spin")  # computing without yielding: no greenlet runs
        assert not starved["renewed"] and starved["lost"], starved
    assert "gevent has patched threading" in log.read_text(), "the worker was warned"


@one_database
def test_uvicorn_renews_whether_the_event_loop_awaits_or_is_blocked(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "uvicorn", "tests.worker_models.asgi:application"]
    with serving(*command, "--port", "{port}", log=tmp_path / "uvicorn.log") as base:
        assert held(base, "await", "hold-async")["renewed"]
        assert held(base, "sleep", "hold-async")["renewed"], "the heartbeat is not the loop's"
        assert held(base, "sleep")["renewed"], "a sync view, in uvicorn's thread pool"


@contextmanager
def celery_worker(
    log: Path, concurrency: int = 1, max_tasks_per_child: int | None = None
) -> Iterator[Any]:
    """A prefork Celery worker of ``tests.worker_models.tasks`` with ``concurrency`` pool
    processes (each replaced after ``max_tasks_per_child`` tasks, if given), on the test
    databases, Redis database ``CELERY_REDIS_DB`` as its broker and result store; yield
    that module, its tasks bound to the broker."""
    from redis import Redis

    broker = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{CELERY_REDIS_DB}"))
    Redis.from_url(broker).flushdb()
    environment = {**worker_environment(), "DJLOCKS_CELERY_BROKER": broker}
    command = [sys.executable, "-m", "celery", "-A", "tests.worker_models.tasks", "worker"]
    pool = ["--pool", "prefork", "--concurrency", str(concurrency), "--without-gossip"]
    if max_tasks_per_child is not None:
        pool += ["--max-tasks-per-child", str(max_tasks_per_child)]
    with log.open("w") as output:
        worker = subprocess.Popen(
            [*command, *pool], cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        from tests.worker_models import tasks

        tasks.app.conf.broker_url = tasks.app.conf.result_backend = broker
        yield tasks
    finally:
        worker.terminate()
        worker.wait(60)
        Redis.from_url(broker).flushdb()


def test_a_celery_prefork_worker_renews_in_its_forked_pool_process(tmp_path: Path) -> None:
    with celery_worker(tmp_path / "celery.log") as tasks:
        renewed = tasks.hold_task.delay("worker:celery", TTL, WORK, "sleep").get(timeout=120)
        assert renewed["renewed"] and renewed["lost"] is None, renewed
        stuck = tasks.hold_task.delay("worker:celery", TTL, WORK, "c-call").get(timeout=60)
        assert not stuck["renewed"] and stuck["lost"], stuck


@one_database
def test_a_recycled_celery_pool_process_writes_its_last_events_before_it_exits(
    tmp_path: Path,
) -> None:
    """A pool process replaced after one task ends with ``os._exit()``, which runs no
    exit handler, within the quarter of a second the background writer lets events
    gather: the events of the grant its task released are written all the same."""
    name = "worker:recycled"
    with celery_worker(tmp_path / "celery.log", max_tasks_per_child=1) as tasks:
        pid = tasks.take_and_release.delay(name).get(timeout=120)
        wait_until_dead(pid, timeout=30)
        kinds = LockEvent.objects.filter(name=name).values_list("kind", flat=True)
        assert sorted(kinds) == [Kind.ACQUIRED, Kind.RELEASED]


@one_database
def test_a_thread_stuck_in_a_c_call_cannot_renew_and_learns_it_at_release() -> None:
    """The holder keeps the GIL (no thread runs, the heartbeat neither): its lease runs
    out at the store, and its release says so instead of ending someone else's grant."""
    assert green_threads_warning() is None, "no gevent here: real threads"
    stuck = hold("worker:here", TTL, WORK, "c-call")
    assert not stuck["renewed"] and stuck["lost"], stuck
    assert hold("worker:here", TTL, 0.5, "sleep")["fence"] > stuck["fence"]
