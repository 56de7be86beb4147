"""Background writers: lock operations hand over records and go on; one daemon
thread per writer and process writes them, many at a time.

Two writers use it: the event history (``djlocks.events``), so that a release is
one round trip to its store, not two; and the holder records of the PostgreSQL
advisory-lock backend (``djlocks.backends.server_records``), so that a grant is
one statement. What this costs: records handed over but not yet written are lost
if the process is killed (``SIGKILL``, a crash) or its exit waits longer than
``EXIT_WAIT`` for them. The events that matter after a crash (a lost or expired
grant, a forced release) are written at once by whoever notices them, and a
holder whose record is missing is still shown from the server's own view.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from djlocks.own_thread import OwnThread

writer_log = logging.getLogger("djlocks.background")

Record = TypeVar("Record")

#: Records waiting to be written, at most; past it, the caller writes its own.
QUEUE_RECORDS = 10_000
#: Records written in one go, at most.
BATCH_RECORDS = 500
#: How long (seconds) the writer lets a batch gather after its first record. A batch
#: costs a commit, and on PostgreSQL about 0.2 ms of the client's CPU before its first
#: row: under contention, when each process ends a few grants per 50 ms, a quarter of
#: a second cut the writers' CPU per grant by about three (measured, 8 processes).
LINGER = 0.25
#: How long (seconds) ``flush()`` waits by default, and the exit waits.
EXIT_WAIT = 5.0
#: How long (seconds) ``flush_all()`` waits for each writer before a database is dropped.
DROP_WAIT = 2.0


class BackgroundWriter(Generic[Record]):
    """Writes the records handed to ``submit()`` with ``write`` on a daemon thread.

    ``write(records)`` should log and drop a write that fails; what it raises all
    the same is logged here, and the thread goes on. ``thread_name`` names the thread.
    ``write_at_once`` (default: ``write``) is what a caller runs itself when the queue
    is full: it should not keep the caller waiting (no pauses between retries).
    """

    def __init__(
        self,
        write: Callable[[list[Record]], None],
        thread_name: str,
        write_at_once: Callable[[list[Record]], object] | None = None,
    ) -> None:
        self._write = write
        self._write_at_once = write_at_once or write
        self._thread_name = thread_name
        self.forget_the_parent()

    def forget_the_parent(self) -> None:
        """Start empty: at first, and in a forked child (its parent's records are the
        parent's to write, and the parent's thread did not come along)."""
        self._guard = threading.Lock()  # a plain lock: cheaper to take than the Condition
        self._changed = threading.Condition(self._guard)
        self._waiting: deque[Record] = deque()
        self._submitted = 0  # records handed over since the start
        self._written = 0  # of these, records written (or dropped by a failed write)
        self._flushing = 0  # callers of flush() waiting
        self._own = OwnThread(self._guard, self._write_as_submitted, self._thread_name)

    def submit(self, records: list[Record]) -> None:
        """Write ``records`` soon, on the writer's thread; at once, on the caller's, if
        ``QUEUE_RECORDS`` are already waiting (the store is slower than the locks)."""
        with self._guard:
            if len(self._waiting) + len(records) > QUEUE_RECORDS:
                overflow = True
            else:
                overflow = False
                self._waiting.extend(records)
                self._submitted += len(records)
                waiting = len(self._waiting)
                if waiting == len(records) or waiting >= BATCH_RECORDS:  # was idle, or is full
                    self._changed.notify_all()
                self._own.start_unless_running()
        if overflow:
            self._write_at_once(records)

    def flush(self, timeout: float = EXIT_WAIT) -> bool:
        """Wait up to ``timeout`` seconds until every record submitted so far is written;
        ``True`` if they are (or their write failed and was logged)."""
        with self._changed:
            target = self._submitted
            self._flushing += 1  # the writer stops gathering and writes at once
            self._changed.notify_all()
            try:
                return self._changed.wait_for(lambda: self._written >= target, timeout)
            finally:
                self._flushing -= 1

    def _write_as_submitted(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._waiting))
                # Let a batch gather: one write and commit for many grants, not one each.
                self._changed.wait_for(
                    lambda: len(self._waiting) >= BATCH_RECORDS or self._flushing, LINGER
                )
                batch = [
                    self._waiting.popleft() for _ in range(min(BATCH_RECORDS, len(self._waiting)))
                ]
            try:
                self._write(batch)
            except Exception:  # the thread must outlive any one write
                writer_log.exception("%s record(s) not written", len(batch))
            finally:
                with self._changed:
                    self._written += len(batch)
                    self._changed.notify_all()


def start(
    write: Callable[[list[Record]], None],
    thread_name: str,
    write_at_once: Callable[[list[Record]], object] | None = None,
) -> BackgroundWriter[Record]:
    """A writer for this process (see ``BackgroundWriter``) that renews itself in forked
    children and is flushed at interpreter exit (for at most ``EXIT_WAIT`` seconds)."""
    writer: BackgroundWriter[Record] = BackgroundWriter(write, thread_name, write_at_once)
    os.register_at_fork(after_in_child=writer.forget_the_parent)
    atexit.register(writer.flush)
    _started.append(writer)
    return writer


#: The writers ``start`` made (one per kind of record, for the process's life).
_started: list[BackgroundWriter[Any]] = []


def flush_all(timeout: float = DROP_WAIT) -> None:
    """Wait until every writer ``start`` made has written what it was handed so far,
    up to ``timeout`` seconds for each."""
    for writer in list(_started):
        writer.flush(timeout)


def flush_in_celery_pool_processes() -> None:
    """Have each pool process of a Celery prefork worker write what is left before it
    exits. It ends with ``os._exit()`` (when recycled, ``worker_max_tasks_per_child``,
    or at the worker's shutdown), which runs no ``atexit`` handler: it lost up to
    ``LINGER`` seconds of records. Celery sends ``worker_process_shutdown`` in the pool
    process just before; its documentation warns that, as for any handler at exit,
    nothing guarantees it is sent. Raises ``ImportError`` without Celery."""
    from celery.signals import worker_process_shutdown

    worker_process_shutdown.connect(
        _flush_before_exit, weak=False, dispatch_uid="djlocks.background.flush"
    )


def _flush_before_exit(**_signal: object) -> None:
    """Write what every writer holds, for ``EXIT_WAIT`` seconds in all: a database that
    cannot be reached must not hold the exit up once per writer."""
    deadline = time.monotonic() + EXIT_WAIT
    for writer in list(_started):
        writer.flush(max(0.0, deadline - time.monotonic()))
