"""The small interface every lock store implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Literal, TypeVar

from django.core.checks import CheckMessage, Error

from djlocks.backends.waiting import Abort
from djlocks.identity import Identity
from djlocks.moments import project_moment

T = TypeVar("T")


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


class LimitAboveMost(ValueError):
    """A semaphore's ``limit`` above the most slots its backend gives a name."""


def _in_project_time(record: object, *fields: str) -> None:
    """Set the moments ``fields`` of the frozen ``record`` in the project's time
    (``djlocks.moments.project_moment``), whatever clock and driver gave them."""
    for field in fields:
        object.__setattr__(record, field, project_moment(getattr(record, field)))


@dataclass(frozen=True)
class HolderInfo:
    """One live grant as the store records it. Its moments are in the project's time:
    aware (UTC) under ``USE_TZ``, naive local time otherwise."""

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
    #: ``None``: not known (a MariaDB grant whose record is not written yet).
    fence: int | None
    token: str
    connection_id: int | None = None
    #: ``False``: djlocks' own record of this grant is not written (yet); the server
    #: shows the grant and who holds it (PostgreSQL: with its fence; MariaDB: the
    #: client's address only), but no token, and ``since`` is when the holder's
    #: session last ran a statement.
    recorded: bool = True

    def __post_init__(self) -> None:
        _in_project_time(self, "since", "expires_at")


@dataclass(frozen=True)
class WaiterInfo:
    """One process blocked in ``acquire`` for a name, in queue order, waiting ``since``
    (in the project's time, as ``HolderInfo``)."""

    name: str
    backend: str
    position: int
    host: str
    pid: int
    thread: str
    label: str
    since: datetime

    def __post_init__(self) -> None:
        _in_project_time(self, "since")


#: One waiter as a store lists it: name, host, pid, thread, label, waiting since.
Waiting = tuple[str, str, int, str, str, datetime]


def in_queue_order(backend: str, waiting: Iterable[Waiting]) -> list[WaiterInfo]:
    """``WaiterInfo`` records of ``backend`` from ``waiting``, given in queue order
    (names may interleave); each name's positions count from 0, the next in line."""
    positions: dict[str, int] = {}
    records = []
    for name, host, pid, thread, label, since in waiting:
        position = positions[name] = positions.get(name, -1) + 1
        records.append(WaiterInfo(name, backend, position, host, pid, thread, label, since))
    return records


