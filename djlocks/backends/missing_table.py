"""Telling an error about a missing djlocks table (its migrations not applied) from others.

Each database says it in its own way: PostgreSQL with SQLSTATE ``42P01``
(``undefined_table``, the PostgreSQL manual's "Error Codes" appendix; psycopg 3
calls it ``sqlstate``, psycopg2 ``pgcode``), MySQL and MariaDB with error 1146
(``ER_NO_SUCH_TABLE``), SQLite with "no such table" in the message. Django's
wrapped errors keep the driver's (``__cause__``, and MySQL's ``args``), so no
query is needed to tell.
"""

from __future__ import annotations

from django.db import DatabaseError

from djlocks.backends.sql.postgresql import sqlstate

#: What to run when a djlocks table is missing.
MIGRATE = "manage.py migrate djlocks"

UNDEFINED_TABLE = "42P01"
NO_SUCH_TABLE = 1146


def is_missing_table(exc: DatabaseError) -> bool:
    """Whether ``exc`` says that a table does not exist."""
    return (
        sqlstate(exc) == UNDEFINED_TABLE
        or bool(exc.args and exc.args[0] == NO_SUCH_TABLE)
        or "no such table" in str(exc)
    )


def missing_table_hint(exc: DatabaseError) -> str:
    """The sentence to add to the error of a backend that met ``exc``: what to run if it
    says a table is missing, else nothing."""
    return f" A djlocks table is missing: run `{MIGRATE}`." if is_missing_table(exc) else ""
