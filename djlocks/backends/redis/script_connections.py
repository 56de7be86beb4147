"""Connections of the cache's pool that the lock scripts keep between calls.

redis-py's client takes a connection out of its pool and puts it back for
every command (a lock, a look at the socket, the pool's bookkeeping, its
metrics), then runs the command through its general machinery: about 900
Python bytecodes more than sending the command and reading its reply, twice per
acquire and release. The Redis backend takes a few connections out of the
pool once and keeps them on a stack of its own: a script takes one from the
top, sends ``EVALSHA``, reads the reply and puts it back. For the pool they
stay in use, so they keep its settings (address, password, TLS, time-outs,
retry policy) and its handling of a server's maintenance notices, and count
against its ``max_connections``: at most ``KEPT`` stay with the backend between
scripts, and a call that finds none kept borrows one more (given back to the
pool if ``KEPT`` are kept again by then).

As the pool does at each checkout, a kept connection is looked at before use: one
that the server closed while it sat idle (a restart, the server's ``timeout``)
connects again instead of failing. A failure is retried as the cache's own
commands retry one, by the connection's ``retry`` policy (redis-py's default
for a pool made from a URL: not at all). A call that ends in anything but a
complete reply disconnects its connection, so a late reply is never read as the
next call's.

Only a plain ``Redis`` client of a pool whose connections all go to one address
(redis-py's ``ConnectionPool`` and ``BlockingConnectionPool``, which django-redis
makes from a ``redis://`` or ``rediss://`` URL) is served this way
(``one_address_pool``): a Sentinel pool moves its connections to a new master,
and a client's subclass may do more per command.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis import BlockingConnectionPool, ConnectionPool, Redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: A connection of redis-py's pool (``redis.connection.PoolConnection``, whose
#: methods redis-py leaves untyped).
PoolConnection = Any
#: Connections that stay with the backend between scripts, at most.
KEPT = 4
#: The pools whose connections all go to the address they were made with.
ONE_ADDRESS_POOLS = (ConnectionPool, BlockingConnectionPool)


def one_address_pool(client: object) -> ConnectionPool | None:
    """``client``'s pool if ``client`` is a plain ``Redis`` client whose pool is one of
    ``ONE_ADDRESS_POOLS`` (exactly: a subclass may route), else ``None``: its scripts
    then go through the client."""
    pool = getattr(client, "connection_pool", None)
    if type(client) is Redis and type(pool) in ONE_ADDRESS_POOLS:
        return pool
    return None


class ScriptConnections:
    """Connections of ``pool`` (a pool of one address: see ``one_address_pool``) kept
    for the lock scripts, in this process."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._kept: deque[PoolConnection] = deque()  # its append and pop are atomic
        self._pid = os.getpid()
        self._closed = False

    def run_script(self, script: Script, key: str, args: Sequence[str | int]) -> Any:
        """The reply of ``script`` run on ``key`` with ``args`` (``EVALSHA``), decoded as
        the pool's connections decode. Raises redis-py's errors: ``ConnectionError``
        or ``TimeoutError`` when the server cannot be reached or does not answer,
        ``ResponseError`` when the script fails, ``AuthenticationError``."""
        connection = self._take()
        try:
            reply = connection.retry.call_with_retry(
                lambda: _evalsha(connection, script, key, args),
                lambda _error: connection.disconnect(),
            )
        except ResponseError:  # the whole reply was read: the connection is clean
            self._put_back(connection)
            raise
        except BaseException:
            connection.disconnect()  # a reply may still come: never read it as another's
            self._put_back(connection)
            raise
        self._put_back(connection)
        return reply

    def give_back(self) -> None:
        """Give every kept connection back to the pool, now and as calls end (the backend
        is closing)."""
        self._closed = True
        while self._kept:
            self._pool.release(self._kept.pop())

    def _take(self) -> PoolConnection:
        """A kept connection, checked; else one more of the pool's (connected)."""
        if self._pid != os.getpid():
            # A forked child: the parent's connections are the parent's (its pool starts
            # afresh in the child, and redis-py never shuts a socket down in a child).
            self._kept, self._pid = deque(), os.getpid()
        try:
            connection = self._kept.pop()
        except IndexError:
            return self._pool.get_connection()
        if connection.is_connected and _closed_or_unread(connection):
            connection.disconnect()  # the script connects again
        return connection

    def _put_back(self, connection: PoolConnection) -> None:
        if len(self._kept) < KEPT and not self._closed:
            self._kept.append(connection)
        else:
            self._pool.release(connection)


def _closed_or_unread(connection: PoolConnection) -> bool:
    """Whether the server closed ``connection`` or left something on it: nothing is
    due between two calls (redis-py's pool asks the same at each checkout)."""
    try:
        return bool(connection.can_read())
    except (RedisConnectionError, RedisTimeoutError, OSError):  # the parser saw the close
        return True


def _evalsha(
    connection: PoolConnection, script: Script, key: str, args: Sequence[str | int]
) -> Any:
    """``EVALSHA`` of ``script``; where the server no longer has it (a restart, ``SCRIPT
    FLUSH``), ``SCRIPT LOAD`` and run it again, as redis-py's ``Script`` does."""
    connection.send_command("EVALSHA", script.sha, 1, key, *args)
    try:
        return connection.read_response()
    except NoScriptError:
        connection.send_command("SCRIPT", "LOAD", script.script)
        connection.read_response()
        connection.send_command("EVALSHA", script.sha, 1, key, *args)
        return connection.read_response()
