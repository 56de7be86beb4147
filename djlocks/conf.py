"""The ``DJLOCKS`` setting, read through a cached accessor.

Keys and defaults (all optional):

``BACKENDS``
    Aliases to backend specs, like ``CACHES``. Default: ``{"default": {"BACKEND":
    "djlocks.backends.lease.LeaseBackend"}}``, on the database the project's routers
    pick for writing djlocks' tables (``"default"`` without routers).
``TTL``
    Default lease length in seconds (60).
``MAX_HOLD``
    The longest, in seconds, that one grant may be held unless its lock says
    otherwise (``max_hold``); ``None`` (the default): no bound.
``POLL_INTERVAL``
    Longest sleep, in seconds, of a waiter that is not at the head of the queue (0.25).
``WAITER_TTL``
    Seconds after which a waiter record of a process that stopped refreshing it
    is ignored (10).
``EVENTS``
    Record acquisitions, releases, time-outs, losses, expiries and forced
    releases in ``djlocks_event`` for the dashboard's history (``True``).
    Costs one ``INSERT`` per grant (at its end) and one per time-out, written by
    a background thread (see ``EVENTS_WRITER``).
``EVENTS_WRITER``
    ``"background"`` (the default): a grant's release and a time-out hand their
    events to a thread of the process, which writes them many at a time;
    ``"synchronous"``: every event is written before the operation returns.
``EVENTS_DATABASE``
    The database alias that holds ``djlocks_event``; ``None`` (the default): the one
    the project's ``DATABASE_ROUTERS`` pick for writing it (``"default"`` without
    routers), as the backends find their tables (``events_database``).
``KEY_PREFIX``
    The first part of every Redis key the Redis backend writes (``"djlocks"``);
    a backend's ``OPTIONS["prefix"]`` overrides it.
``METRICS_GROUP``
    The dotted path of a function (``str -> str``) that gives a name's ``group``
    label in the Prometheus metrics; ``None`` (the default): the part of the name
    before its first ``:``.
``EVENTS_RETENTION``
    Seconds of history ``djlocks sweep`` keeps (604800: seven days).
``SWEEP_IDLE_NAMES``
    Seconds after its last grant that ``djlocks sweep`` removes a name nothing
    holds, waits for or cools down on (at least 120); ``None`` (the default):
    names are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULT_BACKEND = {"BACKEND": "djlocks.backends.lease.LeaseBackend", "OPTIONS": {}}

#: ``EVENTS_WRITER``: routine events go through the background writer.
BACKGROUND = "background"
#: ``EVENTS_WRITER``: every event is written before the operation returns.
SYNCHRONOUS = "synchronous"

DEFAULTS: dict[str, Any] = {
    "BACKENDS": {"default": DEFAULT_BACKEND},
    "TTL": 60,
    "MAX_HOLD": None,
    "POLL_INTERVAL": 0.25,
    "WAITER_TTL": 10,
    "EVENTS": True,
    "EVENTS_WRITER": BACKGROUND,
    "EVENTS_DATABASE": None,
    "EVENTS_RETENTION": 7 * 24 * 3600,
    "KEY_PREFIX": "djlocks",
    "METRICS_GROUP": None,
    "SWEEP_IDLE_NAMES": None,
}


@cache
def djlocks_settings() -> dict[str, Any]:
    """Return ``DJLOCKS`` merged over the defaults (cached until the setting changes)."""
    configured = getattr(settings, "DJLOCKS", {}) or {}
    return {**DEFAULTS, **configured}


def events_database() -> str:
    """The database alias of the history (``djlocks_event``): ``DJLOCKS["EVENTS_DATABASE"]``
    if set, else where the project's ``DATABASE_ROUTERS`` write ``LockEvent`` (Django's
    ``router.db_for_write``; ``"default"`` where no router has a say)."""
    configured = djlocks_settings()["EVENTS_DATABASE"]
    if configured is not None:
        return str(configured)
    from djlocks.backends.base import database_alias

    return database_alias({}, "LockEvent")


Normalized = TypeVar("Normalized")


@cache
def normalized_setting(key: str, normalize: Callable[[Any], Normalized]) -> Normalized:
    """``normalize(DJLOCKS[key])`` (a default read at every acquire), computed once per
    value of the setting. What ``normalize`` raises (``TypeError``, ``ValueError``) is
    raised each time, its message naming the setting: the caller passed no such
    argument, so "ttl must be at least 0.3 seconds" alone would send them looking in
    their own code."""
    try:
        return normalize(djlocks_settings()[key])
    except TypeError as exc:
        raise TypeError(f"DJLOCKS[{key!r}] in your settings: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"DJLOCKS[{key!r}] in your settings: {exc}") from exc


@receiver(setting_changed)
def _clear_cache(*, setting: str, **kwargs: Any) -> None:
    """Re-read ``DJLOCKS`` when a test changes it (the backends rebuild themselves:
    ``djlocks.backends.BackendHandler.settings_changed``)."""
    if setting == "DJLOCKS":
        djlocks_settings.cache_clear()
        normalized_setting.cache_clear()
