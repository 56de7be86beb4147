"""On PostgreSQL, the lease writes a crash may undo commit without waiting for the WAL
flush: a place in the queue, and a release that hands nothing over. A hand-over, which
grants the heir its slot and fence, waits for the flush as a claim does.

Each statement runs inside the test's transaction, where ``synchronous_commit`` then
shows what its commit would do."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from djlocks.backends.lease.store import SLOTS, WAITERS
from djlocks.backends.sql.postgresql import LEASE, lease_handing_over

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="not applicable: only PostgreSQL lets one transaction skip the flush",
    ),
    pytest.mark.django_db,
]

HOLDER, HEIR = "a" * 32, "b" * 32


def _commit_waits_for_the_flush() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0]) == "on"


def _held_slot(cursor: Any) -> None:
    cursor.execute(
        f"INSERT INTO {SLOTS} (name_key, name, slot, slot_limit, token, fence, acquired_at, "
        f"expires_at, host, pid, thread, label) VALUES ('flush', 'flush', 0, 1, %s, 5, "
        f"now(), now() + interval '1 minute', 'host', 1, 'thread', '')",
        (HOLDER,),
    )


def _waiter(cursor: Any) -> None:
    insert, params = _waiter_insert()
    cursor.execute(insert, params)


def _waiter_insert() -> tuple[str, tuple[object, ...]]:
    return (
        f"INSERT INTO {WAITERS} (name_key, name, host, pid, thread, label, since, expires_at, "
        f"slot_limit, token, ttl) VALUES ('flush', 'flush', 'host', 2, 'thread', '', now(), "
        f"now() + interval '1 minute', 1, %s, 30)",
        (HEIR,),
    )


def test_a_hand_over_waits_for_the_flush() -> None:
    with connection.cursor() as cursor:
        _held_slot(cursor)
        _waiter(cursor)
        cursor.execute(lease_handing_over(SLOTS, WAITERS), (HOLDER, HOLDER, HOLDER))
        assert cursor.fetchone()[1], "the slot was handed over"
    assert _commit_waits_for_the_flush()


def test_a_release_that_hands_nothing_over_does_not() -> None:
    with connection.cursor() as cursor:
        _held_slot(cursor)
        cursor.execute(lease_handing_over(SLOTS, WAITERS), (HOLDER, HOLDER, HOLDER))
        assert not cursor.fetchone()[1], "nobody was handed the slot"
    assert not _commit_waits_for_the_flush()


def test_a_plain_release_does_not() -> None:
    with connection.cursor() as cursor:
        _held_slot(cursor)
        cursor.execute(
            f"UPDATE {SLOTS} SET token = NULL WHERE token = %s{LEASE.returning_unflushed}",
            (HOLDER,),
        )
        assert cursor.rowcount == 1
    assert not _commit_waits_for_the_flush()


def test_a_place_in_the_queue_does_not() -> None:
    insert, params = _waiter_insert()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")  # the driver begins the test's transaction
        ticket, ahead = LEASE.enqueue(cursor, insert, params, WAITERS, LEASE.now)
    assert ticket > 0 and ahead == 0
    assert not _commit_waits_for_the_flush()


def test_a_claim_waits_for_the_flush() -> None:
    """The statements above change only their own transaction's setting."""
    with connection.cursor() as cursor:
        _held_slot(cursor)
    assert _commit_waits_for_the_flush()
