"""Fences and holder identity for locks that the database server itself holds.

The session backends (a session's named lock) and the row backend (a
transaction's row lock) keep the lock in the server, which knows nothing of
fences or of who the holder is. Right after the server grants, djlocks writes
both on its own autocommit connection: the fence counter of the name goes up
by one and the slot's holder row is overwritten, in one round trip (each
vendor's ``record_grant`` in ``djlocks.backends.sql``). A fence written there is
durable and is never handed out again, even if the caller's transaction rolls
back: fences rise and are never reused. Whether a holder row is live is always
the server's word, never the row's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.apps import apps

from djlocks.backends.base import AcquireRequest
from djlocks.backends.sql import for_vendor
from djlocks.keys import table_key


@dataclass(frozen=True)
class RecordTables:
    """The fence table and the holder table of one backend family, and the fence model."""

    fence: str
    holder: str
    fence_model: str


SESSION_TABLES = RecordTables(
    "djlocks_session_fence", "djlocks_session_holder", "djlocks.SessionFence"
)
ROW_TABLES = RecordTables("djlocks_row_fence", "djlocks_row_holder", "djlocks.RowFence")

#: The holder row's columns, in the order of ``record_grant``'s values.
HOLDER_COLUMNS = (
    "name_key, slot, name, slot_limit, token, fence, connection_id, acquired_at, "
    "host, pid, thread, label"
)
#: The holder row's columns that a new grant of the same slot overwrites.
OVERWRITTEN = (
    "name",
    "slot_limit",
    "token",
    "fence",
    "connection_id",
    "acquired_at",
    "host",
    "pid",
    "thread",
    "label",
)


def register_name(cursor: Any, vendor: str, tables: RecordTables, request: AcquireRequest) -> None:
    """Make sure the name has a fence row (fence 0 if new), with the caller's limit."""
    params = (table_key(request.name), request.name, request.limit)
    for_vendor(vendor).register_name(cursor, tables, params)


def record_grant(
    cursor: Any,
    vendor: str,
    tables: RecordTables,
    request: AcquireRequest,
    slot: int,
    token: str,
    connection_id: int,
) -> int:
    """Issue the next fence of ``request.name`` and record the holder of ``slot``; return the fence.

    ``connection_id`` is the server connection that holds the lock. One round
    trip and one commit (see each vendor's ``record_grant`` in ``djlocks.backends.sql``).
    """
    key = table_key(request.name)
    who = request.identity
    fence_params = (key, request.name, request.limit)
    holder_params = (
        *(key, slot, request.name, request.limit, token),
        connection_id,
        *(who.host, who.pid, who.thread, who.label),
    )
    fence: int = for_vendor(vendor).record_grant(cursor, tables, fence_params, holder_params)
    return fence


def known_names(tables: RecordTables, using: str, name: str | None = None) -> list[tuple[str, int]]:
    """``(name, limit)`` of every name the fence table knows (or only ``name``), sorted by name."""
    rows = apps.get_model(tables.fence_model).objects.using(using)
    if name is not None:
        rows = rows.filter(key=table_key(name))
    return list(rows.order_by("name").values_list("name", "limit"))
