"""The database contenders, and the contended lock and semaphore workloads on one database.

Contenders on the database that ``DJLOCKS_DB`` selects: every djlocks backend
configured for it (each with its event history on and off), and the peers
as their users write them: raw ``GET_LOCK`` and django-mysql's ``Lock`` on
MySQL/MariaDB, raw ``pg_advisory_lock`` and django-pglock's ``advisory`` on
PostgreSQL, django-db-mutex everywhere (it never waits, so its users retry:
every 2 ms here). One more is a floor, not a peer: the raw primitive plus one
durable upsert, the least a fence that survives a crash costs; another is the raw
primitive with a sequence's next value in the same statement, the least a fence
issued by the server with the grant costs.
``bench/uncontended.py`` measures the same contenders alone.

* Contended lock: 8 processes x 200 iterations of acquire -> read a counter
  row -> write it + 1 -> release (``bench/contention.py``), ``ROUNDS`` times per
  contender, the rounds of all contenders interleaved (``interleaved``). The counter is on
  the worker's own connection, except for the row backend, whose lock is the
  caller's transaction: there it is read and written in that transaction.
* Semaphore: limit 3, 8 processes x 100 iterations, 5 ms hold, for the djlocks
  backends and, as the peer (no Python library has one), the server's own lock tried
  on 3 slot keys in turn with a 2 ms sleep between rounds; ``ROUNDS`` times too.

Usage: DJLOCKS_DB=sqlite|postgresql|mysql python bench/database_locks.py [--quick]
Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import IntegrityError, OperationalError, connection  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from bench.contention import Crew, Workload  # noqa: E402
from djlocks import Lock, Semaphore  # noqa: E402
from djlocks.backends.dedicated import DedicatedConnections  # noqa: E402

NAME = "bench:database"
Handle = tuple[Callable[[], object], Callable[[], object]]
HISTORY_ON, HISTORY_OFF = " (history on)", " (history off)"
RAW = {"mysql": "raw GET_LOCK / RELEASE_LOCK", "postgresql": "raw pg_advisory_lock / unlock"}
FENCED = {
    "mysql": "floor: raw GET_LOCK + one durable fence upsert",
    "postgresql": "floor: raw pg_advisory_lock + one durable fence upsert",
}
#: The least a lock whose grant carries a fence from the server costs: the raw lock and a
#: sequence's next value in one statement, as djlocks' session backends issue theirs
#: (where the database has sequences: not MySQL).
FENCED_IN_STATEMENT = {
    "mysql": "floor: raw GET_LOCK with NEXTVAL() in the statement",
    "postgresql": "floor: raw pg_advisory_lock with nextval() in the statement",
}
PEER = {"mysql": "django-mysql Lock", "postgresql": "django-pglock advisory"}
DB_MUTEX = "django-db-mutex (retried every 2 ms)"
SLOTS = {
    "mysql": "raw GET_LOCK slots (2 ms poll)",
    "postgresql": "raw pg_try_advisory_lock slots (2 ms poll)",
}


def djlocks_aliases() -> list[str]:
    return [alias for alias in settings.DJLOCKS["BACKENDS"] if alias != "redis"]


def contenders() -> list[str]:
    """Every lock contender on this database, djlocks first."""
    labels = djlocks_labels()
    if connection.vendor in RAW:
        vendor = connection.vendor
        fenced = [FENCED_IN_STATEMENT[vendor]] if has_sequences() else []
        labels += [RAW[vendor], *fenced, FENCED[vendor], PEER[vendor]]
    return [*labels, DB_MUTEX]


def djlocks_labels() -> list[str]:
    """Every djlocks backend of this database, with its event history on and off."""
    return [
        f"djlocks {alias}{history}"
        for alias in djlocks_aliases()
        for history in (HISTORY_ON, HISTORY_OFF)
    ]


def semaphore_contenders() -> list[str]:
    labels = djlocks_labels()
    if connection.vendor == "sqlite":  # SQLite's row lock is the database write lock: limit 1
        labels = [label for label in labels if not label.startswith("djlocks row")]
    return labels + ([SLOTS[connection.vendor]] if connection.vendor in SLOTS else [])


def context(contender: str) -> Any:
    """The event history on or off as the djlocks contender's label says."""
    if contender.startswith("djlocks"):
        return override_settings(DJLOCKS={**settings.DJLOCKS, "EVENTS": HISTORY_ON in contender})
    return override_settings()


