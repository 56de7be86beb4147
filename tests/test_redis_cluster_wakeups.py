"""Wake-ups on a Redis Cluster: a release's ``PUBLISH`` reaches subscribers on its own
master at once, and others only through the cluster bus (measured: up to 40 ms), so
each waiting process subscribes at every master."""

from __future__ import annotations

import os
import threading
import time

import pytest
from django.conf import settings

from djlocks import Lock
from djlocks.backends import backends
from tests.faults import until
from tests.redis_cluster import channels_at

pytestmark = pytest.mark.usefixtures("store")

CLUSTER = [alias for alias in settings.DJLOCKS["BACKENDS"] if alias == "redis-cluster"]


@pytest.mark.parametrize("backend", CLUSTER)
def test_a_waiter_listens_at_every_master(backend: str) -> None:
    store = backends[backend]
    names = [f"wake:{n}" for n in range(6)]  # served by different masters
    holders = [Lock(name, backend=backend, ttl=10).acquire_grant() for name in names]
    got: list[str] = []

    def wait(name: str) -> None:
        with Lock(name, backend=backend, ttl=10, timeout=10):
            got.append(name)

    waiters = [threading.Thread(target=wait, args=(name,)) for name in names]
    for waiter in waiters:
        waiter.start()
    until(lambda: len(store.waiters()) == len(names), "every waiter to queue")
    channels = channels_at(store.redis(), f"{store.prefix}:wake:*:{os.getpid()}:*")
    assert len(channels) == 3 and all(len(found) == 1 for found in channels.values()), channels
    released = time.monotonic()
    for holder in holders:
        assert holder is not None
        holder.release()
    for waiter in waiters:
        waiter.join(10)
    assert sorted(got) == names
    assert time.monotonic() - released < 5, "the waiters were not woken"
