"""Every statement djlocks runs on a database server, one module per vendor.

In the spirit of Django's ``connection.ops``: the backend families (lease
rows, session locks, row locks) say *what* they need, and ``for_vendor``
hands them the module that says it in this database's SQL: the statements,
the error codes, how to kill a session and how to list waiting sessions.
No family imports another family; each imports only these modules.
"""

from __future__ import annotations

from types import ModuleType


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