def own_cursor(driver: bool = True) -> Any:
    """A cursor on a new autocommit connection of this process's own.

    ``driver``: the driver's own cursor (no Django in the loop; ``%s``
    parameters, so MySQL and PostgreSQL only), else Django's.
    """
    wrapper = DedicatedConnections.new_wrapper("default")
    wrapper.ensure_connection()
    wrapper.set_autocommit(True)
    OPENED.append(wrapper)
    return wrapper.connection.cursor() if driver else wrapper.cursor()


OPENED: list[Any] = []  # the connections ``own_cursor`` opened, until ``finish()``


def finish() -> None:
    """Close the connections this workload opened (a crew's worker runs many)."""
    while OPENED:
        OPENED.pop().close()


def locking(contender: str, limit: int = 1, name: str = NAME) -> Handle:
    """acquire() and release() of one lock or semaphore, as the contender's users write it."""
    if limit > 1:
        name += ":semaphore"  # never the lock's name: a name has one limit
    if contender.startswith("djlocks"):
        alias = contender.split()[1]
        if limit == 1:
            lock = Lock(name, backend=alias, timeout=600)
            return lock.acquire, lock.release
        semaphore = Semaphore(name, limit=limit, backend=alias, timeout=600)
        return semaphore.acquire, semaphore.release
    if contender == TWO_UPSERTS:
        return two_upserts()
    if contender == SLOTS.get(connection.vendor):
        return slot_poller(name, limit)
    if contender == FENCED.get(connection.vendor):
        return fenced_raw(name)
    if contender == FENCED_IN_STATEMENT.get(connection.vendor):
        return fenced_in_statement(name)
    if contender == RAW.get(connection.vendor):
        cursor = own_cursor()  # the driver's own cursor: no Django in the loop
        if connection.vendor == "mysql":
            return (
                lambda: cursor.execute("SELECT GET_LOCK(%s, 600)", (name,)),
                lambda: cursor.execute("SELECT RELEASE_LOCK(%s)", (name,)),
            )
        key = zlib.crc32(name.encode())
        return (
            lambda: cursor.execute("SELECT pg_advisory_lock(%s)", (key,)),
            lambda: cursor.execute("SELECT pg_advisory_unlock(%s)", (key,)),
        )
    if contender == "django-mysql Lock":
        from django_mysql.locks import Lock as MySQLLock

        peer = MySQLLock(name, acquire_timeout=600)
        return peer.acquire, peer.release
    if contender == "django-pglock advisory":
        import pglock

        advisory = pglock.advisory(name)
        return advisory.acquire, advisory.release
    return db_mutex(name)


def fenced_raw(name: str) -> Handle:
    """The raw primitive plus the least a durable fence costs: one autocommit upsert.

    Not a peer but a floor: what any lock that keeps a fence that survives a
    crash pays per grant on this server, whatever its design.
    """
    cursor = own_cursor()
    create_fence_objects(cursor)
    if connection.vendor == "mysql":
        take, give = "SELECT GET_LOCK(%s, 600)", "SELECT RELEASE_LOCK(%s)"
        bump = "INSERT INTO bench_fence VALUES (1, 1) ON DUPLICATE KEY UPDATE value = value + 1"
        key: object = name
    else:
        take, give = "SELECT pg_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"
        bump = (
            "INSERT INTO bench_fence VALUES (1, 1) "
            "ON CONFLICT (id) DO UPDATE SET value = bench_fence.value + 1"
        )
        key = zlib.crc32(name.encode())

    def acquire() -> None:
        cursor.execute(take, (key,))
        cursor.execute(bump)

    return acquire, lambda: cursor.execute(give, (key,))


