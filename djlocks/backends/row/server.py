"""What PostgreSQL and MySQL/MariaDB share for row locks.

Rows created on first use on djlocks' own connection, fences and holders
recorded there (``server_records``), holders read back through the server's
lock state, and a semaphore's waiters queued on a named lock (the gate) whose
holder polls the slots with ``SKIP LOCKED``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.backends.utils import CursorWrapper

from djlocks.backends.base import AcquireRequest, HolderInfo
from djlocks.backends.row.dialect import Claim, RowDialect, cancellable
from djlocks.backends.server_records import ROW_TABLES, known_names, record_grant, register_name
from djlocks.backends.sql import as_datetime
from djlocks.backends.waiting import Abort, poll_with_backoff, seconds_left
from djlocks.exceptions import BackendUnavailable
from djlocks.keys import table_key
from djlocks.written import WrittenNames

if TYPE_CHECKING:
    from djlocks.backends.row.backend import RowLockBackend
    from djlocks.backends.row.transaction import OwnTransaction


class RowsMissing(Exception):
    """The name's lockable rows are not there: a sweep removed them idle
    (``djlocks.backends.idle``) after this process had created them."""


class ServerRowDialect(RowDialect):
    """PostgreSQL and MySQL/MariaDB: see the module docstring."""

    vendor: str
    #: The SQL function giving the server's id of the caller's connection.
    CONNECTION_ID: str
    #: SQL selecting the live holder rows ``h`` of ``djlocks_row_holder``.
    LIVE_HOLDERS: str

    def __init__(self, backend: RowLockBackend) -> None:
        super().__init__(backend)
        self._created = WrittenNames()  # (key, limit) whose rows exist

    # -- what each server does differently ---------------------------------

    def _try_slots(
        self, cursor: Any, request: AcquireRequest, taken: frozenset[int]
    ) -> Claim | None:
        """One ``SKIP LOCKED`` statement on the caller's connection: a free slot, or none.

        Slots in ``taken`` are skipped too (this transaction's own, see ``RowLockBackend``).
        """
        # Each slot's row by equality, never a range: on InnoDB a range scan also locks
        # the next record of the index, another name's row, which then looks busy (two
        # holders of several names could deadlock on it), and which an insert of this
        # name's rows, gone after a sweep, would wait for until innodb_lock_wait_timeout.
        # This holds under READ COMMITTED, Django's isolation level on MySQL; under
        # REPEATABLE READ, InnoDB locks the gap before a missing row even so.
        slots = ", ".join(str(slot) for slot in range(request.limit) if slot not in taken)
        cursor.execute(
            f"SELECT slot, {self.CONNECTION_ID} FROM djlocks_row_lock WHERE name_key = %s "
            f"AND slot IN ({slots}) ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED",
            (table_key(request.name),),
        )
        row = cursor.fetchone()
        return None if row is None else Claim(*row)

    @abstractmethod
    def _wait_for_slot(
        self, cursor: Any, request: AcquireRequest, slot: int, seconds: float | None
    ) -> Claim | None:
        """Wait in the server up to ``seconds`` (``None``: forever) for the row of ``slot``;
        ``RowsMissing`` if the row is not there."""

    @abstractmethod
    def _take_gate(self, cursor: Any, request: AcquireRequest, seconds: float | None) -> bool:
        """Wait in the server for the name's gate, a session-level named lock;
        ``RowsMissing`` if the name has fewer rows than its limit."""

    @abstractmethod
    def _give_back_gate(self, cursor: Any, request: AcquireRequest) -> None: ...

    @abstractmethod
    def _canceller(self) -> Callable[[], None]:
        """A function that, from another thread, cancels the caller's running statement."""

    @abstractmethod
    def _create_rows(self, cursor: Any, key: str, limit: int) -> None: ...

    @abstractmethod
    def _terminate(self, cursor: Any, holder: HolderInfo) -> int:
        """Terminate ``holder``'s connection if it still holds its slot; return 1 if it did."""

    # -- acquire -------------------------------------------------------------

    def claim(
        self,
        request: AcquireRequest,
        deadline: float | None,
        abort: Abort | None,
        own: OwnTransaction | None,
        taken: frozenset[int],
    ) -> Claim | None:
        self._create_once(request)
        if own is not None:
            own.begin()
        try:
            return self._claim(request, deadline, abort, taken)
        except RowsMissing:
            # A sweep removed the name's rows (djlocks sweep --idle-names) after this
            # process created them: create them again, and try once more.
            self._created.discard((table_key(request.name), request.limit))
            self._create_once(request)
            try:
                return self._claim(request, deadline, abort, taken)
            except RowsMissing:
                raise self._rows_unseen(request) from None

    def _claim(
        self,
        request: AcquireRequest,
        deadline: float | None,
        abort: Abort | None,
        taken: frozenset[int],
    ) -> Claim | None:
        """Take a slot in the caller's transaction; ``RowsMissing`` if the name's rows
        are not there."""
        with connections[self.using].cursor() as cursor:
            claim = self._try_slots(cursor, request, taken)
            if claim is not None or seconds_left(deadline) == 0:
                return claim
            with cancellable(abort, self._canceller()) as cancelled:
                if request.limit == 1:
                    claim = self._wait_for_slot(cursor, request, 0, seconds_left(deadline))
                else:
                    claim = self._poll_behind_gate(cursor, request, deadline, abort, taken)
            return None if cancelled() else claim

    def _rows_unseen(self, request: AcquireRequest) -> BackendUnavailable:
        """The error for rows that this transaction still cannot see once created again."""
        return BackendUnavailable(
            f"{request.name!r}: the row lock's rows were created again, and this "
            f"transaction still cannot see them."
        )

    def _poll_behind_gate(
        self,
        cursor: Any,
        request: AcquireRequest,
        deadline: float | None,
        abort: Abort | None,
        taken: frozenset[int],
    ) -> Claim | None:
        """Queue on the gate in the server; only its holder polls the slots, backing off."""
        if not self._take_gate(cursor, request, seconds_left(deadline)):
            return None
        try:
            return poll_with_backoff(
                lambda: self._try_slots(cursor, request, taken), deadline, abort
            )
        finally:
            self._give_back_gate(cursor, request)

    def _create_once(self, request: AcquireRequest) -> None:
        """Create the name's slot rows and fence row, once per process, on djlocks' connection."""
        key = table_key(request.name)
        if (key, request.limit) in self._created:
            return

        def create(cursor: CursorWrapper) -> None:
            register_name(cursor, self.vendor, ROW_TABLES, request)
            # Inserting a row that exists would wait for its holder on InnoDB
            # (the duplicate check locks it), so look first without locking.
            cursor.execute(
                "SELECT count(*) FROM djlocks_row_lock WHERE name_key = %s AND slot < %s",
                (key, request.limit),
            )
            if cursor.fetchone()[0] < request.limit:
                self._create_rows(cursor, key, request.limit)

        self.backend.side.run_idempotent(create)
        self._created.add((key, request.limit))

    def record(self, request: AcquireRequest, claim: Claim, token: str) -> int:
        """Issue the fence and record the holder (again on a new connection if needed:
        a second try at most skips a fence, and rewrites the same holder row)."""
        return self.backend.side.run_idempotent(
            lambda cursor: record_grant(
                cursor, self.vendor, ROW_TABLES, request, claim.slot, token, claim.connection_id
            )
        )

    # -- introspection and forced release ----------------------------------

    def _live_holders(self, name: str | None, token: str | None = None) -> list[HolderInfo]:
        conditions, params = [], []
        if name is not None:
            conditions.append("h.name_key = %s")
            params.append(table_key(name))
        if token is not None:
            conditions.append("h.token = %s")
            params.append(token)
        where = f" AND {' AND '.join(conditions)}" if conditions else ""
        with self.backend.side.cursor() as cursor:
            cursor.execute(
                f"SELECT h.name, h.slot, h.slot_limit, h.host, h.pid, h.thread, h.label, "
                f"h.acquired_at, h.fence, h.token, h.connection_id "
                f"{self.LIVE_HOLDERS}{where} ORDER BY h.name, h.slot",
                params,
            )
            rows = cursor.fetchall()
        return [self._holder(row) for row in rows]

    def _holder(self, row: Sequence[Any]) -> HolderInfo:
        name, slot, limit, host, pid, thread, label, since, fence, token, connection_id = row
        return HolderInfo(
            name=name,
            backend=self.alias,
            slot=slot,
            limit=limit,
            host=host,
            pid=pid,
            thread=thread,
            label=label,
            since=as_datetime(since, connections[self.backend.using]),
            expires_at=None,
            fence=fence,
            token=token,
            connection_id=connection_id,
        )

    def holders(self, name: str | None) -> list[HolderInfo]:
        return self._live_holders(name)

    def is_live(self, name: str, token: str) -> bool:
        return bool(self._live_holders(name, token))

    def kill(self, name: str, token: str | None) -> int:
        killed = 0
        with self.backend.side.cursor() as cursor:
            for holder in self._live_holders(name, token):
                killed += self._terminate(cursor, holder)
        return killed

    def _known_names(self, name: str | None) -> list[str]:
        return [known for known, _limit in known_names(ROW_TABLES, self.using, name)]
