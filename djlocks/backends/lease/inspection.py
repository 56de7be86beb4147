"""What the lease tables say: holders, waiters, names and cool-downs, and the sweep.

Read through Django's ORM on the models (``LeaseSlot``, ``LeaseWaiter``), with
"live" judged against the database's own now, never this host's clock.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField
from django.db.models.expressions import RawSQL

from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo, in_queue_order
from djlocks.backends.dedicated import statement_cursor
from djlocks.backends.lease.store import SLOTS, WAITERS, LeaseStore, transaction
from djlocks.backends.sql import as_datetime
from djlocks.events import events
from djlocks.keys import table_key
from djlocks.kinds import Kind

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from djlocks.models import LeaseSlot

#: Names looked at, and removed, per transaction of an idle-name sweep, and expired
#: grants cleared per statement: with one more parameter, within the 999 that SQLite
#: allows a statement by default.
IDLE_BATCH = 500

HOLDER_FIELDS = [
    "name",
    "slot",
    "limit",
    "host",
    "pid",
    "thread",
    "label",
    "acquired_at",
    "expires_at",
    "fence",
    "token",
]


class LeaseInspection(LeaseStore):
    """The lease tables as the admin, ``djlocks list`` and the sweep see them."""

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        from djlocks.models import LeaseSlot

        live = LeaseSlot.objects.using(self.using).filter(
            token__isnull=False, expires_at__gt=self._store_now()
        )
        if name is not None:
            live = live.filter(key=table_key(name))
        return self._holders_in(live.order_by("name", "slot"))

    def _holders_in(self, rows: QuerySet[LeaseSlot]) -> list[HolderInfo]:
        """The grants of slot rows (read as plain tuples: the dashboard reads thousands)."""
        moment = partial(as_datetime, db=connections[self.using])
        return [
            HolderInfo(
                name=name,
                backend=self.alias,
                slot=slot,
                limit=limit,
                host=host,
                pid=pid or 0,
                thread=thread,
                label=label,
                since=moment(acquired or expires),
                expires_at=moment(expires),
                fence=fence,
                token=token or "",
            )
            for name, slot, limit, host, pid, thread, label, acquired, expires, fence, token in (
                rows.values_list(*HOLDER_FIELDS)
            )
        ]

    def _store_now(self) -> RawSQL:
        """The database's current time as SQL, to compare the lease columns with in the
        ORM: the database evaluates it, as it wrote the columns (by its UTC clock), with
        none of the conversions a moment sent from here would go through."""
        return RawSQL(self.dialect.now, (), output_field=DateTimeField())

    def names(self) -> list[tuple[str, int]]:
        from djlocks.models import LeaseSlot

        known = LeaseSlot.objects.using(self.using).values_list("name", "limit").distinct()
        return list(known.order_by("name"))

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        from djlocks.models import LeaseWaiter

        live = LeaseWaiter.objects.using(self.using).filter(expires_at__gt=self._store_now())
        if name is not None:
            live = live.filter(key=table_key(name))
        rows = live.order_by("name", "id").values_list(
            "name", "host", "pid", "thread", "label", "since"
        )
        db = connections[self.using]
        return in_queue_order(self.alias, ((*row[:5], as_datetime(row[5], db)) for row in rows))

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        from djlocks.models import LeaseSlot

        cooling = LeaseSlot.objects.using(self.using).filter(cooldown_until__gt=self._store_now())
        if name is not None:
            cooling = cooling.filter(key=table_key(name))
        db = connections[self.using]
        return [
            CooldownInfo(
                name=row.name, backend=self.alias, slot=row.slot, until=as_datetime(until, db)
            )
            for row in cooling.order_by("name", "slot")
            if (until := row.cooldown_until) is not None
        ]

    def set_cooldown(self, name: str, slot: int, seconds: float) -> datetime | None:
        def set_until(db: BaseDatabaseWrapper) -> int:
            until = f"{self.dialect.plus_seconds}" if seconds > 0 else "NULL"
            params = (self.dialect.seconds_param(seconds),) if seconds > 0 else ()
            return self._execute(
                db,
                f"UPDATE {SLOTS} SET cooldown_until = {until} WHERE name_key = %s AND slot = %s",
                (*params, table_key(name), slot),
            )

        if not self._run(set_until):
            raise ValueError(f"{name!r} has no slot {slot} on backend {self.alias!r}.")
        cooling = [c.until for c in self.cooldowns(name) if c.slot == slot]
        return cooling[0] if cooling else None

    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Delete dead waiters' records and clear expired grants' holder details;
        with ``idle_names`` (seconds), delete idle names' slot rows too.

        Each expired grant is recorded as an ``expired`` event first. A name is
        idle when none of its slots is held or cooling down, no live waiter
        queues for it, and its last grant is more than ``idle_names`` seconds old.
        Its rows are locked (in slot order, as claims lock them) and judged again
        before they go, so a grant that comes meanwhile keeps them. A name that
        comes back gets new rows, whose fences start at the database's clock in
        microseconds (``first_fence``): above every fence it had.
        """
        from djlocks.models import LeaseSlot

        now = self.dialect.now
        dead_waiters = self._run(
            lambda db: self._execute(db, f"DELETE FROM {WAITERS} WHERE expires_at <= {now}", ())
        )
        slots = LeaseSlot.objects.using(self.using)
        expired = slots.filter(token__isnull=False, expires_at__lte=self._store_now())
        ended = self._holders_in(expired)
        events.holders_ended(ended, Kind.EXPIRED, reason="the lease ran out without a release")
        # Those grants, and no other that ran out since: each has its event.
        tokens = [holder.token for holder in ended]
        cleared = sum(
            slots.filter(token__in=tokens[at : at + IDLE_BATCH]).update(token=None, expires_at=None)
            for at in range(0, len(tokens), IDLE_BATCH)
        )
        swept = {"expired grants": cleared, "dead waiters": dead_waiters}
        if idle_names is not None:
            swept["idle names"] = self._remove_idle_names(idle_names)
        return swept

    def _remove_idle_names(self, idle: float) -> int:
        """Delete the slot rows of every idle name (see ``sweep``), ``IDLE_BATCH`` names
        per transaction; return how many names went."""
        removed, after = 0, ""
        while True:
            keys = self._run(partial(self._idle_keys, idle=idle, after=after))
            if not keys:
                return removed
            after = keys[-1]
            removed += self._run(partial(self._remove_if_idle, keys=keys, idle=idle))

    def _busy(self, idle: float) -> str:
        """SQL: 1 for a slot row that keeps its name: held, cooling down, or granted
        within ``idle`` seconds (one ``%s``, from ``seconds_param(-idle)``)."""
        d = self.dialect
        return (
            f"CASE WHEN (token IS NOT NULL AND expires_at > {d.now}) "
            f"OR cooldown_until > {d.now} OR acquired_at > {d.plus_seconds} THEN 1 ELSE 0 END"
        )

    def _idle_keys(self, db: BaseDatabaseWrapper, idle: float, after: str) -> list[str]:
        """Up to ``IDLE_BATCH`` keys after ``after``, in order, whose rows are all idle."""
        with statement_cursor(db) as cursor:
            cursor.execute(
                f"SELECT name_key FROM {SLOTS} WHERE name_key > %s GROUP BY name_key "
                f"HAVING max({self._busy(idle)}) = 0 ORDER BY name_key LIMIT {IDLE_BATCH}",
                (after, self.dialect.seconds_param(-idle)),
            )
            return [key for (key,) in cursor.fetchall()]

    def _remove_if_idle(self, db: BaseDatabaseWrapper, keys: list[str], idle: float) -> int:
        """Lock the rows of ``keys``, and delete those of the names still idle."""
        d = self.dialect
        among = ", ".join(["%s"] * len(keys))
        with transaction(db, d.begin), statement_cursor(db) as cursor:
            cursor.execute(
                f"SELECT name_key, {self._busy(idle)} FROM {SLOTS} WHERE name_key IN ({among}) "
                f"ORDER BY name_key, slot{d.for_update}",
                (d.seconds_param(-idle), *keys),
            )
            busy = {key for key, kept in cursor.fetchall() if kept}
            cursor.execute(
                f"SELECT DISTINCT name_key FROM {WAITERS} WHERE name_key IN ({among}) "
                f"AND expires_at > {d.now}",
                keys,
            )
            busy.update(key for (key,) in cursor.fetchall())
            idle_keys = [key for key in keys if key not in busy]
            if not idle_keys:
                return 0
            cursor.execute(
                f"DELETE FROM {SLOTS} WHERE name_key IN ({', '.join(['%s'] * len(idle_keys))})",
                idle_keys,
            )
        return len(idle_keys)
