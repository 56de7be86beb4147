"""The fault catalogue as data, and the results page built from a run.

Each item of the catalogue is a fault or a race that every backend it applies
to must survive, keyed by a short stable slug (``"holder-killed"``). A test
joins the catalogue with ``@pytest.mark.catalogue("holder-killed", ..., backend=ALIAS)``
(or a ``backend`` parameter); ``tests/conftest.py`` records each marked test's
outcome per catalogue item and backend, and the bounds tests measure with the
``bounds`` fixture, into ``$DJLOCKS_CATALOGUE_DIR/<database>.json``.

``python -m tests.catalogue DIR`` merges the files of one run (one per
database: ``make reliability`` runs SQLite, PostgreSQL and MariaDB) into the
Markdown of ``docs/reliability.md``: item x backend (pass, FAIL, not
applicable with the reason, or not yet tested) and the measured bounds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The results columns: a kind of backend by its letter (L lease, M MySQL's
#: GET_LOCK, P PostgreSQL's advisory locks, R row, D Redis) and, for those that
#: run on more than one database, the database it runs on.
COLUMNS = {
    "L:sqlite": "lease, SQLite",
    "L:postgresql": "lease, PostgreSQL",
    "L:mysql": "lease, MariaDB",
    "M:mysql": "GET_LOCK",
    "P:postgresql": "advisory",
    "R:sqlite": "row, SQLite",
    "R:postgresql": "row, PostgreSQL",
    "R:mysql": "row, MariaDB",
    "D": "Redis",
}


@dataclass(frozen=True)
class Item:
    title: str
    letters: str  # the kinds of backend it applies to (the letters of COLUMNS)
    elsewhere: str = ""  # why it does not apply to the others


#: The catalogue, in the order of the results page: slug -> item.
ITEMS = {
    "exact-counter": Item("Exact counter under contention", "LMPRD"),
    "semaphore-limit": Item(
        "Semaphore never exceeds its limit and reaches it",
        "LMPRD",
        "the row backend on SQLite has one write lock: semaphores are refused",
    ),
    "try-lock-burst": Item("Try-lock burst: exactly one winner", "LMPRD"),
    "waiters-in-turn": Item("Waiters progress one at a time, FIFO where promised", "LMPRD"),
    "holder-killed": Item(
        "A SIGKILLed holder frees the name within the crash-release bound", "LMPRD"
    ),
    "paused-session-holder": Item(
        "Paused session holder, then server-side kill",
        "MP",
        "a paused lease holder is fenced instead (`paused-lease-holder`); a row lock ends "
        "with its transaction",
    ),
    "paused-lease-holder": Item(
        "Paused lease holder is fenced",
        "LD",
        "a session or row lock does not expire while its holder is paused "
        "(`paused-session-holder`)",
    ),
    "late-acquire-reply": Item(
        "Acquire reply delayed past the TTL is not believed",
        "LD",
        "session and row grants have no TTL to outlive",
    ),
    "lost-acquire-reply": Item("Acquire reply lost after the store applied it", "LMPRD"),
    "lost-release-reply": Item("Release reply lost: the retried release is idempotent", "LMPRD"),
    "cancelled-acquires": Item("Cancelled acquires leave nothing", "LMPRD"),
    "lost-wake-up": Item(
        "Lost wake-up: the waiter acquires within the poll bound",
        "LD",
        "waiters block in the server, which grants them itself",
    ),
    "client-timeout": Item(
        "Client time-out while the server still waits",
        "MP",
        "a lease waiter's time-out is its own; a row waiter's ends its statement",
    ),
    "django-closes-connections": Item(
        "Django closing connections never leaves a false holder",
        "MP",
        "only session locks live on a connection that Django could close",
    ),
    "server-idle-timeout": Item(
        "Server idle time-out of the lock session is noticed",
        "MP",
        "only session locks live as long as an idle session",
    ),
    "transaction-pooler": Item(
        "PgBouncer transaction pooling is refused",
        "P",
        "leases and row locks work through any pooler; GET_LOCK is MySQL's",
    ),
    "forked-child": Item(
        "fork(): a child never uses the parent's session",
        "MPD",
        "a lease has no session to inherit (djlocks reopens its connections after a "
        "fork); a row lock lives in the caller's own transaction",
    ),
    "two-handles": Item("Two handles in one process exclude each other", "LMPRD"),
    "lock-covers-commit": Item("The lock covers the commit", "LMPRD"),
    "deadlock-victim": Item(
        "Deadlock between two names: a typed error for the victim",
        "MPR",
        "lease and Redis waits are polls and wake-ups, which cannot deadlock in the store",
    ),
    "renewal": Item(
        "Renewal under latency and after expiry",
        "LD",
        "session and row grants are not renewed: they live as long as the session",
    ),
    "redis-clock-and-restart": Item(
        "Redis clock jump and restart", "D", "only Redis keeps grants in memory"
    ),
    "redis-failover": Item(
        "A Redis master fails over (Cluster, Sentinel) under a holder and a waiter: the "
        "holder is told, the waiter gets a higher fence, the old holder's fenced write is "
        "refused",
        "D",
        "only Redis fails over to a replica here (database replicas are refused: djlocks.E014)",
    ),
    "forced-release": Item("Forced release", "LMPRD"),
    "revocation-reaches-holder": Item(
        "A forced release reaches the holder at once where the store pushes, else within a "
        "heartbeat",
        "LMPD",
        "a row lock's holder hears of it at its commit (`forced-release`)",
    ),
    "runlocked-supervision": Item("runlocked supervision", "LMPRD"),
    "admin-matches-store": Item("The admin matches the store", "LMPRD"),
    "server-crash": Item(
        "The database server crashes during a grant storm: every later fence is higher",
        "LMPR",
        "SQLite is a file, not a server; a Redis restart is `redis-clock-and-restart`",
    ),
    "leader-killed": Item(
        "A standby leads within the crash-release bound of its leader's SIGKILL, with a "
        "higher term",
        "LMPRD",
    ),
    "leader-paused": Item(
        "A leader paused past its TTL is replaced, learns it on resuming, and its term is refused",
        "LD",
        "a session or row grant does not expire while its holder is paused",
    ),
    "leader-cut-off": Item(
        "A leader cut off from its store is replaced with a higher term, and steps down "
        "before that where its grant is a lease",
        "LMPRD",
    ),
    "rw-reader-killed": Item(
        "A writer enters within the crash-release bound of a SIGKILLed reader",
        "LMPD",
        "the row backend cannot hold a reader-writer lock",
    ),
    "rw-writer-cut-off": Item(
        "A writer cut off from its store: readers get in within the crash-release bound, "
        "after the writer is told where its grants are leases",
        "LMPD",
        "the row backend cannot hold a reader-writer lock",
    ),
    "rw-writer-paused": Item(
        "A writer paused past its TTL: readers get in, and it is told of its loss on resuming",
        "LD",
        "a session grant does not expire while its holder is paused; the row backend cannot "
        "hold a reader-writer lock",
    ),
    "many-holder-killed": Item(
        "A SIGKILLed holder of a set of names: the set is taken within the crash-release bound",
        "LMPRD",
    ),
    "many-holder-paused": Item(
        "A holder of a set of names paused past its TTL: the set is taken, and the holder is "
        "told of its loss on resuming",
        "LD",
        "a session or row grant does not expire while its holder is paused",
    ),
    "many-cut-off": Item(
        "A holder of a set of names cut off from its store: the set is taken within the "
        "crash-release bound, after the holder is told where its grants are leases",
        "LMPRD",
    ),
    "sqlite-processes": Item(
        "SQLite with several processes", "L", "only the lease backend runs on SQLite"
    ),
}


def column(letter: str, vendor: str) -> str:
    """The results column of a backend (by letter) running on the database ``vendor``."""
    return "D" if letter == "D" else f"{letter}:{vendor}"


#: What the row backend on SQLite (SQLite's one write lock) can be tested for.
ROW_ON_SQLITE = (
    "exact-counter",
    "try-lock-burst",
    "holder-killed",
    "lock-covers-commit",
    "runlocked-supervision",
)
#: Items about replies lost or delayed on the network, a holder cut off from its server, or
#: a server's crash: SQLite is a file, not a server.
NETWORK_ITEMS = (
    "late-acquire-reply",
    "lost-acquire-reply",
    "lost-release-reply",
    "server-crash",
    "leader-cut-off",
    "rw-writer-cut-off",
    "many-cut-off",
)


def applies(slug: str, key: str) -> bool:
    letter = key.partition(":")[0]
    if key == "R:sqlite":
        return slug in ROW_ON_SQLITE
    if key == "L:sqlite" and slug in NETWORK_ITEMS:
        return False
    if slug == "sqlite-processes":
        return key == "L:sqlite"
    return letter in ITEMS[slug].letters


def column_of(test: Any) -> str:
    """The results column of a collected test: its marker's ``backend``, or parameter."""
    from django.db import connections

    from djlocks.backends import backends
    from djlocks.backends.lease import LeaseBackend
    from djlocks.backends.mysql import GetLockBackend
    from djlocks.backends.postgresql import AdvisoryLockBackend
    from djlocks.backends.row import RowLockBackend

    marker = test.get_closest_marker("catalogue")
    alias = marker.kwargs.get("backend") or test.callspec.params["backend"]
    backend = backends[alias]
    letters = {
        LeaseBackend: "L",
        GetLockBackend: "M",
        AdvisoryLockBackend: "P",
        RowLockBackend: "R",
    }
    letter = next((v for k, v in letters.items() if isinstance(backend, k)), "D")
    vendor = connections[getattr(backend, "using", "default")].vendor
    return column(letter, vendor)


