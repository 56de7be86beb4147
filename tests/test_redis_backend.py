"""The Redis backend against a real Redis: what differs from the lease rows
(keys, scripts, wake-ups, the restart of the server), and the fault catalogue's
late-acquire-reply, lost-acquire-reply, lost-release-reply (through a TCP proxy),
cancelled-acquires (100 at a time), lost-wake-up, renewal, redis-clock-and-restart and
forced-release for it. exact-counter, semaphore-limit and paused-lease-holder run for it
in test_lease_processes.py; try-lock-burst, waiters-in-turn, holder-killed, forked-child
and lock-covers-commit in test_reliability.py; runlocked-supervision in test_contract.py;
admin-matches-store in test_admin.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import cast

import pytest
import redis
from django.conf import settings as django_settings
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse

from djlocks import Lock, LockLost, Semaphore, db_lock
from djlocks.backends import backends
from djlocks.backends.base import AcquireRequest, HolderInfo
from djlocks.backends.redis import RedisBackend, script_connections
from djlocks.backends.redis.script_connections import KEPT
from djlocks.backends.redis.wakeups import WakeListener
from djlocks.backends.waiting import Abort
from djlocks.exceptions import AlreadyHeld, BackendUnavailable
from djlocks.fencing import StaleFence, fenced_update
from djlocks.identity import current_identity
from djlocks.inspection import force_release
from djlocks.keys import redis_key, redis_meta_key
from djlocks.models import LockEvent
from djlocks.runlocked import EXIT_UNAVAILABLE
from project.demo.models import FencedCounter
from tests.faults import TcpProxy, free_port, until
from tests.processes import fork_beside_threads

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]
REDIS = "redis"


def backend() -> RedisBackend:
    return cast(RedisBackend, backends[REDIS])


def lock(name: str = "r:job", **options: object) -> Lock:
    return Lock(name, backend=REDIS, **options)  # type: ignore[arg-type]


@pytest.mark.catalogue("two-handles", backend="redis")
def test_lock_is_exclusive_fences_rise_and_timeouts_are_exact() -> None:
    fences = []
    for _ in range(3):
        with lock(timeout=0) as grant:
            fences.append(grant.fence)
            assert grant.expires_at is not None
            assert not lock().acquire(timeout=0), "a second handle in the same thread"
            began = time.monotonic()
            assert not lock().acquire(timeout=0.3)
            # Waiters keep their own deadline, not Redis's 100 ms timer tick.
            assert 0.29 <= time.monotonic() - began < 0.38
    assert fences == sorted(fences) and len(set(fences)) == 3


def test_keys_of_a_name_share_one_hash_tag_and_are_the_documented_ones() -> None:
    """The Lua scripts write the keys djlocks.keys describes, braces and ``%`` escaped."""
    client = backend().redis()
    prefix = backend().prefix
    for name in ("r:tagged", "r:{braced}", "r:%7B"):
        tag = hash_tag(redis_meta_key(prefix, name))
        assert "{" not in tag and "}" not in tag
        with Semaphore(name, limit=2, backend=REDIS, cooldown=5), lock(name + "x"):
            keys = {k.decode() for k in client.scan_iter(match=f"{prefix}:*")}
            mine = {k for k in keys if hash_tag(k) == tag}
            assert mine == {redis_key(prefix, name, "m"), redis_key(prefix, name, "s:0")}
        assert client.exists(redis_key(prefix, name, "c:0"))
        assert backend().cooldowns(name)[0].name == name
    assert ("r:{braced}", 2) in backend().names() and ("r:%7B", 2) in backend().names()


def test_a_braced_name_and_its_hash_are_two_locks() -> None:
    """The earlier scheme keyed a braced name by ``#`` and its SHA-256, which is also a
    name anyone may choose: one Redis lease for two locks."""
    braced = "{tenant-a}"
    twin = "#" + hashlib.sha256(braced.encode()).hexdigest()
    with lock(braced, timeout=0), lock(twin, timeout=0):
        assert {h.name for h in backend().holders()} >= {braced, twin}


def hash_tag(key: str) -> str:
    """The part of ``key`` that Redis Cluster hashes to pick the key's slot."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


def test_semaphore_slots_limit_mismatch_and_reshape() -> None:
    semaphore = Semaphore("r:pool", limit=3, backend=REDIS)
    grants = [semaphore.acquire_grant(timeout=0) for _ in range(3)]
    assert all(grants) and not semaphore.acquire(timeout=0)
    assert sorted(g.slot for g in grants if g) == [0, 1, 2]
    with pytest.raises(AlreadyHeld, match="limit=3"):
        Semaphore("r:pool", limit=2, backend=REDIS).acquire(timeout=0)
    for grant in grants:
        assert grant is not None
        grant.release()
    smaller = Semaphore("r:pool", limit=2, backend=REDIS)
    with smaller, smaller:
        assert len(backend().holders("r:pool")) == 2
    assert ("r:pool", 2) in backend().names()


