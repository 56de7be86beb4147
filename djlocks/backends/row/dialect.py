"""What each database does differently for row locks, behind one small interface.

``RowDialect`` is what ``RowLockBackend`` calls. ``row.server`` implements
what PostgreSQL and MySQL/MariaDB share (``row.postgresql`` and ``row.mysql``
add their SQL); ``row.sqlite`` takes SQLite's one write lock instead.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.core.checks import CheckMessage

from djlocks.backends import aside
from djlocks.backends.base import AcquireRequest, HolderInfo, WaiterInfo
from djlocks.backends.waiting import Abort

if TYPE_CHECKING:
    from djlocks.backends.row.backend import RowLockBackend
    from djlocks.backends.row.transaction import OwnTransaction

CANCEL_EVERY = 0.05  # seconds between cancels of an aborted wait
#: The ``djlocks.keys`` slot suffix of a row semaphore's waiters' gate.
ROW_GATE = "row-gate"


@dataclass(frozen=True)
class Claim:
    """A slot row the caller's transaction has just locked, and on which connection.

    ``fence`` is set where the locking statement issued it too (SQLite).
    """

    slot: int
    connection_id: int
    fence: int | None = None


class RowDialect(ABC):
    """The SQL of one database for ``RowLockBackend``."""

    def __init__(self, backend: RowLockBackend) -> None:
        self.backend = backend
        self.alias = backend.alias
        self.using = backend.using

    @abstractmethod
    def claim(
        self,
        request: AcquireRequest,
        deadline: float | None,
        abort: Abort | None,
        own: OwnTransaction | None,
        taken: frozenset[int],
    ) -> Claim | None:
        """Lock a free slot row in the caller's transaction, waiting until ``deadline``.

        ``own`` is the transaction to begin first when the caller had none;
        ``taken`` are slots this thread's transaction holds already (skip them).

        Raises ``ValueError`` if the database cannot give ``request.limit`` slots.
        """

    @abstractmethod
    def record(self, request: AcquireRequest, claim: Claim, token: str) -> int:
        """Issue the fence and record the holder; return the fence."""

    @abstractmethod
    def is_live(self, name: str, token: str) -> bool: ...

    @abstractmethod
    def holders(self, name: str | None) -> list[HolderInfo]: ...

    @abstractmethod
    def waiters(self, name: str | None) -> list[WaiterInfo]: ...

    @abstractmethod
    def kill(self, name: str, token: str | None) -> int: ...

    def check_messages(self, query: bool) -> list[CheckMessage]:
        """System-check messages about this database; ``query`` allows asking the server.

        None by default.
        """
        return []


@contextlib.contextmanager
def cancellable(abort: Abort | None, cancel: Callable[[], None]) -> Iterator[Callable[[], bool]]:
    """While the block runs, an abort cancels the caller's statement; yields "was it aborted?".

    A cancel that reaches the server between two statements is ignored there,
    so once the abort is set the cancel is repeated every ``CANCEL_EVERY``
    seconds until the block ends. A guard orders each cancel against the
    block's end, so none is sent after it, to a later statement of the caller.
    """
    if abort is None:
        yield lambda: False
        return
    running = True
    guard = threading.Lock()

    def cancel_until_done() -> None:
        while True:
            with guard:
                if not running:
                    return
                cancel()
            time.sleep(CANCEL_EVERY)

    with abort.cancelling(lambda: aside.start(cancel_until_done)):
        try:
            yield abort.is_set
        finally:
            with guard:
                running = False
