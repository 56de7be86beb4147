"""Round trips per operation on one database: what one uncontended grant costs.

For each djlocks backend of the database (history off, then on), a lock and a
semaphore of 3 are taken and released alone, 400 times each, and the driver's
exchanges with the server are counted: in the calling thread (what the caller
waits for) and in djlocks' background threads (the history's and the holder
records' writers, spread over the operations they batch).

SQLite is a file, with no round trips to count: the workload runs on PostgreSQL
and MariaDB.

Usage: DJLOCKS_DB=postgresql|mysql python bench/statements.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from bench.database_locks import djlocks_aliases  # noqa: E402
from djlocks import Lock, Semaphore  # noqa: E402
from djlocks.backends import backends  # noqa: E402
from djlocks.backends.server_records import holder_records  # noqa: E402
from djlocks.events import events  # noqa: E402

#: What is called once per exchange with the server, by vendor: psycopg waits once for
#: each (a ``BEGIN`` or a ``COMMIT`` included), and the session lock's statements sent
#: straight through libpq run once each; mysqlclient's queries and its transaction calls.
EXCHANGES = {
    "postgresql": [
        ("psycopg", "Connection", ("wait",)),
        ("djlocks.backends.libpq", "DirectStatements", ("_run",)),
    ],
    "mysql": [("MySQLdb.connections", "Connection", ("query", "commit", "rollback", "autocommit"))],
}


@contextmanager
def counting_round_trips() -> Iterator[Counter[str]]:
    """Count the driver's exchanges with the server: ``caller`` (this thread) and
    ``background`` (every other thread)."""
    originals = {
        (owner, method): getattr(owner, method)
        for module, name, methods in EXCHANGES[connection.vendor]
        for owner in [getattr(__import__(module, fromlist=[name]), name)]
        for method in methods
    }
    counts: Counter[str] = Counter()
    caller = threading.get_ident()

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def exchange(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts["caller" if threading.get_ident() == caller else "background"] += 1
            return original(self, *args, **kwargs)

        return exchange

    for (owner, method), original in originals.items():
        setattr(owner, method, counted(original))
    try:
        yield counts
    finally:
        for (owner, method), original in originals.items():
            setattr(owner, method, original)


def per_operation(pairs: int, operation: Callable[[], None]) -> dict[str, float]:
    """Round trips per acquire+release, over ``pairs`` of them."""
    for _ in range(20):  # warm-up: connections opened, names recorded
        operation()
    events.flush()
    holder_records.flush()
    with counting_round_trips() as counts:
        for _ in range(pairs):
            operation()
        events.flush()
        holder_records.flush()
    return {
        "caller": round(counts["caller"] / pairs, 2),
        "background": round(counts["background"] / pairs, 2),
    }


def run(pairs: int) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    results = []
    for alias in djlocks_aliases():
        for history in (False, True):
            for limit in (1, 3):
                name = f"bench:statements:{alias}:{limit}"
                handle = (
                    Lock(name, backend=alias)
                    if limit == 1
                    else Semaphore(name, limit=limit, backend=alias)
                )

                def operation(handle: Any = handle, alias: str = alias) -> None:
                    if alias == "row":  # its lock is the caller's transaction
                        with transaction.atomic():
                            handle.acquire()
                            handle.release()
                    else:
                        handle.acquire()
                        handle.release()

                with override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS": history}):
                    counted = per_operation(pairs, operation)
                results.append(
                    {
                        "backend": alias,
                        "kind": "lock" if limit == 1 else "semaphore (limit 3)",
                        "history": history,
                        **counted,
                    }
                )
    backends.reset()
    return {"database": connection.vendor, "pairs": pairs, "results": results}


if __name__ == "__main__":
    print(json.dumps(run(pairs=100 if "--quick" in sys.argv else 400)))
