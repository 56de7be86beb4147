"""``LocMemBackend``: the reference implementation of ``LockBackend`` (see the package)."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, astuple
from datetime import UTC, datetime
from typing import Any

from djlocks.backends.base import (
    AcquireRequest,
    Capabilities,
    CooldownInfo,
    GrantRecord,
    HolderInfo,
    LockBackend,
    WaiterInfo,
    in_queue_order,
)
from djlocks.backends.locmem.state import Lease, NameState, Waiter, shown
from djlocks.backends.waiting import Abort
from djlocks.exceptions import AlreadyHeld, LockLost
from djlocks.moments import project_moment


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
    #: No history: the store and its grants vanish with the process, so a history of
    #: them in the database would outlive what it describes, and a test's database
    #: transaction (which holds SQLite's one write lock) would block the writes.
    capabilities = Capabilities(
        fifo=True,
        semaphores=True,
        cooldowns=True,
        crash_release="process",
        history=False,
        graceful_release=False,
        pushes_revocation=True,
        shared_between_processes=False,
    )

    option_names = frozenset[str]()

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self._lock = threading.Lock()
        self._names: dict[str, NameState] = {}
        self._fence_floor = 0  # the largest fence of any name a sweep removed

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
            waiter = Waiter(request.identity, datetime.now(UTC))
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

    def _entry(self, request: AcquireRequest) -> NameState:
        """The name's state, created on first use; reshaped to a new limit only while unheld."""
        entry = self._names.get(request.name)
        if entry is None:
            entry = NameState(request.limit, threading.Condition(self._lock), self._fence_floor)
            self._names[request.name] = entry
        elif entry.limit != request.limit:
            now = time.monotonic()
            if any(lease.live(now) for lease in entry.leases.values()):
                raise AlreadyHeld.limit_mismatch(request.name, entry.limit, request.limit)
            entry.limit = request.limit
            entry.leases.clear()  # all expired
            entry.cooldowns = {s: end for s, end in entry.cooldowns.items() if s < entry.limit}
        return entry

    def _claim(self, entry: NameState, request: AcquireRequest, ahead: int) -> GrantRecord | None:
        """Take the first free slot if more slots are free than waiters are ``ahead``."""
        now = time.monotonic()
        free = entry.free_slots(now)
        if len(free) <= ahead:
            return None
        slot = free[0]
        entry.fence += 1
        entry.used = now
        lease = Lease(
            secrets.token_hex(16),
            entry.fence,
            request.identity,
            datetime.now(UTC),
            now + request.ttl,
        )
        entry.leases[slot] = lease  # replaces an expired lease: taken over
        entry.cooldowns.pop(slot, None)
        return GrantRecord(lease.token, slot, lease.fence, shown(lease.expires), requested_at=now)

    def _wait(
        self,
        entry: NameState,
        request: AcquireRequest,
        waiter: Waiter,
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
            return shown(lease.expires)

    def is_held(self, name: str, token: str) -> bool:
        """True while the grant ``token`` is live: not released, expired or taken away."""
        with self._lock:
            found = self._find(name, token)
            return found is not None and found[2].live(time.monotonic())

    def _find(self, name: str, token: str) -> tuple[NameState, int, Lease] | None:
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
                    expires_at=shown(lease.expires),
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
            queued = [(key, waiter) for key, entry in self._chosen(name) for waiter in entry.queue]
        return in_queue_order(
            self.alias,
            [(key, *astuple(waiter.identity), waiter.since) for key, waiter in queued],
        )

    def names(self) -> list[tuple[str, int]]:
        """Every ``(name, limit)`` acquired since the store began, held or free, by name."""
        with self._lock:
            return [(key, entry.limit) for key, entry in sorted(self._names.items())]

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        """Slots whose cool-down has not yet ended, by name and slot."""
        with self._lock:
            now = time.monotonic()
            return [
                CooldownInfo(name=key, backend=self.alias, slot=slot, until=shown(end))
                for key, entry in self._chosen(name)
                for slot, end in sorted(entry.cooldowns.items())
                if end > now
            ]

    def _chosen(self, name: str | None) -> list[tuple[str, NameState]]:
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
            return project_moment(shown(now + seconds)) if seconds > 0 else None

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

    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Forget expired leases and ended cool-downs, and names idle for longer than
        ``idle_names`` seconds; return how many of each.

        There are no dead waiters to remove: a waiter leaves the queue in a
        ``finally`` of its own thread. A removed name's fences live on as the
        store's floor: a name first seen after the sweep starts above it.
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
            swept = {"expired grants": expired, "ended cool-downs": ended}
            if idle_names is None:
                return swept
            idle = [
                name
                for name, entry in self._names.items()
                if entry.idle_since(now - idle_names, now)
            ]
            for name in idle:
                self._fence_floor = max(self._fence_floor, self._names.pop(name).fence)
            return {**swept, "idle names": len(idle)}
