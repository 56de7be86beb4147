"""A Redis Cluster master fails over while a holder holds a name and a waiter waits.

Each test has a private cluster (``tests.redis_cluster``) whose nodes vote a
silent master down after ``NODE_TIMEOUT`` seconds. The master that serves the
name is SIGKILLed (its replica is promoted, with whatever it had received) or
hands over on ``CLUSTER FAILOVER`` (its replica catches up first: nothing is
lost). Either way the promoted replica's run id is not the one stamped on the
grant, so the holder's next renewal ends it and tells the holder (``LockLost``);
the waiter then gets the name with a higher fence, and a fenced write from the
old holder is refused. What each run measured goes to the reliability page.

The holder has renewed once before the fail-over: its first renewal stamps the
master's run id on the grant. A grant that has not been renewed yet carries no
run id, so if the promoted replica had received it, it simply goes on there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from django.conf import settings
from django.test import override_settings

from djlocks import BackendUnavailable, Grant, Lock
from djlocks.backends import backends
from djlocks.backends.redis import RedisBackend
from djlocks.fencing import StaleFence, fenced_update
from djlocks.keys import redis_meta_key
from project.demo.models import FencedCounter
from tests.redis_cluster import PrivateRedisCluster

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(180)]

FAILOVER = "failover"
#: Seconds of silence after which the other nodes vote a master down.
NODE_TIMEOUT = 1.0
#: Seconds: the holder's lease (renewed every TTL/3).
TTL = 3.0


@pytest.fixture
def private_cluster() -> Iterator[PrivateRedisCluster]:
    cluster = PrivateRedisCluster(node_timeout=NODE_TIMEOUT)
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": {"cluster": cluster.url}}
    configured = settings.DJLOCKS["BACKENDS"]
    try:
        with override_settings(
            DJLOCKS={**settings.DJLOCKS, "BACKENDS": {**configured, FAILOVER: spec}}
        ):
            yield cluster
    finally:
        backends.reset()
        cluster.stop()


class Waiter(threading.Thread):
    """Waits for ``name`` and notes when it got in and its grant. While the cluster has
    no master for the name, a wait ends in ``BackendUnavailable``: the waiter tries
    again, as an application would."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.lock = Lock(name, backend=FAILOVER, ttl=TTL)
        self.granted_at: float | None = None
        self.grant: Grant | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while self.grant is None and time.monotonic() < deadline:
            try:
                self.grant = self.lock.acquire_grant(timeout=deadline - time.monotonic())
            except BackendUnavailable:
                time.sleep(0.05)
        self.granted_at = time.monotonic()


def _through_a_failover(
    cluster: PrivateRedisCluster, name: str, fail_over: Callable[[int], None]
) -> dict[str, Any]:
    """Hold ``name``, queue a waiter, ``fail_over`` the master serving it; return what
    happened: the fences, when the holder was told and when the waiter got in."""
    FencedCounter.objects.create(name=name)
    rows = FencedCounter.objects.filter(name=name)
    lost_at: list[float] = []
    holder = Lock(
        name, backend=FAILOVER, ttl=TTL, on_lost=lambda *_: lost_at.append(time.monotonic())
    ).acquire_grant()
    assert holder is not None
    assert fenced_update(rows, holder.fence, value=1) == 1
    first_expiry = holder.expires_at
    _until(lambda: holder.expires_at != first_expiry, "the holder's first renewal")
    waiter = Waiter(name)
    waiter.start()
    _until(lambda: backends[FAILOVER].waiters(name), "the waiter to queue")
    store = cast(RedisBackend, backends[FAILOVER])
    master = cluster.master_of(redis_meta_key(store.prefix, name))
    began = time.monotonic()
    fail_over(master)
    waiter.join(60)
    assert waiter.grant is not None and waiter.granted_at is not None, (
        f"the waiter never got in: {cluster._nodes_seen()}"
    )
    _until(lambda: lost_at, "the holder to be told")
    assert waiter.grant.fence > holder.fence, "a fence went backwards over the fail-over"
    assert fenced_update(rows, waiter.grant.fence, value=2) == 1
    with pytest.raises(StaleFence):
        fenced_update(rows, holder.fence, value=3)
    waiter.grant.release()
    return {
        "told": lost_at[0] - began,
        "next holder in": waiter.granted_at - began,
        "two holders": waiter.granted_at < lost_at[0],
    }


def _until(done: Callable[[], object], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.catalogue("redis-failover", backend="redis")
def test_a_master_killed_under_a_holder_is_replaced_and_the_holder_told(
    private_cluster: PrivateRedisCluster, bounds: Callable[[str, float], None]
) -> None:
    seen = _through_a_failover(private_cluster, "failover:kill", private_cluster.kill)
    bounds(f"SIGKILLed master: holder told after (TTL {TTL} s)", seen["told"])
    bounds(f"SIGKILLed master: next holder in after (TTL {TTL} s)", seen["next holder in"])
    assert seen["told"] < NODE_TIMEOUT + TTL + 5, seen
    assert not seen["two holders"], seen


@pytest.mark.catalogue("redis-failover", backend="redis")
def test_a_manual_failover_ends_grants_as_safely(
    private_cluster: PrivateRedisCluster, bounds: Callable[[str, float], None]
) -> None:
    def manual(master: int) -> None:
        replica = private_cluster.replica_of(master)
        assert private_cluster.cli(replica, "CLUSTER", "FAILOVER") == "OK"

    seen = _through_a_failover(private_cluster, "failover:manual", manual)
    bounds(f"CLUSTER FAILOVER: holder told after (TTL {TTL} s)", seen["told"])
    bounds(f"CLUSTER FAILOVER: next holder in after (TTL {TTL} s)", seen["next holder in"])
    assert not seen["two holders"], seen
