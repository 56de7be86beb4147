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

from types import ModuleType

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


def lease_dialect(vendor: str) -> LeaseDialect:
    """The lease rows' SQL fragments on ``vendor``; ``ValueError`` for other databases."""
    dialect: LeaseDialect = for_vendor(vendor).LEASE
    return dialect
