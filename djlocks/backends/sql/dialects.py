"""The shapes of the vendor modules' answers: what differs between databases, per family.

Each vendor module (``sql.postgresql``, ``sql.mysql``, ``sql.sqlite``) fills
these in once; the families read them through ``djlocks.backends.sql``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LeaseDialect:
    """The SQL fragments of the lease rows (``djlocks.backends.lease``) on one database.

    Every moment is the database's own clock, so expiry is judged by one clock.
    """

    #: The store's now, as SQL.
    now: str
    #: The store's now plus one ``%s`` parameter (made by ``seconds_param``).
    plus_seconds: str
    #: Appended to a ``SELECT`` that must lock the rows it reads; empty on SQLite.
    for_update: str
    #: ``UPDATE``/``INSERT ... RETURNING`` exists; else the driver's ``lastrowid``.
    returning: bool
    #: Sets ``fence`` to ``fence + 1`` and makes the new value readable.
    fence_increment: str
    #: The fence a new name's slot rows start at: the store's clock in microseconds.
    first_fence: str
    #: Starts a transaction that serialises the claims of one name.
    begin: str
    #: Seconds as ``plus_seconds``'s parameter.
    seconds_param: Callable[[float], object]
    #: Makes an ``UPDATE`` of grants also wake the waiters and tell the holders in the
    #: same round trip (PostgreSQL ``NOTIFY``); ``None`` where the store cannot notify.
    notifying: Callable[[str, bool, bool], str] | None = None
    #: Runs on each dedicated connection as it opens.
    session_setup: tuple[str, ...] = ()
    #: One ``UPDATE`` can lock a name's slot rows (a CTE ``FOR UPDATE``) and claim
    #: one of them (``lease.claims._claim_free_slot``); else a transaction does.
    slot_in_one_statement: bool = False
    #: Builds the release that hands the freed slot to the head of the queue, fence
    #: and all, and wakes it, in one statement (``(slots, waiters) -> SQL``, with the
    #: named parameter ``token``); ``None`` where a waiter claims a freed slot.
    handing_over: Callable[[str, str], str] | None = None
