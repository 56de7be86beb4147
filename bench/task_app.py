"""The Celery app of the task-queue benchmark (bench/task_queues.py): the same task under
each contender's deduplication, and a task of each that runs until it is killed.

Started by the benchmark as ``celery -A bench.task_app worker``; its broker, result
store and the peers' lock stores are Redis database ``BENCH_REDIS_DB`` of ``REDIS_URL``.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from djlocks.tasks import limit_concurrency

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

#: The Redis database of the broker, the results and the peers' locks (flushed by the bench).
BENCH_REDIS_DB = 6
BROKER = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{BENCH_REDIS_DB}"))
#: Seconds: the TTL of djlocks' slots.
TTL = 1.5

app = Celery("djlocks_bench_tasks", broker=BROKER, backend=BROKER)
app.conf.update(
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": BROKER}},
    singleton_backend_url=BROKER,
    worker_prefetch_multiplier=1,
)


def work(key: str) -> tuple[float, float]:
    """The task's body: nothing; the monotonic times it began and ended."""
    began = time.monotonic()
    return began, time.monotonic()


def stuck_work(key: str) -> None:
    """Says its pool process's pid (at ``pid:<key>`` in the broker's database), then runs
    until the benchmark kills that process."""
    redis.Redis.from_url(BROKER).set(f"pid:{key}", os.getpid())
    time.sleep(60)


plain = app.task(name="plain")(work)
once = app.task(name="once", base=QueueOnce, once={"graceful": True})(work)
singleton = app.task(name="singleton", base=Singleton)(work)
djlocks_redis = app.task(name="djlocks_redis")(
    limit_concurrency("bench-task:{key}", backend="redis", when_busy="skip")(work)
)
djlocks_lease = app.task(name="djlocks_lease")(
    limit_concurrency("bench-task:{key}", backend="default", when_busy="skip")(work)
)

stuck_once = app.task(name="stuck_once", base=QueueOnce, once={"graceful": True})(stuck_work)
stuck_singleton = app.task(name="stuck_singleton", base=Singleton)(stuck_work)
stuck_djlocks_redis = app.task(name="stuck_djlocks_redis")(
    limit_concurrency("bench-stuck:{key}", backend="redis", ttl=TTL)(stuck_work)
)
stuck_djlocks_lease = app.task(name="stuck_djlocks_lease")(
    limit_concurrency("bench-stuck:{key}", backend="default", ttl=TTL)(stuck_work)
)
