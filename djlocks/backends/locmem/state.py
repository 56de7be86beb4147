"""The in-process store's state: per name its limit, last fence, leases, cool-downs
and queue, judged by ``time.monotonic()`` and shown as aware UTC datetimes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from djlocks.identity import Identity

#: The wall-clock time at which ``time.monotonic()`` was 0, taken once: every moment
#: is shown the same way at every call, even if the wall clock is set meanwhile.
MONOTONIC_ZERO = datetime.now(UTC) - timedelta(seconds=time.monotonic())


def shown(moment: float) -> datetime:
    """The monotonic ``moment`` as an aware UTC datetime, for display only."""
    return MONOTONIC_ZERO + timedelta(seconds=moment)


@dataclass
class Lease:
    """One live (or expired, not yet taken over) grant of a slot."""

    token: str
    fence: int
    identity: Identity
    since: datetime
    expires: float  # time.monotonic()

    def live(self, now: float) -> bool:
        return now < self.expires


@dataclass
class Waiter:
    identity: Identity
    since: datetime


@dataclass
class NameState:
    """Everything the store knows about one name, until a sweep removes it idle."""

    limit: int
    changed: threading.Condition
    fence: int  # the last fence issued for the name
    used: float = field(default_factory=time.monotonic)  # its last grant (or creation)
    leases: dict[int, Lease] = field(default_factory=dict)  # by slot
    cooldowns: dict[int, float] = field(default_factory=dict)  # slot -> monotonic end
    queue: list[Waiter] = field(default_factory=list)  # FIFO: the first waited longest

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

    def idle_since(self, before: float, now: float) -> bool:
        """Nothing holds, waits for or cools down on the name, and its last grant
        came before ``before`` (monotonic)."""
        return self.used < before and not self.queue and len(self.free_slots(now)) == self.limit

    def next_change(self, now: float) -> float | None:
        """When a slot frees itself (a lease expires, a cool-down ends); ``None``: never."""
        moments = [lease.expires for lease in self.leases.values() if lease.live(now)]
        moments += [end for end in self.cooldowns.values() if end > now]
        return min(moments, default=None)
