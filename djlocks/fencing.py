"""Fenced writes: let the protected resource refuse a stale holder.

A lease can run out while its holder is paused (see "Fencing" in
docs/guarantees.md); when the holder wakes it may
still write. Store the fence of the last writer beside the data and write
only when your fence is at least as new::

    from djlocks.fencing import fenced_update

    with db_lock("account:7") as grant:
        fenced_update(Account.objects.filter(pk=7), grant.fence, balance=new_balance)

This is one conditional ``UPDATE … SET fence = %s, … WHERE … AND fence <= %s``,
so the check and the write are one atomic step in the database.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet

from djlocks.exceptions import LockLost


class StaleFence(LockLost):
    """A write carried an older fence than the last accepted one: a newer holder exists."""


def fenced_update(
    queryset: QuerySet[Model], fence: int, *, fence_field: str = "fence", **values: Any
) -> int:
    """Update the rows of ``queryset`` whose ``fence_field`` is <= ``fence``; return the count.

    Sets ``fence_field`` to ``fence`` along with ``values``. Raises
    ``StaleFence`` (a ``LockLost``) when rows match ``queryset`` but every one
    of them was already written under a newer fence.
    """
    updated = queryset.filter(**{f"{fence_field}__lte": fence}).update(
        **{fence_field: fence}, **values
    )
    if updated == 0 and queryset.exists():
        raise StaleFence(
            f"Refused a write with fence {fence}: a newer holder already wrote these rows."
        )
    return updated
