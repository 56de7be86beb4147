"""A waiter's own line: a list its hand-off is pushed to, read on a connection of its own.

A waiter queued with no wake-up channel waits in ``BLPOP`` on its line, the key
``h:<id>`` beside its record; the release that hands it a slot pushes the grant
there, and Redis answers the waiter's blocked read at once. No listener thread
stands between the two, as one does for a pub/sub message (``wakeups``), which
the listener must pass to the waiting thread: measured on a FIFO lock reduced to
its hand-off, that relay costs about 0.15 ms of each hand-off.

Redis ends a blocked command's time-out only on its ``hz`` tick (100 ms by
default). A poll may end that late; a wait that must end on time (the caller's
deadline, a lease or cool-down about to end) watches its socket for its seconds
and then closes its connection, which ends the ``BLPOP`` in the server. A grant
pushed in that instant is not lost: the release wrote it in the waiter's record
too, where the waiter's next attempt finds it, or its leaving hands it on.

A wait cut short from another thread (``Abort``, e.g. an ``asyncio`` task's
cancellation) shuts the line's socket down, which ends the read at once and
sends nothing: the thread that cancels may be an event loop's, which must not
wait for Redis.

Each line holds one of the backend's kept connections for its whole wait
(``ScriptConnections.lend``); a waiter that finds none kept is woken through
pub/sub, one connection for all of a process's waiters.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from djlocks.backends.redis.protocol import text
from djlocks.backends.redis.script_connections import PoolConnection, send

line_log = logging.getLogger("djlocks.acquire")

#: Seconds past a poll's end that Redis may take to end its ``BLPOP`` (its tick).
TICK = 0.11
#: The least ``BLPOP`` time-out sent, in seconds (0 would block for good).
SHORTEST = 0.001


class Line:
    """The line ``key`` of one waiter, read on ``connection`` (lent to it for the wait)."""

    #: A line has no pub/sub channel: its waiter's record names none.
    channel = ""

    def __init__(
        self, connection: PoolConnection, key: str, refused: Callable[[ResponseError], None]
    ) -> None:
        self._connection = connection
        self._key = key
        #: Told when Redis refuses ``BLPOP`` itself (an ACL without ``@blocking``).
        self._refused = refused
        #: Set when the wait is cut short; ``_reading`` while a read may be blocked.
        self._cut = threading.Event()
        self._reading = False
        self._guard = threading.Lock()

    def wait(self, seconds: float, exact: bool) -> str | None:
        """The grant a release pushed to the line within ``seconds``, or ``None``: none
        came, the wait was cut short, or the line's connection failed (logged; the
        waiter's next attempt finds a grant handed meanwhile, or says Redis is down).
        ``exact``: end on time, not on Redis's next tick."""
        connection, began = self._connection, time.monotonic()
        with self._guard:
            if self._cut.is_set():
                return None
            self._reading = True
        try:
            send(connection, ("BLPOP", self._key, f"{max(seconds, SHORTEST):.3f}"))
            came = connection.can_read(timeout=seconds) or (
                not exact and connection.can_read(timeout=TICK)
            )
            reply = connection.read_response() if came else None
            if not came:
                connection.disconnect()  # ends the BLPOP: its reply is never read
        except ResponseError as exc:  # the whole reply was read: the connection is clean
            self._refused(exc)
            self._wait_out(seconds, began)
            return None
        except RedisError as exc:
            connection.disconnect()  # a reply may still come: never read it as another's
            if not self._cut.is_set():
                line_log.warning("wake-up line %s failed (%s); its waiter polls", self._key, exc)
                self._wait_out(seconds, began)
            return None
        except BaseException:
            connection.disconnect()
            raise
        finally:
            with self._guard:
                self._reading = False
        return (text(reply[1]) or None) if reply else None

    def _wait_out(self, seconds: float, began: float) -> None:
        """Sleep out the rest of a wait of ``seconds`` that began at ``began``
        (``time.monotonic()``), unless it is cut short: the line could not serve it."""
        self._cut.wait(max(0.0, seconds - (time.monotonic() - began)))

    def cut_short(self) -> None:
        """End the wait now, from another thread, without a word to Redis: the line's
        socket is shut down (redis-py's ``_sock``), which ends a read at once."""
        self._cut.set()
        with self._guard:
            if not self._reading:
                return
            sock = getattr(self._connection, "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):  # closed by the waiter meanwhile
                    sock.shutdown(socket.SHUT_RDWR)
