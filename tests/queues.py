"""The lease backend's queue as the tests look at it: its waiter rows, read with the ORM."""

from __future__ import annotations

import time
from collections.abc import Callable

from djlocks.models import LeaseWaiter

Queue = list[tuple[int, str | None]]


def queue_of(name: str) -> Queue:
    """The waiter rows of ``name``, live or not: (ticket, token), in queue order."""
    return list(LeaseWaiter.objects.filter(name=name).order_by("id").values_list("id", "token"))


def queue_once(name: str, found: Callable[[Queue], bool], what: str) -> Queue:
    """``queue_of(name)`` once ``found`` says yes to it, within 30 s."""
    deadline = time.monotonic() + 30
    while not found(queued := queue_of(name)):
        assert time.monotonic() < deadline, f"{what}: the queue is {queued}"
        time.sleep(0.02)
    return queued
