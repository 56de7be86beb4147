"""Wake-ups for the Redis backend's waiters that have no line of their own
(``lines``): one pub/sub subscription per process.

A waiter's record in Redis names this process's channel; when a release
hands a waiter a slot, the releasing script publishes the waiter's id and the
grant there, and the listener thread gives the grant to that waiter's
``Wake`` and sets its event. Waiting on a local event keeps every
time-out exact (Redis times out blocked commands only on its ``hz`` tick,
100 ms by default) and costs one connection per process, however many wait.

A wake-up is a hint: waiters also poll, so a message lost while the
subscription reconnects delays a waiter by one poll, never strands it.
The thread stops by itself after ``IDLE_STOP`` seconds without a waiter.

On a Redis Cluster a script's ``PUBLISH`` reaches the subscribers of its own
master at once and those of other nodes through the cluster bus, where a
message can wait tens of milliseconds (measured: up to 40 ms, against under
1 ms on the same node). So the listener subscribes at every master it knows
when it starts, one thread each, and a waiter hears the first copy to arrive
(the bus's later copies find no waiter and are dropped). Masters promoted
later are heard through the bus, as are all of them while a master's own
subscription reconnects. A copy that arrives after its waiter went on finds
no waiter, or a waiter that ignores it (``RedisBackend._confirmed``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from redis import Redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from djlocks.backends.redis.nodes import servers
from djlocks.forksafe import fork_safe_lock

wakeup_log = logging.getLogger("djlocks.acquire")

IDLE_STOP = 30.0  # seconds without a waiter before the listener unsubscribes and ends
LISTEN_SLICE = 0.25  # seconds the listener blocks on its socket between checks
SUBSCRIBE_WAIT = 1.0  # seconds a first waiter waits for the subscription to be confirmed
RECONNECT_PAUSE = 0.2  # seconds between attempts while Redis cannot be reached


class Wake:
    """What a waiting thread waits on: ``event`` is set when ``message`` arrives on
    ``channel`` (or to cut the wait short, e.g. on cancellation)."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.event = threading.Event()
        self.message: str | None = None

    def wait(self, seconds: float, exact: bool = True) -> str | None:
        """The message that came, waiting up to ``seconds`` for one (always exactly,
        whatever ``exact``); ``None`` if none came (or the wait was cut short)."""
        if self.message is None:
            self.event.wait(seconds)
        message, self.message = self.message, None
        self.event.clear()
        return message

    def cut_short(self) -> None:
        """End the wait now (from another thread)."""
        self.event.set()


