"""A Redis master fails over while a holder holds a name and a waiter waits: in a
Redis Cluster, and behind Redis Sentinel.

Each test has a private set-up: a cluster (``tests.redis_cluster``) whose nodes
vote a silent master down after ``DOWN_AFTER`` seconds, or a master, a replica
and three Sentinels (``tests.redis_sentinel``) that do the same, reached through
django-redis's Sentinel client. The master that serves the name is SIGKILLed
(its replica is promoted, with whatever it had received) or hands over on
request (``CLUSTER FAILOVER``, ``SENTINEL FAILOVER``). Either way the promoted
replica's run id is not the one stamped on the grant, so the holder's next
renewal ends it and tells the holder (``LockLost``), or its belief runs out
first; the waiter then gets the name with a higher fence, and a fenced write
from the old holder is refused. What each run measured goes to the reliability
page.

The holder has renewed once before the fail-over: its first renewal stamps the
master's run id on the grant. A grant that has not been renewed yet carries no
run id, so if the promoted replica had received it, it simply goes on there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from tests.faults import until
from tests.redis_cluster import PrivateRedisCluster
from tests.redis_sentinel import PrivateRedisSentinel

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(180)]

FAILOVER = "failover"
#: Seconds of silence after which a master is voted down.
DOWN_AFTER = 1.0
#: Seconds: the holder's lease (renewed every TTL/3).
TTL = 3.0


@dataclass
class Replicated:
    """A private replicated Redis and how to fail its masters over."""

    kind: str
    #: The port of the master that serves a name now (``None``: none does).
    master_for: Callable[[str], int | None]
    kill: Callable[[int], None]
    #: Promote the replica of the master at that port, on request.
    hand_over: Callable[[int], None]


#: The set-ups every fail-over runs on: a cluster, Sentinel with one replica, and
#: Sentinel with two and every grant and renewal acknowledged by one (``wait_replicas``).
SETUPS = ["cluster", "sentinel", "sentinel-acknowledged"]


@pytest.fixture
def replicated(request: pytest.FixtureRequest) -> Iterator[Replicated]:
    """The ``failover`` backend on a private cluster, or behind private Sentinels (the
    parameter: one of ``SETUPS``, or ``cluster-acknowledged``: one replica per master,
    acknowledging each grant and renewal)."""
    caches = dict(settings.CACHES)
    if request.param.startswith("cluster"):
        acknowledged = request.param == "cluster-acknowledged"
        cluster = PrivateRedisCluster(node_timeout=DOWN_AFTER)
        server: PrivateRedisCluster | PrivateRedisSentinel = cluster
        options = {"cluster": cluster.url, **({"wait_replicas": 1} if acknowledged else {})}
        setup = Replicated(
            "cluster, wait_replicas 1" if acknowledged else "cluster",
            lambda name: cluster.master_of(redis_meta_key(settings_prefix(), name)),
            cluster.kill,
            lambda master: _replied_ok(
                cluster.cli(cluster.replica_of(master), "CLUSTER", "FAILOVER")
            ),
        )
    else:
        acknowledged = request.param == "sentinel-acknowledged"
        sentinel = PrivateRedisSentinel(down_after=DOWN_AFTER, replicas=2 if acknowledged else 1)
        server = sentinel
        caches[FAILOVER] = sentinel.cache()
        options = {"cache": FAILOVER, **({"wait_replicas": 1} if acknowledged else {})}
        setup = Replicated(
            "sentinel, 2 replicas, wait_replicas 1" if acknowledged else "sentinel",
            lambda name: sentinel.master(),
            sentinel.kill,
            lambda _: sentinel.hand_over(),
        )
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": options}
    configured = settings.DJLOCKS["BACKENDS"]
    try:
        with override_settings(
            CACHES=caches, DJLOCKS={**settings.DJLOCKS, "BACKENDS": {**configured, FAILOVER: spec}}
        ):
            yield setup
    finally:
        backends.reset()
        server.stop()


def settings_prefix() -> str:
    return cast(RedisBackend, backends[FAILOVER]).prefix


def _replied_ok(answer: str) -> None:
    assert answer == "OK", answer


class Waiter(threading.Thread):
    """Waits for ``name`` and notes when it got in and its grant. While the cluster has
    no master for the name, a wait ends in ``BackendUnavailable``: the waiter tries
    again, as an application would (``acquire_retrying``)."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.lock = Lock(name, backend=FAILOVER, ttl=TTL)
        self.granted_at: float | None = None
        self.grant: Grant | None = None

    def run(self) -> None:
        self.grant = acquire_retrying(self.lock)
        self.granted_at = time.monotonic()