def test_cooldown_keeps_the_slot_unavailable_and_can_be_cleared() -> None:
    with lock("r:cool", cooldown=0.6):
        pass
    (cooling,) = backend().cooldowns("r:cool")
    assert cooling.slot == 0
    assert not lock("r:cool").acquire(timeout=0)
    began = time.monotonic()
    with lock("r:cool", timeout=3):
        assert 0.3 < time.monotonic() - began < 2.5  # at the cool-down's end, not the timeout
    backend().set_cooldown("r:cool", 0, 30)
    assert not lock("r:cool").acquire(timeout=0)
    assert backend().set_cooldown("r:cool", 0, 0) is None
    with lock("r:cool", timeout=0):
        pass
    with pytest.raises(ValueError, match="no slot 4"):
        backend().set_cooldown("r:cool", 4, 1)


@pytest.mark.catalogue("renewal", backend="redis")
def test_renewal_sets_never_adds_and_never_reclaims() -> None:
    client = backend().redis()
    # Renewals every 0.67 s: one may come about a second late and still be in time.
    with lock("r:renew", ttl=2) as grant:
        time.sleep(3.0)  # past the TTL: the heartbeat renewed it
        grant.check()
        left = client.pttl(next(k for k in client.scan_iter(match="*{r:renew}:s:0")))
        assert 0 < left <= 2000, "the renewal set the TTL, it did not add to it"
    quiet = lock("r:renew", ttl=0.5, renew=False)
    stale = quiet.acquire_grant()
    assert stale is not None
    time.sleep(0.7)
    newer = lock("r:renew").acquire_grant(timeout=0)
    assert newer is not None and newer.fence > stale.fence
    with pytest.raises(LockLost):
        backend().renew("r:renew", stale.token, 10)  # a late renewal does not re-claim
    with pytest.raises(LockLost):
        stale.release()
    newer.check()  # the late release did not free the newer grant
    with pytest.raises(LockLost):
        backend().release("r:renew", stale.token, 0)  # retried: still refused
    newer.release()


@pytest.mark.catalogue("forced-release", backend="redis")
def test_forced_release_fences_the_old_holder_and_is_recorded() -> None:
    FencedCounter.objects.create(name="r:forced")
    old = lock("r:forced").acquire_grant()
    other = lock("r:other").acquire_grant()
    assert old is not None and other is not None
    rows = FencedCounter.objects.filter(name="r:forced")
    fenced_update(rows, old.fence, value=1)
    (released,) = force_release(backend().holders("r:forced"), operator="tester", reason="stuck")
    assert released.fence == old.fence
    with lock("r:forced", timeout=0) as new:
        assert new.fence > old.fence
        fenced_update(rows, new.fence, value=2)
        with pytest.raises(StaleFence):
            fenced_update(rows, old.fence, value=3)
    with pytest.raises(LockLost):
        old.check()
    with pytest.raises(LockLost):
        old.release()
    other.check()  # only the named grant ended
    other.release()
    assert LockEvent.objects.filter(name="r:forced", kind="forced_release").exists()


@pytest.mark.catalogue("cancelled-acquires", backend="redis")
def test_cancelled_acquires_leave_nothing_sync_and_async() -> None:
    rng = random.Random(11)
    with lock("r:cancel"):
        for _ in range(100):
            abort = Abort()
            timer = threading.Timer(rng.uniform(0, 0.01), abort.set)
            timer.start()
            assert lock("r:cancel").acquire_grant(abort=abort) is None
            timer.join()

        async def cancelled_waits() -> None:
            for _ in range(100):
                attempt = asyncio.ensure_future(lock("r:cancel").__aenter__())
                await asyncio.sleep(rng.uniform(0, 0.01))
                attempt.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await attempt

        asyncio.run(cancelled_waits())
        assert backend().waiters("r:cancel") == []
    began = time.monotonic()
    with lock("r:cancel", timeout=0):
        assert time.monotonic() - began < 1


@pytest.fixture(params=["line", "pub/sub"])
def wake_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """How the tests' waiters hear of their hand-offs: each on its own line (what a
    process's first few waiters get), or all through the process's pub/sub channel
    (what the others get: here every waiter, as no connection is kept for lines)."""
    if request.param == "pub/sub":
        monkeypatch.setattr(script_connections, "KEPT", 0)
    backends.reset()
    yield request.param
    backends.reset()


def blocked_clients() -> set[str]:
    """The ids of the clients of the shared Redis blocked in ``BLPOP`` (waiters' lines;
    a connection whose last command was one and that now idles is not)."""
    clients = backend().redis().client_list()
    return {c["id"] for c in clients if c["cmd"] == "blpop" and "b" in c["flags"]}


