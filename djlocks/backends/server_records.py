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

The PostgreSQL advisory-lock backend issues its fences in the locking statement
itself (a sequence, see ``sql.postgresql.fenced_grant``), so it writes nothing
before ``acquire`` returns: its holder rows go through a background writer
(``HolderRecords``), and until a row is written the server's own view shows the
holder (``pg_stat_activity``'s ``application_name`` carries its identity and fence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.apps import apps
from django.db import DatabaseError

from djlocks import background
from djlocks.backends.base import AcquireRequest
from djlocks.backends.dedicated import RecordWriting
from djlocks.backends.sql import for_vendor
from djlocks.keys import table_key

records_log = logging.getLogger("djlocks.records")


@dataclass(frozen=True)
class RecordTables:
    """The fence table and the holder table of one backend family, and their models."""

    fence: str
    holder: str
    fence_model: str
    holder_model: str


SESSION_TABLES = RecordTables(
    "djlocks_session_fence",
    "djlocks_session_holder",
    "djlocks.SessionFence",
    "djlocks.SessionHolder",
)
ROW_TABLES = RecordTables(
    "djlocks_row_fence", "djlocks_row_holder", "djlocks.RowFence", "djlocks.RowHolder"
)

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
    fence_params = (key, request.name, request.limit)
    holder_params = _holder_row(request, slot, token, None, connection_id, None)
    fence: int = for_vendor(vendor).record_grant(cursor, tables, fence_params, holder_params)
    return fence


def _holder_row(
    request: AcquireRequest,
    slot: int,
    token: str,
    fence: int | None,
    connection_id: int,
    acquired_at: datetime | None,
) -> tuple[object, ...]:
    """A holder row's values in ``HOLDER_COLUMNS`` order; ``record_grant`` fills in
    the fence and the moment it leaves out (``None``)."""
    who = request.identity
    return (
        *(table_key(request.name), slot, request.name, request.limit, token),
        *((fence,) if fence is not None else ()),
        connection_id,
        *((acquired_at,) if acquired_at is not None else ()),
        *(who.host, who.pid, who.thread, who.label),
    )


#: A grant: its request, slot, token, fence, connection id, and the wall clock's
#: seconds then (``time.time``: shown in the holder row, never compared with a deadline).
Granted = tuple[AcquireRequest, int, str, int, int, float]
#: A grant whose holder row is yet to be written, as the caller hands it over (the
#: writer's thread builds the row): the database alias and vendor, the tables, the grant.
HolderRecord = tuple[str, str, RecordTables, Granted]


class HolderRecords:
    """Writes holder rows on a background thread (``djlocks.background``), newest first.

    For backends whose grant statement already issued the fence: ``acquire``
    returns without a write, and the row follows within ``background.LINGER``
    seconds. A write that fails is logged and dropped; the holder is then shown
    from the server's own view.
    """

    def __init__(self) -> None:
        self._connections = RecordWriting()
        self._writer: background.BackgroundWriter[HolderRecord] = background.start(
            self._write, "djlocks-holders"
        )

    def submit(self, record: HolderRecord) -> None:
        """Write the holder row of ``record`` soon. Only a tuple is made here, in the
        holder's thread: its row is built on the writer's."""
        self._writer.submit([record])

    def flush(self, timeout: float = background.EXIT_WAIT) -> bool:
        """Wait up to ``timeout`` seconds until the rows submitted so far are written."""
        return self._writer.flush(timeout)

    def _write(self, records: list[HolderRecord]) -> None:
        batches: dict[tuple[str, str, RecordTables], dict[tuple[str, int], Granted]] = {}
        for using, vendor, tables, grant in records:
            # A process submits a slot's grants in order: the last wins.
            newest = batches.setdefault((using, vendor, tables), {})
            newest[table_key(grant[0].name), grant[1]] = grant
        for (using, vendor, tables), newest in batches.items():
            names: dict[str, tuple[str, str, int, int]] = {}
            for (key, _), (request, _, _, fence, _, _) in newest.items():  # newest fences
                if key not in names or names[key][3] < fence:
                    names[key] = (key, request.name, request.limit, fence)
            # In key order, so two processes' batches lock the rows in the same order.
            rows = [
                _holder_row(*grant[:5], _moment(grant[5]))
                for grant in (newest[slot] for slot in sorted(newest, key=str))
            ]
            fences = [names[key] for key in sorted(names, key=str)]
            connections = self._connections[using]
            for attempt in (1, 2):  # a connection the server closed while idle: once more
                try:
                    with connections.get().cursor() as cursor:
                        for_vendor(vendor).record_holders(cursor, tables, rows, fences)
                    break
                except DatabaseError as exc:
                    connections.discard()
                    if attempt == 2:
                        records_log.warning(
                            "%s holder record(s) not written (%s); those holders are "
                            "shown from the server's own view",
                            len(rows),
                            exc,
                        )


def _moment(seconds: float) -> datetime:
    """The wall clock's ``seconds`` (``time.time``) as an aware UTC moment: the holder
    rows hold UTC, whatever ``USE_TZ`` says, as the grants that the database's own clock
    dates (``record_grant``)."""
    return datetime.fromtimestamp(seconds, tz=UTC)


#: The process's holder records of the backends that write them in the background.
holder_records = HolderRecords()


def known_names(tables: RecordTables, using: str, name: str | None = None) -> list[tuple[str, int]]:
    """``(name, limit)`` of every name the fence table knows (or only ``name``), sorted by name."""
    rows = apps.get_model(tables.fence_model).objects.using(using)
    if name is not None:
        rows = rows.filter(key=table_key(name))
    return list(rows.order_by("name").values_list("name", "limit"))
