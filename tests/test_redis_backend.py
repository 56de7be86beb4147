"""The Redis backend against a real Redis: what differs from the lease rows
(keys, scripts, wake-ups, the restart of the server), and RELIABILITY.md items
8, 9, 10 (through a TCP proxy), 11, 12, 21, 22, 23, 24 for it. Items 1, 2 and 7
run for it in test_lease_processes.py, 3-5, 17 and 19 in test_reliability.py, 25 in
test_admin.py.

The shared Redis (REDIS_URL) is used as is; the restart test starts a private
redis-server on its own port and never touches the shared one."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import cast

import pytest
import redis
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import Client, override_settings
from django.urls import reverse

from djlocks import Lock, LockLost, Semaphore, db_lock
from djlocks.backends import backends
from djlocks.backends.base import Abort
from djlocks.backends.redis import RedisBackend
from djlocks.exceptions import AlreadyHeld, BackendUnavailable
from djlocks.fencing import StaleFence, fenced_update
from djlocks.inspection import force_release
from djlocks.keys import redis_meta_key
from djlocks.models import LockEvent
from djlocks.runlocked import EXIT_CONFLICT, EXIT_LOST
from djlocks.stress import current_database_names, manage_command
from project.demo.models import FencedCounter
from tests.faults import TcpProxy

pytestmark = [pytest.mark.usefixtures("store"), pytest.mark.timeout(120)]
REDIS = "redis"


def backend() -> RedisBackend:
    return cast(RedisBackend, backends[REDIS])


def lock(name: str = "r:job", **options: object) -> Lock:
    return Lock(name, backend=REDIS, **options)  # type: ignore[arg-type]


@pytest.mark.catalogue(18, backend="redis")
def test_lock_is_exclusive_fences_rise_and_timeouts_are_exact() -> None:
    fences = []
    for _ in range(3):
        with lock(timeout=0) as grant:
            fences.append(grant.fence)
            assert grant.expires_at is not None
            assert not lock().acquire(timeout=0), "a second handle in the same thread"
            began = time.monotonic()
            assert not lock().acquire(timeout=0.3)
            # Waiters wait on a local event, not on Redis's 100 ms timer tick.
            assert 0.29 <= time.monotonic() - began < 0.38
    assert fences == sorted(fences) and len(set(fences)) == 3


def test_keys_of_a_name_share_one_hash_tag_and_a_braced_name_is_hashed() -> None:
    client = backend().redis()
    for name in ("r:tagged", "r:{braced}"):
        tag = hash_tag(redis_meta_key(backend().prefix, name))
        assert tag == name or (tag.startswith("#") and "{" in name)
        with Semaphore(name, limit=2, backend=REDIS, cooldown=5), lock(name + "x"):
            keys = {k.decode() for k in client.scan_iter(match=f"{backend().prefix}:*")}
            mine = {k for k in keys if hash_tag(k) == tag}
            assert {k.rsplit("}:", 1)[1] for k in mine} == {"m", "s:0"}
        assert backend().cooldowns(name)[0].name == name
    assert ("r:{braced}", 2) in backend().names()


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
        assert 0.3 < time.monotonic() - began < 1.0
    backend().set_cooldown("r:cool", 0, 30)
    assert not lock("r:cool").acquire(timeout=0)
    assert backend().set_cooldown("r:cool", 0, 0) is None
    with lock("r:cool", timeout=0):
        pass
    with pytest.raises(ValueError, match="no slot 4"):
        backend().set_cooldown("r:cool", 4, 1)


@pytest.mark.catalogue(21, backend="redis")
def test_21_renewal_sets_never_adds_and_never_reclaims() -> None:
    client = backend().redis()
    with lock("r:renew", ttl=1.2) as grant:
        time.sleep(2.0)  # past the TTL: the heartbeat renewed it
        grant.check()
        left = client.pttl(next(k for k in client.scan_iter(match="*{r:renew}:s:0")))
        assert 0 < left <= 1200, "the renewal set the TTL, it did not add to it"
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
    newer.check()  # item 10: the late release did not free the newer grant
    with pytest.raises(LockLost):
        backend().release("r:renew", stale.token, 0)  # retried: still refused
    newer.release()


@pytest.mark.catalogue(23, backend="redis")
def test_23_forced_release_fences_the_old_holder_and_is_recorded() -> None:
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


@pytest.mark.catalogue(11, backend="redis")
def test_11_cancelled_acquires_leave_nothing_sync_and_async() -> None:
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
        assert time.monotonic() - began < 0.1


@pytest.mark.catalogue(12, backend="redis")
def test_12_a_lost_wake_up_costs_at_most_one_poll() -> None:
    client = backend().redis()
    holder = lock("r:wake").acquire_grant()
    assert holder is not None
    got: list[float] = []

    def wait() -> None:
        with lock("r:wake", timeout=10):
            got.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 5
    while not client.pubsub_channels(f"{backend().prefix}:wake:*"):
        assert time.monotonic() < deadline, "the waiter never subscribed"
        time.sleep(0.01)
    # Cut the wake-up path: the listener's subscription connection is killed.
    assert client.client_kill_filter(_type="pubsub") >= 1
    released = time.monotonic()
    holder.release()
    waiter.join(10)
    assert got and got[0] - released < 0.25 + 0.2, "the waiter's poll bound is POLL_INTERVAL"


def test_waiters_are_woken_at_once_when_the_path_works() -> None:
    holder = lock("r:handoff").acquire_grant()
    assert holder is not None
    got: list[float] = []
    waiter = threading.Thread(target=lambda: got.append(_acquire_and_release("r:handoff")))
    waiter.start()
    while not backend().redis().pubsub_channels(f"{backend().prefix}:wake:*"):
        time.sleep(0.01)
    time.sleep(0.3)  # past a poll: only a wake-up can be quick now
    released = time.monotonic()
    holder.release()
    waiter.join(10)
    assert got and got[0] - released < 0.1


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


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


@pytest.mark.catalogue(22, backend="redis")
def test_22_a_redis_restart_is_reported_and_fences_never_go_backwards(
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


@pytest.mark.catalogue(22, backend="redis")
def test_22_the_effects_of_a_redis_clock_jump_are_reported_and_fences_still_rise() -> None:
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


def runlocked(*args: str) -> subprocess.Popen[str]:
    command = [*manage_command(current_database_names()), "runlocked", "--backend", REDIS]
    return subprocess.Popen([*command, *args], text=True)


@pytest.mark.catalogue(24, backend="redis")
def test_24_runlocked_on_redis(tmp_path: Path) -> None:
    with lock("r:cron"):
        assert runlocked("r:cron", "-n", "--", "true").wait(30) == EXIT_CONFLICT
    assert runlocked("r:cron", "--", "sh", "-c", "exit 7").wait(30) == 7
    wrapper = runlocked("r:cron", "--ttl", "1.5", "--kill-after", "0.5", "--", "sleep", "300")
    deadline = time.monotonic() + 20
    while not backend().holders("r:cron"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(force_release(backend().holders("r:cron"))) == 1
    assert wrapper.wait(10) == EXIT_LOST
    # SIGKILL of the wrapper: the lease ends at its TTL.
    wrapper = runlocked("r:cron", "--ttl", "1.5", "--", "sleep", "300")
    while not backend().holders("r:cron"):
        assert time.monotonic() < deadline + 20
        time.sleep(0.05)
    wrapper.kill()
    wrapper.wait(10)
    killed = time.monotonic()
    with lock("r:cron", timeout=5):
        assert time.monotonic() - killed < 1.5 + 0.5


def test_system_checks_warn_of_eviction_and_refuse_other_caches(
    private_redis: PrivateRedis,
) -> None:
    from djlocks.checks import check_redis_stores

    assert {m.id for m in check_redis_stores()} == set()
    redis.Redis(port=private_redis.port).config_set("maxmemory-policy", "allkeys-lru")
    assert {m.id for m in check_redis_stores()} == {"djlocks.W004"}
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
        call_command("djlocks", "list", "--json", stdout=out, stderr=err)
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


@pytest.mark.catalogue(8, backend="redis")
def test_8_a_reply_delayed_past_the_ttl_is_not_believed(proxied: TcpProxy) -> None:
    proxied.reply_delay = 1.2
    late = Lock("r:late", backend="proxied", ttl=1)
    assert late.acquire(timeout=0) is False, "a grant that came after its lease is given back"
    proxied.heal()
    time.sleep(1.0)  # whatever the delayed give-back did, the lease has run out by now
    assert backend().holders("r:late") == []
    with lock("r:late", timeout=0):
        pass


@pytest.mark.catalogue(9, 10, backend="redis")
def test_9_and_10_lost_replies_leave_no_orphan_and_no_double_release(
    proxied: TcpProxy,
) -> None:
    # Item 9: the acquire is applied, its reply lost; the grant ends at its TTL.
    proxied.drop_replies = True
    with pytest.raises(BackendUnavailable):
        Lock("r:lost", backend="proxied", ttl=1).acquire(timeout=0)
    assert len(backend().holders("r:lost")) <= 1, "never a double holder"
    began = time.monotonic()
    with lock("r:lost", timeout=3):
        assert time.monotonic() - began < 1.5, "the orphan ended at its TTL"
    # Item 10: the release is applied, its reply lost; retrying it frees nothing newer.
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
