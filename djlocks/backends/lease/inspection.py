"""What the lease tables say: holders, waiters, names and cool-downs, and the sweep.

Read through Django's ORM on the models (``LeaseSlot``, ``LeaseWaiter``), with
"live" judged against the database's own now, never this host's clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from django.db.backends.base.base import BaseDatabaseWrapper

from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo, in_queue_order
from djlocks.backends.lease.store import SLOTS, WAITERS, LeaseStore
from djlocks.events import events
from djlocks.keys import table_key
from djlocks.kinds import Kind

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from djlocks.models import LeaseSlot

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
            token__isnull=False, expires_at__gt=self._db_now()
        )
        if name is not None:
            live = live.filter(key=table_key(name))
        return self._holders_in(live.order_by("name", "slot"))

    def _holders_in(self, rows: QuerySet[LeaseSlot]) -> list[HolderInfo]:
        """The grants of slot rows (read as plain tuples: the dashboard reads thousands)."""
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
                since=acquired or expires,
                expires_at=expires,
                fence=fence,
                token=token or "",
            )
            for name, slot, limit, host, pid, thread, label, acquired, expires, fence, token in (
                rows.values_list(*HOLDER_FIELDS)
            )
        ]

    def names(self) -> list[tuple[str, int]]:
        from djlocks.models import LeaseSlot

        known = LeaseSlot.objects.using(self.using).values_list("name", "limit").distinct()
        return list(known.order_by("name"))

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        from djlocks.models import LeaseWaiter

        live = LeaseWaiter.objects.using(self.using).filter(expires_at__gt=self._db_now())
        if name is not None:
            live = live.filter(key=table_key(name))
        rows = live.order_by("name", "id").values_list(
            "name", "host", "pid", "thread", "label", "since"
        )
        return in_queue_order(self.alias, rows)

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        from djlocks.models import LeaseSlot

        cooling = LeaseSlot.objects.using(self.using).filter(cooldown_until__gt=self._db_now())
        if name is not None:
            cooling = cooling.filter(key=table_key(name))
        return [
            CooldownInfo(name=row.name, backend=self.alias, slot=row.slot, until=until)
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

    def sweep(self) -> dict[str, int]:
        """Delete dead waiters' records and clear expired grants' holder details.

        Each expired grant is recorded as an ``expired`` event first. Slot rows
        themselves are kept: each remembers the last fence issued on it, and
        deleting it would let a later grant reuse a fence.
        """
        from djlocks.models import LeaseSlot

        now = self.dialect.now
        dead_waiters = self._run(
            lambda db: self._execute(db, f"DELETE FROM {WAITERS} WHERE expires_at <= {now}", ())
        )
        expired = LeaseSlot.objects.using(self.using).filter(
            token__isnull=False, expires_at__lte=self._db_now()
        )
        ended = self._holders_in(expired)
        events.holders_ended(ended, Kind.EXPIRED, reason="the lease ran out without a release")
        cleared = expired.update(token=None, expires_at=None)
        return {"expired grants": cleared, "dead waiters": dead_waiters}
