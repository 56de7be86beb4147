"""Statements sent straight through libpq on djlocks' own PostgreSQL connections.

A psycopg cursor's ``execute`` and ``fetchone`` cost about 750 Python bytecodes
(the query's conversion, the parameters' adaptation, the result's loading, the
wait's generator): a fifth of a session lock's acquire and release. The session
backend's grant and release statements, and the lease backend's hot statements
(``sql.postgresql.run_at_once``), go through psycopg's documented wrapper of
libpq instead (``Connection.pgconn``, ``psycopg.pq``), parameters and values as
text, each parameter's type inferred by the server. Where the connection
prepares its statements (``backends.prepared``), each is prepared the first time
it runs, under a name of djlocks' own, which saves the server its parsing and
planning (about 45 µs for a grant, 12 µs for a release, measured on PostgreSQL
15); one that someone deallocated (``DEALLOCATE ALL``, which psycopg itself sends
after a ``ROLLBACK`` on a connection where it prepared) is prepared again.

The wait for the reply is on the socket, in Python, as psycopg's own is, so
Ctrl-C interrupts a long lock wait. As psycopg does, the statement is then
cancelled, and its end awaited, before the interruption goes on: nothing runs
on the connection afterwards, and no statement commits behind its caller's back
(a lease claim waiting on a row lock would). Statements run under the
connection's ``lock``, as psycopg's do, so they never interleave with a cursor's
on another thread.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import select
from collections.abc import Sequence
from typing import Any

from psycopg import OperationalError, ProgrammingError, errors, pq

#: ``%s`` placeholders, in the order libpq numbers them (``$1``, ``$2``, ...).
PLACEHOLDER = re.compile(r"%s")
#: The prefix of the names djlocks prepares its statements under (psycopg's are
#: ``_pg3_``-prefixed, so they never collide).
PREPARED_PREFIX = "djlocks_"
#: SQLSTATE invalid_sql_statement_name: no prepared statement of that name.
NO_SUCH_STATEMENT = "26000"
#: Times a connection's prepared statements may be found deallocated and prepared
#: again; after that (something deallocates them all the time) they run unprepared.
PREPARED_AGAIN = 100
#: Seconds a statement interrupted while it ran is given to end once cancelled.
CANCEL_WAIT = 5.0
#: A statement's result that is no error: a row set, or a command's count.
SUCCEEDED = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)

#: A statement in libpq's ``$n`` style, and the name it is prepared under (or ``None``).
Known = tuple[bytes, bytes | None]


class DirectStatements:
    """Statements on one psycopg ``connection`` that return at most one row or change
    rows, bypassing its cursors.

    ``prepare``: prepare each statement the first time it runs (only on a
    connection that reaches the server directly: a pooler in transaction mode
    would send the next statement to another server session, where the name is
    unknown).
    """

    def __init__(self, connection: Any, prepare: bool) -> None:
        self._connection = connection
        self._prepare = prepare
        #: SQL in ``%s`` style -> how it is sent.
        self._statements: dict[str, Known] = {}
        #: The numbers of the names statements are prepared under: each name once.
        self._names = itertools.count()
        self._prepared_again = 0
        # ``poll``, not ``select``, which refuses a socket numbered 1024 or more.
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(connection.pgconn.socket, select.POLLIN)
        self._writable.register(connection.pgconn.socket, select.POLLOUT)

    def value(self, sql: str, params: Sequence[object]) -> str | None:
        """The last value of the one row that ``sql`` returns (``%s`` placeholders, one
        per item of ``params``, sent as text), as text; ``None`` for SQL ``NULL``.

        Raises psycopg's error of the statement's SQLSTATE (``psycopg.errors.lookup``)
        when the server reports an error, ``psycopg.OperationalError`` when the
        connection is closed or fails, ``psycopg.ProgrammingError`` if ``sql`` returned
        no row. Wrap the call in Django's ``wrap_database_errors`` to have Django's
        exceptions. Anything raised while it waits (Ctrl-C) first cancels the
        statement and waits for its end (``_cancel``), then goes on.
        """
        result = self._result(sql, params)
        if not result.ntuples:
            raise ProgrammingError(f"{sql!r} returned no row")
        value = result.get_value(0, result.nfields - 1)
        return None if value is None else str(value.decode())

    def outcome(self, sql: str, params: Sequence[object]) -> tuple[list[str | None] | None, int]:
        """Run ``sql`` as ``value`` does; its first row's values as text (``None`` for
        SQL ``NULL``; the row ``None`` if it returned none) and the number of rows it
        returned or changed (an ``UPDATE``'s count). Raises as ``value`` does, but
        never for a statement that returns no row."""
        result = self._result(sql, params)
        changed = result.command_tuples or 0
        if not result.ntuples:
            return None, changed
        row = [result.get_value(0, field) for field in range(result.nfields)]
        return [None if value is None else str(value.decode()) for value in row], changed

    def _result(self, sql: str, params: Sequence[object]) -> Any:
        """Run ``sql`` with ``params`` (sent as text); its result, or raise its error."""
        if self._connection.closed:
            raise OperationalError("the connection is closed")
        known = self._statements.get(sql) or self._known(sql)
        values = [None if param is None else str(param).encode() for param in params]
        result = self._run(known, values)
        if result.status not in SUCCEEDED:
            result = self._after_failure(sql, known, values, result)
        return result

    def _run(self, known: Known, values: list[bytes | None]) -> Any:
        """Send a statement, wait for its result (on the socket: interruptible), and
        read until libpq has no more; return the first result."""
        statement, name = known
        with self._connection.lock:
            pgconn = self._connection.pgconn
            if name is None:
                pgconn.send_query_params(statement, values)
            else:
                pgconn.send_query_prepared(name, values)
            try:
                while pgconn.flush():  # more to send: the socket's buffer was full
                    self._writable.poll()
                return self._results(pgconn)
            except OperationalError:
                raise  # the connection failed: nothing to cancel
            except BaseException:  # interrupted (Ctrl-C, a signal's handler): cancel
                self._cancel(pgconn)
                raise

    def _cancel(self, pgconn: Any) -> None:
        """Cancel the statement sent and wait (``CANCEL_WAIT`` at most) until it has
        ended, its results read; a connection that fails meanwhile is left so."""
        with contextlib.suppress(Exception):
            self._connection.cancel_safe(timeout=CANCEL_WAIT)
            self._results(pgconn)

    def _results(self, pgconn: Any) -> Any:
        """Read until libpq has no more results of the statement sent; the first. An
        error result that the server sent as it ended the session is returned, though
        reading on then fails: it says why."""
        result = self._next_result(pgconn)
        try:
            while self._next_result(pgconn) is not None:
                pass
        except OperationalError:
            if result is None or result.status in SUCCEEDED:
                raise
        return result

    def _next_result(self, pgconn: Any) -> Any:
        """libpq's next result of the statement sent, waiting on the socket
        (interruptible) while it has none ready; ``None`` once every result was read."""
        while pgconn.is_busy():
            self._readable.poll()
            pgconn.consume_input()  # raises psycopg.OperationalError if the connection failed
        return pgconn.get_result()

    def _after_failure(
        self, sql: str, known: Known, values: list[bytes | None], result: Any
    ) -> Any:
        """A statement's result that is an error: raised as psycopg's error, unless
        its prepared statement was deallocated by someone (``DEALLOCATE ALL``), so that
        nothing ran: then prepare it again and run it (unprepared from now on once
        that happened ``PREPARED_AGAIN`` times)."""
        name = known[1]
        if name is not None and _state(result) == NO_SUCH_STATEMENT:
            self._prepared_again += 1
            if self._prepared_again > PREPARED_AGAIN:
                self._prepare = False
            result = self._run(self._known(sql), values)
        if result.status not in SUCCEEDED:
            raise _error(result, self._connection.info.encoding)
        return result

    def _known(self, sql: str) -> Known:
        """``sql`` in libpq's ``$n`` style, prepared on the session if it prepares."""
        numbers = iter(range(1, sql.count("%s") + 1))
        statement = PLACEHOLDER.sub(lambda _: f"${next(numbers)}", sql).encode()
        name = None
        if self._prepare:
            name = f"{PREPARED_PREFIX}{next(self._names)}".encode()
            with self._connection.lock:
                pgconn = self._connection.pgconn
                pgconn.send_prepare(name, statement)
                result = self._results(pgconn)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise _error(result, self._connection.info.encoding)
        self._statements[sql] = (statement, name)
        return statement, name


def _state(result: Any) -> str | None:
    """The SQLSTATE of the error ``result``; ``None`` if it carries none."""
    state = result.error_field(pq.DiagnosticField.SQLSTATE)
    return None if state is None else str(state.decode())


def _error(result: Any, encoding: str) -> Exception:
    """psycopg's exception for an error ``result``, as a cursor raises it: the class of
    its SQLSTATE (or of the SQLSTATE's class, for one psycopg does not know), with the
    server's message and its diagnostics in ``diag`` (detail, hint, context);
    ``OperationalError`` for a result without a SQLSTATE (the connection failed)."""
    if _state(result) is None:
        message = result.get_error_message(encoding)
        return OperationalError(message, info=result, encoding=encoding)
    return errors.error_from_result(result, encoding=encoding)
