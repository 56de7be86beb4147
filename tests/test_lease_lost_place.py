"""A lease waiter whose place in the queue is gone queues again, and a waiter touches no
row but its own.

A place can go while its waiter waits: a sweep removes the place of a waiter that
stalled past ``WAITER_TTL``, and a failover to a replica that had not received it
loses it (the sequence that numbers the tickets then starts again from an older
value). Here the row is deleted, or given another token, behind the waiter's back.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections

from djlocks import Lock
from djlocks.backends import backends
from djlocks.grant import Grant
from djlocks.models import LeaseWaiter
from tests.queues import queue_of, queue_once

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(60)]


class Waiting(threading.Thread):
    """A thread of this process that waits for ``name`` and holds what it is granted
    until ``done`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.lock = Lock(name, ttl=30, timeout=30)
        self.grant: Grant | None = None
        self.granted = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.grant = self.lock.acquire_grant()
            self.granted.set()
            self.done.wait(30)
            if self.grant is not None:
                self.grant.release()
        finally:
            connections.close_all()


def test_a_waiter_whose_place_is_gone_queues_again_and_is_served_in_its_new_turn(
    settings: Any,
) -> None:
    settings.DJLOCKS = {**settings.DJLOCKS, "WAITER_TTL": 3}  # refreshed every second
    name = "lost-place:requeue"
    holder = Lock(name, ttl=30).acquire_grant()
    assert holder is not None
    first, newcomer = Waiting(name), Waiting(name)
    try:
        first.start()
        ((ticket, token),) = queue_once(name, bool, "the waiter never queued")
        waiter = LeaseWaiter.objects.values("pid", "thread").get(id=ticket)
        LeaseWaiter.objects.filter(id=ticket).delete()  # as a sweep or a failover would
        ((requeued, again),) = queue_once(
            name, lambda places: places != [], "the waiter never queued again"
        )
        assert requeued > ticket and again != token, "a new place, with a new token"
        assert LeaseWaiter.objects.values("pid", "thread").get(id=requeued) == waiter
        newcomer.start()
        queue_once(name, lambda places: len(places) == 2, "the newcomer never queued")
        holder.release()
        assert first.granted.wait(10), "the waiter was not served"
        assert first.grant is not None and first.grant.fence == holder.fence + 1
        assert not newcomer.granted.is_set(), "the newcomer was served first"
        first.done.set()
        assert newcomer.granted.wait(10)
        assert newcomer.grant is not None and newcomer.grant.fence == holder.fence + 2
    finally:
        if holder.believed:
            holder.release()
        for thread in (first, newcomer):
            thread.done.set()
            if thread.is_alive():
                thread.join(30)


def test_a_waiter_that_leaves_deletes_its_own_place_alone(settings: Any) -> None:
    """After a failover, a waiter's ticket can be another waiter's (the sequence that
    issues them went back): leaving before it refreshes its place, a waiter deletes
    only a row that has its token."""
    settings.DJLOCKS = {**settings.DJLOCKS, "WAITER_TTL": 30}  # no refresh meanwhile
    name = "lost-place:leave"
    holder = Lock(name, ttl=30).acquire_grant()
    assert holder is not None
    lock = Lock(name, ttl=30)

    def wait_then_leave() -> None:
        try:
            lock.acquire(timeout=2)
        finally:
            connections.close_all()

    try:
        leaving = threading.Thread(target=wait_then_leave)
        leaving.start()
        ((ticket, _),) = queue_once(name, bool, "the waiter never queued")
        # Its ticket now names another waiter's row, as a set-back sequence would have it.
        assert LeaseWaiter.objects.filter(id=ticket).update(token="f" * 32) == 1
        leaving.join(10)
        assert not leaving.is_alive()
        assert queue_of(name) == [(ticket, "f" * 32)], "it deleted another waiter's place"
    finally:
        LeaseWaiter.objects.filter(name=name).delete()
        holder.release()
    assert backends["default"].holders(name) == []
