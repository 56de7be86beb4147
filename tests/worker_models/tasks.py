"""For a Celery worker: ``celery -A tests.worker_models.tasks worker --pool prefork``."""

import json
import os
import time
from typing import Any

from celery import Celery

from djlocks.tasks import limit_concurrency

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.worker_models.settings")

app = Celery("djlocks_worker_models")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task
def hold_task(name: str, ttl: float, seconds: float, kind: str) -> dict[str, object]:
    """``holding.hold`` in a task: on a prefork worker, in a forked pool process."""
    from tests.worker_models.holding import hold

    return hold(name, ttl, seconds, kind)


@app.task
def take_and_release(name: str) -> int:
    """Takes ``name`` and releases it at once, which hands its events to the background
    writer; returns the pool process's pid."""
    from djlocks import Lock

    with Lock(name, ttl=5):
        pass
    return os.getpid()


@app.task(bind=True, max_retries=None)
@limit_concurrency("render:{user_id}", when_busy="retry", retry_after=0.1, max_retry_after=0.4)
def render(self: Any, user_id: int, seconds: float, record: str) -> int:
    """One run per user at a time: append (user, start, end, pid) to ``record``; return
    how many times the run was retried because its user's slot was taken."""
    began = time.monotonic()
    time.sleep(seconds)
    with open(record, "a") as file:
        file.write(json.dumps([user_id, began, time.monotonic(), os.getpid()]) + "\n")
    return int(self.request.retries)


@app.task(time_limit=1)
@limit_concurrency("stuck:{job}", ttl=1.5)
def stuck(job: int, report: str) -> None:
    """Holds its slot past the hard time limit: the worker SIGKILLs its pool process."""
    with open(report, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(60)


@app.task
@limit_concurrency("stuck:{job}", when_busy="wait", timeout=30)
def after_stuck(job: int) -> float:
    """Waits for the slot ``stuck`` held; returns the monotonic time it got it."""
    return time.monotonic()
