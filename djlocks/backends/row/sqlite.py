"""Row locks on SQLite: the database write lock, correct but coarse.

SQLite has no row locks: a transaction that writes holds the one write lock
of the whole database file until it ends (SQLite documentation, "File
Locking And Concurrency"). A ``row`` lock on SQLite is therefore that write
lock, taken by the statement that issues the fence (an ``INSERT ... ON
CONFLICT DO UPDATE ... RETURNING`` on ``djlocks_row_fence``), so one lock is
held at a time per database, whatever its name, and a semaphore with a limit
above 1 is refused. The wait is SQLite's busy handler, set to the caller's
time-out with ``PRAGMA busy_timeout`` for the one statement (and for the
``BEGIN IMMEDIATE`` of a transaction djlocks opens), then put back.

What SQLite cannot do, and the system check says so:

* The fence is written in the caller's transaction (it is the only writer):
  a transaction that rolls back takes its fence increment with it, and the
  next grant gets the same fence again.
* Holders and waiters are invisible to other connections (nothing is
  committed while the lock is held, and SQLite has no lock table), so the
  dashboard and ``djlocks list`` show none, and forced release is impossible.
* "database is locked" before the time-out ran out means the caller's
  transaction began ``DEFERRED`` and read first (SQLite refuses to upgrade it
  to a writer once another wrote): configure ``"transaction_mode":
  "IMMEDIATE"`` in ``DATABASES[...]["OPTIONS"]``. It is raised as
  ``BackendUnavailable``, never passed off as ``NotAcquired``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.core import checks
from django.core.checks import CheckMessage
from django.db import OperationalError, connections

from djlocks.backends.base import AcquireRequest, HolderInfo, WaiterInfo
from djlocks.backends.row.dialect import Claim, RowDialect, cancellable
from djlocks.backends.sql import sqlite
from djlocks.backends.waiting import Abort, seconds_left
from djlocks.exceptions import BackendUnavailable
from djlocks.keys import table_key

if TYPE_CHECKING:
    from djlocks.backends.row.transaction import OwnTransaction

FOREVER_MS = 2**31 - 1  # SQLite's largest busy time-out, about 24.8 days
#: A busy time-out that ran out within this many seconds of the deadline is the time-out.
DEADLINE_SLACK = 0.05
#: Seconds an abortable wait spends in SQLite's busy handler before it looks at the abort.
ABORT_SLICE = 0.1


def _sooner(deadline: float | None, seconds: float) -> float:
    """The earlier of ``deadline`` (``time.monotonic()``, or ``None``) and ``seconds`` from now."""
    soon = time.monotonic() + seconds
    return soon if deadline is None else min(deadline, soon)


class SQLiteRows(RowDialect):
    def check_messages(self, query: bool) -> list[CheckMessage]:
        """W002: SQLite has no row locks, only its one write lock."""
        return [
            checks.Warning(
                f"djlocks backend {self.alias!r} takes row locks on SQLite, which has none: "
                f"each lock is the database's one write lock (one holder at a time, "
                f"whatever the name), semaphores are refused, and holders, waiters and "
                f"history are not visible.",
                hint="Use the lease backend on SQLite, or a server database for row locks.",
                id="djlocks.W002",
            )
        ]

    def claim(
        self,
        request: AcquireRequest,
        deadline: float | None,
        abort: Abort | None,
        own: OwnTransaction | None,
        taken: frozenset[int],
    ) -> Claim | None:
        if request.limit > 1:
            raise ValueError(
                f"{request.name!r}: on SQLite a row lock is the database's one write lock, "
                f"so a semaphore with limit {request.limit} could never have two holders. "
                f"Use the lease backend for semaphores on SQLite."
            )
        wrapper = connections[self.using]
        wrapper.ensure_connection()
        while True:
            interrupt = wrapper.connection.interrupt
            # sqlite3_interrupt() does not end a busy handler's wait, so an abortable
            # wait is cut into slices, with the abort looked at between them.
            stint = deadline if abort is None else _sooner(deadline, ABORT_SLICE)
            with (
                self._busy_timeout(seconds_left(stint)),
                cancellable(abort, interrupt) as cancelled,
            ):
                try:
                    if own is not None:
                        own.begin()
                    return Claim(0, 0, self._issue_fence(request))
                except OperationalError as exc:
                    if own is not None:
                        own.__exit__(type(exc), exc, exc.__traceback__)  # rolls back
                    failure = exc
            if cancelled():
                return None
            if "locked" not in str(failure):
                raise BackendUnavailable(f"djlocks backend {self.alias!r}: {failure}") from failure
            left = seconds_left(deadline)
            if left is not None and left <= DEADLINE_SLACK:
                return None
            stint_left = seconds_left(stint)
            if stint is not deadline and stint_left is not None and stint_left <= DEADLINE_SLACK:
                continue  # a slice of an abortable wait ran out: wait on
            if left is not None or own is None:
                raise BackendUnavailable(_UPGRADE_REFUSED.format(name=request.name)) from failure
            # Waiting forever in a transaction of our own: SQLite's longest busy
            # time-out ran out, so begin again and wait some more.

    def _issue_fence(self, request: AcquireRequest) -> int:
        """The statement that takes the database's write lock and issues the fence."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(
                f"INSERT INTO djlocks_row_fence (name_key, name, slot_limit, fence, used_at) "
                f"VALUES (%s, %s, 1, {sqlite.FIRST_FENCE}, {sqlite.LEASE.now}) "
                f"ON CONFLICT (name_key) DO UPDATE SET fence = fence + 1, slot_limit = 1, "
                f"used_at = excluded.used_at RETURNING fence",
                (table_key(request.name), request.name),
            )
            return int(cursor.fetchone()[0])

    @contextlib.contextmanager
    def _busy_timeout(self, seconds: float | None) -> Iterator[None]:
        wrapper = connections[self.using]
        wrapper.ensure_connection()
        configured = round(float(wrapper.settings_dict["OPTIONS"].get("timeout", 5)) * 1000)
        wait = FOREVER_MS if seconds is None else min(FOREVER_MS, round(seconds * 1000))
        with wrapper.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {int(wait)}")
            try:
                yield
            finally:
                cursor.execute(f"PRAGMA busy_timeout = {int(configured)}")

    def record(self, request: AcquireRequest, claim: Claim, token: str) -> int:
        assert claim.fence is not None
        return claim.fence

    def is_live(self, name: str, token: str) -> bool:
        return True  # only the connection itself could tell, and it ends with the transaction

    def holders(self, name: str | None) -> list[HolderInfo]:
        return []  # see the module docstring: invisible to other connections

    def waiters(self, name: str | None) -> list[WaiterInfo]:
        return []

    def kill(self, name: str, token: str | None) -> int:
        raise ValueError(
            "SQLite cannot end another connection's transaction: a row lock on SQLite "
            "cannot be released by force (it ends when its holder's transaction ends)."
        )


_UPGRADE_REFUSED = (
    "{name!r}: SQLite answered 'database is locked' before the time-out ran out: the "
    "transaction began DEFERRED and read before it asked for the lock, and SQLite does "
    "not let such a transaction become the writer once another connection wrote. Set "
    "DATABASES[...]['OPTIONS']['transaction_mode'] = 'IMMEDIATE' (Django 5.1+)."
)
