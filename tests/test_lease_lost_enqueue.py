"""A lease waiter whose enqueue was applied but whose reply was lost stands in the queue
once: the retried enqueue, on a new connection, takes the place of the first row, or
takes the slot a release handed that row meanwhile."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from djlocks import Lock
from djlocks.backends import backends
from tests.queues import queue_of, queue_once
from tests.workers import CONTEXT, proxied_worker, wait_in_line

pytestmark = [
    pytest.mark.skipif(
        connection.vendor == "sqlite",
        reason="not applicable: an SQLite store has no network to lose a reply on",
    ),
    pytest.mark.usefixtures("store"),
    pytest.mark.timeout(120),
]


@pytest.mark.catalogue("lost-acquire-reply", backend="default")
@pytest.mark.parametrize("served", [False, True], ids=["queued", "served-meanwhile"])
def test_a_lost_enqueue_reply_leaves_the_waiter_queued_once(served: bool) -> None:
    """A waiter in another process, through a TCP proxy that swallows the reply to its
    enqueue, then cuts the connection. ``served``: the holder releases before the cut,
    handing the slot to the row whose reply was lost; the waiter must take that slot,
    not queue again and, at its own release, hand the slot back to itself."""
    name = "l:lost-enqueue"
    report = CONTEXT.Queue()
    holder = Lock(name, ttl=30)
    held = holder.acquire_grant()
    assert held is not None
    released = False
    try:
        with proxied_worker("default", wait_in_line, name, "waiter", report) as (proxy, waiter):
            proxy.drop_replies_from = b"INSERT INTO djlocks_lease_waiter"
            assert proxy.dropping.wait(30), "the waiter never sent its enqueue"
            (first,) = queue_once(name, bool, "the server never applied the lost enqueue")
            if served:
                holder.release()
                released = True
                queue_once(name, lambda rows: rows == [], "the release handed nothing over")
            time.sleep(0.5)  # the server's reply, sent as it committed, is swallowed
            proxy.heal()  # before the cut: the waiter's new connection goes through
            proxy.cut()  # the reply never comes: the waiter's connection fails
            if not served:
                queued = queue_once(
                    name, lambda rows: any(row != first for row in rows), "no retried enqueue"
                )
                assert [token for _, token in queued] == [first[1]], "queued twice"
                holder.release()
                released = True
            assert report.get(timeout=30) == ("waiter", held.fence + 1)
            waiter.join(30)  # released
            assert waiter.exitcode == 0
            assert queue_of(name) == [], "the waiter left a row behind"
            assert backends["default"].holders(name) == [], "the slot was handed back"
    finally:
        if not released:
            holder.release()
