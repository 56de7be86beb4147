"""Fences and holder identity for locks that the database server itself holds.

The session backends (a session's named lock) and the row backend (a
transaction's row lock) keep the lock in the server, which knows nothing of
fences or of who the holder is. Right after the server grants, djlocks writes
both on its own autocommit connection: the fence counter of the name goes up
by one and the slot's holder row is overwritten. A fence written there is
durable and is never handed out again, even if the caller's transaction rolls
back: fences rise and are never reused. Whether a holder row is live is always
the server's word, never the row's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from django.apps import apps

from djlocks.backends.base import AcquireRequest
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

HOLDER_COLUMNS = (
    "name_key, slot, name, slot_limit, token, fence, connection_id, acquired_at, "
    "host, pid, thread, label"
)
_OVERWRITTEN = (
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
    if vendor == "postgresql":
        cursor.execute(
            f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence) "
            f"VALUES (%s, %s, %s, 0) ON CONFLICT (name_key) "
            f"DO UPDATE SET slot_limit = EXCLUDED.slot_limit",
            params,
        )
    else:
        cursor.execute(
            f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence) "
            f"VALUES (%s, %s, %s, 0) ON DUPLICATE KEY UPDATE slot_limit = VALUES(slot_limit)",
            params,
        )


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

    ``connection_id`` is the server connection that holds the lock.

    One round trip and one commit. PostgreSQL: one statement (a CTE feeds the
    new fence into the holder row). MySQL/MariaDB: one batch of statements in a
    transaction (djlocks' connections allow several statements per query, see
    ``DedicatedConnections``); ``LAST_INSERT_ID(expr)`` carries the new fence
    from the fence row to the holder row (MySQL manual, "Information Functions").
    """
    key = table_key(request.name)
    who = request.identity
    holder_values = "%s, %s, %s, %s, %s, {fence}, %s, {now}, %s, %s, %s, %s"
    holder_params = (
        *(key, slot, request.name, request.limit, token),
        connection_id,
        *(who.host, who.pid, who.thread, who.label),
    )
    if vendor == "postgresql":
        overwrite = ", ".join(f"{column} = EXCLUDED.{column}" for column in _OVERWRITTEN)
        values = holder_values.format(fence="issued.fence", now="statement_timestamp()")
        cursor.execute(
            f"WITH issued AS ("
            f" INSERT INTO {tables.fence} (name_key, name, slot_limit, fence)"
            f" VALUES (%s, %s, %s, 1) ON CONFLICT (name_key) DO UPDATE"
            f" SET fence = {tables.fence}.fence + 1, slot_limit = EXCLUDED.slot_limit"
            f" RETURNING fence) "
            f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) SELECT {values} FROM issued "
            f"ON CONFLICT (name_key, slot) DO UPDATE SET {overwrite} RETURNING fence",
            (key, request.name, request.limit, *holder_params),
        )
        return int(cursor.fetchone()[0])
    overwrite = ", ".join(f"{column} = VALUES({column})" for column in _OVERWRITTEN)
    values = holder_values.format(fence="@djlocks_fence", now="UTC_TIMESTAMP(6)")
    try:
        cursor.execute(
            f"START TRANSACTION; "
            f"INSERT INTO {tables.fence} (name_key, name, slot_limit, fence) "
            f"VALUES (%s, %s, %s, LAST_INSERT_ID(1)) ON DUPLICATE KEY UPDATE "
            f"fence = LAST_INSERT_ID(fence + 1), slot_limit = VALUES(slot_limit); "
            f"SET @djlocks_fence = LAST_INSERT_ID(); "
            f"INSERT INTO {tables.holder} ({HOLDER_COLUMNS}) VALUES ({values}) "
            f"ON DUPLICATE KEY UPDATE {overwrite}; "
            f"COMMIT; "
            f"SELECT @djlocks_fence",
            (key, request.name, request.limit, *holder_params),
        )
        while cursor.nextset():  # each statement's result in turn; an error raises here
            if cursor.description:
                return int(cursor.fetchone()[0])
    except BaseException:
        with contextlib.suppress(Exception):
            cursor.execute("ROLLBACK")  # a statement failed: the rest did not run
        raise
    raise AssertionError("the batch ended without the fence")


def known_names(tables: RecordTables, using: str, name: str | None = None) -> list[tuple[str, int]]:
    """``(name, limit)`` of every name the fence table knows (or only ``name``), sorted by name."""
    rows = apps.get_model(tables.fence_model).objects.using(using)
    if name is not None:
        rows = rows.filter(key=table_key(name))
    return list(rows.order_by("name").values_list("name", "limit"))