def unknown_slugs(test: Any) -> list[str]:
    """The arguments of a collected test's ``catalogue`` marker that name no item."""
    marker = test.get_closest_marker("catalogue")
    if marker is None:
        return []
    return [str(slug) for slug in marker.args if slug not in ITEMS] or (
        [] if marker.args else ["(no item)"]
    )


@dataclass
class Recorder:
    """Collects, during a pytest run, each catalogue test's outcome and the bounds measured."""

    outcomes: dict[str, tuple[list[str], str, str]] = field(default_factory=dict)
    bounds: list[tuple[str, str, float]] = field(default_factory=list)

    def note(self, test: Any, report: Any) -> None:
        """Record one phase's report (setup, call, teardown) of a catalogue test."""
        marker = test.get_closest_marker("catalogue")
        if marker is None:
            return
        if report.skipped:
            return  # not applicable on this database: the results page says why
        if report.failed:
            outcome = "failed"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        previous = self.outcomes.get(test.nodeid)
        if previous is not None and previous[2] == "failed":
            return  # a failure is never undone by a later phase
        key = previous[1] if previous else column_of(test)
        self.outcomes[test.nodeid] = (list(marker.args), key, outcome)

    def bound(self, what: str, key: str, seconds: float) -> None:
        self.bounds.append((what, key, seconds))

    def write(self) -> None:
        """Write ``$DJLOCKS_CATALOGUE_DIR/<database>.json`` if that variable is set."""
        directory = os.environ.get("DJLOCKS_CATALOGUE_DIR")
        if not directory:
            return
        from django.db import connection

        results = [
            (slug, key, outcome) for slugs, key, outcome in self.outcomes.values() for slug in slugs
        ]
        Path(directory).mkdir(parents=True, exist_ok=True)
        record = {"database": connection.vendor, "results": results, "bounds": self.bounds}
        (Path(directory) / f"{connection.vendor}.json").write_text(json.dumps(record, indent=1))


