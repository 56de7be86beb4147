"""The SQL that depends on the database, one module per vendor.

In the spirit of Django's ``connection.ops``: each module says in its
database's SQL what djlocks needs there: the lease rows' dialect
(``LEASE``), issuing a fence and recording a holder for the locks a server
holds, taking and releasing a named lock, killing a session, listing the
sessions that wait, and the error codes that tell a time-out from a
deadlock. The backend families (lease rows, session locks, row locks) call
these modules and never import one another; a statement that only one
vendor backend runs stays beside it (the GET_LOCK backend's in
``djlocks.backends.mysql``, the row backend's in ``row.mysql``).
"""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime
from types import ModuleType

from django.conf import settings
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from djlocks.backends.sql.dialects import LeaseDialect


def for_vendor(vendor: str) -> ModuleType:
    """The module of statements for a Django ``connection.vendor``
    (``"postgresql"``, ``"mysql"`` or ``"sqlite"``); ``ValueError`` for others."""
    from djlocks.backends.sql import mysql, postgresql, sqlite

    modules = {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}
    if vendor not in modules:
        raise ValueError(
            f"djlocks has no SQL for the database vendor {vendor!r}: "
            "use PostgreSQL, MySQL/MariaDB or SQLite, or the Redis backend."
        )
    return modules[vendor]


def giving_back_first(give_back: str, granted: str) -> str:
    """SQL worth ``granted`` (SQL) that first runs ``give_back`` (SQL releasing a key the
    session holds, with one ``%s`` parameter: the key, placed before ``granted``'s).

    For the branch of a ``CASE`` that runs only when a statement is granted a key:
    a semaphore's gate is handed on by the statement that took a slot, so the next
    waiter need not wait for another round trip. ``granted`` appears twice in the
    SQL, so it must have no parameters of its own; only one of the two runs.
    """
    return f"CASE WHEN {give_back} IS NULL THEN {granted} ELSE {granted} END"


def lease_dialect(vendor: str) -> LeaseDialect:
    """The lease rows' SQL fragments on ``vendor``; ``ValueError`` for other databases."""
    dialect: LeaseDialect = for_vendor(vendor).LEASE
    return dialect


def as_datetime(value: object, db: BaseDatabaseWrapper) -> datetime:
    """A moment read from ``db`` (through a cursor or the ORM) as an aware datetime.

    djlocks writes its moments by the database's UTC clock. A database without time
    zones (MySQL, SQLite: text) keeps that UTC wall time, which is what counts, even
    where Django's ORM labels it with a ``DATABASES`` ``TIME_ZONE``. PostgreSQL's
    values are read aware, but under ``USE_TZ = False``, where Django reads them as
    naive times in the connection's time zone, ``TIME_ZONE``.
    """
    moment = value if isinstance(value, datetime) else parse_datetime(str(value))
    if moment is None:
        raise ValueError(f"{value!r} read from {db.alias!r} is not a moment.")
    if not db.features.supports_timezones:
        # UTC as written, even where Django read it as in DATABASES' TIME_ZONE
        return moment.replace(tzinfo=UTC)
    if timezone.is_aware(moment):
        return moment
    if not settings.USE_TZ:
        return timezone.make_aware(moment, zoneinfo.ZoneInfo(db.timezone_name))
    return moment.replace(tzinfo=UTC)