def wake_path_is_up(path: str, lines_before: set[str]) -> bool:
    """Whether the waiter of the test is waiting on ``path``: blocked in ``BLPOP`` on its
    line (a client not in ``lines_before``), or subscribed to its process's channel."""
    if path == "line":
        return bool(blocked_clients() - lines_before)
    return bool(backend().redis().pubsub_channels(f"{backend().prefix}:wake:*"))


@pytest.mark.catalogue("lost-wake-up", backend="redis")
def test_a_lost_wake_up_costs_at_most_one_poll(wake_path: str) -> None:
    client = backend().redis()
    holder = lock("r:wake").acquire_grant()
    assert holder is not None
    got: list[float] = []

    def wait() -> None:
        with lock("r:wake", timeout=10):
            got.append(time.monotonic())

    lines_before, lines = blocked_clients(), set()

    def waiting() -> bool:
        lines.update(blocked_clients() - lines_before)  # the same client between two waits
        return bool(lines) if wake_path == "line" else wake_path_is_up(wake_path, lines_before)

    waiter = threading.Thread(target=wait)
    waiter.start()
    until(waiting, f"the waiter's {wake_path}", 5)
    # Cut the wake-up path: the waiter's line, or the listener's subscription, is killed.
    if wake_path == "line":
        [line] = lines
        assert client.client_kill_filter(_id=line) == 1
    else:
        assert client.client_kill_filter(_type="pubsub") >= 1
    released = time.monotonic()
    holder.release()
    waiter.join(10)
    # Without its poll the waiter would sleep until its timeout (10 s).
    assert got and got[0] - released < 0.25 + 1, "the waiter's poll bound is POLL_INTERVAL"


@override_settings(DJLOCKS={**django_settings.DJLOCKS, "POLL_INTERVAL": 60})
def test_waiters_are_woken_at_once_when_the_path_works(wake_path: str) -> None:
    """The waiter's poll (60 s) and the holder's lease (60 s) both end after the
    waiter's timeout (10 s): only the release's wake-up can let it in."""
    holder = lock("r:handoff").acquire_grant()
    assert holder is not None
    got: list[float] = []
    lines_before = blocked_clients()
    waiter = threading.Thread(target=lambda: got.append(_acquire_and_release("r:handoff")))
    waiter.start()
    until(
        lambda: wake_path_is_up(wake_path, lines_before) and backend().waiters("r:handoff"),
        f"the waiter to queue and wait on its {wake_path}",
        10,
    )
    released = time.monotonic()
    holder.release()
    waiter.join(15)
    assert got, "the waiter was not woken by the release"
    assert got[0] - released < 5, "well before any poll"


def test_more_waiters_than_lines_are_all_woken_in_turn() -> None:
    """Eight waiters of one process: the first few wait on lines of their own, the
    others through the process's channel; every one is handed the lock by a release
    (the poll, 60 s, and the leases, 60 s, outlast the test)."""
    order: list[int] = []
    with override_settings(DJLOCKS={**django_settings.DJLOCKS, "POLL_INTERVAL": 60}):
        holder = lock("r:crowd").acquire_grant()
        assert holder is not None
        lines_before = blocked_clients()

        def wait(number: int) -> None:
            with lock("r:crowd", timeout=20):
                order.append(number)

        waiters = [threading.Thread(target=wait, args=(number,)) for number in range(8)]
        for number, waiter in enumerate(waiters):
            waiter.start()
            until(lambda n=number: len(backend().waiters("r:crowd")) == n + 1, "a waiter")
        lines = blocked_clients() - lines_before
        assert len(lines) == KEPT, "the first waiters wait on lines, as many as are kept"
        assert wake_path_is_up("pub/sub", lines_before), "the others listen on the channel"
        holder.release()
        for waiter in waiters:
            waiter.join(15)
    assert order == list(range(8)), "each was handed the lock in its turn"


def test_a_wait_ends_on_time_whatever_redis_s_tick(wake_path: str) -> None:
    """Redis ends a blocked command only at its 100 ms tick: a line keeps its own."""
    with lock("r:tick", timeout=0):
        assert not lock("r:tick").acquire(timeout=0)  # a try alone: no wait
        for _ in range(5):
            began = time.monotonic()
            assert not lock("r:tick").acquire(timeout=0.02)
            assert time.monotonic() - began < 0.08


