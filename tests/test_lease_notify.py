"""PostgreSQL lease waiters each hear on a channel of their own: a release notifies only
the waiters it concerns, not every process that waits for any name."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from django.db import connection

from djlocks import Lock, LockLost
from djlocks.backends import backends
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.lease.store import WAITERS
from djlocks.backends.sql.postgresql import waiter_channel
from djlocks.keys import table_key
from tests.test_lease_wakeups import Waiters

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="not applicable: only PostgreSQL notifies lease waiters (the postgresql run)",
    ),
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def eavesdropper() -> Iterator[DedicatedConnections]:
    """A connection of the test's own, to listen on the waiters' channels."""
    listener = DedicatedConnections("default")
    yield listener
    listener.discard()


def queued(name: str) -> list[tuple[int, int]]:
    """The name's waiters, first in line first: (ticket, listening session)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, connection_id FROM {WAITERS} WHERE name_key = %s ORDER BY id",
            (table_key(name),),
        )
        return [(int(ticket), int(session)) for ticket, session in cursor.fetchall()]


def heard(
    listener: DedicatedConnections, sessions: list[int], action: Callable[[], object]
) -> list[tuple[str, str]]:
    """Listen on the channels of ``sessions``, run ``action()``, and return what was
    notified on them within a second: (channel, payload)."""
    wrapper = listener.get()
    with wrapper.cursor() as cursor:
        for session in sessions:
            cursor.execute(f"LISTEN {waiter_channel(session)}")
    action()
    notes = wrapper.connection.notifies(timeout=1.0)
    return [(note.channel, note.payload) for note in notes]


@pytest.mark.parametrize("release", ["released", "released by force"])
def test_a_release_notifies_only_the_first_waiter(
    release: str, eavesdropper: DedicatedConnections
) -> None:
    """Two waiters queue behind a holder, on two listening sessions. The release (a
    hand-over) and a forced release (which frees the slot for the head of the queue)
    each notify the first waiter alone, with its ticket; it then holds the lock."""
    name = f"l:notify:{release}"
    holder = Lock(name, ttl=30)
    holder.acquire()
    waiters = Waiters(name, limit=1, count=2)
    try:
        (first, first_session), (second, second_session) = queued(name)
        assert first_session != second_session
        action: Callable[[], object] = holder.release
        if release != "released":
            action = lambda: backends["default"].force_release(name)  # noqa: E731
        notes = heard(eavesdropper, [first_session, second_session], action)
        assert notes == [(waiter_channel(first_session), str(first))]
        assert waiters.got.acquire(timeout=10), "the first waiter never got the lock"
        assert [ticket for ticket, _ in queued(name)] == [second]
    finally:
        waiters.leave()
        if release != "released":
            with pytest.raises(LockLost):
                holder.release()
