"""BENCHMARKS.md workloads 1 and 2 for one database: the floor and uncontended locks.

Each contender (every djlocks backend configured for the database, history on
and off for the lease backend, and the raw primitive of the server) runs
acquire+release pairs on one name; the rounds are interleaved so that drift
on a noisy machine hits every contender alike. The floor, ``SELECT 1`` on a
connection of the same driver, is measured in this process before and after.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/uncontended.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from djlocks import Lock  # noqa: E402
from djlocks.backends.dedicated import DedicatedConnections  # noqa: E402
from djlocks.percentiles import percentile  # noqa: E402

NAME = "bench:uncontended"


@dataclass
class Contender:
    """Something that can take and give back one lock, over and over."""

    label: str
    acquire: Callable[[], object]
    release: Callable[[], object]
    djlocks_settings: dict[str, Any] | None = None


def djlocks_contenders() -> list[Contender]:
    contenders = []
    for alias in settings.DJLOCKS["BACKENDS"]:
        if alias == "redis":
            continue  # measured against Redis's own floor, beside its peers: redis_locks.py
        for events in (True, False) if alias == "default" else (True,):
            lock = Lock(NAME, backend=alias, timeout=5)
            history = (
                "" if alias != "default" else (" (history on)" if events else " (history off)")
            )
            contenders.append(
                Contender(
                    f"djlocks {alias}{history}",
                    lock.acquire,
                    lock.release,
                    {**settings.DJLOCKS, "EVENTS": events},
                )
            )
    return contenders


def raw_contender() -> Contender | None:
    """The server's own primitive on a connection of its own, as a peer would use it."""
    wrapper = DedicatedConnections.new_wrapper("default")
    wrapper.ensure_connection()
    cursor = wrapper.connection.cursor()  # the driver's own cursor: no Django in the loop
    if connection.vendor == "mysql":
        return Contender(
            "raw GET_LOCK / RELEASE_LOCK",
            lambda: cursor.execute("SELECT GET_LOCK(%s, 5)", (NAME,)),
            lambda: cursor.execute("SELECT RELEASE_LOCK(%s)", (NAME,)),
        )
    if connection.vendor == "postgresql":
        wrapper.connection.autocommit = True
        return Contender(
            "raw pg_advisory_lock / unlock",
            lambda: cursor.execute("SELECT pg_advisory_lock(4242)"),
            lambda: cursor.execute("SELECT pg_advisory_unlock(4242)"),
        )
    return None


def floor_seconds(samples: int) -> float:
    """Median round trip of ``SELECT 1`` through the driver, on a connection of its own."""
    wrapper = DedicatedConnections.new_wrapper("default")
    wrapper.ensure_connection()
    cursor = wrapper.connection.cursor()
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        cursor.execute("SELECT 1")
        cursor.fetchall()
        times.append(time.perf_counter() - began)
    wrapper.close()
    return statistics.median(times)


def run(pairs: int, rounds: int) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    contenders = djlocks_contenders()
    raw = raw_contender()
    if raw is not None:
        contenders.append(raw)
    floor_before = floor_seconds(200)
    times: dict[str, list[float]] = {c.label: [] for c in contenders}
    for contender in contenders:  # warm-up: connections, prepared statements, first use
        with _settings(contender):
            for _ in range(50):
                contender.acquire()
                contender.release()
    for _ in range(rounds):
        for contender in contenders:
            with _settings(contender):
                for _ in range(pairs // rounds):
                    began = time.perf_counter()
                    contender.acquire()
                    contender.release()
                    times[contender.label].append(time.perf_counter() - began)
    floor = statistics.median([floor_before, floor_seconds(200)])
    return {
        "database": connection.vendor,
        "floor_us": round(floor * 1e6, 1),
        "pairs": pairs,
        "results": [
            {
                "contender": label,
                "median_us": round(statistics.median(samples) * 1e6, 1),
                "p99_us": round((percentile(samples, 99) or 0) * 1e6, 1),
                "x_rtt": round(statistics.median(samples) / floor, 2),
            }
            for label, samples in times.items()
        ],
    }


def _settings(contender: Contender) -> Any:
    if contender.djlocks_settings is None:
        return override_settings()
    return override_settings(DJLOCKS=contender.djlocks_settings)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(json.dumps(run(pairs=400 if quick else 2000, rounds=4 if quick else 10)))
