"""On PostgreSQL, a lease release that hands the slot to nobody commits without waiting
for the WAL flush; every other lease write waits for it: a hand-over, which grants the
heir its slot and fence, a release with a cool-down, and a place in the queue.

Each statement runs inside the test's transaction, where ``synchronous_commit`` then
shows what its commit would do; the release's statements are the ones the backend
builds for it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from django.db import connection

from djlocks.backends import backends
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.lease.store import SLOTS, WAITERS
from djlocks.backends.sql.postgresql import LEASE, lease_handing_over

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="not applicable: only PostgreSQL lets one transaction skip the flush",
    ),
]

HOLDER, HEIR = "a" * 32, "b" * 32
KEY = "flush"


@pytest.fixture
def lease_session(db: None) -> None:
    """The test's transaction commits as a lease connection's would: flushed."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL synchronous_commit TO on")


def _commit_waits_for_the_flush() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0]) != "off"


def _held_slot(cursor: Any) -> None:
    cursor.execute(
        f"INSERT INTO {SLOTS} (name_key, name, slot, slot_limit, token, fence, acquired_at, "
        f"expires_at, host, pid, thread, label) VALUES (%s, 'flush', 0, 1, %s, 5, "
        f"now(), now() + interval '1 minute', 'host', 1, 'thread', '')",
        (KEY, HOLDER),
    )


def _waiter_insert() -> tuple[str, tuple[object, ...]]:
    return (
        f"INSERT INTO {WAITERS} (name_key, name, host, pid, thread, label, since, expires_at, "
        f"slot_limit, token, ttl) VALUES (%s, 'flush', 'host', 2, 'thread', '', now(), "
        f"now() + interval '1 minute', 1, %s, 30)",
        (KEY, HEIR),
    )


def _release_statement(cooldown: float, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    """The statement (and its parameters) with which the lease backend releases
    ``HOLDER``'s grant of a name nobody waits for, with ``cooldown``."""
    backend = backends["default"]
    ran: list[tuple[str, Sequence[object]]] = []

    def freeing(db: object, update: str, params: Sequence[object]) -> int:
        ran.append((update, params))
        return 1

    monkeypatch.setattr(backend, "_execute_freeing", freeing)
    backend.release("flush", HOLDER, cooldown)
    (statement,) = ran
    return statement


@pytest.mark.usefixtures("lease_session")
def test_a_hand_over_waits_for_the_flush() -> None:
    with connection.cursor() as cursor:
        _held_slot(cursor)
        cursor.execute(*_waiter_insert())
        cursor.execute(lease_handing_over(SLOTS, WAITERS), (HOLDER, HOLDER, HOLDER))
        assert cursor.fetchone()[1], "the slot was handed over"
    assert _commit_waits_for_the_flush()


@pytest.mark.usefixtures("lease_session")
def test_a_hand_over_that_finds_nobody_does_not() -> None:
    with connection.cursor() as cursor:
        _held_slot(cursor)
        cursor.execute(lease_handing_over(SLOTS, WAITERS), (HOLDER, HOLDER, HOLDER))
        assert not cursor.fetchone()[1], "nobody was handed the slot"
    assert not _commit_waits_for_the_flush()


@pytest.mark.usefixtures("lease_session")
@pytest.mark.parametrize(("cooldown", "waits"), [(0, False), (60, True)])
def test_a_release_of_a_name_nobody_waits_for_waits_only_with_a_cooldown(
    cooldown: float, waits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release_statement(cooldown, monkeypatch)
    with connection.cursor() as cursor:
        _held_slot(cursor)
        cursor.execute(*release)
        assert cursor.rowcount == 1
    assert _commit_waits_for_the_flush() is waits


@pytest.mark.usefixtures("lease_session")
def test_a_place_in_the_queue_waits_for_the_flush() -> None:
    insert, params = _waiter_insert()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")  # the driver begins the test's transaction
        ticket, ahead = LEASE.enqueue(cursor, insert, params, WAITERS, LEASE.now)
    assert ticket > 0 and ahead == 0
    assert _commit_waits_for_the_flush()


@pytest.fixture
def own_connection(transactional_db: None) -> Iterator[Any]:
    """A cursor on a lease connection of the test's own (autocommit), set up as the
    lease store sets its connections up on a server whose default is
    ``synchronous_commit = off``, and the rows it writes removed afterwards."""
    connections = DedicatedConnections("default")
    wrapper = connections.get()
    wrapper.set_autocommit(True)
    try:
        with wrapper.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO off")  # as a server or role may
            for statement in LEASE.session_setup:
                cursor.execute(statement)
            yield cursor
            cursor.execute(f"DELETE FROM {SLOTS} WHERE name_key = %s", (KEY,))
    finally:
        connections.discard()


def test_a_lease_connection_waits_for_the_flush_where_the_server_would_not(
    own_connection: Any,
) -> None:
    own_connection.execute("SHOW synchronous_commit")
    assert own_connection.fetchone()[0] == "on"


def test_skipping_the_flush_ends_with_the_release(
    own_connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release's setting is its own transaction's: the connection's next commit, a
    claim's, waits again."""
    _held_slot(own_connection)
    own_connection.execute(*_release_statement(0, monkeypatch))
    assert own_connection.rowcount == 1
    own_connection.execute("SHOW synchronous_commit")
    assert own_connection.fetchone()[0] == "on"