def render(runs: Iterable[dict[str, object]]) -> str:
    """The Markdown results page for the recorded runs (see the module docstring)."""
    outcomes: dict[tuple[str, str], set[str]] = defaultdict(set)
    bounds: dict[tuple[str, str], list[float]] = defaultdict(list)
    databases = []
    for run in runs:
        databases.append(str(run["database"]))
        for slug, key, outcome in run["results"]:  # type: ignore[attr-defined]
            outcomes[str(slug), key].add(outcome)
        for what, key, seconds in run["bounds"]:  # type: ignore[attr-defined]
            bounds[what, key].append(float(seconds))
    lines = [
        "# Reliability: the fault catalogue, backend by backend",
        "",
        "Generated by `make reliability` (the catalogue tests of `make test`, on "
        f"{', '.join(databases)}): each item is a fault or a race, named by its key in "
        "`tests/catalogue.py`. **pass**: every test of the item passed on that backend; "
        "**n/a**: the item does not apply (reason below); **not yet tested**: it applies "
        "and no test covers it yet.",
        "",
        "| item | what it checks | " + " | ".join(COLUMNS.values()) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for slug, item in ITEMS.items():
        cells = [_cell(slug, key, outcomes.get((slug, key), set())) for key in COLUMNS]
        lines.append(f"| `{slug}` | {item.title} | " + " | ".join(cells) + " |")
    lines += ["", "Not applicable:", ""]
    lines += [f"- `{slug}`: {item.elsewhere}" for slug, item in ITEMS.items() if item.elsewhere]
    lines += [
        "- row, SQLite: the row backend there is SQLite's one write lock, tested for "
        f"{_slugs(ROW_ON_SQLITE)} only; its fence is written in the holder's transaction, "
        "so a killed holder's fence is issued again (`holder-killed`)",
        f"- lease, SQLite: {_slugs(NETWORK_ITEMS)} are about a database server (replies lost "
        "on the network, a server's crash); SQLite is a file",
        "",
        "## Measured bounds (seconds)",
        "",
        "| what | backend | runs | median | max |",
        "|---|---|---|---|---|",
    ]
    for (what, key), samples in sorted(bounds.items()):
        lines.append(
            f"| {what} | {COLUMNS.get(key, key)} | {len(samples)} | "
            f"{statistics.median(samples):.3f} | {max(samples):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _slugs(slugs: Iterable[str]) -> str:
    return ", ".join(f"`{slug}`" for slug in slugs)


def _cell(slug: str, key: str, seen: set[str]) -> str:
    if not applies(slug, key):
        return "n/a"
    if "failed" in seen:
        return "**FAIL**"
    return "pass" if "passed" in seen else "not yet tested"


def main(directory: str) -> None:
    runs = [json.loads(path.read_text()) for path in sorted(Path(directory).glob("*.json"))]
    sys.stdout.write(render(runs))


if __name__ == "__main__":
    main(sys.argv[1])
