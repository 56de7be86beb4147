"""Leader election: one process of many leads, the others stand by.

``leadership("scheduler")`` campaigns for the name in a thread of its own: it
waits in the lock's queue like any waiter (no polling where the backend does
not poll) and, once granted, keeps the grant renewed for as long as the process
lives and leads. Each leadership is one grant of the lock
``djlocks:leader:<name>``, and its ``term`` is that grant's fence, so every new
leader's term is higher than every earlier one's: a deposed leader that wakes up
and writes can be refused with ``djlocks.fencing.fenced_update(..., term)``.

A leader is deposed when its grant is lost (its lease ran out unrenewed, it was
released by force) or an operator asks for it back; it then steps down, says
so through ``on_deposed``, and stands by again. A standby takes over when the
leader's grant ends: at once when a leader steps down or its session dies, and
within one TTL of a dead leader's last renewal on a lease backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from django.db import connections

from djlocks.arguments import Seconds, normalize_timeout, validate_name
from djlocks.backends.base import HolderInfo, WaiterInfo
from djlocks.backends.dedicated import DedicatedConnections
from djlocks.backends.waiting import Abort
from djlocks.core import Lock
from djlocks.exceptions import BackendUnavailable, LockError, LockLost, NotAcquired
from djlocks.grant import Grant

leadership_log = logging.getLogger("djlocks.leadership")

#: The lock behind the leadership of ``name`` is ``ELECTION_PREFIX + name``.
ELECTION_PREFIX = "djlocks:leader:"
#: Why ``on_deposed`` was called when the leader itself stepped down (``stop()``).
STEPPED_DOWN = "stepped down"
#: Seconds a standby waits before campaigning again after the store could not be reached.
RETRY_AFTER = 1.0

Elected = Callable[[int], None]
Deposed = Callable[[int, str], None]


class NotLeader(LockError):
    """This process is not the leader now (``Leadership.check``)."""


def refuse_short_holds(lock: Lock) -> None:
    """``ValueError`` if ``lock``'s backend cannot hold a grant for a whole term without
    holding up other names (``capabilities.long_holds``: not the row backend on
    SQLite, whose grant holds the database's only write lock)."""
    if not lock.backend.capabilities.long_holds:
        raise ValueError(
            f"The backend {lock.backend_alias!r} cannot hold a leadership: its grant would "
            f"hold up every other write to its database for the whole term. Use a lease "
            f"backend (or Redis) for leader election."
        )


def election_name(name: str) -> str:
    """The lock name behind the leadership of ``name``; ``ValueError`` if too long."""
    name = validate_name(name)
    try:
        return validate_name(ELECTION_PREFIX + name)
    except ValueError:
        raise ValueError(
            f"A leadership's name may be at most {255 - len(ELECTION_PREFIX)} characters "
            f"(its lock is {ELECTION_PREFIX!r} + the name); {name[:40]!r}... has {len(name)}."
        ) from None


def elected_name(lock_name: str) -> str | None:
    """The leadership a lock name belongs to, or ``None`` if it is not an election's."""
    if lock_name.startswith(ELECTION_PREFIX):
        return lock_name[len(ELECTION_PREFIX) :]
    return None


class Leadership:
    """Campaign for leadership of ``name`` among every process that uses the same backend.

    Arguments: ``name`` (``str``, at most 240 characters); ``ttl`` (seconds: how long
    a dead leader's lease outlives its last renewal, on lease backends; default
    ``DJLOCKS["TTL"]``); ``backend`` (an alias of ``DJLOCKS["BACKENDS"]``); ``label``
    (what operators see for this candidate); ``timeout`` (seconds the ``with`` form
    waits to be elected, ``None``: forever); ``on_elected(term)`` and
    ``on_deposed(term, reason)``, called in the campaign's thread when this process
    becomes leader and when it stops being leader (deposed, or ``stop()``: the reason
    is then ``STEPPED_DOWN``). An exception from a callback is logged on
    ``djlocks.leadership`` and the campaign goes on.

    Long-running: ``start()``, then read ``is_leader`` and ``term`` (no I/O) or
    ``wait_until_leader()``; ``stop()`` steps down and ends the campaign. As a
    context manager: ``with leadership("scheduler") as leader:`` waits to be elected
    (``NotAcquired`` after ``timeout``) and steps down on leaving; inside, a deposed
    leader stands by again and ``leader.is_leader`` says which it is now.

    The grant is renewed like any lock's; ``DJLOCKS["MAX_HOLD"]``, if set, bounds a
    term too (the leader is then deposed and stands by again). Raises
    ``ValueError``/``TypeError`` for bad arguments.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: Seconds | None = None,
        backend: str = "default",
        label: str | None = None,
        timeout: Seconds | None = None,
        on_elected: Elected | None = None,
        on_deposed: Deposed | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.timeout = normalize_timeout(timeout)
        for what, callback in (("on_elected", on_elected), ("on_deposed", on_deposed)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{what} must be a function or None, not {callback!r}.")
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.lock = Lock(
            election_name(name),
            ttl=ttl,
            backend=backend,
            label=label,
            max_hold=None,
            on_lost=self._on_lost,
        )
        self._changed = threading.Condition()
        self._grant: Grant | None = None
        self._step_down: str | None = None  # why the leader must step down now
        self._campaign: threading.Thread | None = None
        self._ended = False  # the campaign's thread has finished
        self._stopping = threading.Event()
        self._abort = Abort()

    def __repr__(self) -> str:
        campaigning = self._campaign is not None and not self._ended
        state = "not campaigning"
        if campaigning:
            state = f"leader, term {self.term}" if self.is_leader else "standing by"
        return f"<Leadership {self.name!r} backend={self.lock.backend_alias!r} {state}>"

    # -- state (no I/O) --------------------------------------------------------

    @property
    def grant(self) -> Grant | None:
        """The grant this process leads by, or ``None`` while it stands by (and in a
        child forked from the leader: the grant is its parent's)."""
        grant = self._grant
        if grant is None or grant.pid != os.getpid() or not grant.believed:
            return None
        return grant

    @property
    def is_leader(self) -> bool:
        """Whether this process leads now (elected, and its grant still believed held)."""
        return self.grant is not None

    @property
    def term(self) -> int | None:
        """The current term, or ``None`` while this process is not the leader.

        The term is the grant's fence, so it is higher than every earlier leader's."""
        grant = self.grant
        return None if grant is None else grant.fence

    def check(self) -> int:
        """Return the term if this process leads now; raise ``NotLeader`` if it does not.

        Asks the store (a renewal where the backend renews, a keep-alive of the
        session otherwise), so a leader that was deposed without noticing yet learns it.
        """
        grant = self.grant
        if grant is None:
            raise NotLeader(f"This process is not the leader of {self.name!r}.")
        try:
            grant.check()
        except LockLost as exc:
            raise NotLeader(
                f"This process is no longer the leader of {self.name!r}: {exc}"
            ) from exc
        return grant.fence

    # -- the store's view --------------------------------------------------------

    def leader(self) -> HolderInfo | None:
        """Who leads now, as the store answers (any process), or ``None``; without its
        owner token (``token`` is empty: a token lets its bearer release).

        Raises ``BackendUnavailable`` when the store cannot be reached."""
        holders = self.lock.backend.holders(self.lock.name)
        return dataclasses.replace(holders[0], token="") if holders else None

    def standbys(self) -> list[WaiterInfo]:
        """The candidates standing by, next in line first, as the store answers."""
        return self.lock.backend.waiters(self.lock.name)

    # -- the campaign ------------------------------------------------------------

    def start(self) -> Leadership:
        """Start campaigning in a background thread; return ``self``.

        ``RuntimeError`` if this leadership already campaigns; ``ValueError`` if its
        backend cannot hold a grant for long (``refuse_short_holds``)."""
        if self._campaign is not None and self._campaign.is_alive():
            raise RuntimeError(f"{self!r} already campaigns; stop() it first.")
        refuse_short_holds(self.lock)
        self._stopping.clear()
        self._ended = False
        self._abort = Abort()
        self._campaign = threading.Thread(
            target=self._run, name=f"djlocks-leadership-{self.name}", daemon=True
        )
        self._campaign.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Step down if leading (the grant is released, so a standby takes over at once)
        and end the campaign; wait up to ``timeout`` seconds (``None``: until done)."""
        self._stopping.set()
        with self._changed:
            self._step_down = self._step_down or STEPPED_DOWN
            self._changed.notify_all()
        self._abort.set()
        if self._campaign is not None and self._campaign is not threading.current_thread():
            self._campaign.join(timeout)

    def wait_until_leader(self, timeout: Seconds | None = None) -> bool:
        """Block until this process leads; ``True`` if it does, ``False`` after ``timeout``
        seconds (``None``: no limit) or once the campaign ended. ``RuntimeError`` before
        ``start()``."""
        if self._campaign is None:
            raise RuntimeError(f"{self!r} does not campaign: call start() first.")
        wait = normalize_timeout(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        with self._changed:
            while not self.is_leader:
                if self._stopping.is_set() or self._ended:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def __enter__(self) -> Leadership:
        self.start()
        if not self.wait_until_leader(self.timeout):
            self.stop()
            raise NotAcquired(
                f"The leadership of {self.name!r} was not won within {self.timeout} s."
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    grant = self._elect()
                    if grant is not None:
                        self._lead(grant)
                except Exception:  # a campaign must outlive a bug or a failing store
                    leadership_log.exception(
                        "leadership %r: the campaign failed; campaigning again in %s s",
                        self.name,
                        RETRY_AFTER,
                    )
                    self._stopping.wait(RETRY_AFTER)
        finally:
            DedicatedConnections.close_this_thread()
            connections.close_all()  # this thread's own Django connections
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _elect(self) -> Grant | None:
        """Wait in line for the grant; ``None`` if stopped, or after the store failed."""
        try:
            return self.lock.acquire_grant(timeout=None, abort=self._abort)
        except BackendUnavailable as exc:
            leadership_log.warning(
                "leadership %r: the store cannot be reached (%s); campaigning again in %s s",
                self.name,
                exc,
                RETRY_AFTER,
            )
            self._stopping.wait(RETRY_AFTER)
            return None

    def _lead(self, grant: Grant) -> None:
        """Lead until deposed or stopped, then step down and say so."""
        with self._changed:
            stopped = self._stopping.is_set()  # stop() came as the grant did: never lead
            if not stopped:
                self._grant, self._step_down = grant, None
                self._changed.notify_all()
        if stopped:
            self._give_back(grant)
            return
        self._call(self.on_elected, grant.fence)
        with self._changed:
            while self._step_down is None and grant.believed:
                self._changed.wait(max(0.0, grant.believe_until() - time.monotonic()))
            reason = self._step_down or grant.lost_reason or grant.ran_out_reason()
            self._grant = None
            self._changed.notify_all()
        # The term's work stops before a standby can be elected: on_deposed first.
        self._call(self.on_deposed, grant.fence, reason)
        self._give_back(grant)

    def _give_back(self, grant: Grant) -> None:
        try:
            grant.release()
        except LockLost:
            pass  # deposed: the grant was already gone
        except BackendUnavailable as exc:
            leadership_log.warning(
                "leadership %r: could not release term %s (%s); its lease ends at its TTL",
                self.name,
                grant.fence,
                exc,
            )

    def _on_lost(self, grant: Grant, reason: str) -> None:
        """The grant's ``on_lost``: lost, or asked back by an operator; step down."""
        with self._changed:
            if grant is self._grant:
                self._step_down = self._step_down or reason
                self._changed.notify_all()

    def _call(self, callback: Callable[..., Any] | None, *arguments: Any) -> None:
        if callback is None:
            return
        try:
            callback(*arguments)
        except Exception:
            leadership_log.exception(
                "leadership %r: %s raised", self.name, getattr(callback, "__name__", callback)
            )


def leadership(name: str, **options: Any) -> Leadership:
    """The leadership of ``name``: ``Leadership(name, **options)`` (see it)."""
    return Leadership(name, **options)
