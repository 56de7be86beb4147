"""The event history: what happened to each name, for the dashboard and its statistics.

Events are written on a connection djlocks owns (``DedicatedConnections``), so
a caller's rollback cannot erase them and a caller's broken transaction
cannot break a release. A write that fails is logged on ``djlocks.events``
and dropped (the background writer's, once tried again: ``_write_in_background``):
history is an aid to operators, never a reason to fail a lock operation. A
grant's ``acquired`` and end events are written together, in one write, when
the grant ends.

The events of every grant and wait (released, timed out, cancelled) are handed
to the process's background writer (``djlocks.background``) unless
``DJLOCKS["EVENTS_WRITER"]`` is ``"synchronous"``. The events that tell of
trouble (a lost grant, an expired lease, a forced or requested release, a
cool-down changed by an operator) are written at once, by whoever notices them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError
from django.db import connections as db_connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field
from django.utils import timezone

from djlocks import background
from djlocks.backends.base import AcquireRequest, HolderInfo
from djlocks.backends.dedicated import RecordWriting
from djlocks.backends.driver import psycopg3_in_use
from djlocks.backends.missing_table import MIGRATE, is_missing_table
from djlocks.backends.sql import postgresql
from djlocks.conf import BACKGROUND, djlocks_settings, events_database
from djlocks.kinds import Kind
from djlocks.moments import moment_text
from djlocks.percentiles import percentile

if TYPE_CHECKING:
    from djlocks.grant import Grant
    from djlocks.models import LockEvent

events_log = logging.getLogger("djlocks.events")


#: The statistics look at no more than this many of a name's most recent events.
STATISTICS_WINDOW = 100_000
#: The pauses (seconds) before a failed background write is tried again; then it is dropped.
RETRY_PAUSES = (0.2, 0.8)
#: The events that end a hold and say how long it was.
ENDED_HOLDS = (Kind.RELEASED, Kind.LOST)


class EventLog:
    """Records ``LockEvent`` rows in the history's database (``events_database``)."""

    def __init__(self) -> None:
        self._connections = RecordWriting()
        self._writer = background.start(
            self._write_in_background, "djlocks-history", write_at_once=self._write
        )

    # -- what happened --------------------------------------------------------

    def grant_ended(
        self, grant: Grant, kind: str, reason: str = "", *, in_background: bool = False
    ) -> None:
        """The grant was released (``released``) or found lost (``lost``): two events,
        a release's through the background writer, a loss's at once unless
        ``in_background``."""
        if not grant.backend.capabilities.history or not djlocks_settings()["EVENTS"]:
            return  # before building the events: this is on every release's path
        ended_at, acquired_at = timezone.now(), grant.acquired_at
        common = _about_grant(grant)
        self.record(
            [
                _event(at=acquired_at, kind=Kind.ACQUIRED, waited=grant.waited, **common),
                _event(
                    at=ended_at,
                    kind=kind,
                    held=(ended_at - acquired_at).total_seconds(),
                    reason=reason,
                    **common,
                ),
            ],
            routine=kind == Kind.RELEASED or in_background,
        )

    def not_acquired(
        self, backend: str, request: AcquireRequest, waited: float, *, cancelled: bool
    ) -> None:
        """An acquire gave up: its time-out ran out (``timed_out``) or it was aborted."""
        identity = request.identity
        self.record(
            [
                _event(
                    at=timezone.now(),
                    kind=Kind.CANCELLED if cancelled else Kind.TIMED_OUT,
                    backend=backend,
                    name=request.name,
                    host=identity.host,
                    pid=identity.pid,
                    thread=identity.thread,
                    label=identity.label,
                    waited=waited,
                )
            ],
            routine=True,
        )

    def holders_ended(
        self, holders: Iterable[HolderInfo], kind: str, *, operator: str = "", reason: str = ""
    ) -> None:
        """Grants that ended without their holder: released by force, or expired leases."""
        now = timezone.now()
        self.record(
            [
                _event(
                    at=(ended := min(now, h.expires_at or now)),
                    kind=kind,
                    backend=h.backend,
                    name=h.name,
                    slot=h.slot,
                    fence=h.fence,
                    host=h.host,
                    pid=h.pid,
                    thread=h.thread,
                    label=h.label,
                    held=(ended - h.since).total_seconds(),
                    operator=operator,
                    reason=reason,
                )
                for h in holders
            ]
        )

    def cooldown_changed(
        self,
        backend: str,
        name: str,
        slot: int,
        until: datetime | None,
        *,
        operator: str,
        reason: str,
    ) -> None:
        ends = f"cool-down now ends {moment_text(until)}" if until else "cool-down cleared"
        self.record(
            [
                _event(
                    at=timezone.now(),
                    kind=Kind.COOLDOWN_CHANGED,
                    backend=backend,
                    name=name,
                    slot=slot,
                    operator=operator,
                    reason=f"{ends}: {reason}" if reason else ends,
                )
            ]
        )

    # -- writing and pruning ----------------------------------------------------

    def record(self, events: list[NewEvent], *, routine: bool = False) -> None:
        """Write ``events``, unless events are switched off or none: ``routine`` ones
        through the background writer (unless ``EVENTS_WRITER`` is ``"synchronous"``),
        others at once."""
        settings = djlocks_settings()
        if not events or not settings["EVENTS"]:
            return
        if routine and settings["EVENTS_WRITER"] == BACKGROUND:
            self._writer.submit(events)
        else:
            self._write(events)

    def flush(self, timeout: float = background.EXIT_WAIT) -> bool:
        """Wait up to ``timeout`` seconds for the events handed to the background writer
        so far to be written; ``True`` if they are (tests read the history after it)."""
        return self._writer.flush(timeout)

    def _write_in_background(self, events: list[NewEvent]) -> None:
        """The background writer's write: a batch that fails is tried again after each of
        ``RETRY_PAUSES`` (seconds), from its first row not yet committed, before it is
        dropped; so a database locked or unreachable for a moment (SQLite's lock held by
        a test's flush, a quick restart) loses nothing. Not once the history's database
        is another (a test run's database is replaced by the real one as it ends)."""
        left, target = list(events), _history_database()
        for pause in RETRY_PAUSES:
            if self._write(left, warn=False):
                return
            time.sleep(pause)
            if _history_database() != target:
                events_log.debug("%s event(s) not recorded: the database is another", len(left))
                return
        self._write(left)

    def _write(self, events: list[NewEvent], *, warn: bool = True) -> bool:
        """Insert ``events`` now, as few statements as the database allows; ``False`` if
        that failed (logged on ``djlocks.events``: as a warning if ``warn``, the last try,
        else at debug level). ``events`` loses each row as it is committed."""
        connections = self._connections[events_database()]
        try:
            _insert(connections.get(), events)
            return True
        except DatabaseError as exc:
            connections.discard()
            events_log.log(
                logging.WARNING if warn else logging.DEBUG,
                "%s event(s) of %s not recorded (%s)%s",
                len(events),
                events[0]["name"],
                exc,
                f"; run `{MIGRATE}`, or set DJLOCKS['EVENTS'] = False"
                if is_missing_table(exc)
                else "",
            )
            return False

    def sweep(self) -> int:
        """Delete events older than ``DJLOCKS["EVENTS_RETENTION"]`` seconds; return how many."""
        settings = djlocks_settings()
        from djlocks.models import LockEvent

        cutoff = timezone.now() - timedelta(seconds=settings["EVENTS_RETENTION"])
        deleted, _ = LockEvent.objects.using(events_database()).filter(at__lt=cutoff).delete()
        return deleted


