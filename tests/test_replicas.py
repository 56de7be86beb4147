"""A primary with a replica: locks on the replica are refused, and a project whose
routers read from the replica still locks, and lists its holders, on the primary.

Each run starts a private primary and replica of its vendor (``tests.faults``): a
PostgreSQL hot standby streaming the primary's WAL, or a MariaDB replica reading
the primary's binary log (its ``read_only`` left off, as a careless set-up would:
only its replication thread tells it apart). The project runs in child processes
(``manage.py shell``) pointed at one server or the other.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from djlocks import Lock
from djlocks.stress import current_database_names
from tests.faults import PrivateMariaDB, PrivatePostgreSQL, until
from tests.processes import finished, manage

pytestmark = [
    pytest.mark.skipif(
        connection.vendor == "sqlite",
        reason="not applicable: SQLite has no replicas (the postgresql and mysql runs)",
    ),
    pytest.mark.timeout(300),
]

#: The test project's database backends (its redis and locmem backends have no database).
DATABASE_BACKENDS = ("default", "session", "row")
Server = PrivatePostgreSQL | PrivateMariaDB


@pytest.fixture(scope="module")
def primary_and_replica() -> Iterator[tuple[Server, Server]]:
    """A private primary, migrated, and its replica, caught up."""
    names = tuple(set(current_database_names().values()))
    primary: Server = (
        PrivatePostgreSQL(databases=names)
        if connection.vendor == "postgresql"
        else PrivateMariaDB("--log-bin=primary-bin", "--server-id=1")
    )
    try:
        replica: Server = (
            PrivatePostgreSQL(standby_of=primary)
            if isinstance(primary, PrivatePostgreSQL)
            else PrivateMariaDB("--server-id=2")
        )
        try:
            if isinstance(primary, PrivateMariaDB) and isinstance(replica, PrivateMariaDB):
                replica.replicate(primary)
                for name in names:
                    primary.sql(f"CREATE DATABASE `{name}`")
            env = {**os.environ, "DJLOCKS_DB_PORT": str(primary.port)}
            migrate = manage("migrate", "--noinput", env=env, stdout=subprocess.DEVNULL)
            assert finished(migrate, 180) == 0
            _until_replicated(primary, replica, names[0])
            yield primary, replica
        finally:
            replica.stop()
    finally:
        primary.stop()


def _until_replicated(primary: Server, replica: Server, database: str) -> None:
    """Wait until the replica has applied every migration the primary has."""
    table = (
        "django_migrations"
        if isinstance(replica, PrivatePostgreSQL)
        else f"`{database}`.django_migrations"
    )
    query = f"SELECT COUNT(*) FROM {table}"
    applied = _answer(primary, query, database)
    until(
        lambda: _answer(replica, query, database, missing="0") == applied,
        "the replica to catch up",
    )


def _answer(server: Server, query: str, database: str, missing: str | None = None) -> str:
    """``query``'s one value on ``server``; ``missing`` if it fails (a table not there yet)."""
    try:
        if isinstance(server, PrivatePostgreSQL):
            return server.sql(query, database).strip()
        return server.sql(query).strip()
    except subprocess.CalledProcessError:
        if missing is None:
            raise
        return missing


def in_a_child(function: str, port: int, replica: Server | None = None) -> Any:
    """Run ``function`` of this module in ``manage.py shell`` on the server at ``port``,
    with ``replica`` as the read replica of ``tests.replica_settings`` if given; return
    what it printed (JSON)."""
    env = {**os.environ, "DJLOCKS_DB_PORT": str(port)}
    names = current_database_names()
    if replica is not None:
        env.update(DJANGO_SETTINGS_MODULE="tests.replica_settings",
                   DJLOCKS_REPLICA_PORT=str(replica.port))  # fmt: skip
        names["replica"] = names["default"]
    child = manage(
        "shell", "-c", f"from tests.test_replicas import {function}; {function}()",
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, names=names,
    )  # fmt: skip
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    return json.loads(out.splitlines()[-1])  # after what the shell says of its imports


def try_each_backend() -> None:
    """In a child: try to take a lock on each database backend; print what each raised."""
    outcomes = {}
    for alias in DATABASE_BACKENDS:
        try:
            granted = Lock(f"replica:{alias}", backend=alias, ttl=10).acquire(timeout=0)
            outcomes[alias] = ["granted" if granted else "not granted", ""]
        except Exception as exc:
            outcomes[alias] = [type(exc).__name__, str(exc)]
    print(json.dumps(outcomes))


def hold_and_list_on_each_backend() -> None:
    """In a child: on each database backend, hold a lock and list the holders (what
    ``djlocks list`` and the dashboard show); print the database and what was listed."""
    from djlocks.backends import backends
    from djlocks.inspection import snapshot

    seen = {}
    for alias in DATABASE_BACKENDS:
        with Lock(f"routed:{alias}", backend=alias, ttl=10):
            listed = [holder.name for holder in snapshot(backend=alias).holders]
        seen[alias] = [backends[alias].using, listed]
    print(json.dumps(seen))


def checked_on(server: Server) -> tuple[int, str]:
    """``manage.py check --database default`` on ``server``: its exit code and stderr."""
    checked = manage(
        "check", "--database", "default",
        env={**os.environ, "DJLOCKS_DB_PORT": str(server.port)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = checked.communicate(timeout=120)
    return checked.returncode, err


def test_locks_on_a_replica_are_refused_with_a_clear_error(
    primary_and_replica: tuple[Server, Server],
) -> None:
    _, replica = primary_and_replica
    outcomes = in_a_child("try_each_backend", replica.port)
    for alias in DATABASE_BACKENDS:
        kind, message = outcomes[alias]
        assert kind == "BackendUnavailable", (alias, kind, message)
        assert "primary" in message and ("standby" in message or "replica" in message), message
    exit_code, err = checked_on(replica)
    assert exit_code != 0
    for alias in DATABASE_BACKENDS:
        assert f"djlocks backend {alias!r} uses database 'default', which is read-only" in err


def test_the_primary_is_accepted_and_passes_the_check(
    primary_and_replica: tuple[Server, Server],
) -> None:
    primary, _ = primary_and_replica
    outcomes = in_a_child("try_each_backend", primary.port)
    assert {alias: kind for alias, (kind, _) in outcomes.items()} == dict.fromkeys(
        DATABASE_BACKENDS, "granted"
    )
    exit_code, err = checked_on(primary)
    assert exit_code == 0, err


def test_routers_that_read_from_the_replica_leave_locks_and_holders_on_the_primary(
    primary_and_replica: tuple[Server, Server],
) -> None:
    """The replica's replay is paused, so a holder listed from it would be missing."""
    primary, replica = primary_and_replica
    _pause_replay(replica, True)
    try:
        seen = in_a_child("hold_and_list_on_each_backend", primary.port, replica)
    finally:
        _pause_replay(replica, False)
    for alias in DATABASE_BACKENDS:
        using, listed = seen[alias]
        assert using == "default", alias
        assert f"routed:{alias}" in listed, (alias, listed)


def _pause_replay(replica: Server, paused: bool) -> None:
    if isinstance(replica, PrivatePostgreSQL):
        replica.sql(f"SELECT pg_wal_replay_{'pause' if paused else 'resume'}()")
    else:
        replica.sql("STOP SLAVE SQL_THREAD" if paused else "START SLAVE SQL_THREAD")