def test_a_cancelled_line_wait_ends_at_once_without_asking_redis(
    private_redis: PrivateRedis,
) -> None:
    """An abort may be set by an event loop's thread (an asyncio task cancelled), which
    must not wait for Redis: here Redis holds back every write, as a push to the line
    would be, and the poll (60 s) outlasts the test."""
    server = redis.Redis(port=private_redis.port)
    with override_settings(DJLOCKS={**django_settings.DJLOCKS, "POLL_INTERVAL": 60}):
        holder = Lock("r:cut", backend="private", renew=False).acquire_grant()
        assert holder is not None
        abort, got = Abort(), []
        waiter = threading.Thread(
            target=lambda: got.append(
                Lock("r:cut", backend="private", renew=False).acquire_grant(timeout=30, abort=abort)
            )
        )
        waiter.start()
        until(lambda: any("b" in c["flags"] for c in server.client_list()), "the line's wait")
        server.client_pause(2000, all=False)
        began = time.monotonic()
        abort.set()
        assert time.monotonic() - began < 0.2, "the abort waited for Redis"
        waiter.join(10)
        assert got == [None]
        holder.release()


def test_a_hand_off_read_from_the_record_is_never_read_again_from_the_line() -> None:
    """A release hands the slot to a waiter that is between two waits on its line; its
    next attempt takes the grant from its record. Should that grant end before the
    waiter reads its line (a forced release), the line must not give it back to it."""
    request = AcquireRequest("r:stale", 1, 30, 0, current_identity(None))
    holder = lock("r:stale").acquire_grant()
    assert holder is not None
    waiter = "stale-waiter"
    assert backend()._attempt(request, waiter, "join").grant is None  # queued, on a line
    holder.release()  # hands the slot over: to the waiter's record and its line
    line = redis_key(backend().prefix, "r:stale", f"h:{waiter}")
    assert backend().redis().llen(line) == 1
    handed = backend()._attempt(request, waiter, "wait").grant
    assert handed is not None, "the waiter's attempt finds the hand-off in its record"
    assert not backend().redis().exists(line), "the hand-off stays on the line"
    backend().release("r:stale", handed.token, 0)


def test_the_first_waiter_of_a_process_hears_its_wake_up() -> None:
    """The listener's first start in a process forgets the waiters of another (a fork's
    parent): it must not forget the waiter that starts it, which then slept until its
    next poll (found by a process whose first acquire waited)."""
    listener = WakeListener(backend().redis, backend().prefix)
    try:
        with listener.waiting("the-first") as wake:
            backend().redis().publish(wake.channel, "the-first\nwoken")
            assert wake.wait(5) == "woken", "the first waiter was not woken"
    finally:
        listener.close()


def test_a_wake_listener_whose_client_cannot_be_had_ends_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A misconfigured backend says so in the caller's thread, which builds the same
    client; the listener's thread, started by the first waiter, ends quietly (it
    printed a second, thread-level traceback under ``runlocked``'s error)."""
    uncaught: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)

    def misconfigured() -> redis.Redis:
        raise ImproperlyConfigured("CACHES['nowhere'] cannot be used")

    listener = WakeListener(misconfigured, "djlocks-test")
    with listener.waiting("a-waiter"):  # waits up to a second for a subscription
        pass
    listener.close()  # joins the listener's thread
    assert not uncaught, [str(args.exc_value) for args in uncaught]


def _acquire_and_release(name: str) -> float:
    with lock(name, timeout=10):
        return time.monotonic()


def test_bad_configuration_and_a_server_that_is_down_get_clear_errors() -> None:
    with pytest.raises(ImproperlyConfigured, match="prefix"):
        RedisBackend("bad", {"cache": REDIS, "prefix": "a{b}"})
    with pytest.raises(ImproperlyConfigured, match="django-redis"):
        RedisBackend("bad", {"cache": "default"}).holders()
    with pytest.raises(ImproperlyConfigured, match="nowhere"):
        RedisBackend("bad", {"cache": "nowhere"}).holders()
    down = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
    }
    with (
        override_settings(CACHES={"default": {}, "down": down}),
        pytest.raises(BackendUnavailable, match="Is redis-server running"),
    ):
        RedisBackend("down", {"cache": "down"}).holders()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, free_port())
    server.start()
    settings = {
        "CACHES": {
            **django_settings.CACHES,
            "private": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{server.port}/0",
            },
        },
        "DJLOCKS": {
            "BACKENDS": {
                "default": {"BACKEND": "djlocks.backends.lease.LeaseBackend"},
                REDIS: {
                    "BACKEND": "djlocks.backends.redis.RedisBackend",
                    "OPTIONS": {"cache": REDIS},
                },
                "private": {
                    "BACKEND": "djlocks.backends.redis.RedisBackend",
                    "OPTIONS": {"cache": "private"},
                },
            },
        },
    }
    try:
        with override_settings(**settings):
            yield server
    finally:
        backends.reset()
        server.stop()