events = EventLog()


#: An event to be written: the values (``LockEvent`` field attname -> value) it sets;
#: the model's defaults fill in the others when it is written. Not a model instance,
#: which costs several microseconds to build on every release's path.
NewEvent = dict[str, object]


def _event(**fields: object) -> NewEvent:
    """An event that sets ``fields``; ``TypeError`` for a name the model has no field of."""
    unknown = fields.keys() - _event_fields()
    if unknown:
        raise TypeError(f"LockEvent has no field {', '.join(sorted(unknown))}")
    return fields


@functools.cache
def _event_fields() -> frozenset[str]:
    from djlocks.models import LockEvent

    return frozenset(field.attname for field in LockEvent._meta.concrete_fields)


def _about_grant(grant: Grant) -> dict[str, object]:
    identity = grant.identity
    return {
        "backend": grant.spec.backend_alias,
        "name": grant.name,
        "slot": grant.slot,
        "fence": grant.fence,
        "host": identity.host,
        "pid": identity.pid,
        "thread": identity.thread,
        "label": identity.label,
    }


def _insert(db: BaseDatabaseWrapper, events: list[NewEvent]) -> None:
    """Write ``events`` to ``db``, values prepared by the model's fields for its vendor
    (the model's defaults where an event sets none): on PostgreSQL with one ``COPY``
    (``sql.postgresql.copy_rows``), elsewhere with multi-row ``INSERT`` statements, as
    many rows in each as the database takes (``bulk_batch_size``), each committed on
    its own. ``events`` loses each row as it is committed."""
    from djlocks.models import LockEvent

    fields = _written_fields()
    rows = _prepared_rows(db, fields, events)
    quote = db.ops.quote_name
    table, columns = quote(LockEvent._meta.db_table), [quote(str(f.column)) for f in fields]
    with db.cursor() as cursor, db.wrap_database_errors:
        if _copies(db):
            postgresql.copy_rows(cursor.cursor, table, columns, rows)
            events.clear()
            return
        placeholders = "(" + ", ".join(["%s"] * len(fields)) + ")"
        per_statement = max(1, db.ops.bulk_batch_size(fields, rows))
        for start in range(0, len(rows), per_statement):
            chunk = rows[start : start + per_statement]
            cursor.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) "
                f"VALUES {', '.join([placeholders] * len(chunk))}",
                [value for row in chunk for value in row],
            )
            del events[: len(chunk)]  # committed (autocommit): never written twice


