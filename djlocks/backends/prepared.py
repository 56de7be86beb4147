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
threshold). Direct means that the server sees this very socket: over TCP, the
client address and port the server reports for the session
(``inet_client_addr()``, ``inet_client_port()``) are the socket's own. Through a
pooler or any other proxy they are the proxy's, and over a Unix socket nothing
proves it, so those connections keep Django's client-side binding. An
``OPTIONS["prepare_threshold"]`` set on the database alias is followed as given
(``None``: never prepare).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

#: psycopg's default: a statement is prepared the fifth time it runs.
PSYCOPG_THRESHOLD = 5


def prepare_where_direct(wrapper: BaseDatabaseWrapper) -> bool:
    """Have the newly opened PostgreSQL connection ``wrapper`` prepare djlocks'
    statements if it reaches the server directly (or as the alias's
    ``OPTIONS["prepare_threshold"]`` says); whether it now does."""
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
    return True


def reaches_server_directly(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether the server reports this connection's own TCP address and port as its
    client's: no pooler or proxy between them."""
    with wrapper.connection.cursor() as cursor:
        cursor.execute("SELECT host(inet_client_addr()), inet_client_port()")
        address, port = cursor.fetchone()
    if address is None:  # a Unix socket
        return False
    return _own_address(wrapper.connection) == (ipaddress.ip_address(address), port)


def _own_address(connection: Any) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """The local address and port of the psycopg ``connection``'s socket."""
    own = socket.socket(fileno=os.dup(connection.pgconn.socket))
    try:
        address, port = own.getsockname()[:2]
    finally:
        own.close()
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, port