class PrivateRedis:
    """A redis-server of the test's own, which it may restart (never the shared one)."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        executable = shutil.which("redis-server")
        assert executable, "redis-server is needed (make setup installs it)"
        self.process = subprocess.Popen(
            [
                executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the private redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.mark.catalogue("redis-clock-and-restart", backend="redis")
def test_a_redis_restart_is_reported_and_fences_never_go_backwards(
    private_redis: PrivateRedis,
) -> None:
    # Without persistence: the lease vanishes; the holder learns it at its next check.
    before = Lock("r:restart", backend="private").acquire_grant()
    assert before is not None
    private_redis.restart()
    with pytest.raises(LockLost):
        before.check()
    with db_lock("r:restart", backend="private", timeout=0) as after:
        assert after.fence > before.fence
    with pytest.raises(LockLost):
        before.release()
    # Restored from disk by a new server: the grant reappears, with the old run
    # id stamped by its first renewal; the new server's run id ends it.
    restored = Lock("r:restart", backend="private", renew=False).acquire_grant()
    assert restored is not None
    backends["private"].renew("r:restart", restored.token, 30)
    redis.Redis(port=private_redis.port).save()
    private_redis.restart()
    assert backends["private"].holders("r:restart"), "the grant came back from the RDB file"
    with pytest.raises(LockLost, match="restarted"):
        restored.check()
    assert backends["private"].holders("r:restart") == []
    with db_lock("r:restart", backend="private", timeout=0) as last:
        assert last.fence > restored.fence
    with pytest.raises(LockLost):
        restored.release()


def _script_connections(port: int) -> list[dict[str, str]]:
    """The clients of the server at ``port`` whose last command ran a lock's script."""
    return [
        client
        for client in redis.Redis(port=port).client_list()
        if client["cmd"] in ("evalsha", "script|load")
    ]


