"""What the history says happened to one name over a period, as spans of time.

The dashboard draws these (``djlocks.charts``): each slot's grants as bars from
acquire to release or loss, the waits under them, and the distributions of
waits and holds. Everything comes from ``LockEvent`` rows and from the store's
own holders and waiters right now (the grants and waits still going on).

A grant's end is written as one event with how long it was held; a forced
release is written by the operator and the holder's loss again by the holder
when it notices, so a grant is the earliest end recorded with its fence.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from djlocks.backends.base import HolderInfo, WaiterInfo
from djlocks.conf import events_database
from djlocks.events import ENDED_HOLDS
from djlocks.kinds import Kind

if TYPE_CHECKING:
    from djlocks.models import LockEvent

#: How each end of a grant is drawn, most telling first (a forced release is also a loss).
ENDINGS = (Kind.FORCED_RELEASE, Kind.LOST, Kind.EXPIRED, Kind.RELEASED)
#: The events that end a wait, and say how long it was.
ENDED_WAITS = (Kind.ACQUIRED, Kind.TIMED_OUT, Kind.CANCELLED)
#: Seconds: shorter waits (an uncontended acquire's own round trips) are not drawn.
SHORTEST_WAIT_DRAWN = 0.005
#: The most events one timeline reads.
TIMELINE_EVENTS = 20_000


@dataclass(frozen=True)
class Span:
    """A grant (``lane`` is its slot) or a wait, from ``start`` to ``end``; ``ending`` is
    the ``Kind`` that ended it, or ``None`` while it goes on."""

    start: datetime
    end: datetime
    lane: int
    ending: str | None
    about: str  # who and what, for the tooltip


@dataclass(frozen=True)
class Timeline:
    """One name's grants and waits between ``start`` and ``end``."""

    start: datetime
    end: datetime
    lanes: int
    grants: list[Span]
    waits: list[Span]


def timeline(
    backend: str,
    name: str,
    limit: int,
    start: datetime,
    end: datetime,
    holders: Sequence[HolderInfo],
    waiters: Sequence[WaiterInfo],
) -> Timeline:
    """The grants and waits of ``name`` on ``backend`` that overlap ``start``..``end``
    (aware datetimes): ended ones from the history, live ones from ``holders`` and
    ``waiters`` (the store's answer at ``end``)."""
    ended = _events(backend, name, start, (*ENDED_HOLDS, Kind.EXPIRED, Kind.FORCED_RELEASE))
    grants = _grants(ended, start)
    grants += [
        Span(h.since, end, h.slot, None, f"fence {h.fence}, {_who(h.host, h.pid, h.label)}")
        for h in holders
    ]
    waits = [
        Span(w.since, end, 0, None, f"waiting, {_who(w.host, w.pid, w.label)}") for w in waiters
    ]
    waits += [
        Span(
            max(start, event.at - timedelta(seconds=event.waited)),
            event.at,
            0,
            event.kind,
            f"{Kind(event.kind).label}: waited {event.waited:.3g} s, "
            f"{_who(event.host, event.pid, event.label)}",
        )
        for event in _events(backend, name, start, ENDED_WAITS, waited__gte=SHORTEST_WAIT_DRAWN)
        if event.waited is not None
    ]
    lanes = max([limit, *(grant.lane + 1 for grant in grants)])
    return Timeline(start, end, lanes, grants, _stacked(waits))


def distributions(backend: str, name: str, since: datetime) -> tuple[list[float], list[float]]:
    """The waits and the holds (seconds) of ``name`` on ``backend`` since ``since``."""
    waits = _events(backend, name, since, ENDED_WAITS)
    holds = _events(backend, name, since, ENDED_HOLDS)
    return (
        [event.waited for event in waits if event.waited is not None],
        [event.held for event in holds if event.held is not None],
    )


def average_waiters(
    names: Collection[tuple[str, str]],
    live: Mapping[tuple[str, str], Sequence[datetime]],
    start: datetime,
    end: datetime,
    buckets: int,
) -> dict[tuple[str, str], list[float]]:
    """For each (backend, name): how many waited on average in each of ``buckets``
    equal parts of ``start``..``end``, from the history's ended waits and the
    ``live`` waits (each waiter's start, by name) going on at ``end``."""
    from djlocks.models import LockEvent

    width = (end - start) / buckets
    waits: dict[tuple[str, str], list[tuple[datetime, datetime]]] = {
        key: [(since, end) for since in live.get(key, ())] for key in names
    }
    ended = LockEvent.objects.using(events_database()).filter(
        name__in={name for _, name in names},
        at__gte=start,
        kind__in=ENDED_WAITS,
        waited__gte=SHORTEST_WAIT_DRAWN,
    )
    for backend, name, at, waited in ended.order_by("-at").values_list(
        "backend", "name", "at", "waited"
    )[:TIMELINE_EVENTS]:
        if (backend, name) in waits and waited is not None:
            waits[backend, name].append((at - timedelta(seconds=waited), at))
    averages = {}
    for key, spans in waits.items():
        counts = [0.0] * buckets
        for began, ended_at in spans:
            first = max(0, int((began - start) / width))
            for i in range(first, min(buckets, int((ended_at - start) / width) + 1)):
                low, high = start + width * i, start + width * (i + 1)
                overlap = (min(high, ended_at) - max(low, began)).total_seconds()
                if overlap > 0:
                    counts[i] += overlap / width.total_seconds()
        averages[key] = counts
    return averages


def _events(
    backend: str, name: str, since: datetime, kinds: Iterable[str], **more: object
) -> list[LockEvent]:
    """The name's events of ``kinds`` (and ``more`` conditions) since ``since``, newest
    first: the last ``TIMELINE_EVENTS`` at most."""
    from djlocks.models import LockEvent

    rows = LockEvent.objects.using(events_database()).filter(
        backend=backend, name=name, at__gte=since, kind__in=list(kinds), **more
    )
    return list(rows.order_by("-at")[:TIMELINE_EVENTS])


def _grants(ended: list[LockEvent], start: datetime) -> list[Span]:
    """One bar per fence: from its earliest recorded end back by what it held, drawn as
    its most telling ending."""
    by_fence: dict[int | None, list[LockEvent]] = {}
    for event in ended:
        by_fence.setdefault(event.fence, []).append(event)
    grants = []
    for fence, events in by_fence.items():
        first = min(events, key=lambda event: event.at)
        if first.held is None:
            continue
        kinds = {event.kind for event in events}
        ending = next(kind for kind in ENDINGS if kind in kinds)
        grants.append(
            Span(
                max(start, first.at - timedelta(seconds=first.held)),
                first.at,
                first.slot or 0,
                ending,
                f"fence {fence}, {_who(first.host, first.pid, first.label)}, "
                f"held {first.held:.3g} s, {Kind(ending).label}",
            )
        )
    return grants


def _stacked(waits: list[Span]) -> list[Span]:
    """The waits, each in the first row (``lane``) where it overlaps no other."""
    rows: list[datetime] = []  # each row's latest end
    stacked = []
    for wait in sorted(waits, key=lambda span: span.start):
        row = next((i for i, last in enumerate(rows) if last <= wait.start), len(rows))
        if row == len(rows):
            rows.append(wait.end)
        rows[row] = wait.end
        stacked.append(Span(wait.start, wait.end, row, wait.ending, wait.about))
    return stacked


def _who(host: str, pid: int | None, label: str) -> str:
    return f"{host} pid {pid}" + (f" ({label})" if label else "")
