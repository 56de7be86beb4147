"""What the server says of a session backend's names: holders, waiters, forced release.

The holder rows (``djlocks_session_holder``) carry identity and fences; whether
a row's grant is live is always the server's word (``_live_keys``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo
from djlocks.backends.described import queue_order
from djlocks.backends.server_records import SESSION_TABLES, known_names
from djlocks.backends.session.connections import Key, Session, SessionStore
from djlocks.keys import GATE, table_key


class SessionInspection(SessionStore):
    """Holders and waiters from the server's own view, and killing a holder's session."""

    @abstractmethod
    def _live_keys(self, session: Session, keys: Sequence[Key]) -> dict[Key, int]:
        """Which of ``keys`` the server says are held, and by which connection id."""

    def _holder_rows(self, name: str | None) -> list[Any]:
        from djlocks.models import SessionHolder

        rows = SessionHolder.objects.using(self.using).order_by("name", "slot")
        return list(rows if name is None else rows.filter(key=table_key(name)))

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        rows = self._holder_rows(name)
        keys = {self.key(r.name) if r.limit == 1 else self.key(r.name, r.slot): r for r in rows}
        with self._side_session() as side:
            live = self._live_keys(side, list(keys))
        return [
            HolderInfo(
                name=row.name,
                backend=self.alias,
                slot=row.slot,
                limit=row.limit,
                host=row.host,
                pid=row.pid,
                thread=row.thread,
                label=row.label,
                since=row.acquired_at,
                expires_at=None,
                fence=row.fence,
                token=row.token,
                connection_id=row.connection_id,
            )
            for key, row in keys.items()
            if live.get(key) == row.connection_id
        ]

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

    def sweep(self) -> dict[str, int]:
        return {}  # the server frees a dead session's locks; holder rows are rewritten per slot

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
