"""The floor and the uncontended workload for one database: a round trip, and lone locks.

Each contender (``bench/database_locks.py``: every djlocks backend configured
for the database, the lease backend with history on and off, the server's raw
primitive and the peers, and on the servers two autocommit upserts, the lease's
floor) runs acquire+release pairs on one name; the rounds
are interleaved so that drift on a noisy machine hits every contender alike.
The floor, ``SELECT 1`` on a connection of the same driver, is measured in
this process before and after.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/uncontended.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench.database_locks import TWO_UPSERTS, contenders, context, locking  # noqa: E402
from bench.interleaved import summary, time_pairs  # noqa: E402
from djlocks.backends.dedicated import DedicatedConnections  # noqa: E402


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
    floors = [TWO_UPSERTS] if connection.vendor in ("postgresql", "mysql") else []
    handles = {label: locking(label) for label in [*contenders(), *floors]}
    floor_before = floor_seconds(200)
    times = time_pairs(handles, pairs, rounds, context)
    floor = statistics.median([floor_before, floor_seconds(200)])
    return {
        "database": connection.vendor,
        "floor_us": round(floor * 1e6, 1),
        "pairs": pairs,
        "results": [summary(label, samples, floor) for label, samples in times.items()],
    }


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(json.dumps(run(pairs=400 if quick else 2000, rounds=4 if quick else 10)))
