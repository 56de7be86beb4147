"""Task-queue limits (``djlocks.tasks``): a run per name template at a time, what a busy
run does, the slot of a worker killed at its hard time limit, and enqueue-once; with a
real Celery worker (Redis as its broker), and with Django's own tasks framework, run in
place and by real ``db_worker`` processes of a database queue (django-tasks-db)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import django
import pytest
from django.conf import settings
from django.db import connection

from djlocks import Lock, NotAcquired
from djlocks.backends import backends
from djlocks.tasks import QUEUED_PREFIX, Busy, enqueue_once, fill, limit_concurrency
from tests import test_worker_models as worker_models
from tests.processes import wait_for_file, wait_until_dead

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(240)]
needs_django_tasks = pytest.mark.skipif(
    django.VERSION < (6, 0), reason="django.tasks is new in Django 6.0"
)


def test_the_name_is_filled_from_the_runs_arguments_and_a_missing_field_is_named() -> None:
    def render(user_id: int, page: int = 1) -> None: ...

    assert fill("render:{user_id}:{page}", render, (7,), {}) == "render:7:1"
    with pytest.raises(ValueError, match=r"'account'.*render"):
        fill("render:{account}", render, (7,), {})
    with pytest.raises(ValueError, match=r"'account'.*render"):
        limit_concurrency("render:{account}")(render)
    with pytest.raises(ValueError, match="must name arguments"):
        limit_concurrency("render:{0}")(render)
    with pytest.raises(ValueError, match="decorated with limit_concurrency"):
        enqueue_once(render, (7,))
    with pytest.raises(ValueError, match="when_busy"):
        limit_concurrency("x", when_busy="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        limit_concurrency("x", limit=0)


def test_a_busy_run_skips_waits_or_says_it_cannot_retry_outside_celery() -> None:
    ran: list[int] = []

    def work(user_id: int) -> int:
        ran.append(user_id)
        return user_id

    skipping = limit_concurrency("t-busy:{user_id}", when_busy="skip")(work)
    waiting = limit_concurrency("t-busy:{user_id}", when_busy="wait", timeout=0.2)(work)
    retrying = limit_concurrency("t-busy:{user_id}")(work)
    with Lock("t-busy:1", ttl=10):
        assert skipping(1) is None
        with pytest.raises(NotAcquired):
            waiting(1)
        with pytest.raises(Busy, match="needs a Celery worker"):
            retrying(1)
        assert skipping(2) == 2, "another user's runs are not limited by this one"
    assert (skipping(1), ran) == (1, [2, 1])
    assert backends["default"].holders("t-busy:1") == []


@pytest.mark.skipif(connection.vendor == "sqlite", reason="no session backend on SQLite")
def test_enqueue_once_needs_a_lease_backend() -> None:
    with pytest.raises(ValueError, match="lease backend"):
        enqueue_once(limit_concurrency("x:{user_id}", backend="session")(_work), (1,))


@needs_django_tasks
def test_djangos_own_tasks_run_limited_and_are_enqueued_once() -> None:
    """On Django's default task backend, which runs each task as it is enqueued."""
    from tests.django_tasks import greet, seen

    assert greet.enqueue(3).return_value == 3 and seen[-1] == (3, True), "held while it ran"
    with Lock("t-django:4", ttl=10):
        assert greet.enqueue(4).return_value is None, "skipped: the slot was taken"
        assert enqueue_once(greet, (4,)) is None, "running: not again"
    result = enqueue_once(greet, (5,))
    assert result is not None and result.return_value == 5
    assert backends["default"].holders(QUEUED_PREFIX + "t-django:5") == []


def assert_one_run_per_user_at_a_time(record: Path) -> None:
    """The runs in ``record`` (user, start, end, pid per line) of user 1 (three) never
    overlapped, and user 2's one run overlapped one of them."""
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    ones = sorted((start, end) for user, start, end, _ in runs if user == 1)
    assert len(ones) == 3 and all(a[1] <= b[0] for a, b in pairwise(ones)), ones
    (two,) = [(start, end) for user, start, end, _ in runs if user == 2]
    assert any(start < two[1] and two[0] < end for start, end in ones), "users run side by side"


