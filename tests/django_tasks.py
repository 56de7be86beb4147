"""Tasks of Django's own tasks framework (Django 6.0+), limited by djlocks: tasks must
be defined at a module's top level. ``greet`` runs as it is enqueued (the default
backend); the others go through the ``queue`` backend, a real queue in the database
that ``manage.py db_worker --backend queue`` processes work through."""

import json
import os
import time

from django.tasks import task

from djlocks.backends import backends
from djlocks.tasks import limit_concurrency

#: What each run saw: (user_id, whether its slot was held while it ran).
seen: list[tuple[int, bool]] = []


@task
@limit_concurrency("t-django:{user_id}", when_busy="skip")
def greet(user_id: int) -> int:
    seen.append((user_id, bool(backends["default"].holders(f"t-django:{user_id}"))))
    return user_id


@task(backend="queue")
@limit_concurrency("t-queue:{user_id}", when_busy="wait", timeout=60)
def render(user_id: int, seconds: float, record: str) -> int:
    """One run per user at a time, waiting for its turn: append (user, start, end, pid)
    to ``record``."""
    began = time.monotonic()
    time.sleep(seconds)
    with open(record, "a") as file:
        file.write(json.dumps([user_id, began, time.monotonic(), os.getpid()]) + "\n")
    return user_id


@task(backend="queue")
@limit_concurrency("t-queue-stuck:{job}", ttl=1.5)
def stuck(job: int, report: str) -> None:
    """Holds its slot until its worker is killed: writes the worker's pid to ``report``."""
    with open(report, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(120)


@task(backend="queue")
@limit_concurrency("t-queue-stuck:{job}", when_busy="wait", timeout=60)
def after_stuck(job: int) -> float:
    """Waits for the slot ``stuck`` held; returns the monotonic time it got it."""
    return time.monotonic()
