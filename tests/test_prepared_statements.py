"""The lease store's PostgreSQL connections prepare their statements only where that is
safe: straight to the server, never through a pooler in transaction mode, where a
prepared statement would be missing, or another client's, in the next transaction."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from django.db import connection, connections

from djlocks import Lock
from djlocks.backends import backends
from djlocks.backends.prepared import prepare_where_direct, reaches_server_directly
from tests.faults import PgBouncer
from tests.processes import manage

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="not applicable: prepared statements are psycopg's (the postgresql run)",
    ),
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(120),
]


def lease_connection(alias: str) -> object:
    """The psycopg connection the lease backend ``alias`` uses in this thread."""
    return backends[alias]._connections.get().connection  # type: ignore[attr-defined]


def test_a_direct_connection_prepares_the_lease_statements() -> None:
    for _ in range(10):  # in this thread: each thread has a connection of its own
        with Lock("prepared:direct", backend="default", timeout=30):
            pass
    lease = lease_connection("default")
    assert lease.prepare_threshold is not None  # type: ignore[attr-defined]
    with lease.cursor() as cursor:  # type: ignore[attr-defined]
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone()[0] > 0, "nothing was prepared"
        # Each is planned once: a plan made again at every execution costs the
        # hand-over about 100 µs of the server's time.
        cursor.execute("SHOW plan_cache_mode")
        assert cursor.fetchone()[0] == "force_generic_plan"
        cursor.execute(
            "SELECT generic_plans > 0, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE 'UPDATE djlocks_lease_slot SET token = NULL%'"
        )
        assert cursor.fetchall() == [(True, 0)]


def test_a_connection_that_does_not_prepare_keeps_the_servers_planning() -> None:
    """An application's connection that djlocks leaves alone, like a pooled one, plans
    as the server is configured to."""
    template = connections["default"]
    settings = {**template.settings_dict}
    settings["OPTIONS"] = {**settings.get("OPTIONS", {}), "prepare_threshold": None}
    wrapper = type(template)(settings, alias="probe")
    try:
        wrapper.ensure_connection()
        assert prepare_where_direct(wrapper) is False
        with wrapper.cursor() as cursor:
            cursor.execute("SHOW plan_cache_mode")
            assert cursor.fetchone()[0] == "auto"
    finally:
        wrapper.close()


def test_a_direct_session_prepares_the_advisory_lock_statements() -> None:
    for _ in range(10):
        with Lock("prepared:session", backend="session", timeout=30):
            pass
    session = backends["session"]._checkout()  # type: ignore[attr-defined]
    try:
        assert session.execute("SELECT count(*) FROM pg_prepared_statements")[0] > 0
    finally:
        backends["session"]._checkin(session)  # type: ignore[attr-defined]


@pytest.fixture
def bouncer() -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the test server."""
    server = connection.settings_dict
    pooler = PgBouncer(int(server["PORT"]), server["USER"], "transaction")
    yield pooler
    pooler.stop()


def test_the_check_tells_a_direct_connection_from_a_pooled_one(bouncer: PgBouncer) -> None:
    for port, direct in ((connection.settings_dict["PORT"], True), (bouncer.port, False)):
        template = connections["default"]
        wrapper = type(template)({**template.settings_dict, "PORT": str(port)}, alias="probe")
        try:
            wrapper.ensure_connection()
            assert reaches_server_directly(wrapper) is direct, port
        finally:
            wrapper.close()


@pytest.mark.parametrize("limit", [1, 3])
def test_leases_work_through_a_transaction_pooler(bouncer: PgBouncer, limit: int) -> None:
    """Four processes take turns through PgBouncer: a statement prepared on one server
    session and run on another would fail them."""
    through_the_bouncer = {**os.environ, "DJLOCKS_DB_PORT": str(bouncer.port)}
    stress = manage(
        "djlocks", "stress", "--processes", "4", "--iterations", "25", "--limit", str(limit),
        env=through_the_bouncer, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    output, _ = stress.communicate(timeout=100)
    assert stress.returncode == 0, output
