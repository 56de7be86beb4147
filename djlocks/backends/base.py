"""The small interface every lock store implements."""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from django.core.checks import CheckMessage, Error

from djlocks.identity import Identity

T = TypeVar("T")


class Abort(threading.Event):
    """Set by another thread to end a blocked acquire early (asyncio cancellation, a signal).

    A backend that waits inside a server cannot be woken by the event alone:
    it registers a canceller with ``cancelling()``, which ``set()`` calls (in
    the setting thread), e.g. to kill the waiting connection.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cancellers: list[Callable[[], None]] = []
        self._cancellers_guard = threading.Lock()

    def set(self) -> None:
        """Set the flag, then call every registered canceller (in this thread)."""
        super().set()
        with self._cancellers_guard:
            cancellers = list(self._cancellers)
        for cancel in cancellers:
            cancel()

    @contextlib.contextmanager
    def cancelling(self, cancel: Callable[[], None]) -> Iterator[None]:
        """Call ``cancel`` if the abort is set while the block runs (perhaps twice)."""
        with self._cancellers_guard:
            self._cancellers.append(cancel)
        try:
            if self.is_set():
                cancel()
            yield
        finally:
            with self._cancellers_guard:
                self._cancellers.remove(cancel)


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative; ``None`` stays."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


POLL_MIN = 0.001  # seconds; a queue's head polls from here ...
POLL_MAX = 0.004  # ... backing off to here


def poll_with_backoff(
    attempt: Callable[[], T | None], deadline: float | None, abort: Abort | None = None
) -> T | None:
    """Call ``attempt`` until it returns a value, sleeping ``POLL_MIN`` to ``POLL_MAX`` between.

    Only the head of a queue polls this way (the others wait in the server).
    Returns ``None`` when ``deadline`` passes or ``abort`` is set first.
    """
    pause = POLL_MIN
    while (outcome := attempt()) is None:
        left = seconds_left(deadline)
        if left == 0 or (abort is not None and abort.is_set()):
            return None
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 1.5, POLL_MAX)
    return outcome


@dataclass(frozen=True)
class AcquireRequest:
    """What a caller asks for: ``limit`` slots of ``name``, leased for ``ttl`` seconds."""

    name: str
    limit: int
    ttl: float
    cooldown: float
    identity: Identity


@dataclass(frozen=True)
class GrantRecord:
    """The store's answer to a successful acquire."""

    token: str
    slot: int
    fence: int
    expires_at: datetime | None
    #: A context the backend entered for the grant (the row backend's own
    #: transaction), left at release with the ``with`` block's exception, if any.
    scope: AbstractContextManager[Any] | None = None
    #: The ``time.monotonic()`` moment the request that made a lease was sent.
    #: The lease cannot have started earlier, so the holder's belief in it counts
    #: from here. ``None`` for grants that end with a session or transaction.
    requested_at: float | None = None


@dataclass(frozen=True)
class HolderInfo:
    """One live grant as the store records it."""

    name: str
    backend: str
    slot: int
    limit: int
    host: str
    pid: int
    thread: str
    label: str
    since: datetime
    expires_at: datetime | None
    fence: int
    token: str
    connection_id: int | None = None


@dataclass(frozen=True)
class WaiterInfo:
    """One process blocked in ``acquire`` for a name, in queue order."""

    name: str
    backend: str
    position: int
    host: str
    pid: int
    thread: str
    label: str
    since: datetime


@dataclass(frozen=True)
class CooldownInfo:
    """A released slot that may not be granted again before ``until`` (a cool-down)."""

    name: str
    backend: str
    slot: int
    until: datetime


