"""``OPTIONS["wait_replicas"]``: each grant and renewal waits (Redis ``WAIT``) until
that many replicas have it; one that fewer have is not counted.

On a private master with one replica (``tests.redis_sentinel``, reached through
django-redis's Sentinel client as a replicated set-up is): grants, hand-offs and
renewals go through while the replica keeps up; once it is gone, an acquire
raises ``BackendUnavailable`` and leaves nothing held, the holder's renewals
fail until its belief runs out (``LockLost``), and the system check says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from djlocks import BackendUnavailable, Grant, Lock, Semaphore
from djlocks.backends import backends
from djlocks.backends.redis import RedisBackend
from tests.faults import until
from tests.redis_sentinel import PrivateRedisSentinel

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]

ACKED = "acknowledged"
#: Seconds a grant or renewal waits for its replica.
WAIT_TIMEOUT = 0.3


@pytest.fixture
def replicated() -> Iterator[PrivateRedisSentinel]:
    """The ``acknowledged`` backend on a private master with one replica, waiting for it."""
    server = PrivateRedisSentinel(down_after=60.0)
    spec = {
        "BACKEND": "djlocks.backends.redis.RedisBackend",
        "OPTIONS": {"cache": ACKED, "wait_replicas": 1, "wait_timeout": WAIT_TIMEOUT},
    }
    try:
        with override_settings(
            CACHES={**settings.CACHES, ACKED: server.cache()},
            DJLOCKS={
                **settings.DJLOCKS,
                "BACKENDS": {**settings.DJLOCKS["BACKENDS"], ACKED: spec},
            },
        ):
            yield server
    finally:
        backends.reset()
        server.stop()


@pytest.mark.parametrize(
    ("options", "wrong"),
    [
        ({"wait_replicas": -1}, "wait_replicas"),
        ({"wait_replicas": "1"}, "wait_replicas"),
        ({"wait_replicas": True}, "wait_replicas"),
        ({"wait_replicas": 1, "wait_timeout": 0}, "wait_timeout"),
        ({"wait_replicas": 1, "wait_timeout": float("inf")}, "wait_timeout"),
        ({"wait_replicas": 1, "wait_timeout": "1s"}, "wait_timeout"),
    ],
)
def test_a_wrong_acknowledgement_option_is_refused_by_name(
    options: dict[str, Any], wrong: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"OPTIONS\\['{wrong}'\\]"):
        RedisBackend("bad", {"cache": "redis", **options})


def test_grants_hand_offs_and_renewals_go_through_while_the_replica_keeps_up(
    replicated: PrivateRedisSentinel,
) -> None:
    holder = Lock("acked:lock", backend=ACKED, ttl=1.5).acquire_grant()
    assert holder is not None
    first_expiry = holder.expires_at
    until(lambda: holder.expires_at != first_expiry, "an acknowledged renewal")
    got: list[Grant | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(Lock("acked:lock", backend=ACKED, ttl=1.5).acquire_grant())
    )
    waiter.start()
    until(lambda: backends[ACKED].waiters("acked:lock"), "the waiter to queue")
    holder.release()
    waiter.join(10)
    (handed,) = got
    assert handed is not None and handed.fence > holder.fence
    handed.release()
    with Semaphore("acked:sem", limit=2, backend=ACKED, ttl=5) as slot:
        assert slot.fence > 0
    assert backends[ACKED].check(["default"]) == []


def test_without_its_replica_no_grant_is_counted_and_the_holder_is_told(
    replicated: PrivateRedisSentinel,
) -> None:
    lost: list[float] = []
    holder = Lock(
        "acked:gone", backend=ACKED, ttl=1.5, on_lost=lambda *_: lost.append(time.monotonic())
    ).acquire_grant()
    assert holder is not None
    (replica,) = replicated.replica_ports
    replicated.kill(replica)
    cut = time.monotonic()

    # The holder's renewals are not acknowledged: its belief runs out, and it is told.
    until(lambda: lost, "the holder to be told", timeout=10)
    assert lost[0] - cut < 1.5 + 1.0, "the holder believed past its last acknowledged renewal"

    # A new acquire is refused, says why, and leaves nothing behind.
    began = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"reached 0 of the 1 replica"):
        Lock("acked:other", backend=ACKED, ttl=5).acquire(timeout=0)
    assert time.monotonic() - began >= WAIT_TIMEOUT * 0.9, "WAIT did not wait"
    assert backends[ACKED].holders("acked:other") == []
    # A waiter that gets in (a queue is joined on a wait) gives back grant and place.
    with pytest.raises(BackendUnavailable, match=r"reached 0 of the 1 replica"):
        Lock("acked:other", backend=ACKED, ttl=5).acquire(timeout=5)
    assert backends[ACKED].holders("acked:other") == []
    assert backends[ACKED].waiters("acked:other") == []

    (warning,) = backends[ACKED].check(["default"])
    assert warning.id == "djlocks.W008" and "the server has 0" in warning.msg
    backends[ACKED].force_release("acked:gone")


CLUSTER = [alias for alias in settings.DJLOCKS["BACKENDS"] if alias == "redis-cluster"]


@pytest.mark.parametrize("backend", CLUSTER)
def test_on_a_cluster_each_grant_waits_for_the_replica_of_its_own_master(backend: str) -> None:
    """The test cluster's masters have one replica each: one is found and waited for on
    whichever master serves a name; asking for two gives every grant back."""
    options = settings.DJLOCKS["BACKENDS"][backend]["OPTIONS"]
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend"}
    acked = {**spec, "OPTIONS": {**options, "wait_replicas": 1}}
    overasked = {**spec, "OPTIONS": {**options, "wait_replicas": 2, "wait_timeout": 0.1}}
    configured = settings.DJLOCKS["BACKENDS"]
    try:
        with override_settings(
            DJLOCKS={
                **settings.DJLOCKS,
                "BACKENDS": {**configured, "acked": acked, "overasked": overasked},
            }
        ):
            names = [f"acked:{n}" for n in range(12)]  # spread over the three masters
            for name in names:
                with Lock(name, backend="acked", ttl=5) as grant:
                    assert grant.fence > 0
            assert backends["acked"].check(["default"]) == []
            with pytest.raises(BackendUnavailable, match=r"reached 1 of the 2 replica"):
                Lock(names[0], backend="overasked", ttl=5).acquire(timeout=0)
            (warning,) = backends["overasked"].check(["default"])
            assert warning.id == "djlocks.W008" and warning.msg.count("has 1") == 3
    finally:
        backends.reset()
