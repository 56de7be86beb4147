"""The transaction a row grant lives in when its caller had none."""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from django.db import InterfaceError, OperationalError, connections, transaction

from djlocks.exceptions import LockLost


class OwnTransaction:
    """The transaction a row grant lives in when the caller had none.

    ``transaction.atomic(using)``, begun by the dialect just before it locks
    (``begin()``) and left at release: a commit, or a rollback when the
    ``with`` block raised. A connection that failed at the commit (terminated
    by a forced release) is ``LockLost``; when an exception is already on its
    way, a failed rollback never replaces it (the server rolls back a transaction
    whose connection is gone). Leaving it before ``begin()`` does nothing.
    A connection that failed in a transaction djlocks began is closed, as
    Django does at the end of a request, so that the caller's next query (or
    acquire) reconnects: outside requests (a worker, a cron job) Django never would.
    """

    def __init__(self, using: str) -> None:
        self.using = using
        self._atomic: AbstractContextManager[Any] | None = None

    def begin(self) -> None:
        atomic = transaction.atomic(using=self.using)
        atomic.__enter__()
        self._atomic = atomic

    def __enter__(self) -> None:
        self.begin()

    def close_if_broken(self) -> None:
        """Close the connection if it no longer answers (one ``SELECT 1``; failures only).

        Django's ``close_if_unusable_or_obsolete`` would not: the rollback that
        ended the failed transaction cleared its ``errors_occurred`` flag, and
        mysqlclient's rollback on a connection the server has gone from does not fail.
        """
        connection = connections[self.using]
        if connection.connection is not None and not connection.is_usable():
            connection.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        try:
            atomic.__exit__(exc_type, exc, traceback)
        except (OperationalError, InterfaceError) as failure:
            self.close_if_broken()
            if exc_type is not None:
                return  # the caller's own exception goes on; the server rolls back without us
            raise LockLost(
                f"The transaction that held the row lock could not commit: its connection "
                f"failed or was terminated by a forced release ({failure})."
            ) from failure