def create_fence_objects(cursor: Any) -> None:
    """The floors' fence row table and sequence, unless they exist. The contended runs
    have them made once beforehand (``reset_counter``): several processes creating
    one at the same moment can collide in the catalogue."""
    cursor.execute("CREATE TABLE IF NOT EXISTS bench_fence (id INTEGER PRIMARY KEY, value BIGINT)")
    if has_sequences():
        cursor.execute("CREATE SEQUENCE IF NOT EXISTS bench_fence_seq")


def has_sequences() -> bool:
    """Whether the database has sequences: PostgreSQL and MariaDB; MySQL has none."""
    return connection.vendor == "postgresql" or (
        connection.vendor == "mysql" and connection.mysql_is_mariadb
    )


def fenced_in_statement(name: str) -> Handle:
    """The raw primitive with a fence from a server sequence in the same statement.

    Not a peer but a floor: what a lock that hands each grant a fence issued by
    the server pays, with no round trip and no write of its own for it (a
    sequence), whatever the library around it does.
    """
    cursor = own_cursor()
    create_fence_objects(cursor)
    if connection.vendor == "mysql":
        take = "SELECT CASE GET_LOCK(%s, 600) WHEN 1 THEN NEXTVAL(bench_fence_seq) END"
        give = "SELECT RELEASE_LOCK(%s)"
        key: object = name
    else:
        take = "SELECT pg_advisory_lock(%s), nextval('bench_fence_seq')"
        give = "SELECT pg_advisory_unlock(%s)"
        key = zlib.crc32(name.encode())
    return (
        lambda: cursor.execute(take, (key,)),
        lambda: cursor.execute(give, (key,)),
    )


#: A floor for the lease backend (not a lock): what two durable single-row writes cost.
TWO_UPSERTS = "floor: two single-row autocommit upserts"


def two_upserts() -> Handle:
    """Two autocommit upserts of one row, the least a lease's acquire (one write) and
    release (another) can cost when both must survive a crash."""
    cursor = own_cursor()
    create_fence_objects(cursor)
    if connection.vendor == "mysql":
        upsert = "INSERT INTO bench_fence VALUES (2, 1) ON DUPLICATE KEY UPDATE value = value + 1"
    else:
        upsert = (
            "INSERT INTO bench_fence VALUES (2, 1) "
            "ON CONFLICT (id) DO UPDATE SET value = bench_fence.value + 1"
        )
    return lambda: cursor.execute(upsert), lambda: cursor.execute(upsert)


def db_mutex(name: str) -> Handle:
    """django-db-mutex never waits: its users catch DBMutexError and try again."""
    from db_mutex.db_mutex import db_mutex as mutex
    from db_mutex.exceptions import DBMutexError

    held = mutex(name)

    def acquire() -> None:
        while True:
            try:
                held.start()
                return
            except (DBMutexError, IntegrityError, OperationalError):
                # OperationalError: InnoDB deadlocks (1213) between inserts of one key
                time.sleep(0.002)

    return acquire, held.stop


def slot_poller(name: str, limit: int) -> Handle:
    """A semaphore as a Python peer can build one: try each slot key, sleep 2 ms, repeat."""
    cursor = own_cursor()
    if connection.vendor == "mysql":
        take, give = "SELECT GET_LOCK(%s, 0)", "SELECT RELEASE_LOCK(%s)"
        keys: list[object] = [f"{name}/{slot}" for slot in range(limit)]
    else:
        take, give = "SELECT pg_try_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"
        keys = [zlib.crc32(f"{name}/{slot}".encode()) for slot in range(limit)]
    held: list[object] = []

    def acquire() -> None:
        while True:
            for key in keys:
                cursor.execute(take, (key,))
                if cursor.fetchone()[0] in (1, True):
                    held.append(key)
                    return
            time.sleep(0.002)

    def release() -> None:
        cursor.execute(give, (held.pop(),))
        cursor.fetchall()

    return acquire, release


COUNTER_TABLE = "bench_counter"


