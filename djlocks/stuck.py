"""Stuck holders: held far longer than their name usually is, by its history.

A holder that hangs while its heartbeat renews keeps its name and looks, in the
stores, like any other holder. The dashboard marks it by comparing how long it
has held the name with the name's usual hold: the 95th percentile of its holds
that ended in the last ``USUAL_PERIOD`` (``events.usual_hold``). A holder is
stuck past ``STUCK_FACTOR`` times that, and never before ``STUCK_FLOOR``
seconds. A name with too little history (no history at all with
``DJLOCKS["EVENTS"] = False``) has no usual hold, and none of its holders is
marked. ``max_hold`` is what ends such a hold; this only shows it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.db import DatabaseError

from djlocks.backends.base import HolderInfo
from djlocks.events import usual_hold
from djlocks.forksafe import fork_safe_lock

#: A holder is stuck once held this many times its name's usual hold...
STUCK_FACTOR = 4.0
#: ... and at least this many seconds.
STUCK_FLOOR = 30.0
#: The history a name's usual hold is taken from.
USUAL_PERIOD = timedelta(days=1)
#: Seconds a process keeps a name's usual hold, and how many names it keeps.
USUAL_KEPT, USUAL_KEPT_NAMES = 60.0, 10_000

stuck_log = logging.getLogger("djlocks.dashboard")
_usual: dict[tuple[str, str], tuple[float, float | None]] = {}  # -> (read at, usual hold)
_usual_guard = fork_safe_lock()


#: A holder's place: (backend, name, slot); a slot has one holder at a time.
Place = tuple[str, str, int]


def stuck_holders(holders: Iterable[HolderInfo], now: datetime) -> dict[Place, float]:
    """The stuck ones among ``holders``, by place: each one's usual hold (seconds).

    Only a name with a holder held for longer than ``STUCK_FLOOR`` costs a look at
    the history: one indexed query of its last ``events.USUAL_SAMPLE`` holds, kept
    for ``USUAL_KEPT`` seconds (the dashboard redraws every few seconds).
    """
    stuck = {}
    for holder in holders:
        held = (now - holder.since).total_seconds()
        if held <= STUCK_FLOOR:
            continue
        known = _usual_hold(holder.backend, holder.name, now)
        if known is not None and held > STUCK_FACTOR * known:
            stuck[holder.backend, holder.name, holder.slot] = known
    return stuck


def _usual_hold(backend: str, name: str, now: datetime) -> float | None:
    """``events.usual_hold`` of the name, read at most once per ``USUAL_KEPT`` seconds in
    this process; ``None`` while the history cannot be read."""
    key = (backend, name)
    with _usual_guard:
        kept = _usual.get(key)
    if kept is not None and time.monotonic() - kept[0] < USUAL_KEPT:
        return kept[1]
    try:
        usual = usual_hold(backend, name, now - USUAL_PERIOD)
    except DatabaseError as exc:
        stuck_log.warning("no usual hold for %r: the history cannot be read (%s)", name, exc)
        return None
    with _usual_guard:
        if len(_usual) >= USUAL_KEPT_NAMES:
            _usual.clear()
        _usual[key] = (time.monotonic(), usual)
    return usual
