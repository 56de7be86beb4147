"""What SQLite needs before it can keep leases for several processes: a file (not
memory), WAL journalling and ``BEGIN IMMEDIATE`` transactions.

With SQLite's defaults (a rollback journal, deferred transactions) writers take
the database's one write lock late and readers block them, so the lease
backend spends its time in busy retries and "database is locked" errors.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from urllib.parse import unquote

from django.core import checks
from django.core.checks import CheckMessage, Error
from django.db.backends.base.base import BaseDatabaseWrapper

#: The OPTIONS that make a file database a good lease store (Django 5.1+ for the mode).
RECOMMENDED_OPTIONS = (
    '{"transaction_mode": "IMMEDIATE", "timeout": 20, "init_command": "PRAGMA journal_mode=WAL;"}'
)
TESTING_HINT = (
    "In tests, use djlocks.testing.use_locmem_backends() or the locmem_locks pytest "
    "fixture, or a TransactionTestCase."
)


def database_file(database: str) -> str | None:
    """The real path of the file of the SQLite database ``database`` (a ``NAME``: a path,
    or a ``file:`` URI, which Django opens as one); ``None`` for one in memory, or private
    to its connection (``""``: a temporary file). The lease turns lock files beside it;
    ``djlocks.E004`` refuses leases without it."""
    if database.startswith("file:"):
        path, _, query = database.removeprefix("file:").partition("?")
        if "mode=memory" in query.split("&"):
            return None
        database = unquote(path.removeprefix("//localhost").removeprefix("//"))
    return None if database in (":memory:", "") else os.path.realpath(database)


def is_test_memory_database(name: str) -> bool:
    """Django's in-memory test database, shared by every connection of the test process."""
    return name.startswith("file:memorydb_") and "cache=shared" in name


def lease_store_messages(
    alias: str, connection: BaseDatabaseWrapper, databases: Collection[str] | None
) -> list[CheckMessage]:
    """``djlocks.E004`` (a private in-memory database) and ``djlocks.W007`` (slow settings)."""
    name = str(connection.settings_dict["NAME"])
    if is_test_memory_database(name):
        return []  # one process, which is all a test run needs
    if database_file(name) is None:  # in memory (or a private temporary file)
        return [
            Error(
                f"djlocks backend {alias!r} keeps its leases in an in-memory SQLite "
                f"database ({connection.alias!r}); other processes cannot see it, so it "
                f"locks nothing.",
                hint=f"Use a file database (NAME = a path) with OPTIONS = "
                f"{RECOMMENDED_OPTIONS}. {TESTING_HINT}",
                id="djlocks.E004",
            )
        ]
    unwise = []
    mode = str(connection.settings_dict.get("OPTIONS", {}).get("transaction_mode", "DEFERRED"))
    if mode.upper() != "IMMEDIATE":
        unwise.append(f'transaction_mode is "{mode}", not "IMMEDIATE"')
    if databases is not None and connection.alias in databases:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            journal = str(cursor.fetchone()[0])
        if journal.lower() != "wal":
            unwise.append(f'journal_mode is "{journal}", not "wal"')
    if not unwise:
        return []
    return [
        checks.Warning(
            f"djlocks backend {alias!r} keeps its leases in SQLite database "
            f"{connection.alias!r}, where {' and '.join(unwise)}: concurrent acquires "
            f"then wait on SQLite's write lock and can fail with 'database is locked'.",
            hint=f"Set DATABASES[{connection.alias!r}]['OPTIONS'] = {RECOMMENDED_OPTIONS}.",
            id="djlocks.W007",
        )
    ]
