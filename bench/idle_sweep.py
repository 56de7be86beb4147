"""The idle-name sweep workload: many distinct names taken once each, then swept.

Names are often per object ("invoice:{id}"), so a store that keeps every name
grows without bound. For each store of the database (and Redis once): NAMES
(FEWER on the session and row stores) distinct names are taken and released once
each by PROCESSES processes, then, a few seconds later, RECENT more;
``sweep(idle_names=...)`` then removes the first set and keeps the recent one.
Reported: the rows (or keys) before, filled and after, the names' first-use
rate, the sweep's time, and the dashboard overview's time filled and after.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/idle_sweep.py [--quick]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from django.apps import apps  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django.test import Client  # noqa: E402

from djlocks import Lock  # noqa: E402
from djlocks.backends import backends  # noqa: E402
from djlocks.backends.redis import RedisBackend  # noqa: E402
from djlocks.models import LockEvent  # noqa: E402

QUICK = "--quick" in sys.argv
NAMES = 5_000 if QUICK else 100_000
#: Fewer on the session and row stores, whose first use costs the same round trips.
FEWER = 5_000 if QUICK else 20_000
RECENT = 1_000
PROCESSES = 4
#: New interpreters, not forks: a fork would share (and close) this one's connections.
SPAWN = multiprocessing.get_context("spawn")
#: Seconds between the last of the old names' grants and the first recent one; the
#: sweep removes the names idle since the middle of that gap.
GAP = 4.0
#: The tables of each store family (rows counted before and after).
TABLES = {
    "LeaseBackend": ["djlocks.LeaseSlot", "djlocks.LeaseWaiter"],
    "RowLockBackend": ["djlocks.RowFence", "djlocks.RowHolder", "djlocks.RowLock"],
    "session": ["djlocks.SessionFence", "djlocks.SessionHolder"],
}


def take(alias: str, prefix: str, first: int, count: int) -> None:
    """Take and release ``count`` distinct names once each (a child process)."""
    for i in range(first, first + count):
        with Lock(f"{prefix}{i:06}", backend=alias, ttl=30):
            pass
    connections.close_all()


def take_in_processes(alias: str, prefix: str, count: int) -> float:
    """Names per second, ``count`` names over ``PROCESSES`` processes."""
    share = count // PROCESSES
    began = time.perf_counter()
    workers = [
        SPAWN.Process(target=take, args=(alias, prefix, n * share, share)) for n in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
        assert worker.exitcode == 0, f"a taking process failed ({worker.exitcode})"
    return round(share * PROCESSES / (time.perf_counter() - began))


def size(alias: str) -> int:
    """Rows of the store's tables, or its keys in Redis."""
    backend = backends[alias]
    kind = type(backend).__name__
    if isinstance(backend, RedisBackend):
        keys = backend.redis().scan_iter(match=f"{backend.prefix}:*", count=1000)
        return sum(1 for _ in keys)
    models = TABLES.get(kind, TABLES["session"])
    using = backend.using  # type: ignore[attr-defined]
    return sum(apps.get_model(model).objects.using(using).count() for model in models)


def overview_seconds(client: Client) -> float:
    began = time.perf_counter()
    response = client.get("/admin/djlocks/lockname/")
    assert response.status_code == 200, response.status_code
    return round(time.perf_counter() - began, 3)


def measure(alias: str, client: Client) -> dict[str, Any]:
    prefix = f"bench-idle-{alias}:"
    backend = backends[alias]
    names = NAMES if type(backend).__name__ in ("LeaseBackend", "RedisBackend") else FEWER
    before = size(alias)
    rate = take_in_processes(alias, prefix, names)
    old_done = time.monotonic()
    time.sleep(GAP)
    take_in_processes(alias, f"{prefix}recent:", RECENT)
    filled = size(alias)
    dashboard_filled = overview_seconds(client)
    began = time.perf_counter()
    idle = time.monotonic() - old_done - GAP / 2  # the old names, not the recent ones
    swept = backend.sweep(idle_names=idle).get("idle names", 0)
    sweep_s = time.perf_counter() - began
    after = size(alias)
    dashboard_after = overview_seconds(client)
    backend.sweep(idle_names=0.0)  # the recent names too: the store as it was
    LockEvent.objects.filter(name__startswith=prefix).delete()
    return {
        "backend": alias,
        "store": type(backend).__name__,
        "names": names,
        "recent": RECENT,
        "first_use_per_s": rate,
        "rows_before": before,
        "rows_filled": filled,
        "names_swept": swept,
        "rows_after": after,
        "sweep_s": round(sweep_s, 2),
        "swept_per_s": round(swept / max(sweep_s, 0.001)),
        "dashboard_filled_s": dashboard_filled,
        "dashboard_after_s": dashboard_after,
    }


def main() -> None:
    call_command("migrate", verbosity=0)
    user, _ = User.objects.get_or_create(username="bench-admin", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    with_redis = os.environ.get("DJLOCKS_DB") == "postgresql"  # Redis once, not per database
    aliases = [alias for alias in settings.DJLOCKS["BACKENDS"] if alias != "redis" or with_redis]
    runs = [measure(alias, client) for alias in aliases]
    print(json.dumps({"database": connections["default"].vendor, "runs": runs}))


if __name__ == "__main__":
    main()