class LockBackend(ABC):
    """A lock store. Instances are shared by every thread of a process.

    ``acquire`` blocks until ``deadline`` (a ``time.monotonic()`` value, or
    ``None`` to wait forever) and returns ``None`` when it ran out; ``abort``
    lets another thread end the wait early (asyncio cancellation). Whatever
    ends in an unknown state is cleaned up by token before returning.
    """

    #: What a forced release does to the holder, for the admin's confirmation page.
    forced_release_effect = "its grant is taken away"
    #: False where djlocks cannot write the history of this store's grants.
    records_history = True
    #: True where an operator can ask a holder to give its grant back (``request_release``).
    releases_gracefully = False
    #: True where a grant lives in the acquiring thread's database transaction
    #: (the row backend): it is released in that thread, never from async code.
    in_caller_transaction = False

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        self.alias = alias
        self.options = dict(options)

    @abstractmethod
    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        """Grant a slot of ``request.name``, waiting until ``deadline``; ``None`` if not.

        Raises ``AlreadyHeld`` when the name is held with another limit, and
        ``BackendUnavailable`` when the store cannot be used.
        """

    @abstractmethod
    def release(self, name: str, token: str, cooldown: float) -> None:
        """End the grant ``token``; raise ``LockLost`` if it had already ended."""

    @abstractmethod
    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """Called by the heartbeat every ``ttl``/3 seconds while the grant is held.

        A lease store sets the lease to expire ``ttl`` seconds from its own now
        and returns the new expiry; a session store checks that the session
        still holds the lock (a keep-alive too) and returns ``None``. Raises
        ``LockLost`` if the grant has ended (a renewal never re-claims one).
        """

    @abstractmethod
    def is_held(self, name: str, token: str) -> bool:
        """Ask the store whether the grant ``token`` is still live.

        A store that knows why a grant ended may raise ``LockLost`` saying so
        instead of returning ``False``.
        """

    @abstractmethod
    def holders(self, name: str | None = None) -> list[HolderInfo]:
        """The live grants of ``name`` (or of every name), as the store itself records them."""

    @abstractmethod
    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        """The callers waiting for ``name`` (or for every name), in queue order."""

    @abstractmethod
    def names(self) -> list[tuple[str, int]]:
        """Every ``(name, limit)`` the store knows, held or free, sorted by name."""

    @abstractmethod
    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        """Slots whose cool-down has not yet ended, by the store's clock."""

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        """End slot ``slot``'s cool-down ``seconds`` from the store's now (0 clears it).

        Returns the new end. Raises ``ValueError`` if the store has no such
        slot, or (this default) keeps no cool-downs at all.
        """
        raise ValueError(
            f"Backend {self.alias!r} ({type(self).__name__}) keeps no cool-downs; "
            f"use a lease backend for names that need one."
        )

    @abstractmethod
    def sweep(self) -> dict[str, int]:
        """Remove what dead holders and waiters left behind; return counts by kind.

        Never needed for correctness (expired records are ignored); it bounds
        the store's size. Safe to run at any time, from any process.
        """

    @abstractmethod
    def force_release(self, name: str, token: str | None = None) -> int:
        """Take grants of ``name`` away (one by ``token``, or all); return how many."""

    def request_release(self, name: str, token: str, wait: float) -> int:
        """Ask the holder of the grant ``token`` of ``name`` to give it back (a graceful release).

        The grant stays held, but its lease now ends ``wait`` seconds (float,
        more than 0) from the store's now at the latest, and renewals no longer
        extend it past that: the slot is free when the holder releases it, or
        when the wait runs out. The holder learns it (``ReleaseRequested``) at
        its next renewal or check, at once where the store can push (``watch``).
        Returns 1, or 0 if the grant had already ended. Raises ``ValueError``
        where the backend cannot do this (``releases_gracefully`` is False: this
        default), and ``BackendUnavailable`` when the store cannot be reached.
        """
        raise ValueError(
            f"Backend {self.alias!r} ({type(self).__name__}) cannot ask a holder to give its "
            f"grant back; release it by force instead (the holder learns LockLost)."
        )

    def watch(
        self, name: str, token: str, fence: int, notice: Callable[[], None]
    ) -> Callable[[], None] | None:
        """Call ``notice()`` (from another thread, with no arguments) when an operator
        takes the grant (``name``, ``token``, ``fence``) away or asks for it back.

        The holder's heartbeat watches each grant it renews, and renews at once
        when told: a notice is only a hint, which the renewal confirms, so a
        lost one costs no more than the wait for the next renewal. Returns the
        function that ends the watch, or ``None`` where the store cannot push
        (this default): the holder then learns at its next renewal or check.
        """
        return None

    def close(self) -> None:
        """Stop what the backend runs in the background (``backends.reset()``); most run none."""
        return None

    def check(self, databases: Collection[str] | None) -> list[CheckMessage]:
        """Django system-check messages (``djlocks.E...``/``W...``) about this backend.

        ``databases`` are the database aliases Django asks about: ``None`` for a
        plain ``manage.py check`` or ``runserver``, the migrated or tested
        aliases for ``migrate`` and ``test``. Checks of the configuration always
        run; a check that queries a store runs only when Django asks about it
        (a Redis store: whenever ``databases`` is not ``None``). This default
        finds nothing to report.
        """
        return []


#: The hint of ``djlocks.E006``, a backend on a database it cannot use.
OTHER_DATABASE_HINT = (
    "Point the backend's OPTIONS['using'] at a database it supports, or use the lease "
    "backend, which works on SQLite, PostgreSQL and MySQL/MariaDB."
)


def unknown_database(backend: LockBackend, using: str) -> list[CheckMessage]:
    """``djlocks.E005`` if ``using`` is not an alias of ``DATABASES``, else nothing."""
    from django.db import connections

    if using in connections:
        return []
    return [
        Error(
            f"djlocks backend {backend.alias!r} uses database {using!r}, which is not in "
            f"DATABASES.",
            hint="Set the backend's OPTIONS['using'] to an alias of DATABASES.",
            id="djlocks.E005",
        )
    ]
