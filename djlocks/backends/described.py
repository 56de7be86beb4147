"""How a waiting or holding server session says who it is, and how djlocks reads it back.

The session and row backends wait in the database server, where djlocks can
only see a waiter through what the server shows of its session: MySQL's
process list shows the statement (``sql.mysql.sql_comment`` puts the text in
a comment), PostgreSQL's ``pg_stat_activity`` its ``application_name``.
``describe`` writes that text; ``parse_description``, ``owner_described`` and
``queue_order`` read it back for the admin, the deadlock check and ``waiters``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from djlocks.backends.base import AcquireRequest, WaiterInfo, in_queue_order
from djlocks.backends.session_deadlocks import Owner, owner_of
from djlocks.identity import numbered


def describe(request: AcquireRequest) -> str:
    """Who waits, as the server's process list shows it (``parse_description`` reads it):
    ``djlocks <pid>.<thread id>@<host> <label>``. Plain text: MySQL puts it in SQL
    through ``mysql.sql_comment``, PostgreSQL in ``application_name`` as a parameter."""
    who = request.identity
    tid = owner_of(who.host, who.pid, who.thread)
    thread = "" if tid is None else f".{tid[2]}"
    return f"djlocks {who.pid}{thread}@{who.host} {who.label}"


def parse_description(text: str) -> tuple[str, int, str]:
    """(host, pid, label) from ``describe``'s text, perhaps cut short by the server."""
    found = _DESCRIPTION.match(text or "")
    if found is None:
        return "", 0, text or ""
    return found["host"], int(found["pid"]), found["label"]


def thread_described(text: str) -> str:
    """The waiting or holding thread (``(tid N)``) or task (``(task N)``) in
    ``describe``'s text; empty where the text names none."""
    owner = owner_described(text)
    return "" if owner is None else numbered(owner[2])


def fence_described(text: str | None) -> int | None:
    """The fence in a holder's description (``djlocks#<fence> ...``, which the
    PostgreSQL advisory-lock backend sets as it is granted); ``None`` if none."""
    found = _DESCRIPTION.match(text or "")
    return None if found is None or found["fence"] is None else int(found["fence"])


def owner_described(text: str) -> Owner | None:
    """The owner (host, pid, thread id) of a wait from ``describe``'s text."""
    found = _DESCRIPTION.match(text or "")
    if found is None or found["tid"] is None:
        return None
    return found["host"], int(found["pid"]), int(found["tid"])


_DESCRIPTION = re.compile(
    r"djlocks(?:#(?P<fence>\d+))? (?P<pid>\d+)(?:\.(?P<tid>\d+))?@(?P<host>\S+) ?(?P<label>.*)",
    re.DOTALL,
)


def queue_order(alias: str, rows: Sequence[tuple[str | None, str, datetime]]) -> list[WaiterInfo]:
    """Waiters from (name or None, ``describe`` text, waiting since) in the server's order.

    Rows without a name (not a djlocks name) are left out; positions count per name.
    """
    waiting = []
    for name, description, since in rows:
        if name is not None:
            host, pid, label = parse_description(description)
            waiting.append((name, host, pid, thread_described(description), label, since))
    return in_queue_order(alias, waiting)
