"""What the admin dashboard shows: one summary per name and backend, filtered and sorted.

The rows come from the stores' own answers (``inspection.snapshot`` and each
backend's ``names()``), so the dashboard tells what ``djlocks list`` tells: the
stores' own state, never a copy of it.
The admin views in ``djlocks.admin`` only render and serve these.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from djlocks.backends import backends
from djlocks.backends.base import HolderInfo, WaiterInfo
from djlocks.inspection import UNUSABLE, Snapshot, snapshot, unusable
from djlocks.leadership import elected_name
from djlocks.rwlock import GATE, RW_PREFIX, rw_parts
from djlocks.stuck import Place, stuck_holders

#: A lease whose expiry is this many seconds away, or past, counts as expiring.
EXPIRING_WITHIN = 10.0

STATES = {
    "stuck": "stuck",
    "held": "held",
    "waited": "waited on",
    "expiring": "expiring",
    "cooldown": "in cool-down",
    "free": "free",
}

#: Sortable columns: the ``o`` query value -> the row's value at a given now.
SORTS: dict[str, Callable[[NameSummary, datetime], Any]] = {
    "name": lambda row, now: row.name,
    "backend": lambda row, now: row.backend,
    "holders": lambda row, now: row.holders,
    "waiters": lambda row, now: row.waiters,
    "wait": lambda row, now: row.longest_wait(now),
    "expiry": lambda row, now: row.expires_in(now),
}


@dataclass
class NameSummary:
    """One name on one backend: how many hold it, how many wait, since when, until when."""

    backend: str
    name: str
    limit: int
    holders: int = 0
    waiters: int = 0
    waiting_since: datetime | None = None
    waits_since: list[datetime] = field(default_factory=list)  # each waiter's start
    nearest_expiry: datetime | None = None
    cooldown_until: datetime | None = None
    stuck: int = 0  # holders held far longer than the name usually is (djlocks.stuck)
    words: set[str] = field(default_factory=set)  # hosts and labels, for search

    @property
    def kind(self) -> str:
        return "lock" if self.limit == 1 else f"semaphore of {self.limit}"

    def longest_wait(self, now: datetime) -> float | None:
        """Seconds the first waiter has waited, or ``None`` without waiters."""
        return None if self.waiting_since is None else (now - self.waiting_since).total_seconds()

    def expires_in(self, now: datetime) -> float | None:
        """Seconds until the nearest lease expiry (negative: overdue), ``None`` if no lease."""
        return None if self.nearest_expiry is None else (self.nearest_expiry - now).total_seconds()

    def states(self, now: datetime) -> list[str]:
        found = ["stuck"] if self.stuck else []
        if self.holders:
            found.append("held")
        if self.waiters:
            found.append("waited")
        expires_in = self.expires_in(now)
        if expires_in is not None and expires_in <= EXPIRING_WITHIN:
            found.append("expiring")
        if self.cooldown_until is not None and self.cooldown_until > now:
            found.append("cooldown")
        return found or ["free"]

    def matches(self, text: str) -> bool:
        needle = text.lower()
        return needle in self.name.lower() or any(needle in word.lower() for word in self.words)

    def as_json(self, now: datetime) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "name": self.name,
            "kind": self.kind,
            "limit": self.limit,
            "holders": self.holders,
            "stuck": self.stuck,
            "waiters": self.waiters,
            "longest_wait": self.longest_wait(now),
            "expires_in": self.expires_in(now),
            "cooldown_until": self.cooldown_until,
            "cooldown_ends_in": (
                None if self.cooldown_until is None else (self.cooldown_until - now).total_seconds()
            ),
            "states": [STATES[state] for state in self.states(now)],
        }


def who(entry: HolderInfo | WaiterInfo | None) -> str | None:
    """A holder or waiter as the dashboard names it: host, pid and label."""
    return None if entry is None else f"{entry.host} pid {entry.pid} ({entry.label})"


def mentions(text: str, name: str, entries: list[HolderInfo | WaiterInfo | None]) -> bool:
    """Whether ``text`` (any case) is in ``name`` or in an entry's host or label."""
    needle = text.lower()
    words = [name] + [word for e in entries if e is not None for word in (e.host, e.label)]
    return any(needle in word.lower() for word in words)


