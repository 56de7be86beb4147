"""What the stores say about names: holders, waiters and cool-downs across backends.

Shared by ``manage.py djlocks list|show|release`` and the admin dashboard, so
that every view of the truth asks the stores the same way (the admin tells the
truth: holders and waiters come from the stores' own state).
"""

from __future__ import annotations

import getpass
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.connection import ConnectionDoesNotExist

from djlocks import metrics
from djlocks.backends import backends
from djlocks.backends.base import CooldownInfo, HolderInfo, LockBackend, WaiterInfo
from djlocks.events import events
from djlocks.exceptions import BackendUnavailable
from djlocks.kinds import Kind

force_release_log = logging.getLogger("djlocks.force_release")
#: Seconds a graceful release gives the holders unless the operator says otherwise.
GRACEFUL_WAIT = 30.0


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


#: What a store that cannot be asked raises: it cannot be reached, or its backend
#: names a database that is not configured (``djlocks.E005``).
UNUSABLE = (BackendUnavailable, ImproperlyConfigured, ConnectionDoesNotExist)


def unusable(alias: str, exc: Exception) -> str:
    """Why the store of backend ``alias`` could not be asked, from what it raised."""
    if isinstance(exc, BackendUnavailable):
        return str(exc)
    return f"djlocks backend {alias!r} is misconfigured: {exc} (`manage.py check` says more)"


def snapshot(name: str | None = None, backend: str | None = None) -> Snapshot:
    """Ask each backend (or only ``backend``) about ``name`` (or every name).

    A backend whose store cannot be reached is listed in ``unavailable``; the
    others are still shown (one Redis being down must not hide the database's locks).
    """
    found = Snapshot()
    for alias in [backend] if backend else backends.aliases():
        try:
            store = backends[alias]
            holders, waiters, cooldowns = (
                store.holders(name),
                store.waiters(name),
                store.cooldowns(name),
            )
        except UNUSABLE as exc:
            found.unavailable[alias] = unusable(alias, exc)
            continue
        found.holders.extend(holders)
        found.waiters.extend(waiters)
        found.cooldowns.extend(cooldowns)
    return found


def force_release(
    holders: list[HolderInfo],
    *,
    reason: str = "",
    operator: str | None = None,
    on_released: Callable[[HolderInfo], None] | None = None,
) -> list[HolderInfo]:
    """Take each grant away by its owner token; return those that were still live.

    A grant that ended meanwhile is left alone, and so is whoever holds the
    slot now: release is by token, never by name, so a forced release fences the
    old holder and only that one. The holder hears of it at once where the
    store can push (``LockBackend.watch``: the lease backend on PostgreSQL,
    Redis, session locks), else at its next renewal or check: ``on_lost`` is
    called, and
    ``check()`` and ``release()`` raise ``LockLost``.

    Each grant is audited as soon as its store took it away, before the next
    one is tried: logged on ``djlocks.force_release``, recorded as a
    ``forced_release`` event with ``operator`` (default: the operating-system
    user) and ``reason`` where the backend records history
    (``capabilities.history``), and passed to ``on_released`` (the admin writes its
    ``LogEntry`` there). A store that fails raises ``BackendUnavailable`` and
    the grants after it are not tried; every grant taken away before it has
    its audit already.
    """
    return _take_back(
        holders,
        lambda store, holder: store.force_release(holder.name, holder.token),
        Kind.FORCED_RELEASE,
        operator=operator or getpass.getuser(),
        reason=reason,
        on_done=on_released,
    )


def request_release(
    holders: list[HolderInfo],
    *,
    wait: float,
    reason: str = "",
    operator: str | None = None,
    on_requested: Callable[[HolderInfo], None] | None = None,
) -> list[HolderInfo]:
    """Ask each holder to give its grant back (a graceful release); return those still live.

    Each grant stays held until its holder releases it, or until ``wait``
    seconds (more than 0) have passed, whichever comes first
    (``LockBackend.request_release``): the next waiter never starts while the
    old holder winds down. The holder hears of it at once where the store can
    push, else at its next renewal: ``on_lost`` and ``lock_lost`` get
    ``djlocks.grant.RELEASE_REQUESTED``, ``check()`` raises
    ``ReleaseRequested``, and a ``runlocked`` holder stops its command.

    Audited as ``force_release`` is, as a ``release_requested`` event, each
    grant passed to ``on_requested``. Raises ``ValueError`` for a bad ``wait``
    or a backend that cannot do this (``capabilities.graceful_release``), before any
    grant is asked; ``BackendUnavailable`` as ``force_release`` does.
    """
    if not 0 < wait < float("inf"):
        raise ValueError(f"The wait for a graceful release must be more than 0 s, not {wait}.")
    refused = sorted(
        {h.backend for h in holders if not backends[h.backend].capabilities.graceful_release}
    )
    if refused:
        raise ValueError(
            f"Backend {', '.join(map(repr, refused))} cannot ask a holder to give its grant "
            f"back; release it by force instead (the holder learns LockLost)."
        )
    return _take_back(
        holders,
        lambda store, holder: store.request_release(holder.name, holder.token, wait),
        Kind.RELEASE_REQUESTED,
        operator=operator or getpass.getuser(),
        reason=reason,
        on_done=on_requested,
    )


def _take_back(
    holders: list[HolderInfo],
    act: Callable[[LockBackend, HolderInfo], int],
    kind: Kind,
    *,
    operator: str,
    reason: str,
    on_done: Callable[[HolderInfo], None] | None,
) -> list[HolderInfo]:
    """``act`` on each grant in its store, auditing each one it changed (see ``force_release``)."""
    done = []
    for holder in holders:
        store = backends[holder.backend]
        if not act(store, holder):
            continue
        done.append(holder)
        _audit(holder, store, kind, operator, reason)
        if on_done is not None:
            on_done(holder)
    return done


def _audit(holder: HolderInfo, store: LockBackend, kind: Kind, operator: str, reason: str) -> None:
    """The log line and (where the store records history) the event of one forced release
    or graceful release's request (``kind``)."""
    force_release_log.warning(
        "%s of %s slot %s (fence %s, held by %s pid %s, %s) by %s: %s",
        kind.label,
        holder.name,
        holder.slot,
        holder.fence,
        holder.host,
        holder.pid,
        holder.label,
        operator,
        reason or "no reason given",
    )
    if store.capabilities.history:
        events.holders_ended([holder], kind, operator=operator, reason=reason)
    if kind == Kind.FORCED_RELEASE:
        metrics.released_by_force(holder.backend, holder.name, 1)
