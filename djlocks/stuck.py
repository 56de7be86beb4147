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

from collections.abc import Iterable
from datetime import datetime, timedelta

from djlocks.backends.base import HolderInfo
from djlocks.events import usual_hold

#: A holder is stuck once held this many times its name's usual hold...
STUCK_FACTOR = 4.0
#: ... and at least this many seconds.
STUCK_FLOOR = 30.0
#: The history a name's usual hold is taken from.
USUAL_PERIOD = timedelta(days=1)


#: A holder's place: (backend, name, slot); a slot has one holder at a time.
Place = tuple[str, str, int]


def stuck_holders(holders: Iterable[HolderInfo], now: datetime) -> dict[Place, float]:
    """The stuck ones among ``holders``, by place: each one's usual hold (seconds).

    Only a name with a holder held for longer than ``STUCK_FLOOR`` costs a look at
    the history: one indexed query of its last ``events.USUAL_SAMPLE`` holds.
    """
    usual: dict[tuple[str, str], float | None] = {}
    stuck = {}
    for holder in holders:
        held = (now - holder.since).total_seconds()
        if held <= STUCK_FLOOR:
            continue
        key = (holder.backend, holder.name)
        if key not in usual:
            usual[key] = usual_hold(holder.backend, holder.name, now - USUAL_PERIOD)
        if (known := usual[key]) is not None and held > STUCK_FACTOR * known:
            stuck[holder.backend, holder.name, holder.slot] = known
    return stuck
