"""MySQL lease heirs: a hand-over ends its heir's wait in the server (``KILL QUERY``),
and the heir reads the grant it was handed by its token alone, without counting the
queue again (the waiters' polls are 30 s apart here)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection

from djlocks import Lock
from djlocks.backends import backends
from djlocks.backends.lease.queue import LeaseQueue
from tests.test_lease_notify import heir_of
from tests.test_lease_wakeups import polls_never  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "mysql",
        reason="not applicable: only MySQL wakes lease heirs with KILL QUERY (the mysql run)",
    ),
    pytest.mark.usefixtures("store", "polls_never"),
    pytest.mark.timeout(120),
]


def test_a_woken_heir_reads_its_grant_by_its_token_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[int] = []
    count_ahead = LeaseQueue._waiting_ahead

    def counting(self: LeaseQueue, *args: Any) -> Any:
        counted.append(args[3])  # the ticket
        return count_ahead(self, *args)

    monkeypatch.setattr(LeaseQueue, "_waiting_ahead", counting)
    name = "l:kill-query:heir"
    holder = Lock(name, ttl=30)
    held = holder.acquire_grant()
    assert held is not None
    heir, granted, _ = heir_of(name, ttl=30)
    try:
        released = time.monotonic()
        holder.release()
        heir.join(10)
        assert not heir.is_alive(), "polls are 30 s apart: KILL QUERY never woke the heir"
        (grant,) = granted
        assert grant is not None
        assert time.monotonic() - released < 5, "polls are 30 s apart: KILL QUERY woke the heir"
        assert grant.fence == held.fence + 1
        assert backends["default"].holders(name)[0].fence == grant.fence
        assert counted == [], "the woken heir counted the queue instead of reading its grant"
        grant.release()
    finally:
        heir.join(10)
