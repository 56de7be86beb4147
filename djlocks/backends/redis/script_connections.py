"""Connections of the cache's pool that the lock scripts keep between calls.

redis-py's client takes a connection out of its pool and puts it back for
every command (a lock, a look at the socket, the pool's bookkeeping, its
metrics), then runs the command through its general machinery: about 900
Python bytecodes more than sending the command and reading its reply, twice per
acquire and release. The Redis backend takes a few connections out of the
pool once and keeps them on a stack of its own: a script takes one from the
top, sends ``EVALSHA``, reads the reply and puts it back. For the pool they
stay in use, so they keep its settings (address, password, TLS, time-outs,
retry policy) and count against its ``max_connections``: at most ``KEPT`` stay
with each backend between scripts, and no more than a quarter of
``max_connections``; a call that finds none kept borrows one more, given back
to the pool if enough are kept by then.

Before each script a kept connection is looked at as the pool looks at one it
hands out: one that the server closed while it sat idle (a restart, the
server's ``timeout``) or that redis-py marked for reconnecting (a maintenance
notice) connects again instead of failing; with redis-py's client-side cache or
maintenance notices on, data waiting on it is left for the next read, which
handles it (push messages). A failure is retried as the cache's own commands
retry one, by the connection's ``retry`` policy (redis-py's default for a pool
made from a URL: not at all). A call that ends in anything but a complete reply
disconnects its connection, so a late reply is never read as the next call's.

Only a plain ``Redis`` client of a pool whose connections all go to one address
(redis-py's ``ConnectionPool`` and ``BlockingConnectionPool``, which django-redis
makes from a ``redis://`` or ``rediss://`` URL) with a fixed password (no
``credential_provider``, whose tokens redis-py renews on a connection as it goes
back to the pool) is served this way (``one_address_pool``): a Sentinel pool moves
its connections to a new master, and a client's subclass may do more per command.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from redis import BlockingConnectionPool, ConnectionPool, Redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from djlocks.forksafe import fork_safe_lock

connections_log = logging.getLogger("djlocks.acquire")

if HIREDIS_AVAILABLE:
    from hiredis import pack_command

#: A connection of redis-py's pool (``redis.connection.AbstractConnection``, whose
#: methods redis-py leaves untyped).
PoolConnection = Any
#: Connections that stay with the backend between scripts, at most.
KEPT = 4
#: The pools whose connections all go to the address they were made with.
ONE_ADDRESS_POOLS = (ConnectionPool, BlockingConnectionPool)


def one_address_pool(client: object) -> ConnectionPool | None:
    """``client``'s pool if ``client`` is a plain ``Redis`` client whose pool is one of
    ``ONE_ADDRESS_POOLS`` (exactly: a subclass may route) and authenticates with a
    fixed password, else ``None``: its scripts then go through the client."""
    if type(client) is not Redis:
        return None
    pool: ConnectionPool = client.connection_pool
    if type(pool) in ONE_ADDRESS_POOLS and not pool.connection_kwargs.get("credential_provider"):
        return pool
    return None


class ScriptConnections:
    """Connections of ``pool`` (a pool of one address: see ``one_address_pool``) kept
    for the lock scripts, in this process."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        #: How many stay kept between scripts: never the pool's every connection.
        self._most = min(KEPT, pool.max_connections // 4)
        #: Whether data waiting on an idle connection means it is unusable: not where
        #: redis-py's cache or maintenance notices may push to it (the pool's own test).
        self._data_is_dirty = pool.cache is None and not _maintenance_notices(pool)
        self._guard = fork_safe_lock()
        self._kept: list[PoolConnection] = []
        #: How many connections are lent to waiters' lines (``lend``), and whether any
        #: may be: not where redis-py's client-side cache reads them its own way.
        self._lent = 0
        self._lending = pool.cache is None
        self._pid = os.getpid()
        self._closed = False

    def run_script(self, script: Script, key: str, args: Sequence[str | int]) -> Any:
        """The reply of ``script`` run on ``key`` with ``args`` (``EVALSHA``), decoded as
        the pool's connections decode. Raises redis-py's errors: ``ConnectionError``
        or ``TimeoutError`` when the server cannot be reached or does not answer,
        ``ResponseError`` when the script fails, ``AuthenticationError``."""
        connection = self._take()
        try:
            return connection.retry.call_with_retry(
                lambda: _evalsha(connection, script, key, args),
                lambda _error: connection.disconnect(),
            )
        except ResponseError:  # the whole reply was read: the connection is clean
            raise
        except BaseException:
            connection.disconnect()  # a reply may still come: never read it as another's
            raise
        finally:
            self._put_back(connection)

    def give_back(self) -> None:
        """Give every kept connection back to the pool, now and as calls end (the backend
        is closing). In a forked child, drop the parent's instead."""
        with self._guard:
            self._closed = True
            kept, self._kept = self._kept, []
            ours = self._pid == os.getpid()
        if ours:
            for connection in kept:
                self._pool.release(connection)

    def lend(self) -> PoolConnection | None:
        """A kept connection for a waiter's line (``lines``), checked, to give back with
        ``take_back``; ``None`` if none is kept now (the waiter is woken another way:
        a line never borrows from the pool), or where redis-py's client-side cache
        reads the pool's connections its own way. Lent ones count among those kept."""
        with self._guard:
            self._this_process()
            if not self._lending or self._closed or not self._kept:
                return None
            self._lent += 1
            connection = self._kept.pop()
        return self._checked(connection)

    def refused(self, error: ResponseError) -> None:
        """Redis refused a line's ``BLPOP`` (an ACL without ``@blocking``): lend no more
        connections to lines, and say so once."""
        with self._guard:
            said, self._lending = not self._lending, False
        if not said:
            connections_log.warning(
                "Redis refused a waiter's BLPOP (%s); waiters are woken through pub/sub", error
            )

    def take_back(self, connection: PoolConnection) -> None:
        """A connection ``lend`` gave, its line's wait over."""
        with self._guard:
            self._lent -= 1
        self._put_back(connection)

    def _this_process(self) -> None:
        """In a forked child, forget the parent's connections (call with the guard held):
        they are the parent's (its pool starts afresh in the child; redis-py shuts no
        socket down in a child)."""
        if self._pid != os.getpid():
            self._kept, self._lent, self._pid = [], 0, os.getpid()

    def _take(self) -> PoolConnection:
        """A kept connection, checked; else one more of the pool's (connected)."""
        with self._guard:
            self._this_process()
            connection = self._kept.pop() if self._kept else None
        if connection is None:
            return self._pool.get_connection()
        return self._checked(connection)

    def _checked(self, connection: PoolConnection) -> PoolConnection:
        """``connection``, a kept one, disconnected if it cannot be used as it is (the
        next command connects it again)."""
        if connection.is_connected and (
            _marked_for_reconnecting(connection)
            or _closed_or_unread(connection, self._data_is_dirty)
        ):
            connection.disconnect()
        return connection

    def _put_back(self, connection: PoolConnection) -> None:
        with self._guard:
            keep = not self._closed and len(self._kept) + self._lent < self._most
            if keep:
                self._kept.append(connection)
        if not keep:
            self._pool.release(connection)


def _maintenance_notices(pool: ConnectionPool) -> bool:
    """Whether redis-py may push maintenance notices to ``pool``'s connections (its
    ``maint_notifications_enabled``, redis-py 7 and later)."""
    enabled = getattr(pool, "maint_notifications_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _marked_for_reconnecting(connection: PoolConnection) -> bool:
    """Whether redis-py asked ``connection`` to connect again (``should_reconnect``, set
    by a maintenance notice, redis-py 7 and later)."""
    marked = getattr(connection, "should_reconnect", None)
    return bool(marked()) if marked is not None else False


def _closed_or_unread(connection: PoolConnection, data_is_dirty: bool) -> bool:
    """Whether the server closed ``connection``, or (``data_is_dirty``) left something
    on it: no reply is due between two calls."""
    try:
        return bool(connection.can_read()) and data_is_dirty
    except (RedisConnectionError, RedisTimeoutError, OSError):  # the parser saw the close
        return True


def _evalsha(
    connection: PoolConnection, script: Script, key: str, args: Sequence[str | int]
) -> Any:
    """``EVALSHA`` of ``script``; where the server no longer has it (a restart, ``SCRIPT
    FLUSH``), ``SCRIPT LOAD`` and run it again, as redis-py's ``Script`` does."""
    send(connection, ("EVALSHA", script.sha, 1, key, *args))
    try:
        return connection.read_response()
    except NoScriptError:
        connection.send_command("SCRIPT", "LOAD", script.script)
        connection.read_response()
        send(connection, ("EVALSHA", script.sha, 1, key, *args))
        return connection.read_response()


def send(connection: PoolConnection, command: tuple[str | int, ...]) -> None:
    """Send ``command``, packed by hiredis where redis-py packs with it (what redis-py's
    ``send_command`` does, less its Python pass over the arguments, which lets bytes-like
    values other than ``bytes`` through: a script's arguments are ``str`` and ``int``)."""
    if HIREDIS_AVAILABLE:
        connection.send_packed_command([pack_command(command)])  # type: ignore[arg-type]
    else:
        connection.send_command(*command)
