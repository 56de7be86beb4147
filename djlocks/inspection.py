"""What the stores say about names: holders, waiters and cool-downs across backends.

Shared by ``manage.py djlocks list|show|release`` (and, later, the admin), so
that every view of the truth asks the stores the same way (G13).
"""

from __future__ import annotations

import getpass
import logging
from dataclasses import dataclass, field
from typing import Any

from djlocks.backends import backends
from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo
from djlocks.events import Kind, events
from djlocks.exceptions import BackendUnavailable

force_release_log = logging.getLogger("djlocks.force_release")


@dataclass
class Snapshot:
    """Holders, waiters and cool-downs of some names, as the stores answered."""

    holders: list[HolderInfo] = field(default_factory=list)
    waiters: list[WaiterInfo] = field(default_factory=list)
    cooldowns: list[CooldownInfo] = field(default_factory=list)
    #: Backends that could not be asked (their store is down), with the reason.
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.holders or self.waiters or self.cooldowns)

    def as_json(self) -> dict[str, Any]:
        """Plain data; owner tokens are left out, since a token lets its bearer release."""
        return {
            "holders": [public(h) for h in self.holders],
            "waiters": [vars(w).copy() for w in self.waiters],
            "cooldowns": [vars(c).copy() for c in self.cooldowns],
            "unavailable": dict(self.unavailable),
        }


def public(holder: HolderInfo) -> dict[str, Any]:
    """A holder as plain data without its owner token, which lets its bearer release."""
    return {k: v for k, v in vars(holder).items() if k != "token"}


def snapshot(name: str | None = None, backend: str | None = None) -> Snapshot:
    """Ask each backend (or only ``backend``) about ``name`` (or every name).

    A backend whose store cannot be reached is listed in ``unavailable``; the
    others are still shown (one Redis being down must not hide the database's locks).
    """
    found = Snapshot()
    for alias in [backend] if backend else backends.aliases():
        store = backends[alias]
        try:
            holders, waiters, cooldowns = (
                store.holders(name),
                store.waiters(name),
                store.cooldowns(name),
            )
        except BackendUnavailable as exc:
            found.unavailable[alias] = str(exc)
            continue
        found.holders.extend(holders)
        found.waiters.extend(waiters)
        found.cooldowns.extend(cooldowns)
    return found


def force_release(
    holders: list[HolderInfo], *, reason: str = "", operator: str | None = None
) -> list[HolderInfo]:
    """Take each grant away by its owner token; return those that were still live.

    A grant that ended meanwhile is left alone, and so is whoever holds the
    slot now: release is by token, never by name (G7, G13). The holder learns
    ``LockLost`` at its next check, renewal or release. Each release is
    logged on ``djlocks.force_release`` and recorded as a ``forced_release``
    event with ``operator`` (default: the operating-system user) and ``reason``.
    """
    operator = operator or getpass.getuser()
    released = []
    for holder in holders:
        if backends[holder.backend].force_release(holder.name, holder.token):
            released.append(holder)
            force_release_log.warning(
                "forced release of %s slot %s (fence %s, held by %s pid %s, %s) by %s: %s",
                holder.name,
                holder.slot,
                holder.fence,
                holder.host,
                holder.pid,
                holder.label,
                operator,
                reason or "no reason given",
            )
    events.holders_ended(released, Kind.FORCED_RELEASE, operator=operator, reason=reason)
    return released
