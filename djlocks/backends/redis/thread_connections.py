"""Each thread's own connection to a Redis server, for the lock scripts.

redis-py's client takes a connection out of its pool and puts it back for
every command (a lock, a look at the socket, the pool's bookkeeping), then runs
the command through its general machinery: about 1,100 Python bytecodes more
than sending the command and reading its reply, twice per acquire and release.
A lock's scripts go instead over a connection that the thread keeps, as Django
keeps one database connection per thread. It is made with the pool's
connection class and options (so the cache's address, password, TLS, Sentinel
and time-outs apply) but outside the pool: it takes none of the cache's
connections, so a pool with ``max_connections`` never runs short because
threads hold locks. It closes when its thread ends (its last reference goes),
and a forked child makes its own.

Only a pool whose connections all go to one address (redis-py's
``ConnectionPool`` and ``BlockingConnectionPool``, which django-redis makes from a
``redis://`` or ``rediss://`` URL) is served this way (``one_address_pool``). A Sentinel
pool moves its connections to the new master after a fail-over, which a
connection outside it would not follow: its scripts, and a cluster's, go
through the client.

As the pool does at each checkout, each call first looks at the socket: a
connection the server closed while it was idle (a restart, the server's
``timeout``) connects again instead of failing. A failure is retried as the
cache's own commands retry one: by the connection's ``retry`` policy
(redis-py's default for a pool made from a URL: not at all).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from redis import BlockingConnectionPool, ConnectionPool, Redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as LostConnection
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as NoReply

#: The pools whose connections all go to the address they were made with.
ONE_ADDRESS_POOLS = (ConnectionPool, BlockingConnectionPool)


def one_address_pool(client: object) -> ConnectionPool | None:
    """``client``'s pool if it is a ``Redis`` client whose pool is one of
    ``ONE_ADDRESS_POOLS`` (exactly: a subclass may route), else ``None``: its scripts
    then go through the client."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(client, Redis) and type(pool) in ONE_ADDRESS_POOLS:
        return pool
    return None


class ThreadConnections:
    """One connection per thread and process to the server of ``pool`` (a pool of one
    address: see ``one_address_pool``)."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._local = threading.local()

    def run_script(self, script: Script, key: str, args: Sequence[str | int]) -> Any:
        """The reply of ``script`` run on ``key`` with ``args`` (``EVALSHA``), over this
        thread's connection, decoded as the pool's connections decode. Raises
        redis-py's errors (``ConnectionError`` when the server cannot be reached,
        ``ResponseError`` when the script fails)."""
        connection = self._connection()
        return connection.retry.call_with_retry(
            lambda: _evalsha(connection, script, key, args),
            lambda _error: connection.disconnect(),
        )

    def _connection(self) -> Any:
        """This thread's connection, made at its first use in this process; disconnected
        if the server closed it (the next script connects again)."""
        mine = self._local
        connection = getattr(mine, "connection", None)
        if connection is None or mine.pid != os.getpid():
            # A forked child leaves its parent's connection alone: redis-py's
            # disconnect() shuts a socket down only in the process that opened it.
            connection = self._pool.connection_class(**self._pool.connection_kwargs)
            mine.connection, mine.pid = connection, os.getpid()
        elif connection.is_connected and _closed_or_unread(connection):
            connection.disconnect()
        return connection


def _closed_or_unread(connection: Any) -> bool:
    """Whether the server closed ``connection`` or left something on it: nothing is
    due between two calls (redis-py's pool asks the same at each checkout)."""
    try:
        return bool(connection.can_read())
    except (LostConnection, NoReply, OSError):  # the parser saw the close
        return True


def _evalsha(connection: Any, script: Script, key: str, args: Sequence[str | int]) -> Any:
    """``EVALSHA`` of ``script``; where the server no longer has it (a restart, ``SCRIPT
    FLUSH``), ``SCRIPT LOAD`` and run it again, as redis-py's ``Script`` does."""
    if not connection.is_connected:
        # As the pool does at checkout: a Sentinel's connection asks the Sentinels
        # for the master here (sending would connect to the address in the URL).
        connection.connect()
    connection.send_command("EVALSHA", script.sha, 1, key, *args)
    try:
        return connection.read_response()
    except NoScriptError:
        connection.send_command("SCRIPT", "LOAD", script.script)
        connection.read_response()
        connection.send_command("EVALSHA", script.sha, 1, key, *args)
        return connection.read_response()
