"""The PostgreSQL driver: djlocks' lease and advisory-lock backends need psycopg 3.

Django talks to PostgreSQL through psycopg 3 when it is installed, else through
psycopg2. These backends use what only psycopg 3 has: ``notifies()`` on a connection
(a lease waiter hears its release), the driver's view of its session and socket
(``pgconn``), and statements bound and prepared in the server. Through psycopg2
they would fail at their first statement with an ``AttributeError``; they are
refused instead, with what to install (system check ``djlocks.E015``, and
``BackendUnavailable`` at the first acquire). The row backend and the history
work through either.
"""

from __future__ import annotations

from django.core.checks import CheckMessage, Error
from django.db import connections

from djlocks.exceptions import BackendUnavailable

INSTALL_PSYCOPG3 = (
    "Install psycopg 3: pip install 'djlocks[postgresql]' (Django uses it rather than "
    "psycopg2 once both are installed), or use the row backend, which works with either."
)


def psycopg3_in_use() -> bool:
    """Whether Django's PostgreSQL backend talks through psycopg 3 in this process (it
    picks one driver for every PostgreSQL database). Imports that backend."""
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def driven_by_psycopg3(using: str) -> bool:
    """Whether Django talks to the database ``using`` through psycopg 3: ``True`` for a
    database of another vendor, which has nothing to do with it."""
    return connections[using].vendor != "postgresql" or psycopg3_in_use()


def _refusal(alias: str, using: str) -> str:
    return (
        f"djlocks backend {alias!r} needs psycopg 3 on PostgreSQL, but Django talks to "
        f"database {using!r} through psycopg2."
    )


def driver_messages(alias: str, using: str) -> list[CheckMessage]:
    """``djlocks.E015`` if the backend ``alias`` would reach ``using`` through psycopg2."""
    if driven_by_psycopg3(using):
        return []
    return [Error(_refusal(alias, using), hint=INSTALL_PSYCOPG3, id="djlocks.E015")]


def refuse_psycopg2(alias: str, using: str) -> None:
    """Raise ``BackendUnavailable`` if the backend ``alias`` would reach ``using``
    through psycopg2."""
    if not driven_by_psycopg3(using):
        raise BackendUnavailable(f"{_refusal(alias, using)} {INSTALL_PSYCOPG3}")
