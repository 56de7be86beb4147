"""Redis beyond one process group: djlocks on a Redis Cluster beside one server, and 8
to 64 processes spread over four hosts' addresses of one store.

Runs inside ``bench/private_redis.py`` (``make bench`` does so), whose private
servers ``bench/settings.py`` names as backends. Event history is off throughout:
these figures are the store's.

* Cluster beside one server: the floor of each (median ``PING`` to the server,
  and to the master that serves the name), uncontended pairs, the contended lock
  (8 processes x 200 of acquire -> ``GET`` counter -> ``SET`` + 1 -> release) and
  the semaphore (limit 3, 8 processes x 100, 5 ms hold) for djlocks on the
  server, on the cluster, and on the cluster with ``wait_replicas`` 1 (each grant
  and renewal acknowledged by the master's replica: ``WAIT``'s cost).
* Scale: the contended lock with 8, 16, 32 and 64 processes (1,600 operations in
  all at each size), process *k* connecting through address *k* mod 4 with a
  connection pool of its own, djlocks beside python-redis-lock on the same server:
  ops/s, hand-off, fairness (Jain's index of the grants per process until the first
  process had all of its own: 1.0 is even) and wait p99.

Usage: python -m bench.private_redis python bench/redis_scale.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
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
from redis.cluster import RedisCluster  # noqa: E402

from bench.contention import WORKER, Crew, Workload, worker_number  # noqa: E402
from bench.interleaved import Handle, summary, time_pairs  # noqa: E402
from bench.redis_locks import ping_seconds  # noqa: E402
from djlocks import Lock, Semaphore  # noqa: E402
from djlocks.keys import redis_meta_key  # noqa: E402

NAME = "bench:scale"
COUNTER = "bench:scale:counter"
ALONE, CLUSTER, ACKED = "djlocks, one server", "djlocks, cluster", "djlocks, cluster, WAIT 1"
PEER = "python-redis-lock"
BACKEND_OF = {CLUSTER: "redis-cluster", ACKED: "redis-cluster-acked"}
HOSTS = os.environ.get("DJLOCKS_BENCH_HOSTS", "").split()
SIZES = (8, 16, 32, 64)
OPERATIONS = 1600  # per size, shared among its processes


def host() -> int:
    """The address this process uses: by its number in its crew (the main process: 0)."""
    if multiprocessing.current_process().name.startswith(WORKER):
        return worker_number() % len(HOSTS)
    return 0


def backend_of(contender: str) -> str:
    return BACKEND_OF.get(contender, f"host-{host()}")


def client(contender: str) -> redis.Redis | RedisCluster:
    """A client of the contender's store, with a connection pool of its own."""
    if contender in BACKEND_OF:
        return RedisCluster.from_url(settings.REDIS_CLUSTER_URL)
    return redis.Redis.from_url(f"redis://{HOSTS[host()]}/0")


def locking(contender: str, limit: int) -> Handle:
    if contender == PEER:
        peer = redis_lock.Lock(client(PEER), NAME, expire=30)
        return peer.acquire, peer.release
    if limit == 1:
        lock = Lock(NAME, backend=backend_of(contender), ttl=30)
        return lock.acquire, lock.release
    semaphore = Semaphore(NAME + ":sem", limit=limit, backend=backend_of(contender), ttl=30)
    return semaphore.acquire, semaphore.release


def counter(contender: str) -> tuple[Any, Any]:
    """GET and SET of the shared counter on the worker's own connection."""
    own = client(contender)
    return lambda: int(own.get(COUNTER) or 0), lambda value: own.set(COUNTER, value)


def context(contender: str) -> Any:
    return override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS": False})


def finish() -> None:
    """Nothing to close: each workload's clients and their pools go with it."""


def floors() -> dict[str, float]:
    """Seconds: the median ``PING`` to the one server, and to the master serving ``NAME``
    (its own connection, without the cluster client's routing)."""
    cluster = RedisCluster.from_url(settings.REDIS_CLUSTER_URL)
    prefix = settings.DJLOCKS.get("KEY_PREFIX", "djlocks")
    master = cluster.get_node_from_key(redis_meta_key(prefix, NAME)).redis_connection
    server = redis.Redis.from_url(f"redis://{HOSTS[0]}/0")
    alone = statistics.median(ping_seconds(server, 500))
    on_cluster = statistics.median(ping_seconds(master, 500))
    server.close()
    cluster.close()
    return {ALONE: alone, CLUSTER: on_cluster, ACKED: on_cluster}


def contended(crew: Crew, contender: str, workload: Workload) -> dict[str, Any]:
    store = client(contender)
    return crew.run(
        workload,
        reset=lambda: store.set(COUNTER, 0),
        final_count=lambda: int(store.get(COUNTER) or 0),
    )


def run(quick: bool) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    compared = (ALONE, CLUSTER, ACKED)
    floor = floors()
    pairs, rounds = (400, 4) if quick else (2000, 10)
    with context(ALONE):
        times = time_pairs({c: locking(c, 1) for c in compared}, pairs, rounds, context)
    iterations = 50 if quick else 200
    with Crew("bench.redis_scale") as crew:
        locks = [contended(crew, c, Workload(c, iterations)) for c in compared]
        semaphores = [
            contended(crew, c, Workload(c, iterations // 2, limit=3, hold=0.005)) for c in compared
        ]
    scale = []
    for size in SIZES:
        operations = OPERATIONS // (4 if quick else 1)
        with Crew("bench.redis_scale", processes=size) as crew:
            for contender in (ALONE, PEER):
                result = contended(crew, contender, Workload(contender, operations // size))
                scale.append({"processes": size, **result})
    return {
        "floor_us": {c: round(seconds * 1e6, 1) for c, seconds in floor.items()},
        "pairs": pairs,
        "uncontended": [summary(c, times[c], floor[c]) for c in compared],
        "contended": locks,
        "semaphore": semaphores,
        "hosts": len(HOSTS),
        "operations": OPERATIONS // (4 if quick else 1),
        "scale": scale,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