def counter(contender: str) -> tuple[Callable[[], int], Callable[[int], object]]:
    """Read and write of the counter row, as two statements (see the module docstring)."""
    # The row backend's lock is the caller's transaction: the counter goes through it.
    in_the_lock = contender.startswith("djlocks row")
    cursor = connection.cursor() if in_the_lock else own_cursor(driver=False)

    def read() -> int:
        cursor.execute(f"SELECT value FROM {COUNTER_TABLE} WHERE id = 1")
        return int(cursor.fetchone()[0])

    def write(value: int) -> None:
        cursor.execute(f"UPDATE {COUNTER_TABLE} SET value = %s WHERE id = 1", (value,))

    return read, write


def reset_counter() -> None:
    with connection.cursor() as cursor:
        create_fence_objects(cursor)
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {COUNTER_TABLE} (id INTEGER PRIMARY KEY, value BIGINT)"
        )
        cursor.execute(f"DELETE FROM {COUNTER_TABLE}")
        cursor.execute(f"INSERT INTO {COUNTER_TABLE} (id, value) VALUES (1, 0)")


def final_count() -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {COUNTER_TABLE} WHERE id = 1")
        return int(cursor.fetchone()[0])


#: Each contender's contended runs: interleaved with the other contenders' runs, so
#: that drift on a noisy machine hits them alike; the median one is reported.
ROUNDS = 3


def interleaved(
    crew: Crew, labels: list[str], iterations: int, limit: int = 1, hold: float = 0.0
) -> list[dict[str, Any]]:
    """Every contender's ``ROUNDS`` runs, round by round; for each, its run of median
    throughput, with the oracles of all its runs (lost updates and overlaps added up,
    the most barging, the most holders at once): each must hold in every run."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for _ in range(ROUNDS):
        for label in labels:
            runs[label].append(measure(crew, label, iterations, limit, hold))
    return [median_run(results) for results in runs.values()]


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median ``ops_per_s`` among ``results``, with every run's oracles."""
    chosen = dict(sorted(results, key=lambda run: run["ops_per_s"])[len(results) // 2])
    for key, combine in (("lost_updates", sum), ("overlaps", sum), ("barging_pct", max)):
        if key in chosen:
            chosen[key] = combine(run[key] for run in results)
    chosen["max_concurrent"] = max(run["max_concurrent"] for run in results)
    chosen["rounds"] = len(results)
    return chosen


def measure(crew: Crew, contender: str, iterations: int, limit: int = 1, hold: float = 0.0) -> Any:
    print(f"    {contender} (limit {limit})", file=sys.stderr, flush=True)
    result = crew.run(Workload(contender, iterations, limit, hold), reset_counter, final_count)
    if limit > 1:
        try:
            result["lone_ceiling"] = lone_ceiling(contender, limit, hold)
        finally:
            finish()  # the connections it opened in this process
    return result


def lone_ceiling(contender: str, limit: int, hold: float, rounds: int = 100) -> float:
    """The semaphore's share of the ideal if every slot went to the next holder at once.

    One process alone runs the workload's cycle (acquire, read, hold, write,
    release) with nobody to wait for; ``limit`` slots each cycling that fast
    give ``limit / cycle`` ops/s. What the contended run loses beyond this is
    the cost of waiting and of hand-off; below it, the cost of the cycle itself
    (the round trips, the durable writes, the sleep's own overshoot).
    """
    acquire, release = locking(contender, limit)
    read, write = counter(contender)
    cycles = []
    with context(contender):
        for _ in range(rounds):
            began = time.perf_counter()
            acquire()
            value = read()
            time.sleep(hold)
            write(value + 1)
            release()
            cycles.append(time.perf_counter() - began)
    return round(limit / statistics.median(cycles) / (limit / hold), 3)


def run(quick: bool) -> dict[str, Any]:
    call_command("migrate", verbosity=0)
    iterations = 50 if quick else 200
    with Crew("bench.database_locks") as crew:
        return {
            "database": connection.vendor,
            "contended": interleaved(crew, contenders(), iterations),
            "semaphore": interleaved(
                crew, semaphore_contenders(), 25 if quick else 100, limit=3, hold=0.005
            ),
        }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv)))