@dataclass
class LeadershipSummary:
    """One leadership (``djlocks.leadership``) on one backend: its leader and standbys."""

    backend: str
    name: str  # the leadership's own name
    lock_name: str  # the lock it is held by
    leader: HolderInfo | None = None
    standbys: list[WaiterInfo] = field(default_factory=list)

    def matches(self, text: str) -> bool:
        """Whether ``text`` is in the name, or the host or label of the leader or a standby."""
        return mentions(text, self.name, [self.leader, *self.standbys])

    def as_json(self, now: datetime) -> dict[str, Any]:
        leader = self.leader
        return {
            "backend": self.backend,
            "name": self.name,
            "leader": who(leader),
            "term": None if leader is None else leader.fence,
            "since": None if leader is None else leader.since,
            "leading_for": None if leader is None else (now - leader.since).total_seconds(),
            "expires_in": (
                None
                if leader is None or leader.expires_at is None
                else (leader.expires_at - now).total_seconds()
            ),
            "standbys": len(self.standbys),
            "standby_hosts": [who(standby) for standby in self.standbys],
        }


def leaderships(found: Snapshot, known: Collection[tuple[str, str]]) -> list[LeadershipSummary]:
    """The leaderships among the names of ``found`` and ``known`` (backend, lock name
    pairs), by leadership name."""
    rows: dict[tuple[str, str], LeadershipSummary] = {}

    def row(backend: str, lock_name: str) -> LeadershipSummary | None:
        name = elected_name(lock_name)
        if name is None:
            return None
        return rows.setdefault((backend, lock_name), LeadershipSummary(backend, name, lock_name))

    for backend, lock_name in known:
        row(backend, lock_name)
    for holder in found.holders:
        if (summary := row(holder.backend, holder.name)) is not None:
            summary.leader = holder
    for waiter in found.waiters:
        if (summary := row(waiter.backend, waiter.name)) is not None:
            summary.standbys.append(waiter)
    return sorted(rows.values(), key=lambda summary: (summary.name, summary.backend))


@dataclass
class ReadersWriterSummary:
    """One reader-writer lock (``djlocks.db_rwlock``) on one backend: its writer (the
    gate's holder), its readers (the slots' holders but the writer) and who waits."""

    backend: str
    name: str  # the reader-writer lock's own name
    lock_name: str  # its gate's, whose page shows the writer and the history
    writer: HolderInfo | None = None
    slot_holders: list[HolderInfo] = field(default_factory=list)
    waiting: list[WaiterInfo] = field(default_factory=list)

    def matches(self, text: str) -> bool:
        """Whether ``text`` is in the name, or the host or label of a holder or waiter."""
        return mentions(text, self.name, [self.writer, *self.slot_holders, *self.waiting])

    @property
    def readers(self) -> list[HolderInfo]:
        writer = self.writer
        if writer is None:
            return list(self.slot_holders)
        return [
            held
            for held in self.slot_holders
            if (held.host, held.pid, held.thread) != (writer.host, writer.pid, writer.thread)
        ]

    def as_json(self, now: datetime) -> dict[str, Any]:
        writer, readers = self.writer, self.readers
        return {
            "backend": self.backend,
            "name": self.name,
            "writer": who(writer),
            "writer_fence": None if writer is None else writer.fence,
            "writing_for": None if writer is None else (now - writer.since).total_seconds(),
            "readers": len(readers),
            "reader_hosts": [who(reader) for reader in readers],
            "waiting": len(self.waiting),
        }


def readers_writers(
    found: Snapshot, known: Collection[tuple[str, str]]
) -> list[ReadersWriterSummary]:
    """The reader-writer locks among the names of ``found`` and ``known`` (backend, lock
    name pairs), by name."""
    rows: dict[tuple[str, str], ReadersWriterSummary] = {}

    def row(backend: str, lock_name: str) -> tuple[ReadersWriterSummary, str] | None:
        parts = rw_parts(lock_name)
        if parts is None:
            return None
        name, part = parts
        summary = rows.setdefault(
            (backend, name), ReadersWriterSummary(backend, name, lock_name=RW_PREFIX + name + GATE)
        )
        return summary, part

    for backend, lock_name in known:
        row(backend, lock_name)
    for holder in found.holders:
        if (found_row := row(holder.backend, holder.name)) is not None:
            summary, part = found_row
            if part == "gate":
                summary.writer = holder
            else:
                summary.slot_holders.append(holder)
    for waiter in found.waiters:
        if (found_row := row(waiter.backend, waiter.name)) is not None:
            found_row[0].waiting.append(waiter)
    return sorted(rows.values(), key=lambda summary: (summary.name, summary.backend))