def acquire_retrying(lock: Lock, seconds: float = 60) -> Grant | None:
    """``lock``'s grant, asked for again after each ``BackendUnavailable`` for up to
    ``seconds``: while the cluster has no master for the name, or, with
    ``wait_replicas``, while no replica acknowledges yet (a new cluster's first
    acknowledgements can take longer than the time-out on a busy machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return lock.acquire_grant(timeout=deadline - time.monotonic())
        except BackendUnavailable:
            time.sleep(0.05)
    return None


def _through_a_failover(
    replicated: Replicated, name: str, fail_over: Callable[[int], None]
) -> dict[str, Any]:
    """Hold ``name``, queue a waiter, ``fail_over`` the master serving it; return what
    happened: the fences, when the holder was told and when the waiter got in."""
    FencedCounter.objects.create(name=name)
    rows = FencedCounter.objects.filter(name=name)
    lost_at: list[float] = []
    holder = acquire_retrying(
        Lock(name, backend=FAILOVER, ttl=TTL, on_lost=lambda *_: lost_at.append(time.monotonic()))
    )
    assert holder is not None
    assert fenced_update(rows, holder.fence, value=1) == 1
    first_expiry = holder.expires_at
    until(lambda: holder.expires_at != first_expiry, "the holder's first renewal")
    waiter = Waiter(name)
    waiter.start()
    until(lambda: backends[FAILOVER].waiters(name), "the waiter to queue")
    master = replicated.master_for(name)
    assert master is not None
    began = time.monotonic()
    fail_over(master)
    until(lambda: replicated.master_for(name) not in (master, None), "the replica to take over")
    waiter.join(60)
    assert waiter.grant is not None and waiter.granted_at is not None, "the waiter never got in"
    until(lambda: lost_at, "the holder to be told")
    assert waiter.grant.fence > holder.fence, "a fence went backwards over the fail-over"
    assert fenced_update(rows, waiter.grant.fence, value=2) == 1
    with pytest.raises(StaleFence):
        fenced_update(rows, holder.fence, value=3)
    waiter.grant.release()
    return {
        "told": lost_at[0] - began,
        "next holder in": waiter.granted_at - began,
        "two holders for": max(0.0, lost_at[0] - waiter.granted_at),
    }


def _record(bounds: Callable[[str, float], None], how: str, seen: dict[str, float]) -> None:
    for what, seconds in seen.items():
        bounds(f"{how}: {what} (TTL {TTL} s)", seconds)


@pytest.mark.catalogue("redis-failover", backend="redis")
@pytest.mark.parametrize("replicated", SETUPS, indirect=True)
def test_a_master_killed_under_a_holder_is_replaced_and_the_holder_told(
    replicated: Replicated, bounds: Callable[[str, float], None]
) -> None:
    seen = _through_a_failover(replicated, "failover:kill", replicated.kill)
    _record(bounds, f"{replicated.kind}, master SIGKILLed", seen)
    assert seen["told"] < DOWN_AFTER + TTL + 5, seen


@pytest.mark.catalogue("redis-failover", backend="redis")
@pytest.mark.parametrize("replicated", [*SETUPS, "cluster-acknowledged"], indirect=True)
def test_a_fail_over_on_request_ends_grants_as_safely(
    replicated: Replicated, bounds: Callable[[str, float], None]
) -> None:
    """``CLUSTER FAILOVER`` stops the old master's writes before its replica takes
    over. ``SENTINEL FAILOVER`` does not: the old master takes renewals until it is
    made a replica, while the new one lets the lease expire (two holders, the old
    one's fenced writes refused).

    With ``wait_replicas`` on a cluster, the holder's renewals and the waiter's grant
    follow the slot to the promoted replica, whose old master now replicates it (a
    killed master would leave it none: one replica per master cannot acknowledge a
    grant after a SIGKILL, so that case is not run)."""
    seen = _through_a_failover(replicated, "failover:asked", replicated.hand_over)
    _record(bounds, f"{replicated.kind}, fail-over on request", seen)
