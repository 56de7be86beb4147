"""Prepared statements on djlocks' own PostgreSQL connections (the lease store's and the
advisory locks' sessions), where they are safe.

Django turns psycopg's prepared statements off by default (``OPTIONS
["prepare_threshold"]``) and binds parameters in the client, so that every
connection works through a pooler in transaction mode: PgBouncer before 1.21
hands a client's next transaction to another server session, where a statement
it prepared does not exist, or where another client's statement has its name.
Without them the server parses and plans each of djlocks' statements again,
about 100 to 200 µs each for a lease's claim and release, 20 to 40 µs for an
advisory lock's.

A djlocks connection that reaches the server directly prepares them: its
statements are bound in the server (Django's ``ServerBindingCursor``) and
psycopg prepares each one the fifth time it runs (psycopg's own default
threshold); those djlocks sends through libpq (``libpq.DirectStatements``) are
prepared the first time they run. Direct means that the server sees this very socket: over TCP, the
client and server addresses and ports the server reports for the session
(``inet_client_addr()``, ``inet_client_port()``, ``inet_server_addr()``,
``inet_server_port()``) are the socket's own two ends. Through a pooler or any
other proxy (or an address translation) they are not, and over a Unix socket
nothing proves it, so those connections keep Django's client-side binding.
(djlocks' connections never come from Django's pool, ``OPTIONS["pool"]``, so none
goes back to the application with these settings: ``dedicated.new_wrapper``.) An
``OPTIONS["prepare_threshold"]`` set on the database alias is followed as given
(``None``: never prepare).

A connection that prepares also plans each prepared statement once
(``plan_cache_mode = force_generic_plan``): left to choose, the server planned
the lease's hand-over again at every execution, about 100 µs of each bind, and
came to the same plan (index lookups by token and name).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

#: psycopg's default: a statement is prepared the fifth time it runs.
PSYCOPG_THRESHOLD = 5
#: Plan each prepared statement once (PostgreSQL 12 and later).
GENERIC_PLANS = "SET plan_cache_mode = force_generic_plan"


def prepare_where_direct(wrapper: BaseDatabaseWrapper) -> bool:
    """Have the newly opened PostgreSQL connection ``wrapper`` prepare djlocks'
    statements if it reaches the server directly (or as the alias's
    ``OPTIONS["prepare_threshold"]`` says); whether it now does. Raises Django's
    ``DatabaseError`` if the server cannot be asked."""
    options = wrapper.settings_dict.get("OPTIONS", {})
    if "prepare_threshold" in options:
        threshold = options["prepare_threshold"]
    else:
        threshold = PSYCOPG_THRESHOLD if reaches_server_directly(wrapper) else None
    if threshold is None:
        return False
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection = wrapper.connection
    connection.cursor_factory = ServerBindingCursor
    connection.prepare_threshold = threshold
    with wrapper.wrap_database_errors, connection.cursor() as cursor:
        cursor.execute(GENERIC_PLANS)
    return True


def reaches_server_directly(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether both ends of this connection's TCP socket are the ends the server sees
    (``inet_client_addr()``/``inet_client_port()`` and ``inet_server_addr()``/
    ``inet_server_port()``): no pooler or proxy between them. Raises Django's
    ``DatabaseError`` if the server cannot be asked."""
    with wrapper.wrap_database_errors, wrapper.connection.cursor() as cursor:
        cursor.execute(
            "SELECT host(inet_client_addr()), inet_client_port(), "
            "host(inet_server_addr()), inet_server_port()"
        )
        client, client_port, server, server_port = cursor.fetchone()
    if client is None or server is None:  # a Unix socket
        return False
    try:
        own, peer = _ends(wrapper.connection)
    except OSError:
        return False
    return (own, peer) == ((_address(client), client_port), (_address(server), server_port))


Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def _ends(connection: Any) -> tuple[Address, Address]:
    """The local and the remote address and port of the psycopg ``connection``'s socket."""
    duplicate = os.dup(connection.pgconn.socket)
    try:
        ends = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        raise
    with ends:
        own, peer = ends.getsockname(), ends.getpeername()
    return (_address(own[0]), own[1]), (_address(peer[0]), peer[1])


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP address, an IPv4-mapped IPv6 one as its IPv4 address."""
    ip = ipaddress.ip_address(text)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