def summaries(
    found: Snapshot, known: Mapping[tuple[str, str], int], stuck: Collection[Place] = ()
) -> list[NameSummary]:
    """Fold holders, waiters and cool-downs into one summary per (backend, name).

    ``known`` maps every (backend, name) the stores remember to its limit, so
    that free names are listed too; ``stuck`` holds the places of stuck holders.
    """
    rows = {key: NameSummary(key[0], key[1], limit) for key, limit in known.items()}

    def row(backend: str, name: str, limit: int = 1) -> NameSummary:
        return rows.setdefault((backend, name), NameSummary(backend, name, limit))

    for holder in found.holders:
        summary = row(holder.backend, holder.name, holder.limit)
        summary.limit = holder.limit
        summary.holders += 1
        summary.stuck += (holder.backend, holder.name, holder.slot) in stuck
        summary.words.update((holder.host, holder.label))
        if holder.expires_at is not None:
            summary.nearest_expiry = _earliest(summary.nearest_expiry, holder.expires_at)
    for waiter in found.waiters:
        summary = row(waiter.backend, waiter.name)
        summary.waiters += 1
        summary.words.update((waiter.host, waiter.label))
        summary.waiting_since = _earliest(summary.waiting_since, waiter.since)
        summary.waits_since.append(waiter.since)
    for cooling in found.cooldowns:
        summary = row(cooling.backend, cooling.name)
        if summary.cooldown_until is None or cooling.until > summary.cooldown_until:
            summary.cooldown_until = cooling.until
    return list(rows.values())


@dataclass
class Overview:
    """What the stores answered for the overview page."""

    names: list[NameSummary]  # every name that is not a leadership's or an rwlock's part
    leaderships: list[LeadershipSummary]
    readers_writers: list[ReadersWriterSummary]
    unavailable: dict[str, str]  # the backends that could not be asked, with the reason


def overview(backend: str | None = None) -> Overview:
    """Every name and leadership of every backend (or of ``backend``), as the stores
    answer now."""
    found = snapshot(backend=backend)
    known = {}
    for alias in [backend] if backend else backends.aliases():
        if alias in found.unavailable:
            continue
        try:
            known.update({(alias, name): limit for name, limit in backends[alias].names()})
        except UNUSABLE as exc:
            found.unavailable[alias] = unusable(alias, exc)
    rows = summaries(found, known, stuck_holders(found.holders, timezone.now()))
    return Overview(
        names=[row for row in rows if elected_name(row.name) is None and not rw_parts(row.name)],
        leaderships=leaderships(found, known),
        readers_writers=readers_writers(found, known),
        unavailable=found.unavailable,
    )


def select(
    rows: list[NameSummary], *, now: datetime, search: str, state: str, order: str
) -> list[NameSummary]:
    """Rows matching ``search`` (name, host or label) and ``state``, sorted by ``order``.

    Rows with a stuck holder come first, whatever the order. ``order`` is a key of
    ``SORTS``, ``-`` first for descending; unknown values sort by name. Rows
    without a value for the sort key come last.
    """
    chosen = [
        row
        for row in rows
        if (not search or row.matches(search)) and (not state or state in row.states(now))
    ]
    descending = order.startswith("-")
    column = order.lstrip("-")
    if column not in SORTS:
        column, descending = "name", False

    keyed = [(SORTS[column](row, now), row) for row in chosen]
    present = [(value, row) for value, row in keyed if value is not None]
    absent = [row for value, row in keyed if value is None]
    present.sort(key=lambda pair: (pair[0], pair[1].name, pair[1].backend), reverse=descending)
    absent.sort(key=lambda row: (row.name, row.backend))
    ordered = [row for _, row in present] + absent
    return [row for row in ordered if row.stuck] + [row for row in ordered if not row.stuck]


def _earliest(current: datetime | None, candidate: datetime) -> datetime:
    return candidate if current is None or candidate < current else current