class _Run:
    """One run of the listener: its stop flag (set once, for every thread of the run),
    whether its first subscription is live, its thread and, on a cluster, the threads
    listening at the other masters."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.subscribed = threading.Event()
        self.thread: threading.Thread | None = None
        self.at_other_masters: list[threading.Thread] = []

    def end(self) -> list[threading.Thread]:
        """Tell every thread of the run to end; return them, to join."""
        self.stop.set()
        return [thread for thread in (self.thread, *self.at_other_masters) if thread]


class WakeListener:
    """Delivers wake-ups published to this process's channel to waiting threads."""

    def __init__(self, client: Callable[[], Redis | RedisCluster], prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._guard = fork_safe_lock()
        self._waiting: dict[str, Wake] = {}
        self._run: _Run | None = None
        self._pid = 0
        self.channel = ""

    @contextlib.contextmanager
    def waiting(self, waiter_id: str) -> Iterator[Wake]:
        """The ``Wake`` of ``waiter_id`` while the block runs (the listener runs meanwhile)."""
        with self._guard:
            run = self._running()  # first, as it forgets the waiters of another process
            wake = self._waiting[waiter_id] = Wake(self.channel)
        run.subscribed.wait(SUBSCRIBE_WAIT)
        try:
            yield wake
        finally:
            with self._guard:
                self._waiting.pop(waiter_id, None)

    def _reset_for_this_process(self) -> None:
        """A new process (first use, or a fork): the parent's thread did not come along."""
        self._pid = os.getpid()
        self.channel = f"{self._prefix}:wake:{socket.gethostname()}:{self._pid}:" + (
            secrets.token_hex(4)
        )
        self._run = None
        self._waiting.clear()

    def _running(self) -> _Run:
        """The live listener run, started if there is none (call with the guard held)."""
        if self._pid != os.getpid():
            self._reset_for_this_process()
        run = self._run
        if run is None or run.stop.is_set() or run.thread is None or not run.thread.is_alive():
            if run is not None:
                run.end()  # its first thread died: the others end too
            run = self._run = _Run()
            run.thread = threading.Thread(
                target=self._listen, args=(run,), name="djlocks-redis-wakeups", daemon=True
            )
            run.thread.start()
        return run

    def close(self) -> None:
        """Unsubscribe and end the listener thread (``backends.reset()``)."""
        with self._guard:
            run, self._run = self._run, None
        if run is not None:
            for thread in run.end():
                thread.join(LISTEN_SLICE * 4)

    def _idle_too_long(self, run: _Run, idle_since: float | None) -> tuple[bool, float | None]:
        """Whether ``run`` should end: it was replaced or closed, or has had no waiter for
        ``IDLE_STOP`` seconds (then it ends for every thread); the idle start, updated."""
        with self._guard:
            if self._run is not run:
                run.stop.set()
                return True, idle_since
            if self._waiting:
                return False, None
            now = time.monotonic()
            if idle_since is None:
                return False, now
            if now - idle_since < IDLE_STOP:
                return False, idle_since
            self._run = None
            run.stop.set()
            return True, idle_since

    def _resubscriber(self, where: str, pubsub: Any) -> Any:
        """After ``pubsub``, listening at ``where``, failed: the pub/sub to try next. A
        server's is reset and reconnects to it. On a cluster, a new one at that master
        if it still is one, else (it failed over) on a node the cluster's client picks
        now; the same one again if the cluster cannot be asked."""
        try:
            client = self._client()
            if not isinstance(client, RedisCluster):
                pubsub.reset()
                return pubsub
            master = servers(client).get(where)
            fresh = (master or client).pubsub()  # type: ignore[no-untyped-call]
        except (RedisError, RedisClusterException):
            return pubsub
        with contextlib.suppress(RedisError, RedisClusterException):
            pubsub.close()
        return fresh

    def _listen(self, run: _Run) -> None:
        """The listener's thread: listens at the first server ``servers`` gives (on a
        cluster, a master), and starts a thread for each other. Where the client cannot
        be had, the run ends and its waiters poll: a backend that is misconfigured
        (``ImproperlyConfigured``) says so in the caller's thread, which builds the same
        client; a cluster that cannot be reached is logged."""
        try:
            first, *others = servers(self._client()).items()
        except ImproperlyConfigured:
            run.stop.set()
            return
        except (RedisError, RedisClusterException) as exc:
            wakeup_log.warning("cannot listen for wake-ups (%s); waiters poll meanwhile", exc)
            run.stop.set()
            return
        for where, server in others:
            thread = threading.Thread(
                target=self._listen_on,
                args=(run, where, server.pubsub()),  # type: ignore[no-untyped-call]
                name=f"djlocks-redis-wakeups {where}",
                daemon=True,
            )
            run.at_other_masters.append(thread)
            thread.start()
        where, server = first
        self._listen_on(run, where, server.pubsub(), first=True)  # type: ignore[no-untyped-call]

    def _listen_on(self, run: _Run, where: str, pubsub: Any, first: bool = False) -> None:
        """Listen at ``where`` until ``run`` ends; the ``first`` thread's subscription is
        the one new waiters wait for (``SUBSCRIBE_WAIT``)."""
        idle_since: float | None = None
        try:
            while not run.stop.is_set():
                stop, idle_since = self._idle_too_long(run, idle_since)
                if stop:
                    return
                try:
                    if not pubsub.subscribed:
                        pubsub.subscribe(self.channel)
                    message = pubsub.get_message(timeout=LISTEN_SLICE)
                except (RedisError, RedisClusterException) as exc:
                    if first:
                        run.subscribed.clear()
                    if run.stop.is_set():
                        return
                    wakeup_log.warning(
                        "wake-up subscription at %s lost (%s); waiters poll meanwhile", where, exc
                    )
                    pubsub = self._resubscriber(where, pubsub)
                    run.stop.wait(RECONNECT_PAUSE)
                    continue
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    if first:
                        run.subscribed.set()
                elif message["type"] == "message":
                    waiter_id, _, payload = message["data"].decode().partition("\n")
                    with self._guard:
                        wake = self._waiting.get(waiter_id)
                    if wake is not None:
                        wake.message = payload
                        wake.event.set()
        finally:
            if first:
                run.subscribed.clear()
            with contextlib.suppress(RedisError, RedisClusterException):
                pubsub.close()
