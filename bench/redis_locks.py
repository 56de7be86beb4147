"""The floor, uncontended, contended lock and semaphore workloads on Redis: djlocks'
Redis backend beside its peers.

Contenders: djlocks ``redis`` (history on and off), redis-py's ``Lock`` (what
django-redis's ``cache.lock`` returns) and python-redis-lock, all on the same
Redis (``REDIS_URL``), in one run; and a floor, the least a lock that serves
its waiters in order costs (``fifo_floor``).

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
#: The least a lock that serves its waiters in order costs on Redis: no lease, fence or
#: identity, only a queue that a release hands the lock to the head of (``fifo_floor``).
FIFO_FLOOR = "floor: FIFO hand-off (Lua queue, BLPOP)"
CONTENDERS = (
    "djlocks redis (history on)",
    "djlocks redis (history off)",
    "redis-py Lock",
    "python-redis-lock",
    FIFO_FLOOR,
)
#: ``fifo_floor``'s acquire: take the free lock (1), else join the queue (0).
TAKE_OR_QUEUE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 1 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 0
"""
#: ``fifo_floor``'s release: the lock to the head of the queue, woken on its own list.
HAND_OVER = """
local heir = redis.call('LPOP', KEYS[2])
if not heir then redis.call('DEL', KEYS[1]) return 0 end
redis.call('SET', KEYS[1], heir)
redis.call('RPUSH', KEYS[3] .. heir, 1)
return 1
"""


def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def handle(contender: str, name: str = NAME) -> Handle:
    """acquire() and release() of one lock, as the contender's users would write them."""
    if contender.startswith("djlocks"):
        lock = Lock(name, backend="redis", ttl=30)
        return lock.acquire, lock.release
    if contender == FIFO_FLOOR:
        return fifo_floor(name)
    if contender == "redis-py Lock":
        peer = client().lock(name, timeout=30)
        return peer.acquire, peer.release
    other = redis_lock.Lock(client(), name, expire=30)
    return other.acquire, other.release


def fifo_floor(name: str) -> Handle:
    """A fair lock reduced to its hand-off, one round trip each way: the acquire takes
    the free lock or queues, then waits in ``BLPOP`` on a list of its own; the release
    gives the lock to the head of the queue and pushes to that list. What every lock
    that never lets a newcomer overtake a waiter pays under contention: each grant
    goes to another process (a barging lock keeps some in the releasing one)."""
    own = client()
    keys = fifo_keys(name)
    me = f"{os.getpid()}"
    take, give = own.register_script(TAKE_OR_QUEUE), own.register_script(HAND_OVER)

    def acquire() -> None:
        if not take(keys=keys[:2], args=[me]):
            own.blpop([keys[2] + me], 0)

    return acquire, lambda: give(keys=keys)


def fifo_keys(name: str) -> tuple[str, str, str]:
    """``fifo_floor``'s lock, queue, and wake-up lists' prefix (each run starts without)."""
    return f"{name}:fifo", f"{name}:fifo:queue", f"{name}:fifo:wake:"


def fresh_start() -> None:
    """Zero the counter, and drop the lock and queue an interrupted ``fifo_floor`` left."""
    own = client()
    own.delete(*fifo_keys(NAME)[:2])
    own.set(COUNTER, 0)


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
    fresh_start()
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
        reset=fresh_start,
        final_count=lambda: int(client().get(COUNTER) or 0),
    )


def run(quick: bool) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    pairs, rounds = (400, 4) if quick else (2000, 10)
    floor, table = uncontended(pairs, rounds)
    iterations = 50 if quick else 200
    with Crew("bench.redis_locks") as crew:
        # Untimed: each process's first contended acquires start what later ones reuse
        # (a waiter's line or wake-up listener, the history's writer), which the first
        # contender measured would otherwise pay for alone.
        contended(crew, CONTENDERS[0], iterations // 4)
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
