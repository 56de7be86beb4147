"""Revocation notices a store pushes to the process that holds a grant.

A forced release, and a graceful release's request, publish the grant's key
(its name's key and its fence) where the store can push: PostgreSQL
``NOTIFY``, Redis pub/sub. One listener thread per process and store hands
each notice to the heartbeat of the grant it names (``LockBackend.watch``),
which renews that grant at once and so learns what happened. A notice is
only a hint: a lost one (while the listener reconnects, or before it first
listened) costs the holder the wait for its next renewal, never more. The
thread stops by itself after ``IDLE_STOP`` seconds without a watched grant.

A session lock needs no message: a forced release kills the holder's server
session, and ``ClosedSockets`` notices the server hanging up that connection.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from djlocks.forksafe import fork_safe_lock
from djlocks.own_thread import OwnThread

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

push_log = logging.getLogger("djlocks.renew")

IDLE_STOP = 30.0  # seconds without a watched grant before the listener stops
LISTEN_SLICE = 0.05  # seconds the listener blocks on its connection between checks
READY_WAIT = 1.0  # seconds a first watch waits for the listener to be listening
RECONNECT_PAUSE = 0.2  # seconds between attempts while the store cannot be reached


class Run:
    """One run of a listener thread: its stop flag, and whether it is listening now."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.idle_since: float | None = None
        self.thread: threading.Thread | None = None


class PushListener(ABC):
    """Calls a watched grant's notice when its key arrives from the store (see the module)."""

    #: The listener thread's name.
    thread_name = "djlocks-revocations"

    def __init__(self) -> None:
        self._guard = fork_safe_lock()
        self._watching: dict[str, Callable[[], None]] = {}
        self._run: Run | None = None
        self._pid = os.getpid()

    def watch(self, key: str, notice: Callable[[], None]) -> Callable[[], None]:
        """Call ``notice()`` when ``key`` arrives; return the function that ends the watch.

        A watch that starts the thread waits (``READY_WAIT`` seconds at most)
        until it listens, so that a revocation sent once the grant was handed out
        is heard; later watches never wait, not even while the thread reconnects.
        """
        with self._guard:
            if self._pid != os.getpid():  # a forked child: the parent's thread stayed there
                self._pid, self._run = os.getpid(), None
                self._watching.clear()
            self._watching[key] = notice
            started = self._run
            run = self._running()
        if run is not started:
            run.ready.wait(READY_WAIT)
        return functools.partial(self._unwatch, key, notice)

    def _unwatch(self, key: str, notice: Callable[[], None]) -> None:
        with self._guard:
            if self._watching.get(key) is notice:
                del self._watching[key]

    def deliver(self, key: str) -> None:
        """Called by the listener with a key the store pushed: tell its watcher, if any."""
        with self._guard:
            notice = self._watching.get(key)
        if notice is not None:
            notice()

    def close(self) -> None:
        """Stop listening and end the thread (``backends.reset()``)."""
        with self._guard:
            run, self._run = self._run, None
        if run is not None and run.thread is not None and run.thread.is_alive():
            run.stop.set()
            run.thread.join(LISTEN_SLICE * 4)

    def _running(self) -> Run:
        """The live run, started if there is none (call with the guard held)."""
        run = self._run
        if run is None or run.thread is None or not run.thread.is_alive():
            run = self._run = Run()
            run.thread = threading.Thread(
                target=self._serve, args=(run,), name=self.thread_name, daemon=True
            )
            run.thread.start()
        return run

    def keep_going(self, run: Run) -> bool:
        """False once ``run`` was stopped or has had nothing to watch for ``IDLE_STOP`` s."""
        with self._guard:
            if run.stop.is_set():
                return False
            if self._watching:
                run.idle_since = None
                return True
            now = time.monotonic()
            if run.idle_since is None:
                run.idle_since = now
            if now - run.idle_since < IDLE_STOP:
                return True
            if self._run is run:
                self._run = None
            return False

    def _serve(self, run: Run) -> None:
        failing = False
        while self.keep_going(run):
            try:
                self.listen(run)
            except Exception as exc:  # the store went away: listen again when it is back
                if self._stop_if_idle(run):
                    return  # e.g. Django closed it to drop a test database: stay away
                log = push_log.debug if failing else push_log.warning
                log("revocation listener lost its connection (%s); renewals tell meanwhile", exc)
                failing = True
                run.stop.wait(RECONNECT_PAUSE)
            else:
                failing = False
            finally:
                run.ready.clear()

    def _stop_if_idle(self, run: Run) -> bool:
        """End ``run`` if nothing is watched: True if it did."""
        with self._guard:
            if self._watching:
                return False
            if self._run is run:
                self._run = None
            return True

    @abstractmethod
    def listen(self, run: Run) -> None:
        """Connect, subscribe, set ``run.ready``, then hand every key that arrives to
        ``deliver`` until ``keep_going(run)`` is False (checked every ``LISTEN_SLICE``
        seconds at most). Raises what the store's client raises when it fails."""


