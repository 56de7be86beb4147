"""Locks are taken on the primary: a read-only server is refused, never used silently.

A replica's locks exclude only the replica's own clients. PostgreSQL grants
advisory locks on a hot standby ("Advisory locks work normally in recovery":
the manual's "Hot Standby" chapter), and a MariaDB or MySQL replica grants
``GET_LOCK`` and row locks, and, to an account with ``SUPER`` or ``READ ONLY
ADMIN``, writes, all of it local to that server. A process whose ``using``
alias points at a replica would hold a lock that a process on the primary
never sees. So every connection djlocks takes locks on is probed when it is
first used (one statement; two to four on MariaDB and MySQL), and a read-only
server raises ``BackendUnavailable``; ``manage.py check --database`` reports
the same as ``djlocks.E014``.

Read-only means, on PostgreSQL, in recovery (a standby) or with read-only
transactions (``default_transaction_read_only``); on MariaDB and MySQL,
``read_only`` or ``innodb_read_only`` set, or a replication connection (a
replica, running or stopped, whatever its ``read_only``: the replica status is
read where the account may, with ``REPLICATION CLIENT``, ``REPLICA MONITOR`` or
``SUPER``). A node of a ring of primaries replicates too, and is refused:
``GET_LOCK`` and row locks there would not reach the other primaries' clients.
SQLite has no replicas.
"""

from __future__ import annotations

import weakref
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from djlocks.exceptions import BackendUnavailable

#: What to do about a read-only server (the error's and the check's advice).
PRIMARY_HINT = (
    "Point the backend's OPTIONS['using'] at a DATABASES alias that connects to the "
    "primary (the server that accepts writes), even where your routers send reads "
    "to a replica: djlocks locks, lists holders and releases there."
)


def read_only_reason(wrapper: BaseDatabaseWrapper) -> str | None:
    """Why the server behind ``wrapper`` (connected) cannot take djlocks' locks, or
    ``None`` if it is a writable primary (or djlocks cannot tell: SQLite, a replica
    status the account may not read)."""
    if wrapper.vendor == "postgresql":
        return _postgresql_reason(wrapper)
    if wrapper.vendor == "mysql":
        return _mysql_reason(wrapper)
    return None


def refuse_read_only(wrapper: BaseDatabaseWrapper, alias: str) -> None:
    """Raise ``BackendUnavailable`` if ``wrapper``'s server is read-only (see the module)."""
    reason = read_only_reason(wrapper)
    if reason is not None:
        raise BackendUnavailable(
            f"djlocks backend {alias!r} refuses database {wrapper.alias!r}: {reason}, and a "
            f"lock taken there would not exclude the processes that lock on the primary. "
            f"{PRIMARY_HINT}"
        )


def refuse_read_only_once(wrapper: BaseDatabaseWrapper, alias: str) -> None:
    """``refuse_read_only`` on the first use of each connection of ``wrapper`` (a
    Django connection, which djlocks does not open, so cannot probe when it opens).
    With ``CONN_MAX_AGE = 0`` that is once per request that takes a lock."""
    wrapper.ensure_connection()
    if wrapper not in _probed:
        refuse_read_only(wrapper, alias)
        _probed.add(wrapper)


#: Django connections whose current server connection ``refuse_read_only_once``
#: probed; each leaves when it connects again.
_probed: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()


@receiver(connection_created)
def _forget_the_probe(sender: object, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """A Django connection connected anew, maybe to another server: probe it again."""
    _probed.discard(connection)


def read_only_messages(alias: str, using: str) -> list[CheckMessage]:
    """``djlocks.E014`` if database ``using`` is read-only; nothing if it is writable or
    cannot be reached (a server that is down is reported when a lock is taken)."""
    try:
        with connections[using].cursor():
            reason = read_only_reason(connections[using])
    except DatabaseError:
        return []
    if reason is None:
        return []
    return [
        Error(
            f"djlocks backend {alias!r} uses database {using!r}, which is read-only: {reason}.",
            hint=PRIMARY_HINT,
            id="djlocks.E014",
        )
    ]


def _postgresql_reason(wrapper: BaseDatabaseWrapper) -> str | None:
    with wrapper.cursor() as cursor:
        cursor.execute("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
        in_recovery, read_only = cursor.fetchone()
    if in_recovery:
        return "the server is a standby in recovery (pg_is_in_recovery())"
    if read_only == "on":
        return "its transactions are read-only (default_transaction_read_only)"
    return None


def _mysql_reason(wrapper: BaseDatabaseWrapper) -> str | None:
    with wrapper.cursor() as cursor:
        cursor.execute("SELECT @@global.read_only, @@global.innodb_read_only")
        read_only, innodb_read_only = cursor.fetchone()
    if read_only or innodb_read_only:
        setting = "read_only" if read_only else "innodb_read_only"
        return f"the server is read-only ({setting} is set)"
    if _replicating(wrapper):
        return (
            "the server is a replica (it has a replication connection: RESET REPLICA ALL "
            "if it is one no longer)"
        )
    return None


#: Statements that list a server's replication connections, newest syntax first: every
#: connection of a MariaDB multi-source replica, then MySQL 8.0.22+'s, then the oldest.
REPLICA_STATUS = ("SHOW ALL REPLICAS STATUS", "SHOW REPLICA STATUS", "SHOW SLAVE STATUS")


def _replicating(wrapper: BaseDatabaseWrapper) -> bool:
    """Whether the server has a replication connection, running or stopped (a stopped
    replica is a replica still); False if the account may not read the replica
    status."""
    for statement in REPLICA_STATUS:
        try:
            with wrapper.cursor() as cursor:
                cursor.execute(statement)
                return bool(cursor.fetchall())
        except DatabaseError:
            continue
    return False
