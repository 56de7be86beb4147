"""Removing idle names from the tables of the locks a database server holds.

The session backends and the row backend keep a fence row per name (and the row
backend's lockable rows, and each slot's last holder row) long after the name's
last grant. ``remove_idle_records`` deletes them for names whose last grant or
registration (``used_at``, by the database's clock) is older than the idle time
and that the server's own view shows neither held nor waited for.

Each batch locks the names' fence rows first (``SELECT ... FOR UPDATE``) and
judges them again under that lock: a grant or a registration that comes
meanwhile renews ``used_at`` in the same row, so it either made the name busy
before the lock or waits for the sweep's commit and then writes a new row. The
row backend's lockable rows go only if no transaction holds one of them (``SKIP
LOCKED``). A process that still believes a removed name's rows exist finds them
missing and creates them again (``row.server``). A name that comes back starts
its fences at the server's clock in microseconds (``FIRST_FENCE`` of each vendor
module), above every fence it had: fences rise by one per grant, far slower than
the clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from typing import Any

from django.db import OperationalError, connections, transaction

from djlocks.backends.server_records import RecordTables
from djlocks.backends.sql import lease_dialect

#: Names looked at, and removed, per transaction.
BATCH = 1000

idle_log = logging.getLogger("djlocks.sweep")


def remove_idle_records(
    using: str,
    tables: RecordTables,
    idle: float,
    busy: Collection[str],
    *,
    lockable_rows: bool = False,
) -> int:
    """Delete the records of every name of ``tables`` on ``using`` whose ``used_at`` is
    more than ``idle`` seconds old by the database's clock and whose key is not in
    ``busy`` (the table keys of the names held or waited for now); return how many
    names went.

    With ``lockable_rows`` the name's ``djlocks_row_lock`` rows go too, and the name
    stays if a transaction holds one of them. A name whose ``used_at`` is unknown
    (written by a djlocks older than the sweep) is kept.
    """
    dialect = lease_dialect(connections[using].vendor)
    unused = f"used_at < {dialect.plus_seconds}"
    before: Any = dialect.seconds_param(-idle)
    removed, after = 0, ""
    while True:
        with connections[using].cursor() as cursor:
            cursor.execute(
                f"SELECT name_key FROM {tables.fence} WHERE name_key > %s AND {unused} "
                f"ORDER BY name_key LIMIT {BATCH}",
                (after, before),
            )
            keys = [key for (key,) in cursor.fetchall()]
        if not keys:
            return removed
        after = keys[-1]
        candidates = [key for key in keys if key not in busy]
        if not candidates:
            continue
        try:
            removed += _remove(using, tables, candidates, unused, before, lockable_rows)
        except OperationalError as exc:  # a deadlock or a lock wait with a writer
            idle_log.info("%s idle name(s) left for the next sweep: %s", len(candidates), exc)


def _remove(
    using: str,
    tables: RecordTables,
    keys: list[str],
    unused: str,
    before: Any,
    lockable_rows: bool,
) -> int:
    """In one transaction: lock the fence rows of ``keys`` still unused, then delete
    those names' records; return how many names went."""
    for_update = lease_dialect(connections[using].vendor).for_update
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        among = ", ".join(["%s"] * len(keys))
        cursor.execute(
            f"SELECT name_key FROM {tables.fence} WHERE name_key IN ({among}) "
            f"AND {unused} ORDER BY name_key{for_update}",
            (*keys, before),
        )
        still = [key for (key,) in cursor.fetchall()]
        if lockable_rows:
            still = _free_lockable_rows(cursor, still)
        if not still:
            return 0
        among = ", ".join(["%s"] * len(still))
        cursor.execute(f"DELETE FROM {tables.holder} WHERE name_key IN ({among})", still)
        cursor.execute(
            f"DELETE FROM {tables.fence} WHERE name_key IN ({among}) AND {unused}",
            (*still, before),
        )
        return int(cursor.rowcount)


def _free_lockable_rows(cursor: Any, keys: list[str]) -> list[str]:
    """Delete the row backend's lockable rows of each of ``keys`` none of whose rows a
    transaction holds; return those keys (and the keys that had no rows)."""
    if not keys:
        return keys
    among = ", ".join(["%s"] * len(keys))
    cursor.execute(f"SELECT name_key FROM djlocks_row_lock WHERE name_key IN ({among})", keys)
    counted = Counter(key for (key,) in cursor.fetchall())
    cursor.execute(
        f"SELECT id, name_key FROM djlocks_row_lock WHERE name_key IN ({among}) "
        f"FOR UPDATE SKIP LOCKED",
        keys,
    )
    locked = cursor.fetchall()
    ours = Counter(key for _, key in locked)
    free = [key for key in keys if ours[key] == counted[key]]
    chosen = set(free)
    # One row per statement: InnoDB may scan a small table for "id IN (...)", and a
    # DELETE (unlike an UPDATE) then waits for every row a holder locks.
    cursor.executemany(
        "DELETE FROM djlocks_row_lock WHERE id = %s",
        [(row_id,) for row_id, key in locked if key in chosen],
    )
    return free