class PostgresListener(PushListener):
    """``LISTEN channel`` on a connection of its own to the database alias ``using``;
    each notification's payload is a key."""

    def __init__(self, using: str, channel: str) -> None:
        super().__init__()
        self.using, self.channel = using, channel

    def listen(self, run: Run) -> None:
        from djlocks.backends.dedicated import DedicatedConnections
        from djlocks.backends.sql import postgresql

        wrapper = DedicatedConnections.new_wrapper(self.using)
        try:
            wrapper.ensure_connection()  # Django's connections are in autocommit
            connection = wrapper.connection
            connection.execute(f"LISTEN {self.channel}")
            run.ready.set()
            while self.keep_going(run):
                for note in postgresql.notifications(connection, LISTEN_SLICE):
                    self.deliver(note.payload)
        finally:
            wrapper.close()


class RedisListener(PushListener):
    """``SUBSCRIBE channel`` on a connection of its own to the server of the client
    ``client()`` returns (never one of its pool's, which other calls use; a cluster's
    pub/sub opens its own), made anew at each ``listen``; each message is a key."""

    def __init__(self, client: Callable[[], Redis | RedisCluster], channel: str) -> None:
        super().__init__()
        self.client, self.channel = client, channel

    def listen(self, run: Run) -> None:
        from redis import ConnectionPool, Redis

        client, own = self.client(), None
        if isinstance(client, Redis):
            pool = client.connection_pool
            own = ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
            client = Redis(connection_pool=own)
        pubsub = client.pubsub()  # type: ignore[no-untyped-call]  # a cluster's has its own
        try:
            pubsub.subscribe(self.channel)
            while self.keep_going(run):
                message = pubsub.get_message(timeout=LISTEN_SLICE)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    run.ready.set()
                elif message["type"] == "message":
                    self.deliver(message["data"].decode())
        finally:
            pubsub.close()
            if own is not None:
                own.disconnect()


def hung_up(socket: int) -> bool:
    """Whether the peer of the socket ``socket`` (a file descriptor) hung up, or the socket
    is closed: one ``poll`` that does not wait and reads nothing. ``False`` where
    ``POLLRDHUP`` is missing (not Linux)."""
    if not ClosedSockets.supported:
        return False
    poller = select.poll()
    poller.register(socket, ClosedSockets.HANG_UP | select.POLLERR)
    return bool(poller.poll(0))


class ClosedSockets:
    """Tells when a server closes a watched connection (a session lock's, which a
    forced release kills): one thread per process polls the watched sockets for the
    peer's hang-up (``POLLRDHUP``, ``POLLHUP``, ``POLLERR``), never for data, which
    every keep-alive's reply brings. Each watch fires once, at the first such event
    (or when its socket was closed meanwhile), and then ends: the renewal it asks
    for finds out what happened. The thread takes up new watches at its next poll,
    within ``LISTEN_SLICE`` seconds, so a grant's watch costs it no system call and
    no wake-up. The thread stops after ``IDLE_STOP`` idle seconds. Linux only
    (``POLLRDHUP``): elsewhere ``supported`` is False.
    """

    supported = hasattr(select, "POLLRDHUP")
    HANG_UP = getattr(select, "POLLRDHUP", 0) | getattr(select, "POLLHUP", 0)

    def __init__(self) -> None:
        self._guard = fork_safe_lock()
        self._watching: dict[str, tuple[int, Callable[[], None]]] = {}
        self._pid = 0
        self._own = self._new_thread()

    def _new_thread(self) -> OwnThread:
        return OwnThread(self._guard, self._poll_until_idle, "djlocks-session-watch")

    def watch(self, key: str, socket: int, notice: Callable[[], None]) -> Callable[[], None]:
        """Call ``notice()`` once when the peer of the socket ``socket`` (a file
        descriptor) hangs up; return the function that ends the watch. A watch still on
        the socket when it is closed fires once (``poll`` reports the closed descriptor,
        or a new socket given the same number hangs up later): ``notice`` must expect a
        call after its grant's release (the heartbeat's ignores it)."""
        with self._guard:
            if self._pid != os.getpid():  # first use, or a forked child
                self._pid, self._own = os.getpid(), self._new_thread()
                self._watching.clear()
            self._watching[key] = (socket, notice)
            self._own.start_unless_running()
        return functools.partial(self._unwatch, key, notice)

    def _unwatch(self, key: str, notice: Callable[[], None]) -> None:
        with self._guard:
            if self._watching.get(key, (0, None))[1] is notice:
                del self._watching[key]

    def _poll_until_idle(self) -> None:
        idle_since: float | None = None
        while True:
            with self._guard:
                sockets = {fd: key for key, (fd, _) in self._watching.items()}
                if sockets:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= IDLE_STOP:
                    self._own.ending()  # in the guard: a watch from now on starts a thread
                    return
            poller = select.poll()
            for fd in sockets:
                poller.register(fd, self.HANG_UP | select.POLLERR)
            for fd, _ in poller.poll(LISTEN_SLICE * 1000):
                if fd in sockets:
                    self._fire(sockets[fd], fd)

    def _fire(self, key: str, socket: int) -> None:
        with self._guard:
            watched = self._watching.get(key)
            if watched is None or watched[0] != socket:
                return
            del self._watching[key]
        watched[1]()