def test_the_scripts_keep_a_few_of_the_pools_connections_and_give_them_back(
    private_redis: PrivateRedis,
) -> None:
    def take_and_give_back(name: str) -> None:
        for _ in range(20):
            with db_lock(name, backend="private", timeout=5, renew=False):
                pass

    threads = [
        threading.Thread(target=take_and_give_back, args=(f"r:kept:{number}",))
        for number in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = cast(RedisBackend, backends["private"])
    scripts = store._script_connections
    assert scripts is not None
    kept = set(scripts._kept)
    assert 1 <= len(kept) <= KEPT
    pool = store.redis().connection_pool
    assert kept <= pool._in_use_connections  # the pool counts them as in use
    # Every other connection went back: in use besides, only the listeners' (pub/sub).
    assert len(pool._in_use_connections - kept) <= 2, pool._in_use_connections
    store.close()
    assert kept <= set(pool._available_connections)


def test_a_free_lock_is_tried_without_listening_for_a_wake_up(
    private_redis: PrivateRedis,
) -> None:
    server = redis.Redis(port=private_redis.port)
    for _ in range(3):
        with db_lock("r:free", backend="private", timeout=5, renew=False):
            pass
    assert server.pubsub_channels() == [], "an uncontended acquire subscribed for wake-ups"
    holder = Lock("r:free", backend="private", renew=False).acquire_grant()
    assert holder is not None
    got: list[bool] = []

    def wait_for_it() -> None:
        lock = Lock("r:free", backend="private", renew=False)
        got.append(lock.acquire(timeout=5))
        lock.release()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    until(lambda: backends["private"].waiters("r:free"), "the waiter to queue")
    until(lambda: any("b" in c["flags"] for c in server.client_list()), "a wait on its line")
    holder.release()
    waiter.join(10)
    assert got == [True]


def test_a_connection_the_server_closed_while_idle_connects_again(
    private_redis: PrivateRedis,
) -> None:
    with db_lock("r:idle", backend="private", timeout=5, renew=False) as first:
        pass
    [idle] = _script_connections(private_redis.port)
    redis.Redis(port=private_redis.port).client_kill_filter(_id=idle["id"])
    with db_lock("r:idle", backend="private", timeout=5, renew=False) as second:
        assert second.fence > first.fence


def test_scripts_the_server_forgot_are_loaded_again(private_redis: PrivateRedis) -> None:
    with db_lock("r:flush", backend="private", timeout=5, renew=False) as first:
        pass
    redis.Redis(port=private_redis.port).script_flush()
    with db_lock("r:flush", backend="private", timeout=5, renew=False) as second:
        assert second.fence > first.fence


def test_a_forked_child_and_its_parent_never_share_a_kept_connection(
    private_redis: PrivateRedis,
) -> None:
    """Both take turns at once after the fork: on one socket, one's reply would be read
    as the other's (a wrong fence, a release that finds nothing)."""
    take_turns("r:fork:parent", 3)
    kept = cast(RedisBackend, backends["private"])._script_connections
    assert kept is not None and kept._kept, "the parent keeps connections when it forks"
    child = fork_beside_threads()
    if child == 0:
        signal.alarm(60)  # a child that hangs dies of SIGALRM and fails the test
        try:
            take_turns("r:fork:child", 300)
        except BaseException:
            traceback.print_exc()
            os._exit(12)
        os._exit(0)
    try:
        take_turns("r:fork:parent", 300)
    finally:
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "see the child's report above"


def take_turns(name: str, turns: int) -> None:
    """Acquire and release ``name`` on the private store ``turns`` times, each grant the
    only holder and its fence above the last."""
    last = 0
    for _ in range(turns):
        with db_lock(name, backend="private", timeout=5, renew=False) as grant:
            assert grant.fence > last
            assert [h.token for h in backends["private"].holders(name)] == [grant.token]
            last = grant.fence


def test_a_call_that_ends_after_the_backend_closed_gives_its_connection_back(
    proxied: TcpProxy,
) -> None:
    store = cast(RedisBackend, backends["proxied"])
    take_once("r:closing")
    pool = store.redis().connection_pool
    proxied.reply_delay = 0.5
    calling = threading.Thread(target=take_once, args=("r:closing",))
    calling.start()
    assert proxied.holding_back.wait(10), "the call never waited for its reply"
    store.close()  # while the call waits: its connection must go back when it ends
    calling.join(10)
    store.close()
    assert not pool._in_use_connections, "a connection stayed out of the pool"


def take_once(name: str) -> None:
    with db_lock(name, backend="proxied", timeout=5, renew=False):
        pass


def test_a_reply_that_comes_after_its_call_gave_up_is_never_read_as_another_calls(
    proxied: TcpProxy,
) -> None:
    take_once("r:gave-up:before")  # the store has connected and keeps a connection
    proxied.reply_delay = 3  # past the store's 2 s socket time-out
    with pytest.raises(BackendUnavailable):
        Lock("r:gave-up", backend="proxied", ttl=2).acquire(timeout=0)
    proxied.heal()  # the late reply is still on its way: on the old connection, it would be
    for name in ("r:next", "r:gave-up:after"):  # read as the next call's
        with db_lock(name, backend="proxied", timeout=5, renew=False) as grant:
            holders = backend().holders(name)
            assert [(h.token, h.fence) for h in holders] == [(grant.token, grant.fence)]
    until(lambda: not backend().holders("r:gave-up"), "the orphaned grant's lease to end")


@pytest.mark.catalogue("redis-clock-and-restart", backend="redis")
def test_the_effects_of_a_redis_clock_jump_are_reported_and_fences_still_rise() -> None:
    """A jump of Redis's clock ahead expires leases early; a jump back makes ``TIME``
    smaller than the fences already issued. libfaketime cannot run Debian's
    redis-server (it clashes with jemalloc), so both effects are made directly: the
    lease is expired now, and the name's last fence is one issued an hour ahead."""
    store = backends[REDIS].redis()
    meta = redis_meta_key(cast(RedisBackend, backends[REDIS]).prefix, "r:jump")
    before = lock("r:jump", renew=False).acquire_grant()
    assert before is not None
    store.pexpire(meta.removesuffix(":m") + ":s:0", 1)  # the lease's key, as if an hour passed
    time.sleep(0.01)
    with pytest.raises(LockLost):
        before.check()
    from_an_hour_ahead = before.fence + 3600 * 10**6  # fences count microseconds of TIME
    store.hset(meta, "fence", from_an_hour_ahead)
    with lock("r:jump", timeout=0) as after:
        assert after.fence > from_an_hour_ahead
    with pytest.raises(LockLost):
        before.release()


def test_system_checks_warn_of_eviction_and_refuse_other_caches(
    private_redis: PrivateRedis,
) -> None:
    from djlocks.checks import check_backends

    def check_redis_stores() -> list[CheckMessage]:
        """What the checks say when Django asks about stores (as migrate and test do)."""
        return check_backends(databases=[])

    assert {m.id for m in check_redis_stores()} == set()
    redis.Redis(port=private_redis.port).config_set("maxmemory-policy", "allkeys-lru")
    assert {m.id for m in check_redis_stores()} == {"djlocks.W004"}
    plain_check = {m.id for m in check_backends(databases=None)}
    assert "djlocks.W004" not in plain_check, "a plain check must not query Redis"
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend"}
    down = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
    }
    with override_settings(
        CACHES={
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "down": down,
        },
        DJLOCKS={
            "BACKENDS": {
                "local": {**spec, "OPTIONS": {"cache": "default"}},
                "down": {**spec, "OPTIONS": {"cache": "down"}},
            }
        },
    ):
        assert {m.id for m in check_redis_stores()} == {"djlocks.E008", "djlocks.W005"}


