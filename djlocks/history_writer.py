"""The background writer of the event history: lock operations hand over their events
and go on; one daemon thread per process inserts them, many at a time.

A grant's release is then one round trip to its store, not two: its history no
longer waits for a second commit. What this costs: events handed over but not yet
written are lost if the process is killed (``SIGKILL``, a crash) or its exit waits
longer than ``EXIT_WAIT`` for them. The events that matter after a crash (a lost or
expired grant, a forced release) are written at once by whoever notices them (see
``djlocks.events``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from djlocks.models import LockEvent

events_log = logging.getLogger("djlocks.events")

#: Events waiting to be written, at most; past it, the caller writes its own.
QUEUE_EVENTS = 10_000
#: Events written in one go, at most.
BATCH_EVENTS = 500
#: How long (seconds) the writer lets a batch gather after its first event.
LINGER = 0.05
#: How long (seconds) ``flush()`` waits by default, and the exit waits.
EXIT_WAIT = 5.0


class HistoryWriter:
    """Writes the events handed to ``submit()`` with ``write`` on a daemon thread.

    ``write(events)`` logs and drops a write that fails (``EventLog._write``); what
    it raises all the same is logged here, and the thread goes on.
    """

    def __init__(self, write: Callable[[list[LockEvent]], None]) -> None:
        self._write = write
        self.forget_the_parent()

    def forget_the_parent(self) -> None:
        """Start empty: at first, and in a forked child (its parent's events are the
        parent's to write, and the parent's thread did not come along)."""
        self._changed = threading.Condition()
        self._waiting: deque[LockEvent] = deque()
        self._submitted = 0  # events handed over since the start
        self._written = 0  # of these, events written (or dropped by a failed write)
        self._flushing = 0  # callers of flush() waiting
        self._thread: threading.Thread | None = None

    def submit(self, events: list[LockEvent]) -> None:
        """Write ``events`` soon, on the writer's thread; at once, on the caller's, if
        ``QUEUE_EVENTS`` are already waiting (the store is slower than the locks)."""
        with self._changed:
            if len(self._waiting) + len(events) > QUEUE_EVENTS:
                overflow = True
            else:
                overflow = False
                self._waiting.extend(events)
                self._submitted += len(events)
                waiting = len(self._waiting)
                if waiting == len(events) or waiting >= BATCH_EVENTS:  # was idle, or is full
                    self._changed.notify_all()
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="djlocks-history", daemon=True
                    )
                    self._thread.start()
        if overflow:
            self._write(events)

    def flush(self, timeout: float = EXIT_WAIT) -> bool:
        """Wait up to ``timeout`` seconds until every event submitted so far is written;
        ``True`` if they are (or their write failed and was logged)."""
        with self._changed:
            target = self._submitted
            self._flushing += 1  # the writer stops gathering and writes at once
            self._changed.notify_all()
            try:
                return self._changed.wait_for(lambda: self._written >= target, timeout)
            finally:
                self._flushing -= 1

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._waiting))
                # Let a batch gather: one INSERT and commit for many grants, not for each.
                self._changed.wait_for(
                    lambda: len(self._waiting) >= BATCH_EVENTS or self._flushing, LINGER
                )
                batch = [
                    self._waiting.popleft() for _ in range(min(BATCH_EVENTS, len(self._waiting)))
                ]
            try:
                self._write(batch)
            except Exception:  # the thread must outlive any one write
                events_log.exception("%s event(s) not recorded", len(batch))
            finally:
                with self._changed:
                    self._written += len(batch)
                    self._changed.notify_all()


def start(write: Callable[[list[LockEvent]], None]) -> HistoryWriter:
    """A writer for this process that renews itself in forked children and is flushed
    at interpreter exit (for at most ``EXIT_WAIT`` seconds)."""
    writer = HistoryWriter(write)
    os.register_at_fork(after_in_child=writer.forget_the_parent)
    atexit.register(writer.flush)
    return writer
