"""The Redis backend: leases as Redis keys with a TTL, through django-redis.

Each operation is one Lua script (``djlocks/backends/lua/``), loaded once and
called by SHA (redis-py's ``Script``), so every decision is atomic and judged
by Redis's own clock: a lease is a key whose ``PX`` expiry Redis enforces.
This follows the single-instance lock pattern of the Redis documentation
(``SET`` with ``PX`` and a random value; compare-and-delete in a script)
and adds what that pattern lacks: semaphore slots, a fair queue, fences,
cool-downs and the holder's identity.

* A slot is granted only when fewer live waiters are queued ahead than slots
  are free, so nobody barges past the queue. Waiters queue in a sorted set by
  ticket; each waiter's record expires ``WAITER_TTL`` seconds after its last
  attempt, so a dead waiter drops out on its own.
* A release hands the freed slot to the next live waiter in the same script
  (the grant is made there, with its fence) and publishes it on the waiter's
  process's channel (``redis_wakeups``): the waiter needs no further round
  trip. Waiters also retry every ``POLL_INTERVAL`` seconds at most, and when
  the soonest lease or cool-down ends, and find a hand-off whose message was
  lost in their record: a lost wake-up costs one poll, never a stranded waiter.
* A forced release, and a graceful release's request (which caps the lease
  at the operator's wait; renewals respect the cap), publish the grant on the
  revocations channel, where every holding process listens
  (``push.RedisListener``): the holder renews at once and so hears of it.
* The fence is one more than the name's last fence and never below Redis's
  clock in microseconds, so it keeps rising when Redis restarts empty. The
  first renewal stamps Redis's run id on the grant: a grant restored from
  disk by a restarted server is ended, and its holder told (``LockLost``).

What Redis cannot promise: a failover to a replica, or a restart that loses
writes (no ``appendfsync always``), can grant a name twice; fences, and the
``LockLost`` the holder then gets, are the defence. A ``maxmemory-policy``
other than ``noeviction`` may evict leases (system check ``djlocks.W004``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from typing import Any

from django.core import checks
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from redis import Redis
from redis.commands.core import Script
from redis.exceptions import RedisError, ResponseError

from djlocks.backends.base import (
    Abort,
    AcquireRequest,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    seconds_left,
)
from djlocks.backends.push import RedisListener
from djlocks.backends.redis_wakeups import WakeListener
from djlocks.conf import djlocks_settings
from djlocks.exceptions import AlreadyHeld, BackendUnavailable, LockLost, ReleaseRequested
from djlocks.identity import Identity
from djlocks.keys import redis_meta_key

acquire_log = logging.getLogger("djlocks.acquire")
renew_log = logging.getLogger("djlocks.renew")

SCRIPTS = (
    "acquire",
    "release",
    "renew",
    "leave",
    "force_release",
    "request_release",
    "describe",
    "set_cooldown",
    "sweep",
)
PREFIX_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-:")
SCAN_BATCH = 1000
GRANTED, WAITING, LIMIT_MISMATCH = 1, 0, -1
ENDED, RESTARTED, RELEASE_REQUESTED = 0, -2, 3


@cache
def _script_source(name: str) -> str:
    lua = resources.files("djlocks.backends") / "lua"
    return (lua / "prelude.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds (at least 1: ``PX 0`` is an error in Redis)."""
    return max(1, round(seconds * 1000))


def _moment(ms: int | bytes | str) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _identity_json(identity: Identity) -> str:
    """The holder's or waiter's identity as stored in Redis (JSON has no raw newline)."""
    return json.dumps([identity.host, identity.pid, identity.thread, identity.label])


def _token(secret: str, slot: int) -> str:
    """A grant's token: its random secret and its slot, so release finds the slot at once."""
    return f"{secret}.{slot}"


def _handed_grant(secret: str, message: str, not_before: float) -> GrantRecord:
    """The grant a release handed this waiter: ``granted\n<slot>\n<fence>\n<expires ms>``,
    made after ``not_before`` (monotonic)."""
    _, slot, fence, expires_ms = message.split("\n")
    return GrantRecord(
        _token(secret, int(slot)),
        int(slot),
        int(fence),
        _moment(expires_ms),
        requested_at=not_before,
    )


def _split_token(token: str) -> tuple[str, int]:
    secret, _, slot = token.rpartition(".")
    return secret, int(slot)


@dataclass(frozen=True)
class _Attempt:
    """What one acquire script said: a grant, or how long until a slot may free."""

    grant: GrantRecord | None
    sent: float  # time.monotonic() when the script was sent
    soonest: float | None = None  # seconds until the soonest lease or cool-down ends


