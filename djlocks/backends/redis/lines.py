"""A waiter's own line: a list its hand-off is pushed to, read on a connection of its own.

A waiter queued with no wake-up channel waits in ``BLPOP`` on its line, the key
``h:<id>`` beside its record; the release that hands it a slot pushes the grant
there, and Redis answers the waiter's blocked read at once. No listener thread
stands between the two, as one does for a pub/sub message (``wakeups``), which
the listener must pass to the waiting thread: measured on a FIFO lock reduced to
its hand-off, the relay costs about 0.15 ms of each hand-off.

Redis ends a blocked command only on its ``hz`` tick (100 ms by default), so the
line keeps the wait's end itself: it watches its socket for the seconds it was
given, then pushes an empty entry to its own line, which ends the ``BLPOP`` at
once, and reads the reply (a grant pushed just before that entry comes first).
The ``BLPOP``'s own time-out, ``SERVER_SLACK`` seconds later, ends the command
should something else arrive on the connection meanwhile (a maintenance notice of
redis-py's RESP3 connections, which its parser handles as it reads the reply). A
waiter cut short from another thread (``Abort``) is sent the same empty entry.

Each line holds a connection for its whole wait, so only a few are lent at once
(``ScriptConnections.lend``): other waiters of the process are woken through
pub/sub, one connection for them all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from djlocks.backends.redis.protocol import text
from djlocks.backends.redis.script_connections import PoolConnection, send

line_log = logging.getLogger("djlocks.acquire")

#: Seconds the server's own ``BLPOP`` time-out runs past the line's.
SERVER_SLACK = 0.2


class Line:
    """The line ``key`` of one waiter, read on ``connection`` (lent to it for the
    wait); ``client`` pushes the empty entry that ends a wait, which expires after
    ``entry_ttl_ms`` (milliseconds) if no read takes it."""

    #: A line has no pub/sub channel: its waiter's record names none.
    channel = ""

    def __init__(
        self,
        connection: PoolConnection,
        key: str,
        client: Callable[[], Redis | Any],
        entry_ttl_ms: int,
    ) -> None:
        self._connection = connection
        self._key = key
        self._client = client
        self._entry_ttl_ms = entry_ttl_ms
        #: Set when the wait is cut short: ends a failed line's wait too.
        self._cut = threading.Event()

    def wait(self, seconds: float) -> str | None:
        """The grant a release pushed to the line within ``seconds`` (exactly, whatever
        Redis's tick), or ``None``: none came, the wait was cut short, or the line's
        connection failed (logged; the rest of ``seconds`` is waited out, and the
        waiter's next attempt finds a grant handed meanwhile, or says Redis is down)."""
        connection, began = self._connection, time.monotonic()
        try:
            send(connection, ("BLPOP", self._key, f"{seconds + SERVER_SLACK:.3f}"))
            if not connection.can_read(timeout=seconds):
                self._push_empty()
            reply = connection.read_response()
        except RedisError as exc:
            connection.disconnect()  # a reply may still come: never read it as another's
            line_log.warning("the wake-up line %s failed (%s); its waiter polls", self._key, exc)
            self._cut.wait(max(0.0, seconds - (time.monotonic() - began)))
            return None
        except BaseException:
            connection.disconnect()
            raise
        return (text(reply[1]) or None) if reply else None

    def cut_short(self) -> None:
        """End the wait now (from another thread): an empty entry on the line. If Redis
        cannot be reached, the wait ends at its own time."""
        self._cut.set()
        with contextlib.suppress(RedisError):
            self._push_empty()

    def _push_empty(self) -> None:
        with self._client().pipeline() as pipeline:
            pipeline.rpush(self._key, "")
            pipeline.pexpire(self._key, self._entry_ttl_ms)
            pipeline.execute()
