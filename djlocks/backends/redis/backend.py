"""``RedisBackend``: acquire, release, renew and revoke Redis leases (see the package)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

from djlocks.backends.base import AcquireRequest, Capabilities, GrantRecord
from djlocks.backends.redis.inspection import RedisInspection
from djlocks.backends.redis.lines import Line
from djlocks.backends.redis.protocol import (
    ENDED,
    LIMIT_MISMATCH,
    RELEASE_REQUESTED,
    RESTARTED,
    WAITING,
    Attempt,
    handed_grant,
    identity_json,
    moment,
    ms,
    split_token,
    token_of,
)
from djlocks.backends.redis.wakeups import Wake
from djlocks.backends.waiting import Abort, seconds_left
from djlocks.conf import djlocks_settings
from djlocks.exceptions import AlreadyHeld, BackendUnavailable, LockLost, ReleaseRequested
from djlocks.keys import redis_key, redis_meta_key
from djlocks.moments import project_moment
from djlocks.recent import CONTENDED_FOR, Recent

acquire_log = logging.getLogger("djlocks.acquire")
renew_log = logging.getLogger("djlocks.renew")


class RedisBackend(RedisInspection):
    """Locks and semaphores as Redis leases, on a django-redis cache's connection or a
    Redis Cluster's.

    OPTIONS: ``cache`` (a ``CACHES`` alias whose backend is django-redis,
    default ``"default"``) or ``cluster`` (a Redis Cluster node's URL), ``prefix``
    (key prefix, default ``DJLOCKS["KEY_PREFIX"]``), ``wait_replicas`` and
    ``wait_timeout`` (replicas that must acknowledge each grant and renewal, Redis
    ``WAIT``: see ``replicas``). Crash release: at the TTL.
    Waiters queue FIFO in Redis and are woken on lines of their own (``lines``) or
    through pub/sub (``wakeups``), with a bounded poll.
    An acquire first tries, without queueing or listening for a wake-up, unless a try
    of this process found the name taken in the last ``CONTENDED_FOR`` seconds.
    """

    forced_release_effect = (
        "its lease key is deleted at once and the next holder gets a higher fence, so the "
        "old holder's fenced writes are refused; the old holder hears of it at once "
        "(pub/sub), or at its next renewal or check if that message is lost"
    )

    capabilities = Capabilities(
        fifo=True,
        semaphores=True,
        cooldowns=True,
        crash_release="ttl",
        history=True,
        graceful_release=True,
        pushes_revocation=True,
        shared_between_processes=True,
    )

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        #: Names a try found taken lately: their acquires queue at once (``acquire``).
        self._contended = Recent(CONTENDED_FOR)

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        secret = secrets.token_hex(16)  # the grant's secret, and the waiter's id in the queue
        once = deadline is not None and time.monotonic() >= deadline
        try:
            if once or request.name not in self._contended:
                # A try neither queues nor listens for a wake-up (nor overtakes a waiter).
                grant = self._attempt(request, secret, "try").grant
                if grant is not None or once:
                    return grant
                self._contended.add(request.name)
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
            self._woken(request.name, secret) as wake,
            abort.cancelling(wake.cut_short) if abort is not None else contextlib.nullcontext(),
        ):
            while True:
                attempt = self._attempt(request, secret, mode, wake.channel)
                if attempt.grant is not None:
                    return attempt.grant
                left = seconds_left(deadline)
                if left == 0 or (abort is not None and abort.is_set()):
                    return None
                pause = min(poll, attempt.soonest if attempt.soonest is not None else poll)
                wait = pause if left is None else min(pause, left)
                # A poll may end late (a line's, on Redis's tick); a deadline or an end due
                # sooner may not.
                message = wake.wait(wait, exact=wait < poll)
                if abort is not None and abort.is_set():
                    return None
                if message is not None:
                    # Handed over after this waiter's last try ran: the lease began later.
                    handed = self._confirmed(request, handed_grant(secret, message, attempt.sent))
                    if handed is not None:
                        return handed
                mode = "wait"

    @contextlib.contextmanager
    def _woken(self, name: str, secret: str) -> Iterator[Line | Wake]:
        """How the waiter ``secret`` of ``name`` hears of its hand-off while the block
        runs: its own line where a connection can be lent to it (``lines``), else this
        process's pub/sub channel (``wakeups``)."""
        self.redis()  # after close(), the kept connections start again with the client
        kept = self._script_connections
        lent = kept.lend() if kept is not None else None
        if kept is None or lent is None:
            with self._wakeups.waiting(secret) as wake:
                yield wake
            return
        try:
            yield Line(lent, redis_key(self.prefix, name, f"h:{secret}"), kept.refused)
        finally:
            kept.take_back(lent)

    def _confirmed(self, request: AcquireRequest, handed: GrantRecord) -> GrantRecord | None:
        """``handed``, a grant a release made, once ``wait_replicas`` replicas have it:
        a renewal, sent with ``WAIT``, covers the release's writes too (a replica
        applies them in order). ``None`` if the lease ended before it was confirmed.
        Raises ``BackendUnavailable`` when too few replicas acknowledged it."""
        if not self.acknowledgement:
            return handed
        try:
            expires_ms = self._renew(request.name, handed.token, ms(request.ttl), "the hand-off")
        except ReleaseRequested:
            raise  # an operator wants it back already: acquire() gives it back
        except LockLost:
            return None
        return dataclasses.replace(handed, expires_at=moment(expires_ms))

    def _attempt(
        self, request: AcquireRequest, secret: str, mode: str, channel: str = ""
    ) -> Attempt:
        """One acquire script in ``mode`` (``try``, ``join``, ``wait``); a queued waiter
        is woken on ``channel``, or on its line where that is empty."""
        sent = time.monotonic()
        reply, acknowledged = self._run_acknowledged(
            "acquire",
            request.name,
            secret,
            request.limit,
            ms(request.ttl),
            mode,
            ms(float(djlocks_settings()["WAITER_TTL"])),
            channel,
            request.name,
            identity_json(request.identity),
        )
        status = int(reply[0])
        if status == LIMIT_MISMATCH:
            raise AlreadyHeld.limit_mismatch(request.name, int(reply[1]), request.limit)
        if status == WAITING:
            soonest = int(reply[1])
            return Attempt(None, sent, None if soonest < 0 else soonest / 1000)
        if error := self.unacknowledged(f"the grant of {request.name!r}", acknowledged):
            raise error  # acquire() gives the grant back
        slot, fence, expires_ms = int(reply[1]), int(reply[2]), int(reply[3])
        grant = GrantRecord(
            token_of(secret, slot), slot, fence, moment(expires_ms), requested_at=sent
        )
        return Attempt(grant, sent)

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

    def release(self, name: str, token: str, cooldown: float) -> None:
        secret, slot = split_token(token)
        cooldown_ms = ms(cooldown) if cooldown > 0 else 0
        if not self._run("release", name, secret, slot, cooldown_ms):
            raise LockLost(
                f"The grant of {name!r} had ended before release: its lease expired, it was "
                f"released by force, or Redis lost it (a restart or failover)."
            )

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        expires_ms = self._renew(name, token, ms(ttl))
        renew_log.debug("renewed %s until %s", name, expires_ms)
        return moment(expires_ms)

    def is_held(self, name: str, token: str) -> bool:
        """True, or ``LockLost`` saying why the grant ended (expired, forced, restart)."""
        self._renew(name, token, 0)
        return True

    def _renew(self, name: str, token: str, ttl_ms: int, what: str = "the renewal") -> int:
        """Renew (``ttl_ms`` 0: only check); return the new expiry (ms). Raises
        ``LockLost`` if the grant ended, ``ReleaseRequested`` while an operator asks
        for it back, ``BackendUnavailable`` if fewer replicas than ``wait_replicas``
        acknowledged a renewal (the heartbeat retries it; the holder's belief runs
        from the last acknowledged one)."""
        secret, slot = split_token(token)
        if ttl_ms:
            reply, acknowledged = self._run_acknowledged("renew", name, secret, slot, ttl_ms)
        else:  # a check writes nothing: there is nothing for replicas to acknowledge
            reply = self._run("renew", name, secret, slot, ttl_ms)
            acknowledged = self.acknowledgement.replicas
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
        if error := self.unacknowledged(f"{what} of {name!r}", acknowledged):
            raise error  # before a request for release, which would count it as renewed
        if int(reply[0]) == RELEASE_REQUESTED:
            left = int(reply[2]) / 1000
            raise ReleaseRequested(
                f"An operator asked for the grant of {name!r} back: its lease ends in "
                f"{left:.1f} s at the latest.",
                left,
                moment(reply[1]),
            )
        return int(reply[1])

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        until = int(self._run("set_cooldown", name, slot, ms(seconds) if seconds > 0 else 0))
        if until < 0:
            raise ValueError(f"{name!r} has no slot {slot} on backend {self.alias!r}.")
        return project_moment(moment(until)) if until else None

    def force_release(self, name: str, token: str | None = None) -> int:
        """Delete the lease of ``token`` (or every lease) of ``name``; each holder is
        told at once on the revocations channel."""
        secret = split_token(token)[0] if token else ""
        return int(self._run("force_release", name, secret, self.revocations))

    def request_release(self, name: str, token: str, wait: float) -> int:
        """Cut the lease to end ``wait`` seconds from Redis's now at the latest; renewals
        stop there and the holder is told at once (see the base class)."""
        return int(
            self._run("request_release", name, split_token(token)[0], ms(wait), self.revocations)
        )

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """``notice`` is called when a forced release or a graceful release's request of
        this grant is published on the revocations channel."""
        return self._revocations.watch(f"{redis_meta_key(self.prefix, name)} {fence}", notice)

    def close(self) -> None:
        self._wakeups.close()
        self._revocations.close()
        self.close_client()
