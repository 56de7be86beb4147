"""What the server says of a session backend's names: holders, waiters, forced release.

The holder rows (``djlocks_session_holder``) carry identity and fences; whether
a row's grant is live is always the server's word (``_holding_sessions``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections
from django.utils import timezone

from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo
from djlocks.backends.described import (
    fence_described,
    parse_description,
    queue_order,
    thread_described,
)
from djlocks.backends.idle import remove_idle_records
from djlocks.backends.server_records import SESSION_TABLES, holder_records, known_names
from djlocks.backends.session.connections import Key, Session, SessionStore
from djlocks.backends.sql import as_datetime
from djlocks.keys import GATE, table_key


@dataclass(frozen=True)
class Holding:
    """A server session that holds a key, as the server shows it."""

    connection_id: int
    #: What the session says of itself (PostgreSQL's ``application_name``: who holds,
    #: with the grant's fence, see ``described``); ``None`` where the server shows none.
    description: str | None = None
    #: When the session last changed state (``pg_stat_activity.state_change``) or ran a
    #: statement (MariaDB's process list).
    since: datetime | None = None
    #: The client's address (``host:port``), where the server's view names no holder
    #: (MariaDB's process list).
    address: str | None = None


class SessionInspection(SessionStore):
    """Holders and waiters from the server's own view, and killing a holder's session."""

    @abstractmethod
    def _live_keys(self, session: Session, keys: Sequence[Key]) -> dict[Key, int]:
        """Which of ``keys`` the server says are held, and by which connection id."""

    def _holding_sessions(self, session: Session, keys: Sequence[Key]) -> dict[Key, Holding]:
        """Which of ``keys`` the server says are held, by which session, and what that
        session says of itself (where the server shows it: see ``Holding``)."""
        return {key: Holding(cid) for key, cid in self._live_keys(session, keys).items()}

    def _holder_rows(self, name: str | None) -> list[Any]:
        from djlocks.models import SessionHolder

        rows = SessionHolder.objects.using(self.using).order_by("name", "slot")
        return list(rows if name is None else rows.filter(key=table_key(name)))

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        """Every live grant: its holder row where the row is this grant's (same server
        session and, where the server shows it, same fence); else, where the server
        shows the holding session's own description (PostgreSQL) or its client's
        address (MariaDB, whose view has no fence: ``fence=None``), the holder from
        it, marked ``recorded=False`` (a record the background writer has not
        written yet). On MariaDB a session that held the same slot before, for an
        earlier grant of this process, is shown with that grant's row until the new
        one is written (``background.LINGER`` seconds)."""
        holder_records.flush()  # this process's own grants are always listed in full
        rows = {self._row_key(row): row for row in self._holder_rows(name)}
        slots = {key: (row.name, row.slot, row.limit) for key, row in rows.items()}
        for known, limit in known_names(SESSION_TABLES, self.using, name):
            for slot in range(limit):
                slots.setdefault(
                    self.key(known) if limit == 1 else self.key(known, slot), (known, slot, limit)
                )
        with self._side_session() as side:
            live = self._holding_sessions(side, list(slots))
        found = []
        for key, holding in live.items():
            row = rows.get(key)
            shown = fence_described(holding.description)
            if (
                row is not None
                and row.connection_id == holding.connection_id
                and shown in (None, row.fence)
            ):
                found.append(self._recorded(row))
            elif holding.since is not None and (shown is not None or holding.address):
                found.append(self._from_the_server(*slots[key], holding, shown))
        return sorted(found, key=lambda holder: (holder.name, holder.slot))

    def _row_key(self, row: Any) -> Key:
        return self.key(row.name) if row.limit == 1 else self.key(row.name, row.slot)

    def _recorded(self, row: Any) -> HolderInfo:
        return HolderInfo(
            name=row.name,
            backend=self.alias,
            slot=row.slot,
            limit=row.limit,
            host=row.host,
            pid=row.pid,
            thread=row.thread,
            label=row.label,
            since=as_datetime(row.acquired_at, connections[self.using]),
            expires_at=None,
            fence=row.fence,
            token=row.token,
            connection_id=row.connection_id,
        )

    def _from_the_server(
        self, name: str, slot: int, limit: int, holding: Holding, fence: int | None
    ) -> HolderInfo:
        host, pid, label = parse_description(holding.description or "")
        host = host or holding.address or ""
        return HolderInfo(
            name=name,
            backend=self.alias,
            slot=slot,
            limit=limit,
            host=host,
            pid=pid,
            thread=thread_described(holding.description or ""),
            label=label,
            since=holding.since or timezone.now(),
            expires_at=None,
            fence=fence,
            token="",
            connection_id=holding.connection_id,
            recorded=False,
        )

    def force_release(self, name: str, token: str | None = None) -> int:
        """Kill the holder's session, after the server confirms it still holds the key."""
        killed = 0
        with self._side_session() as side:
            for holder in self.holders(name):
                if token is None or holder.token == token:
                    key = self.key(name) if holder.limit == 1 else self.key(name, holder.slot)
                    killed += self._kill(side, holder.connection_id or 0, key)
        return killed

    def names(self) -> list[tuple[str, int]]:
        return known_names(SESSION_TABLES, self.using)

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        return []  # refused at acquire: a session lock cannot outlive its release

    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Nothing to do for dead holders (the server frees a dead session's locks, and
        holder rows are rewritten per slot); with ``idle_names`` (seconds), delete the
        fence and holder rows of names neither held nor waited for whose last grant
        is older (``djlocks.backends.idle``)."""
        if idle_names is None:
            return {}
        busy = {table_key(holder.name) for holder in self.holders()}
        busy.update(table_key(waiter.name) for waiter in self.waiters())
        return {"idle names": remove_idle_records(self.using, SESSION_TABLES, idle_names, busy)}

    def _waited_names(self, name: str | None) -> dict[Key, str]:
        """The keys a waiter of each known name (or of ``name``) may wait on."""
        return {
            key: known
            for known, limit in known_names(SESSION_TABLES, self.using, name)
            for key in self._waited_keys(known, limit)
        }

    def _waited_keys(self, name: str, limit: int) -> list[Key]:
        """A lock's key, or a semaphore's gate and slots (its gate's holder waits on one)."""
        if limit == 1:
            return [self.key(name)]
        return [self.key(name, GATE), *(self.key(name, slot) for slot in range(limit))]

    def _as_waiters(self, rows: Sequence[tuple[str | None, str, datetime]]) -> list[WaiterInfo]:
        return queue_order(self.alias, rows)