class RedisBackend(LockBackend):
    """Locks and semaphores as Redis leases, on a django-redis cache's connection.

    OPTIONS: ``cache`` (a ``CACHES`` alias whose backend is django-redis,
    default ``"default"``), ``prefix`` (key prefix, default
    ``DJLOCKS["KEY_PREFIX"]``). Crash release: at the TTL. Waiters queue
    FIFO in Redis and are woken through pub/sub, with a bounded poll.
    """

    forced_release_effect = (
        "its lease key is deleted at once and the next holder gets a higher fence, so the "
        "old holder's fenced writes are refused; the old holder hears of it at once "
        "(pub/sub), or at its next renewal or check if that message is lost"
    )
    releases_gracefully = True

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.cache: str = self.options.get("cache", "default")
        self.prefix: str = self.options.get("prefix") or djlocks_settings()["KEY_PREFIX"]
        if not self.prefix or not set(self.prefix) <= PREFIX_CHARACTERS:
            raise ImproperlyConfigured(
                f"djlocks backend {alias!r}: the Redis key prefix {self.prefix!r} must be "
                f"non-empty letters, digits and '_.-:' (no braces or glob characters)."
            )
        self._client: Redis | None = None
        self._scripts: dict[str, Script] = {}
        self._wakeups = WakeListener(self.redis, self.prefix)
        #: Where forced releases and graceful releases' requests tell holders (``watch``).
        self.revocations = f"{self.prefix}:revoked"
        self._revocations = RedisListener(self.redis, self.revocations)

    # -- system checks -------------------------------------------------------

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """When Django asks about databases: E008 a cache that is not django-redis,
        W005 Redis cannot be reached, W004 an eviction policy that may delete leases."""
        if databases is None:
            return []
        try:
            policy = self.redis().config_get("maxmemory-policy").get("maxmemory-policy")
        except ImproperlyConfigured as exc:
            hint = "Point OPTIONS['cache'] at a CACHES alias whose BACKEND is " + repr(
                "django_redis.cache.RedisCache"
            )
            return [Error(str(exc), hint=hint + ".", id="djlocks.E008")]
        except ResponseError:
            return []  # CONFIG is disabled (managed Redis): the policy cannot be read
        except RedisError as exc:
            return [
                checks.Warning(
                    f"djlocks backend {self.alias!r} cannot reach Redis: {exc}",
                    hint="Start redis-server, or fix the cache's LOCATION.",
                    id="djlocks.W005",
                )
            ]
        if policy in (None, "noeviction"):
            return []
        return [
            checks.Warning(
                f"djlocks backend {self.alias!r}: Redis evicts keys (maxmemory-policy="
                f"{policy}) when it is full, and an evicted lease is a lock granted twice.",
                hint="Set maxmemory-policy noeviction, or give locks a Redis of their own.",
                id="djlocks.W004",
            )
        ]

    # -- the connection and the scripts -----------------------------------

    def redis(self) -> Redis:
        """The django-redis client of the cache ``OPTIONS["cache"]`` (thread-safe, pooled)."""
        if self._client is None:
            from django_redis import get_redis_connection

            try:
                client = get_redis_connection(self.cache)
            except NotImplementedError as exc:
                raise ImproperlyConfigured(
                    f"djlocks backend {self.alias!r} needs CACHES[{self.cache!r}] to use "
                    f"django-redis ('django_redis.cache.RedisCache'): {exc}"
                ) from exc
            except Exception as exc:  # django's InvalidCacheBackendError and friends
                raise ImproperlyConfigured(
                    f"djlocks backend {self.alias!r}: CACHES[{self.cache!r}] cannot be used: {exc}"
                ) from exc
            self._scripts = {name: client.register_script(_script_source(name)) for name in SCRIPTS}
            self._client = client
        return self._client

    def _run(self, script: str, name: str, *args: str | int) -> Any:
        """Run ``script`` on the keys of ``name``; Redis errors become ``BackendUnavailable``."""
        return self._call(script, redis_meta_key(self.prefix, name), *args)

    def _call(self, script: str, meta_key: str, *args: str | int) -> Any:
        self.redis()
        try:
            return self._scripts[script](keys=[meta_key], args=list(args))
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: RedisError) -> BackendUnavailable:
        return BackendUnavailable(
            f"djlocks backend {self.alias!r} could not use Redis (cache {self.cache!r}): "
            f"{exc} Is redis-server running and reachable at the cache's LOCATION?"
        )

    # -- acquire -----------------------------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        secret = secrets.token_hex(16)  # the grant's secret, and the waiter's id in the queue
        once = deadline is not None and time.monotonic() >= deadline
        try:
            if once:
                return self._attempt(request, secret, "try").grant
            grant = self._wait_in_queue(request, secret, deadline, abort)
        except BaseException:
            self._leave(request.name, secret)  # the outcome is unknown: clean up by token
            raise
        if grant is None:
            self._leave(request.name, secret)
        return grant

    def _wait_in_queue(
        self, request: AcquireRequest, secret: str, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        """Try; if not granted, queue and wait for a release to hand this waiter a slot,
        trying again at the soonest lease end or the poll bound (a lost message, a
        crashed holder, a cool-down).

        The wake-up is registered before the first try, so a hand-off that follows
        the queueing at once is never missed.
        """
        poll = float(djlocks_settings()["POLL_INTERVAL"])
        mode = "join"
        with (
            self._wakeups.waiting(secret) as wake,
            abort.cancelling(wake.event.set) if abort is not None else contextlib.nullcontext(),
        ):
            while True:
                attempt = self._attempt(request, secret, mode)
                if attempt.grant is not None:
                    return attempt.grant
                left = seconds_left(deadline)
                if left == 0 or (abort is not None and abort.is_set()):
                    return None
                pause = min(poll, attempt.soonest if attempt.soonest is not None else poll)
                if wake.message is None:
                    wake.event.wait(pause if left is None else min(pause, left))
                if abort is not None and abort.is_set():
                    return None
                if wake.message is not None:
                    # Handed over after this waiter's last try ran: the lease began later.
                    return _handed_grant(secret, wake.message, attempt.sent)
                wake.event.clear()
                mode = "wait"

    def _attempt(self, request: AcquireRequest, secret: str, mode: str) -> _Attempt:
        sent = time.monotonic()
        reply = self._run(
            "acquire",
            request.name,
            secret,
            request.limit,
            _ms(request.ttl),
            mode,
            _ms(float(djlocks_settings()["WAITER_TTL"])),
            self._wakeups.ensure_channel() if mode != "try" else "",
            request.name,
            _identity_json(request.identity),
        )
        status = int(reply[0])
        if status == LIMIT_MISMATCH:
            raise AlreadyHeld.limit_mismatch(request.name, int(reply[1]), request.limit)
        if status == WAITING:
            soonest = int(reply[1])
            return _Attempt(None, sent, None if soonest < 0 else soonest / 1000)
        slot, fence, expires_ms = int(reply[1]), int(reply[2]), int(reply[3])
        grant = GrantRecord(
            _token(secret, slot), slot, fence, _moment(expires_ms), requested_at=sent
        )
        return _Attempt(grant, sent)

    def _leave(self, name: str, secret: str) -> None:
        """Leave the queue and drop any grant of ``secret`` (handed over meanwhile, or
        granted by an acquire whose reply was lost)."""
        try:
            self._run("leave", name, secret)
        except BackendUnavailable as exc:
            acquire_log.warning(
                "could not leave the queue of %r (%s); the waiter record expires by itself "
                "and any grant at its TTL",
                name,
                exc,
            )

    # -- release, renew, check ---------------------------------------------

    def release(self, name: str, token: str, cooldown: float) -> None:
        secret, slot = _split_token(token)
        cooldown_ms = _ms(cooldown) if cooldown > 0 else 0
        if not self._run("release", name, secret, slot, cooldown_ms):
            raise LockLost(
                f"The grant of {name!r} had ended before release: its lease expired, it was "
                f"released by force, or Redis lost it (a restart or failover)."
            )

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        expires_ms = self._renew(name, token, _ms(ttl))
        renew_log.debug("renewed %s until %s", name, expires_ms)
        return _moment(expires_ms)

    def is_held(self, name: str, token: str) -> bool:
        """True, or ``LockLost`` saying why the grant ended (expired, forced, restart)."""
        self._renew(name, token, 0)
        return True

    def _renew(self, name: str, token: str, ttl_ms: int) -> int:
        """Renew (``ttl_ms`` 0: only check); return the new expiry (ms). Raises
        ``LockLost`` if the grant ended, ``ReleaseRequested`` while an operator asks
        for it back."""
        secret, slot = _split_token(token)
        reply = self._run("renew", name, secret, slot, ttl_ms)
        if int(reply[0]) == RELEASE_REQUESTED:
            left = int(reply[2]) / 1000
            raise ReleaseRequested(
                f"An operator asked for the grant of {name!r} back: its lease ends in "
                f"{left:.1f} s at the latest.",
                left,
                _moment(reply[1]),
            )
        if int(reply[0]) == ENDED:
            raise LockLost(
                f"The lease on {name!r} had ended: it expired, was released by force, or "
                f"Redis lost it (a restart without persistence, or a failover)."
            )
        if int(reply[0]) == RESTARTED:
            raise LockLost(
                f"Redis restarted while {name!r} was held (its run id changed); the grant "
                f"restored from disk was ended."
            )
        return int(reply[1])

    # -- introspection -----------------------------------------------------

    def _meta_keys(self) -> Iterator[str]:
        """Every name's meta key, by ``SCAN`` (never ``KEYS``: it blocks the server)."""
        try:
            for key in self.redis().scan_iter(match=f"{self.prefix}:{{*}}:m", count=SCAN_BATCH):
                yield _text(key)
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _described(self, name: str | None) -> list[Sequence[Any]]:
        """The describe script's reply for ``name``, or for every name (pipelined)."""
        if name is not None:
            return [self._run("describe", name)]
        keys = list(self._meta_keys())
        replies: list[Sequence[Any]] = []
        for start in range(0, len(keys), SCAN_BATCH):
            try:
                with self.redis().pipeline(transaction=False) as pipe:
                    for key in keys[start : start + SCAN_BATCH]:
                        self._scripts["describe"](keys=[key], client=pipe)
                    replies.extend(pipe.execute())
            except RedisError as exc:
                raise self._unavailable(exc) from exc
        return sorted(replies, key=lambda reply: _text(reply[1]))

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        holders = []
        for reply in self._described(name):
            for slot, lease, expires in reply[3]:
                secret, fence, since, identity = _text(lease).split("\n", 3)
                host, pid, thread, label = json.loads(identity.split("\n")[0])
                holders.append(
                    HolderInfo(
                        name=_text(reply[1]),
                        backend=self.alias,
                        slot=int(slot),
                        limit=int(reply[2]),
                        host=host,
                        pid=pid,
                        thread=thread,
                        label=label,
                        since=_moment(since),
                        expires_at=_moment(expires),
                        fence=int(fence),
                        token=_token(secret, int(slot)),
                    )
                )
        return holders

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        return [
            CooldownInfo(
                name=_text(reply[1]), backend=self.alias, slot=int(slot), until=_moment(until)
            )
            for reply in self._described(name)
            for slot, until in reply[4]
        ]

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        waiting = []
        for reply in self._described(name):
            for position, record in enumerate(reply[5]):
                _, since, _, identity = _text(record).split("\n", 3)
                host, pid, thread, label = json.loads(identity)
                waiting.append(
                    WaiterInfo(
                        name=_text(reply[1]),
                        backend=self.alias,
                        position=position,
                        host=host,
                        pid=pid,
                        thread=thread,
                        label=label,
                        since=_moment(since),
                    )
                )
        return waiting

    def names(self) -> list[tuple[str, int]]:
        return [(_text(reply[1]), int(reply[2])) for reply in self._described(None)]

    # -- operators' actions ------------------------------------------------

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        until = int(self._run("set_cooldown", name, slot, _ms(seconds) if seconds > 0 else 0))
        if until < 0:
            raise ValueError(f"{name!r} has no slot {slot} on backend {self.alias!r}.")
        return _moment(until) if until else None

    def force_release(self, name: str, token: str | None = None) -> int:
        """Delete the lease of ``token`` (or every lease) of ``name``; each holder is
        told at once on the revocations channel."""
        secret = _split_token(token)[0] if token else ""
        return int(self._run("force_release", name, secret, self.revocations))

    def request_release(self, name: str, token: str, wait: float) -> int:
        """Cut the lease to end ``wait`` seconds from Redis's now at the latest; renewals
        stop there and the holder is told at once (see the base class)."""
        return int(
            self._run("request_release", name, _split_token(token)[0], _ms(wait), self.revocations)
        )

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """``notice`` is called when a forced release or a graceful release's request of
        this grant is published on the revocations channel."""
        return self._revocations.watch(f"{redis_meta_key(self.prefix, name)} {fence}", notice)

    def sweep(self) -> dict[str, int]:
        """Drop dead waiters from every queue.

        Leases and cool-downs need no sweeping: Redis deletes them at their
        TTL. Such expiries leave no ``expired`` event (the key is gone before
        anyone looks); the holder records a ``lost`` event when it notices.
        """
        dead = sum(int(self._call("sweep", key)) for key in self._meta_keys())
        return {"dead waiters": dead}

    def close(self) -> None:
        self._wakeups.close()
        self._revocations.close()