def refused_while_queued_or_running(task: Any, name: str, record: Path) -> Any:
    """Enqueue a 1 s run of user 9 of ``task`` (a ``render``, whose slot is ``name``) with
    ``enqueue_once``; check that it is refused again while the run is queued, and while it
    runs after it gave its marker back. Return the queue's result of the run."""
    first = enqueue_once(task, (9, 1.0, str(record)))
    assert first is not None
    assert enqueue_once(task, (9, 1.0, str(record))) is None, "queued: not again"
    deadline = time.monotonic() + 60
    while not backends["default"].holders(name):  # running now
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.02)
    while backends["default"].holders(QUEUED_PREFIX + name):  # given back by the run
        assert time.monotonic() < deadline, "the run never gave the marker back"
        time.sleep(0.02)
    assert enqueue_once(task, (9, 1.0, str(record))) is None, "running: not again"
    return first


# -- a real django.tasks queue and its workers ---------------------------------------


@pytest.fixture
def task_workers(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two ``manage.py db_worker`` processes of the ``queue`` task backend (django-tasks-db),
    each running one task at a time in its own process; ready when yielded."""
    if "queue" not in settings.TASKS:
        pytest.fail("No queue task backend: make test-newest installs django-tasks-db.")
    command = [sys.executable, "-m", "django", "db_worker", "--backend", "queue"]
    options = ["--interval", "0.05", "--no-startup-delay", "--no-reload"]
    environment = {**worker_models.worker_environment(), "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / f"db_worker-{number}.log" for number in (1, 2)]
    workers = []
    for log in logs:
        with log.open("w") as output:
            workers.append(
                subprocess.Popen(
                    [*command, *options],
                    cwd=worker_models.ROOT,
                    env=environment,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        deadline = time.monotonic() + 60
        while not all("Starting worker" in log.read_text() for log in logs):
            assert all(worker.poll() is None for worker in workers), "a worker exited"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        yield workers
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(30)


def finished(result: Any, timeout: float = 60) -> Any:
    """The return value of the ``django.tasks`` run ``result``, once a worker has run it."""
    deadline = time.monotonic() + timeout
    while not result.is_finished:
        assert time.monotonic() < deadline, f"the run is still {result.status}"
        time.sleep(0.05)
        result.refresh()
    return result.return_value


@needs_django_tasks
def test_django_task_workers_run_one_per_user_at_a_time(
    task_workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    from tests.django_tasks import render

    record = tmp_path / "runs.jsonl"
    results = [render.enqueue(user, 0.5, str(record)) for user in (1, 1, 2, 1)]
    assert [finished(result) for result in results] == [1, 1, 2, 1]
    assert_one_run_per_user_at_a_time(record)
    assert len({pid for *_, pid in map(json.loads, record.read_text().splitlines())}) == 2


@needs_django_tasks
def test_a_django_task_worker_killed_mid_run_frees_its_slot_within_its_ttl(
    task_workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    from tests.django_tasks import after_stuck, stuck

    report = tmp_path / "stuck-pid"
    stuck.enqueue(1, str(report))
    pid = int(wait_for_file(report))
    waiting = after_stuck.enqueue(1)
    deadline = time.monotonic() + 30
    while not backends["default"].waiters("t-queue-stuck:1"):  # the other worker waits
        assert time.monotonic() < deadline, "the second run never waited for the slot"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    wait_until_dead(pid, timeout=30)
    died = time.monotonic()
    got = finished(waiting)
    # The slot's lease ran out unrenewed, at most its TTL (1.5 s) after the kill; the
    # 3 s of slack are for a loaded box.
    assert got - died < 1.5 + 3.0, f"the slot came free {got - died:.2f} s after the kill"


@needs_django_tasks
def test_django_task_enqueue_once_refuses_a_key_queued_or_running(
    task_workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    from tests.django_tasks import render

    record = tmp_path / "runs.jsonl"
    first = refused_while_queued_or_running(render, "t-queue:9", record)
    assert finished(first) == 9
    again = enqueue_once(render, (9, 0.0, str(record)))
    assert again is not None and finished(again) == 9
    assert len(record.read_text().splitlines()) == 2


# -- a real Celery worker -----------------------------------------------------------


@pytest.fixture
def celery_worker(tmp_path: Path) -> Iterator[Any]:
    """A real prefork Celery worker with 3 pool processes; yields its tasks' module."""
    with worker_models.celery_worker(tmp_path / "celery.log", concurrency=3) as tasks:
        yield tasks


@pytest.mark.real_workers
@pytest.mark.one_database
def test_celery_runs_one_per_user_at_a_time_retrying_the_busy_ones(
    celery_worker: Any, tmp_path: Path
) -> None:
    record = tmp_path / "runs.jsonl"
    results = [celery_worker.render.delay(user, 0.3, str(record)) for user in (1, 1, 1, 2)]
    retries = [result.get(timeout=120) for result in results]
    assert_one_run_per_user_at_a_time(record)
    assert sum(retries) >= 2, "the busy runs were retried, not run at once"
    assert backends["default"].holders() == []


@pytest.mark.real_workers
@pytest.mark.one_database
def test_a_run_killed_at_its_hard_time_limit_frees_its_slot_within_its_ttl(
    celery_worker: Any, tmp_path: Path
) -> None:
    report = tmp_path / "stuck-pid"
    killed = celery_worker.stuck.delay(1, str(report))
    pid = int(wait_for_file(report))
    waiting = celery_worker.after_stuck.delay(1)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Worker exited"):
        killed.get(timeout=60)
    wait_until_dead(pid, timeout=30)
    died = time.monotonic()
    got = waiting.get(timeout=60)
    # The slot's lease ran out unrenewed, at most its TTL (1.5 s) after the kill; the
    # 3 s of slack are for a loaded box.
    assert got - died < 1.5 + 3.0, f"the slot came free {got - died:.2f} s after the kill"


@pytest.mark.real_workers
@pytest.mark.one_database
def test_celery_enqueue_once_refuses_a_key_queued_or_running(
    celery_worker: Any, tmp_path: Path
) -> None:
    record = tmp_path / "runs.jsonl"
    first = refused_while_queued_or_running(celery_worker.render, "render:9", record)
    first.get(timeout=60)
    again = enqueue_once(celery_worker.render, (9, 0.0, str(record)))
    assert again is not None and again.get(timeout=60) == 0
    assert len(record.read_text().splitlines()) == 2


def _work(user_id: int) -> int:
    return user_id


def test_the_marker_is_given_back_by_the_run_and_a_second_attempt_still_runs() -> None:
    """A queue that keeps its messages (a stand-in for a broker): the run gives the
    marker back, a redelivered attempt whose marker is gone still runs, a busy run that
    will not be retried gives it back too."""
    work = limit_concurrency("t-once:{user_id}", when_busy="skip")(_work)
    queued: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Queue:
        func = staticmethod(work)

        def enqueue(self, *args: Any, **kwargs: Any) -> str:
            queued.append((args, kwargs))
            return "queued"

    marker = QUEUED_PREFIX + "t-once:1"
    assert enqueue_once(Queue(), (1,)) == "queued"
    assert enqueue_once(Queue(), (1,)) is None, "already queued"
    args, kwargs = queued[0]
    assert backends["default"].holders(marker)
    assert work(*args, **kwargs) == 1 and backends["default"].holders(marker) == []
    assert work(*args, **kwargs) == 1, "a second attempt runs though its marker is gone"
    assert enqueue_once(Queue(), (1,)) == "queued"
    with Lock("t-once:1", ttl=10):
        args, kwargs = queued[-1]
        assert work(*args, **kwargs) is None, "skipped: busy"
    assert backends["default"].holders(marker) == [], "a skipped run gives the marker back"


def test_an_async_task_is_refused_at_decoration() -> None:
    async def render(user_id: int) -> None: ...

    with pytest.raises(TypeError, match="async"):
        limit_concurrency("t:{user_id}")(render)


@pytest.mark.one_database  # and where the Celery workers' tests run first: its eager
# run makes the app's result backend, which must be theirs (celery_worker sets it)
def test_an_eager_celery_run_that_is_busy_raises_busy_instead_of_retrying_in_place(
    tmp_path: Path,
) -> None:
    """``apply()`` (or always-eager) runs in place, with no queue to retry through."""
    from tests.worker_models.tasks import render

    with Lock("render:70", ttl=10):
        result = render.apply(args=(70, 0.0, str(tmp_path / "runs")))
    with pytest.raises(Busy, match="needs a Celery worker"):
        result.get()
