"""Removing idle names from the tables of the locks a database server holds.

The session backends and the row backend keep a fence row per name (and the row
backend's lockable rows, and each slot's last holder row) long after the name's
last grant. ``remove_idle_records`` deletes them for names whose last grant
(``used_at``) is older than the idle time and that the server's own view shows
neither held nor waited for. A grant that comes meanwhile renews ``used_at``
and its holder row's ``acquired_at``, and each ``DELETE`` checks those again
under the row's lock, so it keeps them. A name that comes back starts its
fences at the server's clock in microseconds (``FIRST_FENCE`` of each vendor
module), above every fence it had: fences rise by one per grant, far slower
than the clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from datetime import timedelta

from django.apps import apps
from django.db import connections, transaction
from django.db.models import Q

from djlocks.backends.server_records import RecordTables
from djlocks.backends.sql import database_now

#: Names looked at, and removed, per transaction.
BATCH = 1000


def remove_idle_records(
    using: str,
    tables: RecordTables,
    idle: float,
    busy: Collection[str],
    *,
    lockable_rows: bool = False,
) -> int:
    """Delete the records of every name of ``tables`` on ``using`` whose last grant is
    more than ``idle`` seconds old and whose key is not in ``busy`` (the table keys
    of the names held or waited for now); return how many names went.

    With ``lockable_rows`` the name's ``djlocks_row_lock`` rows go too, only if no
    transaction holds one of them (``SELECT ... FOR UPDATE SKIP LOCKED``).
    """
    cutoff = database_now(using) - timedelta(seconds=idle)
    unused = Q(used_at__isnull=True) | Q(used_at__lt=cutoff)
    fences = apps.get_model(tables.fence_model).objects.using(using)
    holders = apps.get_model(tables.holder_model).objects.using(using)
    removed, after = 0, ""
    while True:
        keys = list(
            fences.filter(unused, key__gt=after)
            .order_by("key")
            .values_list("key", flat=True)[:BATCH]
        )
        if not keys:
            return removed
        after = keys[-1]
        idle_keys = [key for key in keys if key not in busy]
        with transaction.atomic(using=using):
            if lockable_rows:
                idle_keys = _free_lockable_rows(using, idle_keys)
            holders.filter(key__in=idle_keys, acquired_at__lt=cutoff).delete()
            removed += fences.filter(unused, key__in=idle_keys).delete()[0]


def _free_lockable_rows(using: str, keys: list[str]) -> list[str]:
    """Delete the row backend's lockable rows of each of ``keys`` none of whose rows a
    transaction holds; return those keys (and the keys that had no rows)."""
    from djlocks.models import RowLock

    rows = RowLock.objects.using(using).filter(key__in=keys)
    counted = Counter(rows.values_list("key", flat=True))
    locked = list(rows.select_for_update(skip_locked=True).values_list("pk", "key"))
    ours = Counter(key for _, key in locked)
    free = [key for key in keys if ours[key] == counted[key]]
    chosen = set(free)
    with connections[using].cursor() as cursor:
        # One row per statement: InnoDB may scan a small table for "id IN (...)", and a
        # DELETE (unlike an UPDATE) then waits for every row a holder locks.
        cursor.executemany(
            f"DELETE FROM {RowLock._meta.db_table} WHERE id = %s",
            [(pk,) for pk, key in locked if key in chosen],
        )
    return free
