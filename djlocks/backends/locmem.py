"""The in-process backend: every grant lives in this process's memory.

``LocMemBackend`` locks between the threads of one process and nothing else:
another process, or another ``LocMemBackend`` instance, has its own store.
It exists for tests (see ``djlocks.testing``) and as the reference
implementation of ``LockBackend``: the smallest store that keeps the whole
contract, with each method's docstring saying what the contract requires of
every backend. The database and Redis backends keep the same promises with
SQL, Lua and server sessions; here each one is a few lines of Python.

The state is a dict of names, each with its limit, its last fence, its
grants by slot, its cool-downs by slot and its queue of waiters. One lock
guards all of it; each name has a ``threading.Condition`` on that lock, which
is notified whenever a slot of the name may have become free. The store's
clock is ``time.monotonic()``: leases, cool-downs and deadlines are judged by
it, and only shown as aware UTC datetimes.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from djlocks.backends.base import (
    Abort,
    AcquireRequest,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
)
from djlocks.exceptions import AlreadyHeld, LockLost
from djlocks.identity import Identity

#: The wall-clock time at which ``time.monotonic()`` was 0, taken once: every moment
#: is shown the same way at every call, even if the wall clock is set meanwhile.
_MONOTONIC_ZERO = datetime.now(UTC) - timedelta(seconds=time.monotonic())


def _shown(moment: float) -> datetime:
    """The monotonic ``moment`` as an aware UTC datetime, for display only."""
    return _MONOTONIC_ZERO + timedelta(seconds=moment)


@dataclass
class _Lease:
    """One live (or expired, not yet taken over) grant of a slot."""

    token: str
    fence: int
    identity: Identity
    since: datetime
    expires: float  # time.monotonic()

    def live(self, now: float) -> bool:
        return now < self.expires


@dataclass
class _Waiter:
    identity: Identity
    since: datetime


@dataclass
class _Name:
    """Everything the store knows about one name. Kept while the process lives, so
    that its fence counter survives the name being idle."""

    limit: int
    changed: threading.Condition
    fence: int = 0  # the last fence issued for the name
    leases: dict[int, _Lease] = field(default_factory=dict)  # by slot
    cooldowns: dict[int, float] = field(default_factory=dict)  # slot -> monotonic end
    queue: list[_Waiter] = field(default_factory=list)  # FIFO: the first waited longest

    def free_slots(self, now: float) -> list[int]:
        return [slot for slot in range(self.limit) if self.is_free(slot, now)]

    def is_free(self, slot: int, now: float) -> bool:
        """Nobody holds a live lease of ``slot`` and its cool-down is over."""
        lease = self.leases.get(slot)
        held = lease is not None and lease.live(now)
        return not held and self.cooldowns.get(slot, now) <= now

    def wake_all(self) -> None:
        """Wake every waiter of the name to look again (``abort.set()`` calls this)."""
        with self.changed:
            self.changed.notify_all()

    def next_change(self, now: float) -> float | None:
        """When a slot frees itself (a lease expires, a cool-down ends); ``None``: never."""
        moments = [lease.expires for lease in self.leases.values() if lease.live(now)]
        moments += [end for end in self.cooldowns.values() if end > now]
        return min(moments, default=None)


class LocMemBackend(LockBackend):
    """Locks and semaphores in this process's memory, shared by all its threads.

    No ``OPTIONS``. Each instance is its own store, so ``backends.reset()``
    (called when ``DJLOCKS["BACKENDS"]`` changes) starts with an empty one.
    Waiters are woken by a ``threading.Condition`` when a slot is released,
    or when a lease or cool-down they wait on ends: no polling.
    """

    forced_release_effect = (
        "its grant is taken away at once: its next check, renewal or release raises "
        "LockLost, and the next holder gets a higher fence"
    )
    #: False: the store and its grants vanish with the process, so a history of them
    #: in the database would outlive what it describes, and a test's database
    #: transaction (which holds SQLite's one write lock) would block the writes.
    records_history = False

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self._lock = threading.Lock()
        self._names: dict[str, _Name] = {}

    # -- acquire -------------------------------------------------------------

    def acquire(
        self, request: AcquireRequest, deadline: float | None, abort: Abort | None
    ) -> GrantRecord | None:
        """Grant one free slot of ``request.name`` or wait for one, first come first served.

        Returns ``None`` once ``time.monotonic()`` reaches ``deadline`` (a
        deadline already past tries once) or when ``abort`` is set. A caller
        never passes a waiter queued before it. Raises ``AlreadyHeld`` when the
        name is held with another ``limit``.
        """
        with self._lock:
            entry = self._entry(request)
            record = self._claim(entry, request, ahead=len(entry.queue))
            if record is not None or (deadline is not None and time.monotonic() >= deadline):
                return record
            waiter = _Waiter(request.identity, datetime.now(UTC))
            entry.queue.append(waiter)
        woken_by_abort = (
            contextlib.nullcontext() if abort is None else abort.cancelling(entry.wake_all)
        )
        try:
            with woken_by_abort:
                return self._wait(entry, request, waiter, deadline, abort)
        finally:
            with self._lock:
                entry.queue.remove(waiter)
                entry.changed.notify_all()  # those behind move up

    def _entry(self, request: AcquireRequest) -> _Name:
        """The name's state, created on first use; reshaped to a new limit only while unheld."""
        entry = self._names.get(request.name)
        if entry is None:
            entry = _Name(request.limit, threading.Condition(self._lock))
            self._names[request.name] = entry
        elif entry.limit != request.limit:
            now = time.monotonic()
            if any(lease.live(now) for lease in entry.leases.values()):
                raise AlreadyHeld.limit_mismatch(request.name, entry.limit, request.limit)
            entry.limit = request.limit
            entry.leases.clear()  # all expired
            entry.cooldowns = {s: end for s, end in entry.cooldowns.items() if s < entry.limit}
        return entry

    def _claim(self, entry: _Name, request: AcquireRequest, ahead: int) -> GrantRecord | None:
        """Take the first free slot if more slots are free than waiters are ``ahead``."""
        now = time.monotonic()
        free = entry.free_slots(now)
        if len(free) <= ahead:
            return None
        slot = free[0]
        entry.fence += 1
        lease = _Lease(
            secrets.token_hex(16),
            entry.fence,
            request.identity,
            datetime.now(UTC),
            now + request.ttl,
        )
        entry.leases[slot] = lease  # replaces an expired lease: taken over
        entry.cooldowns.pop(slot, None)
        return GrantRecord(lease.token, slot, lease.fence, _shown(lease.expires), requested_at=now)

    def _wait(
        self,
        entry: _Name,
        request: AcquireRequest,
        waiter: _Waiter,
        deadline: float | None,
        abort: Abort | None,
    ) -> GrantRecord | None:
        """Sleep on the name's condition until a slot comes to this waiter's turn."""
        with self._lock:
            while abort is None or not abort.is_set():
                self._entry(request)  # the limit may have been changed meanwhile
                record = self._claim(entry, request, ahead=entry.queue.index(waiter))
                if record is not None:
                    return record
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                wake_at = min(
                    (m for m in (deadline, entry.next_change(now)) if m is not None), default=None
                )
                entry.changed.wait(None if wake_at is None else wake_at - now)
            return None

    # -- release, renew, check -----------------------------------------------

    def release(self, name: str, token: str, cooldown: float) -> None:
        """End the grant ``token`` and start its slot's cool-down of ``cooldown`` seconds.

        Compare-and-act on the token: a grant that had already ended (expired,
        or released by force) raises ``LockLost`` and frees nothing, whoever
        holds the slot now.
        """
        with self._lock:
            now = time.monotonic()
            found = self._find(name, token)
            if found is None:
                raise LockLost(
                    f"The grant of {name!r} had ended before release: it was released by "
                    f"force, or its lease expired (and was taken over or swept)."
                )
            entry, slot, lease = found
            del entry.leases[slot]
            if not lease.live(now):
                raise LockLost(
                    f"The grant of {name!r} had ended before release: its lease expired."
                )
            if cooldown > 0:
                entry.cooldowns[slot] = now + cooldown
            entry.changed.notify_all()

    def renew(self, name: str, token: str, ttl: float) -> datetime | None:
        """Extend the live grant ``token`` to expire ``ttl`` seconds from the store's now.

        Returns the new expiry. Raises ``LockLost`` if the grant had ended: an
        expired lease is never re-claimed, even if nobody has taken it over.
        """
        with self._lock:
            now = time.monotonic()
            found = self._find(name, token)
            if found is None or not found[2].live(now):
                raise LockLost(f"The lease on {name!r} could not be renewed: it had already ended.")
            lease = found[2]
            lease.expires = now + ttl
            return _shown(lease.expires)

    def is_held(self, name: str, token: str) -> bool:
        """True while the grant ``token`` is live: not released, expired or taken away."""
        with self._lock:
            found = self._find(name, token)
            return found is not None and found[2].live(time.monotonic())

    def _find(self, name: str, token: str) -> tuple[_Name, int, _Lease] | None:
        """The lease ``token`` of ``name`` and its slot, live or expired; ``None`` once gone."""
        entry = self._names.get(name)
        if entry is None:
            return None
        return next(
            ((entry, s, lease) for s, lease in entry.leases.items() if lease.token == token), None
        )

    # -- introspection ---------------------------------------------------------

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        """Live grants of ``name`` (or of every name), by name and slot."""
        with self._lock:
            now = time.monotonic()
            return [
                HolderInfo(
                    name=key,
                    backend=self.alias,
                    slot=slot,
                    limit=entry.limit,
                    **asdict(lease.identity),
                    since=lease.since,
                    expires_at=_shown(lease.expires),
                    fence=lease.fence,
                    token=lease.token,
                )
                for key, entry in self._chosen(name)
                for slot, lease in sorted(entry.leases.items())
                if lease.live(now)
            ]

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        """Callers blocked in ``acquire`` for ``name`` (or every name), in queue order."""
        with self._lock:
            return [
                WaiterInfo(
                    name=key,
                    backend=self.alias,
                    position=position,
                    **asdict(waiter.identity),
                    since=waiter.since,
                )
                for key, entry in self._chosen(name)
                for position, waiter in enumerate(entry.queue)
            ]

    def names(self) -> list[tuple[str, int]]:
        """Every ``(name, limit)`` acquired since the store began, held or free, by name."""
        with self._lock:
            return [(key, entry.limit) for key, entry in sorted(self._names.items())]

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        """Slots whose cool-down has not yet ended, by name and slot."""
        with self._lock:
            now = time.monotonic()
            return [
                CooldownInfo(name=key, backend=self.alias, slot=slot, until=_shown(end))
                for key, entry in self._chosen(name)
                for slot, end in sorted(entry.cooldowns.items())
                if end > now
            ]

    def _chosen(self, name: str | None) -> list[tuple[str, _Name]]:
        if name is None:
            return sorted(self._names.items())
        return [(name, self._names[name])] if name in self._names else []

    # -- operators' actions ----------------------------------------------------

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        """End slot ``slot``'s cool-down ``seconds`` from now (0 clears it); return the end.

        Raises ``ValueError`` if the name has no such slot. Waiters are woken,
        since a shorter cool-down may free the slot at once.
        """
        with self._lock:
            entry = self._names.get(name)
            if entry is None or not 0 <= slot < entry.limit:
                raise ValueError(f"{name!r} has no slot {slot} on backend {self.alias!r}.")
            now = time.monotonic()
            entry.cooldowns.pop(slot, None)
            if seconds > 0:
                entry.cooldowns[slot] = now + seconds
            entry.changed.notify_all()
            return _shown(now + seconds) if seconds > 0 else None

    def force_release(self, name: str, token: str | None = None) -> int:
        """Take the live grant ``token`` of ``name`` away (or every live grant); return how many.

        The holder learns ``LockLost`` at its next check, renewal or release;
        the fence counter goes on, so the next holder's fence is higher.
        """
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                return 0
            now = time.monotonic()
            taken = [
                slot
                for slot, lease in entry.leases.items()
                if lease.live(now) and token in (None, lease.token)
            ]
            for slot in taken:
                del entry.leases[slot]
            entry.changed.notify_all()
            return len(taken)

    def sweep(self) -> dict[str, int]:
        """Forget expired leases and ended cool-downs; return how many of each.

        Never needed for correctness: expired leases and ended cool-downs are
        ignored. Names are kept, with their fence counters, so a fence is never
        issued twice. There are no dead waiters to remove: a waiter leaves the
        queue in a ``finally`` of its own thread.
        """
        with self._lock:
            now = time.monotonic()
            expired = ended = 0
            for entry in self._names.values():
                live = {slot: lease for slot, lease in entry.leases.items() if lease.live(now)}
                cooling = {slot: end for slot, end in entry.cooldowns.items() if end > now}
                expired += len(entry.leases) - len(live)
                ended += len(entry.cooldowns) - len(cooling)
                entry.leases, entry.cooldowns = live, cooling
            return {"expired grants": expired, "ended cool-downs": ended}
