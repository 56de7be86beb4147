"""What is particular to a Redis Cluster: wake-ups heard at every master, settings
checked on every node, several seed nodes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from djlocks import Lock
from djlocks.backends import backends
from djlocks.backends.redis import RedisBackend, wakeups
from tests.faults import free_port, until
from tests.redis_cluster import channels_at

CLUSTER = [alias for alias in settings.DJLOCKS["BACKENDS"] if alias == "redis-cluster"]


@pytest.mark.usefixtures("store")
@pytest.mark.parametrize("backend", CLUSTER)
def test_a_waiter_listens_at_every_master(backend: str) -> None:
    """A release's ``PUBLISH`` reaches subscribers on its own master at once, others only
    through the cluster bus (measured: up to 40 ms)."""
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


@pytest.mark.usefixtures("store")
@pytest.mark.parametrize("backend", CLUSTER)
def test_an_evicting_replica_is_reported(backend: str) -> None:
    """A replica's policy matters too: a fail-over promotes it."""
    store = backends[backend]
    replicas = [
        address
        for address, node in store.redis().cluster_nodes().items()
        if "slave" in node["flags"]
    ]
    server = redis.Redis.from_url(f"redis://{replicas[0]}/0")
    server.config_set("maxmemory-policy", "allkeys-lru")
    try:
        (warning,) = store.check(["default"])
        assert warning.id == "djlocks.W004" and f"{replicas[0]}: allkeys-lru" in warning.msg
    finally:
        server.config_set("maxmemory-policy", "noeviction")
        server.close()
    assert store.check(["default"]) == []


@pytest.mark.usefixtures("store")
@pytest.mark.parametrize("backend", CLUSTER)
def test_the_first_seed_that_answers_is_used(backend: str) -> None:
    """``OPTIONS["cluster"]`` may list several nodes: a process starts while one is down."""
    live = settings.DJLOCKS["BACKENDS"][backend]["OPTIONS"]["cluster"]
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend",
            "OPTIONS": {"cluster": [f"redis://127.0.0.1:{free_port()}/0", live]}}  # fmt: skip
    configured = {**settings.DJLOCKS["BACKENDS"], "seeds": spec}
    try:
        with (
            override_settings(DJLOCKS={**settings.DJLOCKS, "BACKENDS": configured}),
            Lock("seeds", backend="seeds", ttl=5) as grant,
        ):
            assert grant.fence > 0
    finally:
        backends.reset()


@pytest.mark.parametrize(
    ("cluster", "wrong"),
    [
        (7000, "must be a Redis Cluster node's URL"),
        (["redis://127.0.0.1:7000/0", ""], "must be a Redis Cluster node's URL"),
    ],
)
def test_a_wrong_cluster_option_is_refused(cluster: object, wrong: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=wrong):
        RedisBackend("bad", {"cluster": cluster})


def test_seeds_must_share_their_credentials() -> None:
    seeds = ["redis://:pw-alpha@127.0.0.1:7000/0", "redis://:pw-beta@127.0.0.1:7001/0"]
    with pytest.raises(ImproperlyConfigured, match=r"differs from .* in more than host") as told:
        RedisBackend("bad", {"cluster": seeds})
    assert "pw-" not in str(told.value), "a password was shown"
    with pytest.raises(ImproperlyConfigured, match="non-empty list") as told:
        RedisBackend("bad", {"cluster": ["redis://:secret@127.0.0.1:7000/0", None]})
    assert "secret" not in str(told.value), "a password was shown"
    # Database 0 said or not: the same options.
    RedisBackend("good", {"cluster": ["redis://127.0.0.1:7000/0", "redis://127.0.0.1:7001"]})


@pytest.mark.usefixtures("store")
@pytest.mark.parametrize("backend", CLUSTER)
def test_an_idle_listener_ends_at_every_master(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its threads, one per master, end together, also when a new wait starts as they
    go idle; none is left listening."""
    monkeypatch.setattr(wakeups, "IDLE_STOP", 0.2)
    store = backends[backend]
    for round_ in range(4):
        holder = Lock(f"idle:{round_}", backend=backend, ttl=10).acquire_grant()
        waiter = threading.Thread(target=_take_and_release, args=(f"idle:{round_}", backend))
        waiter.start()
        until(lambda: store.waiters(), "the waiter to queue")
        assert holder is not None
        holder.release()
        waiter.join(10)
        time.sleep(0.2 + 0.05 * round_)  # around the idle stop
    until(lambda: not _listening(), "every listener thread to end", timeout=10)
    channels = channels_at(store.redis(), f"{store.prefix}:wake:*:{os.getpid()}:*")
    assert not any(channels.values()), channels


def _take_and_release(name: str, backend: str) -> None:
    with Lock(name, backend=backend, ttl=10, timeout=10):
        pass


def _listening() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("djlocks-redis-wakeups")]