@functools.cache
def _written_fields() -> list[Field[Any, Any]]:
    """The ``LockEvent`` fields an insert writes: all but the primary key."""
    from djlocks.models import LockEvent

    return [f for f in LockEvent._meta.concrete_fields if not f.primary_key and f.column]


def _prepared_rows(
    db: BaseDatabaseWrapper, fields: list[Field[Any, Any]], events: list[NewEvent]
) -> list[tuple[Any, ...]]:
    """Each event's values in ``fields`` order, prepared for ``db`` by the model's fields
    (``get_db_prep_save``; the field's default where the event sets none). A batch
    repeats most values (one holder's name, host, thread, label; the defaults), so
    each distinct value of a field is prepared once per batch, a column at a time:
    measured on PostgreSQL, this was most of the writer's work when done value by
    value."""
    columns = []
    for field in fields:
        attname, default = field.attname, field.get_default()
        values = [event.get(attname, default) for event in events]
        prepared = {value: field.get_db_prep_save(value, db) for value in set(values)}
        columns.append([prepared[value] for value in values])
    return list(zip(*columns, strict=True))


def _history_database() -> tuple[str, object]:
    """The alias the history is written to, and the name of its database now."""
    alias = events_database()
    return alias, db_connections.settings[alias].get("NAME")


def _copies(db: BaseDatabaseWrapper) -> bool:
    """Whether ``db`` can take rows with ``COPY``: PostgreSQL through psycopg 3 (Django
    also runs on psycopg2, whose cursors copy otherwise)."""
    return db.vendor == "postgresql" and psycopg3_in_use()


def recent_events(backend: str, name: str, count: int) -> list[LockEvent]:
    """The last ``count`` events of ``name`` on ``backend``, newest first."""
    from djlocks.models import LockEvent

    recent = LockEvent.objects.using(events_database())
    return list(recent.filter(backend=backend, name=name).order_by("-at", "-id")[:count])


#: A name's usual hold is read from at most this many of its last holds...
USUAL_SAMPLE = 1_000
#: ... and known only from at least this many.
USUAL_EVIDENCE = 20


def usual_hold(backend: str, name: str, since: datetime) -> float | None:
    """The 95th percentile (seconds) of the last ``USUAL_SAMPLE`` holds of ``name`` on
    ``backend`` that ended (released or lost) since ``since``; ``None`` with fewer
    than ``USUAL_EVIDENCE`` of them."""
    from djlocks.models import LockEvent

    recent = (
        LockEvent.objects.using(events_database())
        .filter(backend=backend, name=name, at__gte=since, kind__in=ENDED_HOLDS)
        .exclude(held=None)
        .order_by("-at")
    )
    holds = [
        held for held in recent.values_list("held", flat=True)[:USUAL_SAMPLE] if held is not None
    ]
    return percentile(holds, 95) if len(holds) >= USUAL_EVIDENCE else None


@dataclass(frozen=True)
class Statistics:
    """Counts and wait/hold percentiles (seconds) of a name's events since ``since``."""

    since: datetime
    acquisitions: int
    timed_out: int
    cancelled: int
    lost: int
    expired: int
    forced: int
    wait_median: float | None
    wait_p95: float | None
    hold_median: float | None
    hold_p95: float | None


def statistics(backend: str, name: str, since: datetime) -> Statistics:
    """Summarise the events of ``name`` on ``backend`` from ``since`` (an aware datetime)."""
    from djlocks.models import LockEvent

    rows = list(
        LockEvent.objects.using(events_database())
        .filter(backend=backend, name=name, at__gte=since)
        .order_by("-at")
        .values_list("kind", "waited", "held")[:STATISTICS_WINDOW]
    )
    counts = {kind: 0 for kind in Kind.values}
    waits: list[float] = []
    holds: list[float] = []
    for kind, waited, held in rows:
        counts[kind] += 1
        if kind == Kind.ACQUIRED and waited is not None:
            waits.append(waited)
        if kind in ENDED_HOLDS and held is not None:
            holds.append(held)
    return Statistics(
        since=since,
        acquisitions=counts[Kind.ACQUIRED],
        timed_out=counts[Kind.TIMED_OUT],
        cancelled=counts[Kind.CANCELLED],
        lost=counts[Kind.LOST],
        expired=counts[Kind.EXPIRED],
        forced=counts[Kind.FORCED_RELEASE],
        wait_median=percentile(waits, 50),
        wait_p95=percentile(waits, 95),
        hold_median=percentile(holds, 50),
        hold_p95=percentile(holds, 95),
    )