@dataclass(frozen=True)
class CooldownInfo:
    """A released slot that may not be granted again before ``until`` (a cool-down, in
    the project's time, as ``HolderInfo``)."""

    name: str
    backend: str
    slot: int
    until: datetime

    def __post_init__(self) -> None:
        _in_project_time(self, "until")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by the backend and asked by djlocks' checks,
    commands, admin and contract tests (never inferred from class names)."""

    #: Waiters are granted in arrival order, and a newcomer never barges past them.
    fifo: bool
    #: Limits above 1 (counting semaphores) are accepted.
    semaphores: bool
    #: A released slot can be held back for a cool-down (``set_cooldown``).
    cooldowns: bool
    #: How a holder that died (SIGKILL, lost host) stops holding. ``"ttl"`` when its
    #: lease runs out; ``"session"`` at once, when the server ends its session;
    #: ``"transaction"`` at once, when the server ends its transaction (a row lock's,
    #: which a lost session also ends); ``"process"`` with the process (in-memory
    #: stores).
    crash_release: Literal["ttl", "session", "transaction", "process"]
    #: djlocks can write the history of this store's grants (``DJLOCKS["EVENTS"]``).
    history: bool
    #: An operator can ask a holder to give its grant back (``request_release``).
    graceful_release: bool
    #: The store tells a holder at once that its grant was taken (``watch``); else the
    #: holder learns it at its next renewal or check.
    pushes_revocation: bool
    #: Grants exclude other processes and hosts, not only other threads.
    shared_between_processes: bool
    #: An operator can list the holders and take their grants away (``force_release``);
    #: not where the store cannot see other connections' locks (row locks on SQLite).
    forced_release: bool = True
    #: A grant lives in the acquiring thread's database transaction, so it is released
    #: in that thread, never from async code.
    in_caller_transaction: bool = False
    #: A grant may be held for hours without holding up anything but its own name, as a
    #: leadership's term is; not where one grant holds the database's only write lock
    #: (row locks on SQLite).
    long_holds: bool = True

    @property
    def grant_ends_with(self) -> str:
        """What a grant ends with when it has no lease to run out (``expires_at`` is
        ``None``), in words for an operator: ``"its session"``, ``"its transaction"``,
        ``"its process"``; ``"its lease"`` where every grant has one."""
        return "its lease" if self.crash_release == "ttl" else f"its {self.crash_release}"


class LockBackend(ABC):
    """A lock store. Instances are shared by every thread of a process.

    ``acquire`` blocks until ``deadline`` (a ``time.monotonic()`` value, or
    ``None`` to wait forever) and returns ``None`` when it ran out; ``abort``
    lets another thread end the wait early (asyncio cancellation). Whatever
    ends in an unknown state is cleaned up by token before returning.
    """

    #: What a forced release does to the holder, for the admin's confirmation page.
    forced_release_effect = "its grant is taken away"

    #: The ``OPTIONS`` keys the backend reads: the system check warns of any other
    #: (``djlocks.W006``, a misspelling). ``None``: not declared, not checked.
    option_names: ClassVar[frozenset[str] | None] = None

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do; a class attribute where it does not depend on the database."""

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

        Returns the new end, in the project's time (``moments.project_moment``), or
        ``None`` once cleared. Raises ``ValueError`` if the store has no such slot,
        or (this default) keeps no cool-downs at all.
        """
        raise ValueError(
            f"Backend {self.alias!r} ({type(self).__name__}) keeps no cool-downs; "
            f"use a lease backend for names that need one."
        )

    @abstractmethod
    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Remove what dead holders and waiters left behind; return counts by kind.

        Never needed for correctness (expired records are ignored); it bounds
        the store's size. Safe to run at any time, from any process.

        With ``idle_names`` (seconds), also remove each name that nothing holds,
        waits for or cools down on and that was last granted more than that long
        ago: its rows or keys go, and so does its place in the store's listings.
        Its fences are not forgotten: a name that comes back starts above every
        fence it had (the store's clock in microseconds where the store keeps
        the fence, the largest removed fence in memory). Use at least
        ``djlocks.written.SHORTEST_IDLE`` (120) seconds, as the command and the
        setting do: a process re-checks the names it created every 60 s.
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
        where the backend cannot do this (``capabilities.graceful_release`` is False: this
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

    def key(self, name: str, slot: int | str | None = None) -> int | str | None:
        """The server's own lock key for ``name`` (``slot=None``), a semaphore slot (int)
        or its gate (``"gate"``), for finding it with the database's tools
        (``djlocks key``); ``None`` (this default) where the store keeps names in
        djlocks' tables or keys rather than in server lock keys."""
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


#: The ``OPTIONS`` of a backend on a database: ``using``, its ``DATABASES`` alias.
DATABASE_OPTIONS = frozenset({"using"})


def database_alias(options: Mapping[str, Any], model: str) -> str:
    """The database a backend takes its locks on: ``OPTIONS["using"]``, else the one
    the project's ``DATABASE_ROUTERS`` pick for writing djlocks' ``model`` (Django's
    ``router.db_for_write``: ``"default"`` where no router has a say). Writes, never
    reads: a router that sends reads to a replica does not move locks there."""
    if "using" in options:
        return str(options["using"])
    from django.apps import apps
    from django.db import router

    return router.db_for_write(apps.get_model("djlocks", model))


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
