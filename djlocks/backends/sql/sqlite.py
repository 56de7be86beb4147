"""What djlocks runs on SQLite: every statement, error code and server query."""

from __future__ import annotations

from djlocks.backends.sql.dialects import LeaseDialect, enqueue_returning

# -- History (djlocks.events) ------------------------------------------------

#: Run once on the history's own connection: nothing.
HISTORY_SESSION: str | None = None

#: A new name's first fence: the clock in microseconds since the epoch (see
#: ``sql.postgresql.FIRST_FENCE``).
FIRST_FENCE = "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)"

# -- Lease rows (djlocks.backends.lease) ------------------------------------

NOW = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"


def lease_first_waiters(waiters: str, name_key: str, limit: str) -> str:
    """A query of the ids of the first ``limit`` live waiters of the name ``name_key``
    (both SQL expressions) in the table ``waiters``."""
    return (
        f"SELECT id FROM (SELECT w.id, row_number() OVER (ORDER BY w.id) AS place "
        f"FROM {waiters} w WHERE w.name_key = {name_key} AND w.expires_at > {NOW}) "
        f"WHERE place <= {limit}"
    )


def lease_returning_heads(update: str, slots: str, waiters: str) -> str:
    """``update`` (of the table ``slots``) returning, per changed slot, the tickets of the
    name's first ``slot_limit`` live waiters, comma-separated (NULL if none)."""
    first = lease_first_waiters(waiters, f"{slots}.name_key", f"{slots}.slot_limit")
    return f"{update} RETURNING (SELECT group_concat(id) FROM ({first}))"


LEASE = LeaseDialect(
    now=NOW,
    plus_seconds="strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)",
    for_update="",
    returning=True,
    enqueue=enqueue_returning,
    fence_increment="fence = fence + 1",
    first_fence=FIRST_FENCE,
    # No row locks: IMMEDIATE takes the database's write lock up front.
    begin="BEGIN IMMEDIATE",
    seconds_param=lambda seconds: f"{seconds:+.3f} seconds",
    returning_heads=lease_returning_heads,
    write_gate=True,
)
