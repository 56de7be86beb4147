"""The grant: what one successful acquire hands back to its holder."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connections

from djlocks import metrics
from djlocks.backends.base import GrantRecord, LockBackend
from djlocks.events import events
from djlocks.exceptions import LockLost, NotHeld, ReleaseRequested
from djlocks.heartbeat import heartbeat
from djlocks.identity import Identity
from djlocks.kinds import Kind
from djlocks.moments import project_moment
from djlocks.signals import lock_lost
from djlocks.watchdog import watchdog

if TYPE_CHECKING:
    from djlocks.core import Lock

lost_log = logging.getLogger("djlocks.lost")
release_log = logging.getLogger("djlocks.release")

#: The exception leaving a ``with`` block, as ``__exit__`` receives it.
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]

#: A holder stops believing this share of the TTL before the lease's end, so that it
#: never believes past its TTL (honest belief, docs/guarantees.md).
BELIEF_MARGIN = 0.1
#: The reason ``on_lost`` and ``lock_lost`` are given when an operator asks the holder
#: to give its grant back (a graceful release): it is still held, until it is released
#: or the operator's wait runs out.
RELEASE_REQUESTED = "release requested by an operator"
#: Seconds a release that finds its grant lost waits for the loss to reach the history
#: before it raises ``LockLost``: the thread that found the loss (the heartbeat, a
#: revocation push) may still be writing it, and once release has said "lost", the
#: history says so too.
LOSS_RECORD_WAIT = 5.0
#: The reason ``on_lost`` and ``lock_lost`` are given, and ``LockLost`` says, when a
#: grant was held past its ``max_hold``: the heartbeat then takes it back.
HELD_PAST_MAX_HOLD = "held for longer than its max_hold"


class Grant:
    """A live grant of one slot of a name.

    ``fence`` (int) is strictly greater than every fence handed out earlier for
    the name; pass it to the protected resource (see ``djlocks.fencing``).
    ``expires_at`` is the lease's expiry by the store's clock (a ``datetime``,
    refreshed by each renewal) or ``None`` for grants that end with a session or
    transaction. ``acquired_at`` (a ``datetime``) and ``waited`` (seconds spent in
    acquire) describe the grant in the event history. Both moments are in the
    project's time, as ``django.utils.timezone.now()`` gives it: aware (UTC) under
    ``USE_TZ``, naive local time otherwise.
    """

    def __init__(
        self,
        spec: Lock,
        backend: LockBackend,
        record: GrantRecord,
        ttl: float,
        acquire_started: float,
        identity: Identity,
        on_lost: Callable[[Grant, str], None] | None,
        max_hold: float | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.backend = backend
        self.token = record.token
        self.slot = record.slot
        self.fence = record.fence
        self.expires_at = project_moment(record.expires_at)
        self.ttl = ttl
        self.identity = identity
        # ``acquired_at`` shows the grant's moment by the wall clock, as USE_TZ is now.
        self._granted_wall = time.time()  # wall clock ok
        self._granted_aware = settings.USE_TZ
        self.granted = time.monotonic()
        self.waited = self.granted - acquire_started  # seconds, for the history
        self._on_lost = on_lost
        #: The transaction the grant lives in, if djlocks opened one (the row backend).
        self.scope: AbstractContextManager[Any] | None = record.scope
        self.thread = threading.get_ident()
        self.pid = os.getpid()
        self._guard = threading.Lock()
        # A lease counts from when its request was sent (a long wait in the queue
        # before it does not shorten it); a session's or transaction's grant from now.
        believe_from = time.monotonic() if record.requested_at is None else record.requested_at
        #: The ``time.monotonic()`` moment past which the grant is not held (``max_hold``
        #: seconds from the grant), or ``None``.
        self.hold_until = None if max_hold is None else self.granted + max_hold
        self._believe_until = self._within_max_hold(believe_from + ttl * (1 - BELIEF_MARGIN))
        self._lost_reason: str | None = None
        #: Made with the first loss noted, set once that loss is in the history.
        self._loss_recorded: threading.Event | None = None
        self._loss_teller: int | None = None  # the thread telling listeners of the loss
        self._released = False
        self._release_requested = False
        #: Renewals that failed in a row (counted, and logged, by the heartbeat).
        self.renewal_failures = 0
        #: Where the metrics counted the grant (``djlocks.metrics``), until its end is
        #: counted too.
        self.measured_as: object = None

    @property
    def acquired_at(self) -> datetime:
        """When the grant was made, by this host's wall clock, as
        ``django.utils.timezone.now()`` gave it then: aware (UTC) under ``USE_TZ``, else
        naive local time. The clock is read at the grant; the ``datetime`` is built when
        asked for (the event history), not on the way to the holder."""
        return datetime.fromtimestamp(self._granted_wall, UTC if self._granted_aware else None)

    def __repr__(self) -> str:
        state = "lost" if self._lost_reason else "released" if self._released else "held"
        return f"<Grant {self.name!r} slot={self.slot} fence={self.fence} {state}>"

    @property
    def believed(self) -> bool:
        """True while the holder may believe it holds the grant, by the local monotonic clock.

        False after the lease's TTL (less a margin) ran out without a renewal,
        after a loss was detected, and after release. No I/O.
        """
        with self._guard:
            return (
                not self._released
                and self._lost_reason is None
                and time.monotonic() < self._believe_until
            )

    def check(self) -> None:
        """Raise ``LockLost`` unless the grant is still live.

        Asks the store (one round trip), so a forced release or a lease that
        another holder took over is seen at once, not only at the next renewal.
        Raises ``ReleaseRequested`` (a ``LockLost``) while an operator asks for
        the grant back (a graceful release): it is still held, for
        ``seconds_left`` at most; release it. Raises ``NotHeld`` in a forked
        child (see ``refuse_in_a_forked_child``).
        """
        self.refuse_in_a_forked_child()
        if self._released:
            raise LockLost(f"The grant of {self.name!r} was released.")
        asked = time.monotonic()
        if self._lost_reason is None and asked >= self._believe_until:
            self.mark_lost(self.ran_out_reason())
        elif self._lost_reason is None:
            try:
                if not self.backend.is_held(self.name, self.token):
                    self.mark_lost("the store no longer has it (expired or released by force)")
            except ReleaseRequested as request:
                self.release_requested(asked, request)
            except LockLost as exc:
                self.mark_lost(str(exc))
        if self._lost_reason is not None:
            reason = self._lost_reason.rstrip(".")
            raise LockLost(f"The grant of {self.name!r} was lost: {reason}.")
        if self._release_requested:
            left = max(0.0, self._believe_until - time.monotonic())
            raise ReleaseRequested(
                f"An operator asked for the grant of {self.name!r} back: it stays held for "
                f"{left:.1f} s at most, unless released first. Release it.",
                left,
                self.expires_at,
            )

    def refuse_in_a_forked_child(self) -> None:
        """Raise ``NotHeld`` in a process forked from the one that acquired the grant.

        The grant, its session and its renewals belong to the parent (dedicated
        connections are never inherited across ``fork()``): a child that released
        or checked it through inherited connections would end or disturb the
        parent's hold. No I/O.
        """
        if self.pid != os.getpid():
            raise NotHeld(
                f"The grant of {self.name!r} belongs to process {self.pid}, which acquired "
                f"it; this process ({os.getpid()}) was forked from it and may not check or "
                f"release it. Acquire the lock in this process instead."
            )

    def release(self) -> None:
        """Release this grant, from any thread (``Lock.release()`` serves the acquiring one).

        Raises ``LockLost`` if the grant had already ended; the slot is free
        either way afterwards. Raises ``NotHeld`` from another thread for a
        grant that lives in a transaction, and in a forked child.
        """
        self.spec.forget(self)
        self.end()

    def end(self, exc_info: ExcInfo = (None, None, None)) -> None:
        """Release the grant at the store; ``exc_info`` is the exception leaving a ``with``
        block, if any (``Lock`` calls this once it has stopped filing the grant).

        A grant that lives in a transaction djlocks opened (``record.scope``: the
        row backend's) ends with that transaction: committed, or rolled back on
        an exception, in the thread that acquired it. Raises ``LockLost`` if the
        grant had already ended (the slot is free either way), and ``NotHeld``
        in a forked child or, for a grant in a transaction, from another thread.
        """
        self.refuse_in_a_forked_child()
        if self.scope is not None and self.thread != threading.get_ident():
            raise NotHeld(
                f"The grant of {self.name!r} lives in the database transaction of the "
                f"thread that acquired it; release it from that thread."
            )
        lost_earlier = self.begin_release()
        try:
            self._release_at_store(exc_info, lost_earlier)
        finally:
            # After the store's release, which the next holder waits for: a renewal
            # meanwhile reports nothing (``begin_release``).
            heartbeat.discard(self)
            self._measure_end()
        release_log.debug("released %s fence %s", self.name, self.fence)
        events.grant_ended(self, Kind.RELEASED)

    def _release_at_store(self, exc_info: ExcInfo, lost_earlier: str | None) -> None:
        """Release at the store (and leave the grant's scope); raise ``LockLost`` if it
        had ended, with the loss seen before the release (``lost_earlier``) first."""
        try:
            try:
                self.backend.release(self.name, self.token, self.spec.cooldown)
            except LockLost as exc:
                self.mark_lost(str(exc), by_release=True)
                self._wait_for_the_loss_record()
                raise
            finally:
                if self.scope is not None:
                    self.scope.__exit__(*exc_info)
        except LockLost as exc:  # from the store, or from the scope's commit
            if lost_earlier is None:
                raise
            raise self._lost_before(lost_earlier) from exc  # the store's word is the cause
        if lost_earlier is not None:
            self._wait_for_the_loss_record()
            raise self._lost_before(lost_earlier)

    def _wait_for_the_loss_record(self) -> None:
        """Let the history say so too before the release raises ``LockLost``; not in the
        thread telling listeners of the loss (a listener releasing the grant), whose
        record comes once the listeners return."""
        recorded = self._loss_recorded
        if recorded is not None and self._loss_teller != threading.get_ident():
            recorded.wait(LOSS_RECORD_WAIT)

    def hand_over(self) -> str:
        """Stop holding the grant in this process without ending it at the store, for
        another process to release by its token (returned). No renewal, release or loss
        is reported for it here from now on; the store ends it at its TTL, or when the
        other process releases it."""
        heartbeat.discard(self)
        self.spec.forget(self)
        self.begin_release()
        self._measure_end()
        return self.token

    def _measure_end(self) -> None:
        """Put the grant's end (a release, or a loss) in the metrics, once."""
        with self._guard:
            series, self.measured_as = self.measured_as, None
        if series is not None:
            held = time.monotonic() - self.granted
            metrics.grant_ended(series, held, self._lost_reason is not None)

    def _lost_before(self, lost_earlier: str) -> LockLost:
        """What release raises after a loss was seen before it (``lost_earlier``), whether
        or not the store, asked again, says the grant had ended."""
        return LockLost(
            f"The grant of {self.name!r} was lost before release: {lost_earlier.rstrip('.')}."
        )

    def renewed(
        self, renewal_started: float, expires_at: datetime | None, lasts: float | None = None
    ) -> None:
        """Record a successful renewal that was sent at ``renewal_started`` (monotonic).

        ``lasts`` (seconds) is what the store said the lease has left when that
        is less than the TTL (a graceful release's wait): the holder then
        believes no longer than that, less the margin.
        """
        length = self.ttl if lasts is None else min(self.ttl, lasts)
        with self._guard:
            if self._lost_reason is not None:  # too late: the holder was told
                return
            believed_until = self._believe_until
            self._believe_until = self._within_max_hold(
                renewal_started + length * (1 - BELIEF_MARGIN)
            )
            self.expires_at = project_moment(expires_at)
            shortened = self._believe_until < believed_until
        if shortened:
            watchdog.moved_earlier(self)

    def _within_max_hold(self, moment: float) -> float:
        return moment if self.hold_until is None else min(moment, self.hold_until)

    def held_past_max_hold(self) -> bool:
        """Whether the grant has been held for its ``max_hold`` (by the monotonic clock)."""
        return self.hold_until is not None and time.monotonic() >= self.hold_until

    def take_back(self) -> None:
        """End the grant at its store as a forced release does, so that the next waiter
        gets it (the heartbeat does this once the grant is held past ``max_hold``; the
        calling thread's Django connections are closed afterwards). Never raises: a
        store that cannot be reached ends a lease at its TTL all the same, and a
        session lock with its session."""
        try:
            self.backend.force_release(self.name, self.token)
        except Exception:
            lost_log.warning(
                "could not take back %s (fence %s), held past its max_hold",
                self.name,
                self.fence,
                exc_info=True,
            )
        finally:
            connections.close_all()  # this thread's own, if the backend opened one

    def believe_until(self) -> float:
        """The ``time.monotonic()`` moment the holder stops believing it holds the grant,
        unless a renewal moves it: before its lease can end by the store's clock."""
        return self._believe_until

    def release_requested(self, asked_at: float, request: ReleaseRequested) -> None:
        """Note that an operator asks for the grant back, as the store said in answer to a
        renewal or check sent at ``asked_at`` (monotonic); tell listeners once.

        The holder believes no longer than the operator's wait
        (``request.seconds_left``); ``on_lost`` and ``lock_lost`` get
        ``RELEASE_REQUESTED`` as the reason.
        """
        self.renewed(asked_at, request.expires_at, request.seconds_left)
        with self._guard:
            if self._release_requested or self._lost_reason is not None or self._released:
                return
            self._release_requested = True
        lost_log.warning(
            "release of %s (fence %s) requested: %s s left",
            self.name,
            self.fence,
            round(request.seconds_left, 3),
        )
        lock_lost.send(sender=type(self.spec), spec=self.spec, grant=self, reason=RELEASE_REQUESTED)
        if self._on_lost is not None:
            self._on_lost(self, RELEASE_REQUESTED)

    def ran_out_reason(self) -> str:
        """Why the grant is lost once the holder's belief ran out without a renewal."""
        if self.held_past_max_hold():
            return HELD_PAST_MAX_HOLD
        if self._release_requested:
            return "the wait an operator gave for its release ran out"
        return "its lease ran out without a successful renewal"

    def mark_lost(
        self,
        reason: str,
        *,
        by_release: bool = False,
        take_back: bool = False,
        record_in_background: bool = False,
    ) -> None:
        """Note that the grant ended without release; tell listeners once, then put the
        loss in the history (so a history store that hangs delays no listener).

        Once release has begun only the release itself may report a loss, so a
        renewal that races with the release cannot raise a false alarm.
        ``take_back``: end the grant at its store too (``take_back()``), after the
        loss is noted (a release from now on reports it) and before anyone is told
        (whatever a listener does cannot stop it); even if the loss was noted before.
        ``record_in_background``: hand the loss's events to the background writer even
        where the history writes losses at once (for a caller that must not wait on
        the database: the watchdog).
        """
        with self._guard:
            first = self._lost_reason is None and (by_release or not self._released)
            if first:
                self._lost_reason = reason
                self._loss_teller = threading.get_ident()
                self._loss_recorded = recorded = threading.Event()
        if take_back:
            self.take_back()
        if not first:
            return
        lost_log.warning("lost %s (fence %s): %s", self.name, self.fence, reason)
        self._measure_end()
        try:
            lock_lost.send(sender=type(self.spec), spec=self.spec, grant=self, reason=reason)
            if self._on_lost is not None:
                self._on_lost(self, reason)
        finally:
            try:
                events.grant_ended(self, Kind.LOST, reason, in_background=record_in_background)
            finally:
                recorded.set()

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason

    def begin_release(self) -> str | None:
        """Stop renewals from reporting; return the loss reason seen before, if any."""
        with self._guard:
            self._released = True
            return self._lost_reason
