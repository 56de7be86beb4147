"""Task-queue deduplication: djlocks' ``enqueue_once`` beside celery-once and
celery-singleton, through one Celery broker and real prefork workers.

Contenders, all on the same task and the same Redis broker (``bench/task_app.py``):
plain ``apply_async`` (the floor: no deduplication), celery-once's ``QueueOnce``
and celery-singleton's ``Singleton`` (a Redis key per queued or running task), and
djlocks' ``enqueue_once`` on its Redis backend and on its lease backend (the
database picked by ``DJLOCKS_DB``), whose run holds a ``limit_concurrency`` slot.

* Enqueue: the median time to enqueue one of N new keys, then to refuse each of
  them again while queued (no worker is running yet), and how many were refused.
* Drain: a worker with 2 pool processes runs the N queued tasks: runs per second
  from the first run's start to the last run's end, each contender's run-side work
  included; then the deduplication keys left behind (none is right).
* Killed: a run of each whose pool process is killed with SIGKILL (as the OOM
  killer, a lost host, or a hard time limit the task does not answer would end it):
  how long until the same key can be enqueued again, watched for ``WATCH_S`` seconds,
  each library with its defaults (celery-once's keys expire after an hour,
  celery-singleton's never; neither is renewed, so an expiry set shorter than the
  longest run would let a duplicate in while it runs).

Usage: DJLOCKS_DB=postgresql python bench/task_queues.py [--quick]. Prints one JSON
document.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
from celery import uuid  # noqa: E402
from django.core.management import call_command  # noqa: E402

from bench import task_app  # noqa: E402
from djlocks.backends import backends  # noqa: E402
from djlocks.percentiles import percentile  # noqa: E402
from djlocks.tasks import enqueue_once  # noqa: E402

#: Seconds a killed run's key is watched for becoming free again.
WATCH_S = 10.0
#: In every key of this run: a run is never refused by what an earlier one left.
RUN = uuid()[:8]
#: The worker's log: the runs killed on purpose log their loss there.
WORKER_LOG = ROOT / "var" / "bench-celery.log"
Enqueue = Callable[[str], Any]  # key -> the queue's result, or None if refused


def celery_once_enqueue(task: Any) -> Enqueue:
    def enqueue(key: str) -> Any:
        result = task.apply_async((key,))
        return result if result.id else None  # graceful: a duplicate's result has no id

    return enqueue


def singleton_enqueue(task: Any) -> Enqueue:
    def enqueue(key: str) -> Any:
        task_id = uuid()
        result = task.apply_async((key,), task_id=task_id)
        return result if result.id == task_id else None  # a duplicate: the queued run's

    return enqueue


def djlocks_enqueue(task: Any) -> Enqueue:
    return lambda key: enqueue_once(task, (key,))


def peer_keys(pattern: str) -> Callable[[], int]:
    return lambda: sum(1 for _ in broker().scan_iter(match=pattern, count=1000))


def djlocks_holders(alias: str) -> Callable[[], int]:
    def count() -> int:
        names = (holder.name for holder in backends[alias].holders())
        return sum(RUN in name for name in names)

    return count


#: contender -> (how it enqueues the task, how it enqueues the stuck task, how many of
#: its deduplication keys or holders are left).
CONTENDERS: dict[str, tuple[Enqueue, Enqueue | None, Callable[[], int]]] = {
    "Celery apply_async (no deduplication)": (
        lambda key: task_app.plain.apply_async((key,)),
        None,
        lambda: 0,
    ),
    "celery-once QueueOnce": (
        celery_once_enqueue(task_app.once),
        celery_once_enqueue(task_app.stuck_once),
        peer_keys("qo_*"),
    ),
    "celery-singleton Singleton": (
        singleton_enqueue(task_app.singleton),
        singleton_enqueue(task_app.stuck_singleton),
        peer_keys("SINGLETONLOCK_*"),
    ),
    "djlocks enqueue_once (redis)": (
        djlocks_enqueue(task_app.djlocks_redis),
        djlocks_enqueue(task_app.stuck_djlocks_redis),
        djlocks_holders("redis"),
    ),
    "djlocks enqueue_once (lease)": (
        djlocks_enqueue(task_app.djlocks_lease),
        djlocks_enqueue(task_app.stuck_djlocks_lease),
        djlocks_holders("default"),
    ),
}


def broker() -> redis.Redis:
    return redis.Redis.from_url(task_app.BROKER)


@contextmanager
def worker() -> Iterator[None]:
    """A prefork Celery worker of ``bench.task_app`` with 2 pool processes."""
    command = [sys.executable, "-m", "celery", "-A", "bench.task_app", "worker"]
    options = ["--pool", "prefork", "--concurrency", "2", "--loglevel", "WARNING"]
    options += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    with WORKER_LOG.open("a") as log:
        process = subprocess.Popen(
            [*command, *options], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        yield
    finally:
        process.terminate()
        process.wait(60)


def timed(enqueue: Enqueue, keys: list[str]) -> tuple[list[float], list[Any]]:
    """Seconds each enqueue of ``keys`` took, and what each returned."""
    seconds, results = [], []
    for key in keys:
        began = time.perf_counter()
        results.append(enqueue(key))
        seconds.append(time.perf_counter() - began)
    return seconds, results


def dedup(contender: str, keys: int) -> dict[str, Any]:
    """Enqueue ``keys`` new keys, refuse them again, drain them with a worker."""
    enqueue, _, left_behind = CONTENDERS[contender]
    names = [f"{RUN}-{list(CONTENDERS).index(contender)}-{number}" for number in range(keys)]
    warm_up = enqueue(f"{names[0]}-warm-up")  # connections opened, scripts loaded: untimed
    new, results = timed(enqueue, names)
    again, duplicates = timed(enqueue, names)
    with worker():
        runs = [result.get(timeout=300) for result in results]
        warm_up.get(timeout=300)
    began, ended = min(start for start, _ in runs), max(end for _, end in runs)
    return {
        "contender": contender,
        "enqueue_us": round(statistics.median(new) * 1e6),
        "enqueue_p99_us": round(percentile(new, 99) * 1e6),
        "duplicate_us": round(statistics.median(again) * 1e6),
        "refused": sum(result is None for result in duplicates),
        "keys": keys,
        "runs_per_s": round(len(runs) / (ended - began)),
        "left_behind": left_behind(),
    }


def killed_run(contender: str) -> float | None:
    """Seconds from the SIGKILL of a run's pool process until its key can be enqueued
    again; ``None`` if it was still refused after ``WATCH_S``."""
    _, enqueue_stuck, _ = CONTENDERS[contender]
    assert enqueue_stuck is not None
    key = f"{RUN}-stuck-{list(CONTENDERS).index(contender)}"
    assert enqueue_stuck(key) is not None, f"{contender}: a stale key refused the first run"
    kill(running(key))
    killed = time.monotonic()
    while time.monotonic() - killed < WATCH_S:
        if enqueue_stuck(key) is not None:
            freed = time.monotonic() - killed
            kill(running(key))  # the run enqueued again: it would run on for a minute
            return round(freed, 2)
        time.sleep(0.05)
    return None


def running(key: str) -> int:
    """The pid of the pool process that runs the stuck task of ``key``, once it says so."""
    deadline = time.monotonic() + 60
    while (pid := broker().getdel(f"pid:{key}")) is None:
        assert time.monotonic() < deadline, f"the stuck run of {key} never started"
        time.sleep(0.01)
    return int(pid)


def kill(pid: int) -> None:
    """SIGKILL, as the OOM killer or a lost host would end the run: no handler runs."""
    os.kill(pid, signal.SIGKILL)


def run(quick: bool) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    broker().flushdb()
    WORKER_LOG.write_text("")
    keys = 60 if quick else 300
    rows = [dedup(contender, keys) for contender in CONTENDERS]
    with worker():
        freed = {
            contender: killed_run(contender)
            for contender, (_, stuck, _) in CONTENDERS.items()
            if stuck is not None
        }
    for row in rows:
        row["free_after_kill_s"] = freed.get(row["contender"], "n/a")
    broker().flushdb()
    return {
        "ttl_s": task_app.TTL,
        "watch_s": WATCH_S,
        "dedup": rows,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
