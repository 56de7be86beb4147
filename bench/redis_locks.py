"""The floor, uncontended, contended lock and semaphore workloads on Redis: djlocks'
Redis backend beside its peers.

Contenders: djlocks ``redis`` (history on and off), redis-py's ``Lock`` (what
django-redis's ``cache.lock`` returns) and python-redis-lock, all on the same
Redis (``REDIS_URL``), in one run.

* Floor: median ``PING`` through redis-py, sampled between the batches.
* Uncontended: acquire+release pairs on one name, rounds interleaved.
* Contended lock: 8 processes x 200 iterations of acquire -> read a counter
  (``GET`` on the worker's own connection), write it + 1 (``SET``) -> release.
  Reported: ops/s, lost updates, overlapping critical sections, hand-off
  (previous holder's end of critical section -> next holder's acquire
  returned, for holders that were already waiting), barging (after a release
  while another process waited, how often the releaser got the lock straight
  back), and wait p99 / max.
* Semaphore (djlocks only; the peers have none): limit 3, 8 processes x 100,
  5 ms hold, as a share of the 600 ops/s ideal; the most holders seen at once.

Usage: DJLOCKS_DB=postgresql python bench/redis_locks.py [--quick]
(the database only holds djlocks' event history). Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
import redis_lock  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from bench.contention import Crew, Workload  # noqa: E402
from bench.interleaved import Handle, summary, time_pairs  # noqa: E402
from djlocks import Lock, Semaphore  # noqa: E402

NAME = "bench:redis"
COUNTER = "bench:redis:counter"
CONTENDERS = (
    "djlocks redis (history on)",
    "djlocks redis (history off)",
    "redis-py Lock",
    "python-redis-lock",
)


def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def handle(contender: str, name: str = NAME) -> Handle:
    """acquire() and release() of one lock, as the contender's users would write them."""
    if contender.startswith("djlocks"):
        lock = Lock(name, backend="redis", ttl=30)
        return lock.acquire, lock.release
    if contender == "redis-py Lock":
        peer = client().lock(name, timeout=30)
        return peer.acquire, peer.release
    other = redis_lock.Lock(client(), name, expire=30)
    return other.acquire, other.release


def history(contender: str) -> Any:
    return override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS": "off" not in contender})


def ping_seconds(connection: redis.Redis, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        connection.ping()
        times.append(time.perf_counter() - began)
    return times


def uncontended(pairs: int, rounds: int) -> tuple[float, list[dict[str, Any]]]:
    """The floor (median ``PING``, sampled between every batch) and each contender's pairs."""
    pinger = client()
    pings = ping_seconds(pinger, 100)
    times = time_pairs(
        {c: handle(c) for c in CONTENDERS},
        pairs,
        rounds,
        history,
        between=lambda: pings.extend(ping_seconds(pinger, 20)),
    )
    floor = statistics.median(pings)
    return floor, [summary(contender, samples, floor) for contender, samples in times.items()]


def context(contender: str) -> Any:
    return history(contender)


def counter(contender: str) -> tuple[Callable[[], int], Callable[[int], object]]:
    """GET and SET of the shared counter on the worker's own connection."""
    own = client()
    return lambda: int(own.get(COUNTER) or 0), lambda value: own.set(COUNTER, value)


def locking(contender: str, limit: int) -> Handle:
    if limit == 1:
        return handle(contender)
    semaphore = Semaphore(NAME + ":sem", limit=limit, backend="redis", ttl=30)
    return semaphore.acquire, semaphore.release


def finish() -> None:
    """Nothing to close: redis-py's pools go with their clients."""


def contended(
    crew: Crew, contender: str, iterations: int, limit: int = 1, hold: float = 0.0
) -> Any:
    return crew.run(
        Workload(contender, iterations, limit, hold),
        reset=lambda: client().set(COUNTER, 0),
        final_count=lambda: int(client().get(COUNTER) or 0),
    )


def run(quick: bool) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    pairs, rounds = (400, 4) if quick else (2000, 10)
    floor, table = uncontended(pairs, rounds)
    iterations = 50 if quick else 200
    with Crew("bench.redis_locks") as crew:
        lock_runs = [contended(crew, contender, iterations) for contender in CONTENDERS]
        semaphore = contended(crew, CONTENDERS[0], 25 if quick else 100, limit=3, hold=0.005)
    return {
        "floor_us": round(floor * 1e6, 1),
        "pairs": pairs,
        "uncontended": table,
        "contended": lock_runs,
        "semaphore": semaphore,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