def test_a_redis_that_is_down_does_not_hide_the_other_stores(admin_client: Client) -> None:
    down_cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
    }
    down = {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": {"cache": "down"}}
    configured = django_settings.DJLOCKS
    with (
        override_settings(
            CACHES={**django_settings.CACHES, "down": down_cache},
            DJLOCKS={**configured, "BACKENDS": {**configured["BACKENDS"], "down": down}},
        ),
        db_lock("r:visible"),
    ):
        page = admin_client.get(reverse("admin:djlocks_lockname_changelist")).content.decode()
        assert "r:visible" in page and "Backend &#x27;down&#x27; could not be asked" in page
        data = admin_client.get(reverse("admin:djlocks_overview_json")).json()
        assert list(data["unavailable"]) == ["down"] and data["count"] >= 1
        out, err = StringIO(), StringIO()
        with pytest.raises(CommandError) as failed:  # exit 69: a store could not be asked
            call_command("djlocks", "list", "--json", stdout=out, stderr=err)
        assert failed.value.returncode == 69
        assert list(json.loads(out.getvalue())["unavailable"]) == ["down"]
        assert "'down' could not be asked" in err.getvalue()


@pytest.fixture
def proxied() -> Iterator[TcpProxy]:
    """The backend ``proxied``: the shared Redis behind a TCP proxy, 2 s socket time-outs."""
    shared = redis.Redis.from_url(django_settings.REDIS_URL).connection_pool.connection_kwargs
    port, db = shared["port"], shared.get("db", 0)
    proxy = TcpProxy(port)
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{proxy.port}/{db}",
        "OPTIONS": {"SOCKET_TIMEOUT": 2, "SOCKET_CONNECT_TIMEOUT": 2},
    }
    spec = {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": {"cache": "proxied"}}
    configured = django_settings.DJLOCKS
    try:
        with override_settings(
            CACHES={**django_settings.CACHES, "proxied": cache},
            DJLOCKS={**configured, "BACKENDS": {**configured["BACKENDS"], "proxied": spec}},
        ):
            yield proxy
            proxy.heal()
            backends.reset()
    finally:
        proxy.close()


@pytest.mark.catalogue("late-acquire-reply", backend="redis")
def test_a_reply_delayed_past_the_ttl_is_not_believed(proxied: TcpProxy) -> None:
    proxied.reply_delay = 1.2
    late = Lock("r:late", backend="proxied", ttl=1)
    assert late.acquire(timeout=0) is False, "a grant that came after its lease is given back"
    proxied.heal()
    time.sleep(1.0)  # whatever the delayed give-back did, the lease has run out by now
    assert backend().holders("r:late") == []
    with lock("r:late", timeout=0):
        pass


@pytest.mark.catalogue("lost-acquire-reply", "lost-release-reply", backend="redis")
def test_lost_replies_leave_no_orphan_and_no_double_release(
    proxied: TcpProxy,
) -> None:
    # The acquire is applied, its reply lost; the grant ends at its TTL.
    proxied.drop_replies = True
    with pytest.raises(BackendUnavailable):
        Lock("r:lost", backend="proxied", ttl=1).acquire(timeout=0)
    assert len(backend().holders("r:lost")) <= 1, "never a double holder"
    began = time.monotonic()
    with lock("r:lost", timeout=3):
        assert time.monotonic() - began < 1.5, "the orphan ended at its TTL"
    # The release is applied, its reply lost; retrying it frees nothing newer.
    proxied.heal()
    old = Lock("r:lost", backend="proxied", ttl=5).acquire_grant(timeout=0)
    assert old is not None
    proxied.drop_replies = True
    with pytest.raises(BackendUnavailable):
        old.release()
    proxied.heal()
    with lock("r:lost", timeout=0) as newer:
        with pytest.raises(LockLost):
            backends["proxied"].release("r:lost", old.token, 0)
        newer.check()


@contextlib.contextmanager
def semaphore_of_two(name: str) -> Iterator[list[HolderInfo]]:
    """Two grants of a semaphore on the proxied store (no renewal: nothing else is
    sent), as their holders; whatever is left of them is released afterwards."""
    semaphore = Semaphore(name, limit=2, backend="proxied", renew=False)
    grants = [semaphore.acquire_grant(timeout=0) for _ in range(2)]
    try:
        assert all(grants)
        yield sorted(backends["proxied"].holders(name), key=lambda h: h.slot)
    finally:
        for grant in filter(None, grants):
            with contextlib.suppress(LockLost, BackendUnavailable):
                grant.release()


def secret_of(holder: HolderInfo) -> bytes:
    """What a Redis force_release sends of the grant: its token's secret."""
    return holder.token.rpartition(".")[0].encode()


def test_a_forced_release_that_fails_half_way_audits_what_it_took(proxied: TcpProxy) -> None:
    """The store fails on the second grant: the first was taken away and is audited."""
    with semaphore_of_two("r:half") as (first, second):
        proxied.refuse = secret_of(second)
        with pytest.raises(BackendUnavailable):
            force_release([first, second], operator="tester", reason="stuck")
        proxied.heal()
        (event,) = LockEvent.objects.filter(name="r:half", kind="forced_release")
        assert (event.fence, event.operator, event.reason) == (first.fence, "tester", "stuck")
        assert [h.fence for h in backends["proxied"].holders("r:half")] == [second.fence]


def test_djlocks_release_says_what_it_released_before_the_store_failed(
    proxied: TcpProxy,
) -> None:
    with semaphore_of_two("r:half-command") as (first, second):
        proxied.refuse = secret_of(second)
        with pytest.raises(CommandError, match="Released 1 of 2 grant") as failed:
            call_command("djlocks", "release", "r:half-command", "--backend", "proxied", "--yes")
        proxied.heal()
        assert failed.value.returncode == EXIT_UNAVAILABLE
        (event,) = LockEvent.objects.filter(name="r:half-command", kind="forced_release")
        assert event.fence == first.fence


def test_the_admin_audits_a_release_that_fails_half_way(
    proxied: TcpProxy, admin_client: Client
) -> None:
    with semaphore_of_two("r:half-admin") as (first, second):
        proxied.refuse = secret_of(second)
        url = reverse("admin:djlocks_release") + "?backend=proxied&name=r:half-admin"
        fences = f"{first.fence},{second.fence}"
        answer = admin_client.post(url, {"fences": fences, "reason": "stuck"}, follow=True)
        proxied.heal()
        assert answer.status_code == 200
        (entry,) = LogEntry.objects.filter(object_id="r:half-admin")
        assert f"fence {first.fence}" in entry.get_change_message()
        shown = [str(m) for m in answer.context["messages"]]
        assert any("Released 1 grant(s)" in m for m in shown), shown
        assert any("could not use Redis" in m for m in shown), shown
        assert [h.fence for h in backends["proxied"].holders("r:half-admin")] == [second.fence]


def test_the_admin_says_when_the_store_is_down_instead_of_failing(
    proxied: TcpProxy, admin_client: Client
) -> None:
    with Semaphore("r:down-admin", limit=2, backend="proxied", cooldown=300, renew=False):
        pass
    held = Semaphore("r:down-admin", limit=2, backend="proxied", renew=False).acquire_grant(
        timeout=0
    )
    assert held is not None and held.slot == 1, "slot 0 cools down"
    query = "?backend=proxied&name=r:down-admin"
    proxied.refuse = b""  # every request: the store is down
    try:
        for url, data in (
            (reverse("admin:djlocks_release") + query, {"fences": str(held.fence), "reason": "x"}),
            (
                reverse("admin:djlocks_cooldown") + query + "&slot=0",
                {"seconds": "0", "reason": "x"},
            ),
        ):
            answer = admin_client.post(url, data)
            assert answer.status_code == 302, url
            shown = [str(m) for m in get_messages(answer.wsgi_request)]
            assert any("could not" in m for m in shown), shown
            assert not any("Released" in m for m in shown), shown
    finally:
        proxied.heal()
    assert backends["proxied"].holders("r:down-admin"), "nothing was released"
    assert backends["proxied"].cooldowns("r:down-admin"), "the cool-down is unchanged"
    assert not LogEntry.objects.filter(object_id="r:down-admin").exists()
    held.release()


def test_an_outage_logs_a_renewals_first_failure_and_its_recovery_not_each_retry(
    proxied: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals are retried every 0.2 s through an outage: one warning, not five a
    second for each grant held, and a line once a renewal succeeds again."""
    caplog.set_level(logging.DEBUG, logger="djlocks.renew")
    with Lock("r:outage", backend="proxied", ttl=6) as grant:
        proxied.cut_off(silent=False)
        time.sleep(3.0)  # the renewal due at 2 s fails, and its retries
        proxied.heal()
        deadline = time.monotonic() + 2
        while not any("succeeded after" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no renewal succeeded after the outage"
            time.sleep(0.05)
        grant.check()
    failed = [r for r in caplog.records if "renewal of r:outage " in r.getMessage()]
    warned = [r for r in failed if r.levelno == logging.WARNING]
    retried = [r for r in failed if r.levelno == logging.DEBUG and "failed again" in r.getMessage()]
    assert len(warned) == 1 and "retrying every 0.2 s" in warned[0].getMessage(), warned
    assert len(retried) >= 2, [r.getMessage() for r in failed]
    (recovered,) = [r for r in failed if r.levelno == logging.INFO]
    assert f"after {len(retried) + 1} failed attempt(s)" in recovered.getMessage()
