"""``SessionBackend``: the rules shared by the GET_LOCK and advisory-lock backends.

Made of ``connections`` (the dedicated sessions), ``claims`` (waiting in the
server, fences and holder rows) and ``inspection`` (holders, waiters, forced
release); the vendors' SQL is in ``djlocks.backends.mysql`` and
``djlocks.backends.postgresql``.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Collection
from contextlib import nullcontext
from datetime import datetime

from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import (
    OTHER_DATABASE_HINT,
    AcquireRequest,
    Capabilities,
    GrantRecord,
    LimitAboveMost,
    unknown_database,
)
from djlocks.backends.driver import driver_messages
from djlocks.backends.missing_table import missing_table_hint
from djlocks.backends.primary import read_only_messages
from djlocks.backends.push import ClosedSockets
from djlocks.backends.session.claims import SessionClaims
from djlocks.backends.session.connections import Held, Key
from djlocks.backends.session.inspection import SessionInspection
from djlocks.backends.waiting import Abort
from djlocks.exceptions import BackendUnavailable, LockLost

#: Slot keys end in /0 ... /9999 and must fit GET_LOCK's 64 characters.
MAX_SLOTS = 9999


class SessionBackend(SessionClaims, SessionInspection):
    """Shared machinery of the GET_LOCK and advisory-lock backends (see the package docstring).

    ``OPTIONS``: ``using``, the Django database alias whose settings the
    dedicated connections copy (default: where the routers write djlocks' tables,
    ``base.database_alias``).
    """

    #: Whether the server grants waiters in the order they asked (the subclass's database).
    serves_waiters_in_order: bool

    forced_release_effect = (
        "its dedicated database connection is terminated, so the server frees the lock at "
        "once; the holder hears of it at once (the server closes that connection), or at "
        "its next keep-alive (every TTL/3)"
    )

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Server-held locks: free at once when the holder's session ends."""
        return Capabilities(
            fifo=self.serves_waiters_in_order,
            semaphores=True,
            cooldowns=False,
            crash_release="session",
            history=True,
            graceful_release=False,
            pushes_revocation=True,
            shared_between_processes=True,
        )

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """E005 an unknown database; E006 a database of another vendor; E015 PostgreSQL
        through psycopg2 (``driver``); and, when
        Django asks about the database, the server's own settings (``server_messages``),
        E014 a read-only server (``primary``) and E009 server sessions shared between
        clients by a pooler."""
        problems = unknown_database(self, self.using)
        if problems:
            return problems
        connection = connections[self.using]
        if connection.vendor != self.vendor:
            return [
                Error(
                    f"djlocks backend {self.alias!r} ({type(self).__name__}) needs a "
                    f"{self.vendor} database, but {self.using!r} is {connection.vendor}.",
                    hint=OTHER_DATABASE_HINT,
                    id="djlocks.E006",
                )
            ]
        problems = driver_messages(self.alias, self.using)
        if problems:
            return problems
        if databases is None or self.using not in databases:
            return []
        messages = self.server_messages(connection) + read_only_messages(self.alias, self.using)
        try:
            problem = self.shared_session_problem()
        except BackendUnavailable:
            return messages  # a server that is down is reported when a lock is taken
        if problem is not None:
            messages.append(
                Error(
                    problem,
                    hint="Session locks need a server session of their own: connect "
                    "directly, or through a PgBouncer pool with pool_mode = session.",
                    id="djlocks.E009",
                )
            )
        return messages

    def server_messages(self, connection: BaseDatabaseWrapper) -> list[CheckMessage]:
        """Check messages about the server's settings, read on ``connection``; none here."""
        return []

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        self._refuse(request)
        token = secrets.token_hex(16)  # made before the grant: nothing else waits on it then
        session = self._checkout()
        try:
            with abort.cancelling(lambda: self._kill_aside(session)) if abort else nullcontext():
                claimed = self._claim(session, request, deadline)
            if claimed is None:
                self._checkin(session)
                return None
            if abort is not None and abort.is_set():
                session.close()  # granted after the caller gave up: the grant ends with it
                return None
            slot, fence = claimed
            fence = self._record(session, request, slot, token, fence)
        except DatabaseError as exc:
            self._end(session)  # whatever it may have been granted or still waits for
            if abort and abort.is_set():
                return None
            raise BackendUnavailable(
                f"djlocks backend {self.alias!r} failed while acquiring {request.name!r}: "
                f"{exc}.{missing_table_hint(exc)}"
            ) from exc
        except BaseException:
            self._end(session)
            raise
        with self._guard:
            self._held[token] = Held(session, self._slot_key(request, slot))
        return GrantRecord(token, slot, fence, None)

    def _refuse(self, request: AcquireRequest) -> None:
        if connections[self.using].in_atomic_block:
            raise BackendUnavailable(
                f"{request.name!r}: a session lock taken inside transaction.atomic() would "
                f"be released before the transaction commits, so other processes could "
                f"act on data it has not committed yet (a lock must cover the commit). Take "
                f"the lock outside: `with db_lock(...): with transaction.atomic(): ...`, or "
                f"use the row backend, whose lock ends with the transaction. In tests, "
                f"Django's TestCase runs each test in a transaction: use TransactionTestCase, "
                f"or djlocks.testing.use_locmem_backends()."
            )
        if request.cooldown:
            raise ValueError(
                f"djlocks backend {self.alias!r} holds locks in server sessions, which "
                f"cannot outlive their release: a cool-down needs a lease backend."
            )
        if request.limit > MAX_SLOTS:
            raise LimitAboveMost(f"A session semaphore has at most {MAX_SLOTS} slots.")

    def _slot_key(self, request: AcquireRequest, slot: int) -> Key:
        return self.key(request.name) if request.limit == 1 else self.key(request.name, slot)

    def release(self, name: str, token: str, cooldown: float) -> None:
        with self._guard:
            held = self._held.pop(token, None)
        if held is None:
            raise LockLost(f"The grant of {name!r} had ended before release: its session ended.")
        with held.session.guard:
            try:
                released = self._give_back(held.session, held.key)
            except DatabaseError as exc:
                held.session.close()
                raise LockLost(
                    f"The grant of {name!r} had ended before release: its session failed ({exc})."
                ) from exc
            except BaseException:  # interrupted (Ctrl-C) mid-statement: the session ends
                held.session.close()
                raise
        if not released:
            held.session.close()
            raise LockLost(
                f"The grant of {name!r} had ended before release: the server no longer "
                f"held it for this session (killed, or released by force)."
            )
        self._checkin(held.session)

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """A keep-alive that also asks the server whether the session still holds the key."""
        if not self.is_held(name, token):
            with self._guard:
                held = self._held.pop(token, None)
            if held is not None:
                held.session.close()
            raise LockLost(
                f"The session holding {name!r} ended or no longer holds it: an operator "
                f"released it by force or killed the session, or its connection failed."
            )
        return None  # a session grant has no expiry

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """``notice`` is called when the server closes the grant's session (a forced
        release kills it; so does an administrator, or the server's idle time-out)."""
        with self._guard:
            held = self._held.get(token)
        if held is None or not _closed_sockets.supported:
            return None
        return _closed_sockets.watch(token, held.session.wrapper.connection.fileno(), notice)

    def is_held(self, name: str, token: str) -> bool:
        with self._guard:
            held = self._held.get(token)
        if held is None:
            return False
        if not held.session.guard.acquire(timeout=5):
            return True  # busy releasing; the release itself will tell
        try:
            return self._holds(held.session, held.key)
        except DatabaseError:
            return False
        finally:
            held.session.guard.release()


#: Watches the sessions of every session backend of the process (see ``watch``).
_closed_sockets = ClosedSockets()
